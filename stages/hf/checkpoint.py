"""A local Hugging Face checkpoint directory, read as JSON: no torch, no ``transformers``.

:func:`load_checkpoint` is what ``serve MODEL_DIR`` and ``generate --model``
ask before any worker starts: the directory exists and holds a checkpoint
(``config.json``, weights, a tokenizer), its ``architectures`` name a kind of
model this project serves (:data:`CAUSAL_LM_SUFFIXES`, :data:`PIPELINES`; an
architecture it does not serve is refused by name), and what the head needs
to know of it (of the text model, a multi-stage model's thinker):
the context length (``max_model_len``, derived as vLLM derives it), the
vocabulary and hidden size, the dtype, the chat template and special tokens
(``tokenizer_config.json``, or ``chat_template.jinja`` beside it), and the
generation defaults (``generation_config.json``).  Every failure is a
:class:`CheckpointError` naming the path.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["CAUSAL_LM_SUFFIXES", "DTYPES", "LENGTH_KEYS", "NOT_YET", "PIPELINES", "Checkpoint",
           "CheckpointError", "load_checkpoint"]

#: an architecture whose name ends so is a causal LM that ``AutoModelForCausalLM`` loads
CAUSAL_LM_SUFFIXES = ("ForCausalLM", "LMHeadModel")
#: architectures served as a pipeline of several stages -> the config key of their text model
PIPELINES: dict[str, str] = {
    "Qwen2_5OmniForConditionalGeneration": "thinker_config",  # thinker -> talker -> token2wav
}
#: architectures this project knows but does not serve yet, with what to say
NOT_YET: dict[str, str] = {
    "Qwen3OmniMoeForConditionalGeneration": "a thinker -> talker -> code predictor -> code2wav pipeline, "
                                            "not served yet (docs/models.md says what it needs)",
}
#: the config keys a context length is read from (the smallest one present wins), as vLLM reads them
LENGTH_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "max_sequence_length",
               "max_seq_length", "seq_len")
#: the dtypes a checkpoint stage computes in (``dtype`` option; "auto": the config's)
DTYPES = ("auto", "float32", "float16", "bfloat16")
_WEIGHTS = ("*.safetensors", "pytorch_model*.bin")


class CheckpointError(ValueError):
    """Not a checkpoint this project can serve; the message names the path and why."""


def _json(path: Path, required: bool) -> dict[str, Any]:
    if not path.is_file():
        if required:
            raise CheckpointError(f"{path.parent}: not a Hugging Face checkpoint directory: no {path.name}")
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: cannot read it: {exc}") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _token(value: Any) -> str | None:
    """A special token as ``tokenizer_config.json`` writes it: a string, or ``{"content": ...}``."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def _template(folder: Path, tok_config: dict[str, Any]) -> str | None:
    """The chat template: ``chat_template.jinja``, else ``tokenizer_config.json``'s (its default one)."""
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    found = tok_config.get("chat_template")
    if isinstance(found, list):  # named templates: the one called "default"
        found = next((t.get("template") for t in found if isinstance(t, dict) and t.get("name") == "default"),
                     None)
    if found is None:
        found = _json(folder / "chat_template.json", False).get("chat_template")
    return found if isinstance(found, str) and found else None


