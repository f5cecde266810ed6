"""What a Qwen2.5-Omni checkpoint says about its three parts, read from ``config.json`` (no ``transformers``).

The head needs it before any worker starts, and the workers need the same
ids: the thinker's media placeholders and end-of-text, the talker's codec
control codes (its end and pad codes are the config's -- ``generate()``
hard-codes 8292 and 8294, the real checkpoint's, and stops a checkpoint with
other ids at the wrong code), the ids of the text tokens whose thinker
embeddings frame the talker's input, and token2wav's rates.  The speakers
are in ``spk_dict.pt``, a torch file: :func:`speaker_ids` reads their names
and start ids without torch (the head lists them to refuse an unknown voice),
:func:`speakers` the whole of it (torch, imported then).
"""

from __future__ import annotations

import json
import math
import pickle
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["ARCHITECTURE", "SAMPLE_RATE", "SPEAKER_FILE", "OmniConfig", "OmniConfigError", "read_omni_config",
           "speaker_ids", "speakers"]

ARCHITECTURE = "Qwen2_5OmniForConditionalGeneration"
SPEAKER_FILE = "spk_dict.pt"
#: token2wav's output rate (BigVGAN's mel frames are 240 samples apart at 24 kHz)
SAMPLE_RATE = 24000


class OmniConfigError(ValueError):
    """Not a Qwen2.5-Omni checkpoint this project can serve; the message names the path and why."""


@dataclass(frozen=True)
class OmniConfig:
    """The ids and sizes of one Qwen2.5-Omni checkpoint (see the module's docstring)."""

    path: Path
    thinker: dict[str, Any]
    talker: dict[str, Any]
    token2wav: dict[str, Any]
    #: the checkpoint's dtype (``config.json``'s ``dtype``, or ``torch_dtype`` as older files say)
    dtype: str = "float32"

    # ---- the thinker
    @property
    def text(self) -> dict[str, Any]:
        return self.thinker.get("text_config") or {}

    @property
    def hidden_size(self) -> int:
        return int(self.text["hidden_size"])

    @property
    def vocab_size(self) -> int:
        return int(self.text["vocab_size"])

    @property
    def max_model_len(self) -> int:
        return int(self.text.get("max_position_embeddings", 32768))

    @property
    def eos_token_ids(self) -> list[int]:
        found = self.text.get("eos_token_id")
        ids = found if isinstance(found, list) else [found]
        return [i for i in ids if isinstance(i, int)]

    def media_token(self, medium: str) -> int:
        """The placeholder id of ``medium`` ("image", "audio", "video") in the thinker's prompt."""
        return int(self.thinker[f"{medium}_token_index"])

    @property
    def vision_start_token_id(self) -> int | None:
        """The rope index reads it from the thinker's config, whose class has no default for it."""
        for part in (self.thinker, self.talker):
            if isinstance(part.get("vision_start_token_id"), int):
                return int(part["vision_start_token_id"])
        return None

    # ---- the talker
    @property
    def codec(self) -> dict[str, int]:
        """The talker's control codes: ``pad``, ``start``, ``end``, ``mask``."""
        names = ("pad", "start", "end", "mask")
        return {name: int(self.talker[f"tts_codec_{name}_token_id"]) for name in names}

    @property
    def codec_stop(self) -> list[int]:
        """The codes that end the talker's answer: the config's pad and end codes."""
        return [self.codec["pad"], self.codec["end"]]

    @property
    def tts_text(self) -> dict[str, int]:
        """The thinker ids whose embeddings close the talker's text track: ``end`` and ``pad``."""
        return {name: int(self.talker[f"tts_text_{name}_token_id"]) for name in ("start", "end", "pad")}

    @property
    def codec_vocab(self) -> int:
        return int(self.talker["vocab_size"])

    # ---- token2wav
    @property
    def hop(self) -> int:
        """Waveform samples per mel frame (BigVGAN's upsampling)."""
        rates = (self.token2wav.get("bigvgan_config") or {}).get("upsample_rates", [5, 3, 2, 2, 2, 2])
        return int(math.prod(rates))

    @property
    def mel_per_code(self) -> int:
        """Mel frames per codec code (the DiT's ``repeats``)."""
        return int((self.token2wav.get("dit_config") or {}).get("repeats", 2))


