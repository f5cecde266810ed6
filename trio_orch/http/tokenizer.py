"""The pipeline's tokenizer, and vLLM's ``POST /tokenize`` and ``POST /detokenize`` over it.

The server counts and splits text with the same ``tokenizers``-library
tokenizer as the text stage (:mod:`stages.tokenizer`), so ``/tokenize`` and
chat ``usage`` agree with what the stage reads.  The built-in text model
(``stages.models.Thinker``) reads bytes by default: the library-built
byte-level tokenizer, a token per byte of the prompt's UTF-8 text and 256
for end-of-text; it runs here, in the server, without torch or a model
(:class:`ByteTokenizer` says the same mapping in plain Python; tests check
the two against each other and against the thinker).  A stage whose ready
info names a ``tokenizer`` -- the thinker given a ``tokenizer.json``
(``[stages.model] tokenizer``), or a plug-in kind that reports one (a path,
or "" for the byte-level default) -- is tokenized with that file.  The
talker reads the thinker's tokens, so a pipeline that begins with it has the
same tokenizer for its input.  Which stage a route tokenizes for: the stage
that gives the text (:func:`stages.registry.text_stage`), else stage 0.

``/tokenize`` takes ``prompt`` (text) or ``messages`` (a chat, made into the
prompt the chat route would send: the same chat template, ``serve
--chat-template``; ``add_generation_prompt`` false leaves the assistant's
turn unopened); it answers ``tokens``, ``count`` and
``max_model_len`` (from the stage's workers when they report it, else null),
and ``token_strs`` when ``return_token_strs`` is true.  ``/detokenize`` takes
``tokens`` and answers ``prompt``.  A pipeline with no stage whose tokenizer
is known (the in-process toy, an image pipeline) answers 400 naming ``model``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from stages.hf.tokenizer import checkpoint_tokenizer
from stages.limits import context_error
from stages.registry import text_stage
from stages.tokenizer import TextTokenizer, byte_level, load_tokenizer
from trio_orch.engine import Engine
from trio_orch.http.chat_template import ChatInput
from trio_orch.http.generation import OpenAIRoute
from trio_orch.http.limits import HTTPLimits
from trio_orch.http.metrics import FrontMetrics
from trio_orch.http.openai_chat import parse_chat_request
from trio_orch.http.schemas import BadRequest, ServedModels

__all__ = ["DETOKENIZE", "TOKENIZE", "TOKENIZERS", "ByteTokenizer", "Tokenizer", "check_context",
           "context_length", "max_model_len", "pipeline_tokenizer", "prompt_token_count", "stage_info",
           "tokenizer_routes"]

TOKENIZE = "/tokenize"
DETOKENIZE = "/detokenize"


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


#: what a route tokenizes with: a ``tokenizers``-library tokenizer (or the plain byte mapping)
Tokenizer = ByteTokenizer | TextTokenizer

#: stage kind -> the tokenizer of the tokens it reads when its workers name none (the talker reads
#: the thinker's): the library-built byte-level one
TOKENIZERS: dict[str, Tokenizer] = {"thinker": byte_level(), "talker": byte_level()}


def stage_info(engine: Engine, stage: int) -> dict[str, Any]:
    """What the stage's first ready worker reported in its handshake (empty: in-process, or none yet)."""
    for client in getattr(engine.stages[stage], "replicas", ()):
        ready = getattr(client, "ready", None)
        if ready is not None and isinstance(ready.info, dict):
            return ready.info
    return {}


def pipeline_tokenizer(engine: Engine, outputs: Sequence[str] | None) -> tuple[int, Tokenizer] | None:
    """The stage a prompt is tokenized for (its text stage, else stage 0) and its tokenizer; None: unknown.

    A stage whose workers report a ``tokenizer`` -- a ``tokenizer.json`` (the thinker's ``[stages.model]
    tokenizer``, or a plug-in's), "" for the byte-level default -- has that one
    (:func:`stages.tokenizer.load_tokenizer`, loaded once); a built-in text kind that reports none has
    the byte-level one.
    """
    kinds = [p.name for p in engine.stage_params] if engine.stage_params is not None else None
    if kinds is None:
        return None
    k = text_stage(engine.final_stage_ids, outputs)
    for stage in dict.fromkeys(s for s in (k, 0) if s is not None):
        path = stage_info(engine, stage).get("tokenizer")
        if isinstance(path, str):
            try:  # a checkpoint stage reports its directory: its tokenizer is transformers'
                checkpoint = bool(path) and Path(path).is_dir()
                return stage, checkpoint_tokenizer(path) if checkpoint else load_tokenizer(path)
            except (ValueError, ImportError):
                return None  # the worker loaded it; this process cannot: say the tokenizer is unknown
        if kinds[stage] in TOKENIZERS:
            return stage, TOKENIZERS[kinds[stage]]
    return None


