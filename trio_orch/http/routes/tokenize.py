"""vLLM's ``POST /tokenize`` and ``POST /detokenize`` over the pipeline's tokenizer.

The tokenizer is the text stage's (:func:`trio_orch.openai.tokenizer.pipeline_tokenizer`),
so ``/tokenize``, chat ``usage`` and what the stage reads agree.
``/tokenize`` takes ``prompt`` (text) or ``messages`` (a chat, made into the
prompt the chat route would send: the same chat template, ``serve
--chat-template``; ``add_generation_prompt`` false leaves the assistant's
turn unopened); it answers ``tokens``, ``count`` and ``max_model_len`` (from
the stage's workers when they report it, else null), and ``token_strs`` when
``return_token_strs`` is true.  ``/detokenize`` takes ``tokens`` and answers
``prompt``.  A pipeline with no stage whose tokenizer is known (the
in-process toy, an image pipeline) answers 400 naming ``model``.
"""

from __future__ import annotations

from collections.abc import Sequence

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from trio_orch.engine.api import EngineClient
from trio_orch.http.generation import OpenAIRoute
from trio_orch.http.limits import HTTPLimits
from trio_orch.http.metrics import FrontMetrics
from trio_orch.openai.chat import parse_chat_request
from trio_orch.openai.chat_template import ChatInput
from trio_orch.openai.protocol import DetokenizeRequest, ServedModels, TokenizeRequest
from trio_orch.openai.tokenizer import Tokenizer, max_model_len, pipeline_tokenizer
from trio_orch.openai.validation import BadRequest

__all__ = ["DETOKENIZE", "TOKENIZE", "tokenizer_routes"]

TOKENIZE = "/tokenize"
DETOKENIZE = "/detokenize"


def tokenizer_routes(engine: EngineClient, *, models: ServedModels, outputs: Sequence[str] | None,
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