def _part(config: dict[str, Any], name: str, path: Path) -> dict[str, Any]:
    part = config.get(f"{name}_config")
    if not isinstance(part, dict):
        raise OmniConfigError(f"{path}: config.json has no {name}_config (a {ARCHITECTURE} has a thinker, a "
                              "talker and token2wav)")
    return part


def read_omni_config(path: str | Path) -> OmniConfig:
    """The Omni checkpoint in directory ``path`` (OmniConfigError naming the path and what is missing)."""
    folder = Path(path).expanduser().resolve()
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise OmniConfigError(f"{folder}: cannot read config.json: {exc}") from None
    if not isinstance(config, dict) or ARCHITECTURE not in (config.get("architectures") or []):
        raise OmniConfigError(f"{folder}: config.json does not name {ARCHITECTURE} in its architectures")
    found = OmniConfig(folder, _part(config, "thinker", folder), _part(config, "talker", folder),
                       _part(config, "token2wav", folder),
                       str(config.get("dtype") or config.get("torch_dtype") or "float32"))
    try:
        needed = [found.hidden_size, found.vocab_size, found.codec_vocab, *found.codec.values(),
                  *found.tts_text.values(), found.media_token("image"), found.media_token("audio")]
    except (KeyError, TypeError, ValueError) as exc:
        raise OmniConfigError(f"{folder}: config.json lacks {exc} (a thinker or talker id)") from None
    if not all(isinstance(n, int) for n in needed) or found.vision_start_token_id is None:
        raise OmniConfigError(f"{folder}: config.json gives no vision_start_token_id (the thinker's rope "
                              "index needs it)")
    if not (folder / SPEAKER_FILE).is_file():
        raise OmniConfigError(f"{folder}: no {SPEAKER_FILE} (the talker's speakers)")
    return found


def speakers(path: str | Path) -> dict[str, dict[str, Any]]:
    """``spk_dict.pt``: speaker name -> ``{"bos_token": int, "cond": tensor, "ref_mel": tensor}`` (torch)."""
    import torch

    file = Path(path) / SPEAKER_FILE
    try:
        found = torch.load(file, weights_only=True, map_location="cpu")
    except Exception as exc:
        raise OmniConfigError(f"{file}: cannot read it: {type(exc).__name__}: {exc}") from None
    if not isinstance(found, dict) or not found or not all(
            isinstance(v, dict) and {"bos_token", "cond", "ref_mel"} <= set(v) for v in found.values()):
        raise OmniConfigError(f"{file}: expected speaker name -> {{bos_token, cond, ref_mel}}")
    return {str(k): v for k, v in found.items()}


class _Tensor:
    """Whatever torch would rebuild: the names and ids are all :func:`speaker_ids` reads."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass


class _Names(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module == "collections" and name == "OrderedDict":
            return dict
        if module.startswith("torch"):
            return _Tensor
        raise pickle.UnpicklingError(f"unexpected {module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        return None


def speaker_ids(path: str | Path) -> dict[str, int]:
    """``spk_dict.pt``'s speakers -> their start token id, read without torch (a torch zip file's pickle,
    tensors left unbuilt); OmniConfigError naming the file when it is not one."""
    file = Path(path) / SPEAKER_FILE
    try:
        with zipfile.ZipFile(file) as z:
            name = next(n for n in z.namelist() if n.endswith("/data.pkl") or n == "data.pkl")
            found = _Names(z.open(name)).load()
    except (OSError, StopIteration, zipfile.BadZipFile, pickle.UnpicklingError, EOFError) as exc:
        raise OmniConfigError(f"{file}: not a torch speaker file: {type(exc).__name__}: {exc}") from None
    if not isinstance(found, dict) or not found or not all(
            isinstance(v, dict) and isinstance(v.get("bos_token"), int) for v in found.values()):
        raise OmniConfigError(f"{file}: expected speaker name -> {{bos_token, cond, ref_mel}}")
    return {str(k): int(v["bos_token"]) for k, v in found.items()}