def prompt_token_count(engine: Engine, outputs: Sequence[str] | None, prompt: str) -> int | None:
    """``prompt``'s length in the pipeline's tokens (usage's ``prompt_tokens``; None: no tokenizer known)."""
    found = pipeline_tokenizer(engine, outputs)
    return len(found[1].encode(prompt)) if found is not None else None


def check_context(engine: Engine, outputs: Sequence[str] | None, prompt_tokens: int | None,
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


def context_length(engine: Engine, outputs: Sequence[str] | None) -> int | None:
    """The context of the stage a prompt is counted for (its text stage, else stage 0), when its workers
    report one (``max_model_len``); what ``/v1/models`` shows."""
    if engine.stage_params is None:
        return None
    k = text_stage(engine.final_stage_ids, outputs)
    return next((n for s in dict.fromkeys(x for x in (k, 0) if x is not None)
                 if (n := max_model_len(engine, s)) is not None), None)


def max_model_len(engine: Engine, stage: int) -> int | None:
    """The stage's context length (prompt and generated tokens), when its workers report it."""
    total = stage_info(engine, stage).get("max_model_len")
    return total if isinstance(total, int) else None


class TokenizeRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    prompt: str | None = None
    messages: list[Any] | None = None
    add_special_tokens: bool = True  # the byte tokenizer adds none either way
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    tokens: list[int]
    model: str | None = None


def tokenizer_routes(engine: Engine, *, models: ServedModels, outputs: Sequence[str] | None,
                     limits: HTTPLimits, front: FrontMetrics, chat: ChatInput | None = None) -> list[Route]:
    """``POST /tokenize`` and ``POST /detokenize`` for ``engine``'s pipeline (``models``: its names;
    ``chat``: the chat route's template and media, for ``messages``)."""
    tok_route = OpenAIRoute(engine, TOKENIZE, front, limits)
    detok_route = OpenAIRoute(engine, DETOKENIZE, front, limits)

    def tokenizer() -> tuple[int, Tokenizer]:
        found = pipeline_tokenizer(engine, outputs)
        if found is None:
            raise BadRequest("this pipeline has no stage whose tokenizer the server knows (a thinker's, or "
                             "a talker's input)", "model")
        return found

    def prompt_of(req: TokenizeRequest) -> str:
        if (req.prompt is None) == (req.messages is None):
            raise BadRequest("give either 'prompt' or 'messages'", "prompt")
        if req.prompt is not None:
            return req.prompt
        return parse_chat_request({"messages": req.messages}, models, chat=chat, defer_remote=True,
                                  add_generation_prompt=req.add_generation_prompt).prompt  # not fetched

    async def tokenize(request: Request) -> Response:
        try:
            req = tok_route.parse(await request.body(), TokenizeRequest)
            models.resolve(req.model)
            text = prompt_of(req)
            stage, tok = tokenizer()
        except BadRequest as exc:
            return tok_route.bad(exc)
        tokens = tok.encode(text)
        return tok_route.ok(JSONResponse({
            "count": len(tokens), "max_model_len": max_model_len(engine, stage), "tokens": tokens,
            "token_strs": [tok.token_str(t) for t in tokens] if req.return_token_strs else None}))

    async def detokenize(request: Request) -> Response:
        try:
            req = detok_route.parse(await request.body(), DetokenizeRequest)
            models.resolve(req.model)
            _, tok = tokenizer()
            bad = next((i for i, t in enumerate(req.tokens) if not 0 <= t < tok.vocab_size), None)
            if bad is not None:
                raise BadRequest(f"'tokens[{bad}]': {req.tokens[bad]} is not a token id (0 to "
                                 f"{tok.vocab_size - 1})", f"tokens[{bad}]")
        except BadRequest as exc:
            return detok_route.bad(exc)
        return detok_route.ok(JSONResponse({"prompt": tok.decode(req.tokens)}))

    return [Route(TOKENIZE, tokenize, methods=["POST"]), Route(DETOKENIZE, detokenize, methods=["POST"])]