@dataclass(frozen=True)
class Checkpoint:
    """What the head knows of a checkpoint directory (see the module's docstring)."""

    path: Path
    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int | None
    max_model_len: int
    dtype: str
    chat_template: str | None = None
    bos_token: str | None = None
    eos_token: str | None = None
    #: ``generation_config.json`` as written (sampling defaults, ``eos_token_id``)
    generation: dict[str, Any] = field(default_factory=dict)

    @property
    def is_causal_lm(self) -> bool:
        return self.architecture.endswith(CAUSAL_LM_SUFFIXES)

    @property
    def is_pipeline(self) -> bool:
        """Served as several stages (:data:`PIPELINES`), not as one causal LM."""
        return self.architecture in PIPELINES

    def eos_token_ids(self) -> list[int]:
        """The ids that end an answer, as ``generation_config.json`` (else ``config.json``) gives them."""
        found = self.generation.get("eos_token_id")
        ids = found if isinstance(found, list) else [found] if isinstance(found, int) else []
        return [i for i in ids if isinstance(i, int)]

    def context(self, max_model_len: int | None) -> int:
        """The context to serve: the checkpoint's, or a smaller ``max_model_len`` (a larger: an error)."""
        if max_model_len is None:
            return self.max_model_len
        if not 1 <= max_model_len <= self.max_model_len:
            raise CheckpointError(f"{self.path}: max_model_len {max_model_len} must be between 1 and the "
                                  f"model's context, {self.max_model_len} tokens (its config.json)")
        return max_model_len


def load_checkpoint(path: str | Path) -> Checkpoint:
    """The checkpoint in directory ``path`` (CheckpointError naming the path as given, and why)."""
    given = str(path)
    folder = Path(path).expanduser().resolve()
    if not folder.exists():
        raise CheckpointError(f"{given}: no such checkpoint directory")
    if not folder.is_dir():
        raise CheckpointError(f"{given}: not a directory (a checkpoint is a directory with config.json, "
                              "weights and a tokenizer)")
    config = _json(folder / "config.json", True)
    archs = config.get("architectures")
    if not isinstance(archs, list) or not archs or not all(isinstance(a, str) for a in archs):
        raise CheckpointError(f"{given}: config.json names no architectures (e.g. [\"Qwen2ForCausalLM\"])")
    arch = archs[0]
    if arch in NOT_YET:
        raise CheckpointError(f"{given}: {arch} is {NOT_YET[arch]}")
    if not arch.endswith(CAUSAL_LM_SUFFIXES) and arch not in PIPELINES:
        raise CheckpointError(f"{given}: architecture {arch} is not served: a causal language model "
                              f"(an architecture ending in {' or '.join(CAUSAL_LM_SUFFIXES)}) is, and "
                              f"{', '.join(PIPELINES)}")
    if not any(next(folder.glob(pattern), None) for pattern in _WEIGHTS):
        raise CheckpointError(f"{given}: no weights (*.safetensors or pytorch_model*.bin)")
    if not (folder / "tokenizer.json").is_file() and not (folder / "tokenizer_config.json").is_file():
        raise CheckpointError(f"{given}: no tokenizer (tokenizer.json or tokenizer_config.json)")
    outer = config.get(PIPELINES[arch], {}) if arch in PIPELINES else config
    if not isinstance(outer, dict):
        raise CheckpointError(f"{given}: config.json has no {PIPELINES[arch]}")
    text = outer.get("text_config") if isinstance(outer.get("text_config"), dict) else outer
    vocab = text.get("vocab_size")
    if not isinstance(vocab, int) or vocab < 1:
        raise CheckpointError(f"{given}: config.json has no vocab_size")
    lengths = [v for k in LENGTH_KEYS if isinstance(v := text.get(k), int) and v > 0]
    if not lengths:
        raise CheckpointError(f"{given}: config.json says no context length ({', '.join(LENGTH_KEYS)})")
    dtype = text.get("dtype") or text.get("torch_dtype") or config.get("dtype") or "float32"
    tok_config = _json(folder / "tokenizer_config.json", False)
    hidden = text.get("hidden_size")
    return Checkpoint(path=folder, architecture=arch, model_type=str(config.get("model_type", "")),
                      vocab_size=vocab, hidden_size=hidden if isinstance(hidden, int) else None,
                      max_model_len=min(lengths), dtype=str(dtype),
                      chat_template=_template(folder, tok_config),
                      bos_token=_token(tok_config.get("bos_token")),
                      eos_token=_token(tok_config.get("eos_token")),
                      generation=_json(folder / "generation_config.json", False)
                      or {"eos_token_id": text.get("eos_token_id", config.get("eos_token_id"))})
