"""Load one part of a Qwen2.5-Omni checkpoint -- only its weights -- and the checkpoint's processor.

Each stage worker holds one part: :func:`load_part` builds ``model.thinker``,
``model.talker`` or ``model.token2wav`` from its sub-config and reads only
that part's tensors from the safetensors (the others are never
materialised).  Two things ``from_pretrained`` gets wrong on its own, fixed
here: token2wav's weights are stored under ``token2wav.`` but its class's
prefix is ``model``, so without a ``key_mapping`` every weight stays random
(and only a warning says so: a part missing any weight is an error here);
and the thinker's config class has no ``vision_start_token_id``, which its
rope index reads (taken from the checkpoint, else the talker's config).
token2wav runs in float32 whatever the checkpoint's dtype, as ``generate()``
runs it.

:func:`load_processor` is ``Qwen2_5OmniProcessor`` over the checkpoint's
tokenizer, image processor, Whisper feature extractor and chat template.
``transformers`` builds that processor with a video processor that needs
torchvision; the image processor here is the Pillow one and there is no
video processor (a video input is refused by name), so nothing needs
torchvision.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from stages.hf.omni.checkpoint import OmniConfig, read_omni_config

__all__ = ["PARTS", "PartError", "load_part", "load_processor", "part_dtype", "require_transformers",
           "weights_summary"]

#: the parts of the checkpoint: attribute of the full model -> its class in ``transformers``
PARTS = {"thinker": "Qwen2_5OmniThinkerForConditionalGeneration",
         "talker": "Qwen2_5OmniTalkerForConditionalGeneration",
         "token2wav": "Qwen2_5OmniToken2WavModel"}


class PartError(ValueError):
    """A part that cannot be loaded as asked (missing weights, unknown part or dtype)."""


def require_transformers() -> Any:
    """The ``transformers`` module, or ImportError saying how to get it."""
    try:
        import transformers
    except ImportError:
        raise ImportError("serving a Qwen2.5-Omni checkpoint needs transformers: "
                          "pip install 'trio-orch[hf]'") from None
    return transformers


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """``transformers`` at error level, no progress bars: loading one part reports every other part's keys
    as unexpected."""
    from transformers.utils import logging as hf_logging

    before, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(before)
        if bars:
            hf_logging.enable_progress_bar()


def part_dtype(cfg: OmniConfig, part: str, dtype: str = "auto") -> torch.dtype:
    """The dtype ``part`` computes in: token2wav float32; the others ``dtype`` (auto: the checkpoint's)."""
    if part == "token2wav":
        return torch.float32
    name = dtype
    if dtype == "auto":
        sub = cfg.thinker if part == "thinker" else cfg.talker
        name = str(sub.get("dtype") or sub.get("torch_dtype") or cfg.dtype)
    found = getattr(torch, name, None)
    if not isinstance(found, torch.dtype):
        raise PartError(f"{cfg.path}: dtype {name!r} is not a torch dtype")
    return found


def load_part(path: str | Path, part: str, *, device: str | torch.device = "cpu", dtype: str = "auto") -> Any:
    """``part`` ("thinker", "talker", "token2wav") of the checkpoint at ``path``, alone, in eval mode."""
    if part not in PARTS:
        raise PartError(f"no part {part!r} in a Qwen2.5-Omni checkpoint (parts: {', '.join(PARTS)})")
    transformers = require_transformers()
    cfg = read_omni_config(path)
    with quiet_transformers():
        full = transformers.Qwen2_5OmniConfig.from_pretrained(str(cfg.path))
        sub = getattr(full, f"{part}_config")
        if part == "thinker" and getattr(sub, "vision_start_token_id", None) is None:
            sub.vision_start_token_id = cfg.vision_start_token_id
        extra: dict[str, Any] = {"key_mapping": {r"^token2wav\.": ""}} if part == "token2wav" else {}
        model, info = getattr(transformers, PARTS[part]).from_pretrained(
            str(cfg.path), config=sub, dtype=part_dtype(cfg, part, dtype), local_files_only=True,
            output_loading_info=True, **extra)
    missing = sorted(info.get("missing_keys") or [])
    if missing:
        raise PartError(f"{cfg.path}: the {part}'s weights are not all in the checkpoint: {len(missing)} "
                        f"missing, e.g. {missing[0]}")
    return model.to(device).eval()


class _NoVideo:
    """Stands in for the video processor (torchvision): the processor reads its sizes, never calls it."""

    merge_size = 2
    temporal_patch_size = 2

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise ValueError("video input is not served (the video processor needs torchvision)")


def load_processor(path: str | Path) -> Any:
    """The checkpoint's ``Qwen2_5OmniProcessor`` without a video processor (see the module's docstring)."""
    transformers = require_transformers()
    cfg = read_omni_config(path)

    class OmniProcessor(transformers.Qwen2_5OmniProcessor):
        def check_argument_for_proper_class(self, argument_name: str, argument: Any) -> Any:
            if argument_name == "video_processor":
                return type(argument)
            return super().check_argument_for_proper_class(argument_name, argument)

    folder = str(cfg.path)
    with quiet_transformers():
        tokenizer = transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True)
        images = transformers.Qwen2VLImageProcessorPil.from_pretrained(folder, local_files_only=True)
        audio = transformers.WhisperFeatureExtractor.from_pretrained(folder, local_files_only=True)
    return OmniProcessor(image_processor=images, video_processor=_NoVideo(), feature_extractor=audio,
                         tokenizer=tokenizer, chat_template=_chat_template(cfg.path, tokenizer))


def _chat_template(folder: Path, tokenizer: Any) -> str | None:
    """The processor's chat template: ``chat_template.jinja`` or ``.json``, else the tokenizer's."""
    import json

    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    js = folder / "chat_template.json"
    if js.is_file():
        found = json.loads(js.read_text(encoding="utf-8")).get("chat_template")
        if isinstance(found, str):
            return found
    return getattr(tokenizer, "chat_template", None)


def weights_summary(part: str, model: Any) -> dict[str, Any]:
    """What a worker holds, for its ``weights`` RPC: its part, every parameter's and buffer's name, their
    count and bytes (each stage's worker holds one part and no other's)."""
    tensors = dict(model.named_parameters())
    tensors.update(model.named_buffers())
    return {"part": part, "names": sorted(tensors), "parameters": sum(p.numel() for p in model.parameters()),
            "bytes": sum(t.numel() * t.element_size() for t in tensors.values())}
