"""The pipeline's tokenizer: what a front counts and splits text with, as the text stage reads it.

The server counts and splits text with the same ``tokenizers``-library
tokenizer as the text stage (:mod:`stages.tokenizer`), so ``/tokenize``,
chat ``usage`` and the speech route's input agree with what the stage reads.
The built-in text model (``stages.models.Thinker``) reads bytes by default:
the library-built byte-level tokenizer, a token per byte of the prompt's
UTF-8 text and 256 for end-of-text; it runs here, in the server, without
torch or a model (:class:`ByteTokenizer` says the same mapping in plain
Python; tests check the two against each other and against the thinker).  A
stage whose ready info names a ``tokenizer`` -- the thinker given a
``tokenizer.json`` (``[stages.model] tokenizer``), or a plug-in kind that
reports one (a path, or "" for the byte-level default) -- is tokenized with
that file.  Which kinds read tokens is the stage registry's to say
(:func:`stages.registry.reads_tokens`: the thinker reads text, the talker
the thinker's token ids), so a pipeline that begins with a talker has the
same tokenizer for its input.  Which stage a route tokenizes for: the stage
that gives the text (:func:`stages.registry.text_stage`), else stage 0.

The engine is read through its seam only (:class:`~trio_orch.engine.api.EngineClient`:
each stage's kind, and what its workers reported when ready).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from stages.hf.tokenizer import checkpoint_tokenizer
from stages.limits import context_error
from stages.registry import reads_tokens, text_stage
from stages.tokenizer import TextTokenizer, byte_level, load_tokenizer
from trio_orch.engine.api import EngineClient
from trio_orch.openai.validation import BadRequest

__all__ = ["ByteTokenizer", "Tokenizer", "check_context", "context_length", "max_model_len",
           "pipeline_tokenizer", "prompt_token_count", "stage_tokenizer"]


@dataclass(frozen=True)
class ByteTokenizer:
    """The byte-level mapping in plain Python: one token per byte of UTF-8 text, ``eos`` for end-of-text.

    What :func:`stages.tokenizer.byte_level` builds with the library; kept as the statement tests check
    the library's tokenizer (and the thinker) against.
    """

    eos: int = 256

    @property
    def vocab_size(self) -> int:
        return self.eos + 1

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, tokens: Iterable[int]) -> str:
        """The text of ``tokens``; end-of-text is not text, and a cut UTF-8 sequence shows as U+FFFD."""
        return bytes(t for t in tokens if t != self.eos).decode("utf-8", "replace")

    def token_str(self, token: int) -> str:
        return "<eos>" if token == self.eos else bytes([token]).decode("utf-8", "backslashreplace")


#: what a front tokenizes with: a ``tokenizers``-library tokenizer (or the plain byte mapping)
Tokenizer = ByteTokenizer | TextTokenizer

_UNREADABLE = object()  # a stage's workers named a tokenizer this process cannot load


def _of_stage(engine: EngineClient, kinds: Sequence[str], stage: int) -> Tokenizer | object | None:
    """``stage``'s tokenizer, :data:`_UNREADABLE`, or None when the stage reads no tokens."""
    path = engine.stage_info(stage).get("tokenizer")
    if isinstance(path, str):
        try:  # a checkpoint stage reports its directory: its tokenizer is transformers'
            checkpoint = bool(path) and Path(path).is_dir()
            return checkpoint_tokenizer(path) if checkpoint else load_tokenizer(path)
        except (ValueError, ImportError):
            return _UNREADABLE  # the worker loaded it; this process cannot: say the tokenizer is unknown
    return byte_level() if reads_tokens(kinds[stage]) else None


def stage_tokenizer(engine: EngineClient, stage: int) -> Tokenizer | None:
    """The tokenizer of the text or token ids ``stage`` reads (None: it reads none, or it is unknown)."""
    kinds = engine.stage_kinds
    found = _of_stage(engine, kinds, stage) if kinds is not None else None
    return found if isinstance(found, ByteTokenizer | TextTokenizer) else None


def pipeline_tokenizer(engine: EngineClient, outputs: Sequence[str] | None) -> tuple[int, Tokenizer] | None:
    """The stage a prompt is tokenized for (its text stage, else stage 0) and its tokenizer; None: unknown.

    A stage whose workers report a ``tokenizer`` -- a ``tokenizer.json`` (the thinker's ``[stages.model]
    tokenizer``, or a plug-in's), "" for the byte-level default -- has that one
    (:func:`stages.tokenizer.load_tokenizer`, loaded once); a kind that reads tokens and reports none has
    the byte-level one.
    """
    kinds = engine.stage_kinds
    if kinds is None:
        return None
    k = text_stage(engine.final_stage_ids, outputs)
    for stage in dict.fromkeys(s for s in (k, 0) if s is not None):
        found = _of_stage(engine, kinds, stage)
        if found is _UNREADABLE:
            return None
        if isinstance(found, ByteTokenizer | TextTokenizer):
            return stage, found
    return None


def prompt_token_count(engine: EngineClient, outputs: Sequence[str] | None, prompt: str) -> int | None:
    """``prompt``'s length in the pipeline's tokens (usage's ``prompt_tokens``; None: no tokenizer known)."""
    found = pipeline_tokenizer(engine, outputs)
    return len(found[1].encode(prompt)) if found is not None else None


def check_context(engine: EngineClient, outputs: Sequence[str] | None, prompt_tokens: int | None,
                  max_tokens: int | None, param: str) -> None:
    """BadRequest (400, vLLM's words, naming both numbers) when the prompt and ``max_tokens`` do not fit
    the text stage's context: the rule of :func:`stages.limits.context_error`, asked before admission
    (the stage asks it again).  Nothing to check without a known tokenizer or context length."""
    limit = context_length(engine, outputs)
    if limit is None or prompt_tokens is None:
        return
    error = context_error(limit, prompt_tokens, max_tokens)
    if error is not None:
        raise BadRequest(error, param, code="context_length_exceeded")


def context_length(engine: EngineClient, outputs: Sequence[str] | None) -> int | None:
    """The context of the stage a prompt is counted for (its text stage, else stage 0), when its workers
    report one (``max_model_len``); what ``/v1/models`` shows."""
    kinds = engine.stage_kinds
    if kinds is None:
        return None
    k = text_stage(engine.final_stage_ids, outputs)
    return next((n for s in dict.fromkeys(x for x in (k, 0) if x is not None)
                 if (n := max_model_len(engine, s)) is not None), None)


def max_model_len(engine: EngineClient, stage: int) -> int | None:
    """The stage's context length (prompt and generated tokens), when its workers report it."""
    total = engine.stage_info(stage).get("max_model_len")
    return total if isinstance(total, int) else None
