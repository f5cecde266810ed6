"""``POST /v1/completions``: OpenAI's (legacy) text completions, served by the pipeline's text stage.

Request: ``prompt`` (text, or a list holding one text), ``model`` (optional;
if given, a served name, else 404 ``model_not_found``), ``max_tokens``,
``temperature``, ``top_p``, ``seed``, ``stop``, ``stream`` (SSE) with
``stream_options.include_usage``, ``echo``, ``user``; vLLM's ``top_k``,
``min_tokens``, ``repetition_penalty`` and the penalties, and the
``stage_sampling`` extension, each mapped onto the text stage as the chat
route maps them (:mod:`trio_orch.http.openai_sampling`).  ``n``, ``best_of``,
``logprobs``, ``suffix`` and ``logit_bias`` beyond their defaults are 400s
naming them; fields the schema does not know are ignored (and logged).
Without ``max_tokens`` the text stage's own cap applies (vLLM's default),
not OpenAI's 16.

The request stops at the text stage (a speech pipeline makes no audio for
it).  Answer: ``{"object": "text_completion", "choices": [{"text",
"finish_reason"}], "usage"}``; streamed, one ``text_completion`` chunk per
text piece, the last with ``finish_reason``, the usage chunk if asked, then
``data: [DONE]``.  Token counts are the thinker's (one per byte of the prompt
and per generated token).
"""

from __future__ import annotations

import secrets
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from stages.registry import as_text, text_stage
from trio_orch.engine import AsyncRequestHandle, Engine
from trio_orch.http import openai_sampling
from trio_orch.http.generation import OpenAIRoute
from trio_orch.http.limits import HTTPLimits
from trio_orch.http.metrics import FrontMetrics
from trio_orch.http.schemas import BadRequest, OpenAIRequest, ServedModels, error_body
from trio_orch.http.streaming import sse
from trio_orch.http.tokenizer import check_context, prompt_token_count
from trio_orch.types import OrchOutput

__all__ = ["COMPLETIONS", "CompletionRequest", "TextCompletion", "completions_route"]

COMPLETIONS = "/v1/completions"


class CompletionRequest(OpenAIRequest, kw_only=True):
    """The body of ``POST /v1/completions``: the shared fields, and the completion's own."""

    prompt: str | list[str]
    echo: bool = False
    best_of: int | None = None
    logprobs: int | None = None
    suffix: str | None = None

    def text(self, max_chars: int | None) -> str:
        """The one prompt; BadRequest for what cannot be one."""
        if self.best_of not in (None, 1):
            raise BadRequest("only 'best_of': 1 is supported", "best_of", code="unsupported_parameter")
        if self.suffix:
            raise BadRequest("'suffix' (insertion) is not supported", "suffix", code="unsupported_parameter")
        prompt = self.prompt
        if isinstance(prompt, list):
            if len(prompt) != 1:
                raise BadRequest(f"one prompt per request: a text or a list of one text, got {len(prompt)}",
                                 "prompt")
            prompt = prompt[0]
        if not prompt:
            raise BadRequest("'prompt' must not be empty", "prompt")
        if max_chars is not None and len(prompt) > max_chars:
            raise BadRequest(f"the prompt has {len(prompt)} characters, over the limit of {max_chars}",
                             "prompt", code="context_length_exceeded")
        return prompt


@dataclass
class TextCompletion:
    """One request's text pieces -> streamed chunks, or the whole completion."""

    model: str
    prompt: str
    stage: int  # the text stage
    max_tokens: int | None
    token_limit: int | None  # the text stage's own cap (its workers' max_new_tokens)
    outputs: Sequence[str] | None
    id: str = field(default_factory=lambda: "cmpl-" + secrets.token_hex(12))
    created: int = field(default_factory=lambda: int(time.time()))
    pieces: list[str] = field(default_factory=list)
    tokens: int = 0
    reason: str | None = None  # what the text stage reported
    #: the prompt's length in the text stage's tokens (None: its UTF-8 bytes, the byte tokenizer's)
    prompt_tokens: int | None = None

    def add(self, m: OrchOutput) -> str:
        """Absorb one output; its text ("" if it carries none)."""
        modality = self.outputs[m.stage_id] if self.outputs is not None else "data"
        text = as_text(modality, m.data)
        if text is None:
            return ""
        data = m.data if isinstance(m.data, dict) else {}
        if isinstance(data.get("finish_reason"), str):
            self.reason = data["finish_reason"]
        toks = data.get("tokens")
        self.tokens += len(toks) if toks is not None else int(bool(text))
        if text:
            self.pieces.append(text)
        return text

    def finish_reason(self) -> str:
        if self.reason is not None:
            return self.reason
        caps = [n for n in (self.max_tokens, self.token_limit) if n is not None]
        return "length" if caps and len(self.pieces) >= min(caps) else "stop"

    def usage(self) -> dict[str, int]:
        prompt = self.prompt_tokens if self.prompt_tokens is not None else len(self.prompt.encode())
        return {"prompt_tokens": prompt, "completion_tokens": self.tokens,
                "total_tokens": prompt + self.tokens}

    def chunk(self, text: str, finish: str | None = None) -> dict[str, Any]:
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}]}

    def completion(self, echo: bool) -> dict[str, Any]:
        body = self.chunk((self.prompt if echo else "") + "".join(self.pieces), self.finish_reason())
        return {**body, "usage": self.usage()}

    def usage_chunk(self) -> dict[str, Any]:
        return {**self.chunk(""), "choices": [], "usage": self.usage()}


def completions_route(engine: Engine, *, models: ServedModels, outputs: Sequence[str] | None,
                      limits: HTTPLimits, front: FrontMetrics, token_limit: int | None) -> Route:
    """``POST /v1/completions`` over ``engine`` (``models``: the names it answers to)."""
    route = OpenAIRoute(engine, COMPLETIONS, front, limits)

    def count_tokens(tc: TextCompletion) -> None:
        front.count_tokens(tc.usage()["prompt_tokens"], {tc.stage: tc.tokens})

    def failure(code: str, message: str) -> bytes:
        return sse(error_body(message, "server_error", code=code))

    async def stream(req: CompletionRequest, tc: TextCompletion, handle: AsyncRequestHandle
                     ) -> AsyncIterator[bytes]:
        if req.echo:
            yield sse(tc.chunk(tc.prompt))

        def render(m: OrchOutput) -> bytes:
            text = tc.add(m)
            out = sse(tc.chunk(text)) if text else b""
            if m.finished:
                front.count_finished(tc.finish_reason())
                out += sse(tc.chunk("", tc.finish_reason()))
                if req.include_usage:
                    out += sse(tc.usage_chunk())
            return out

        try:
            async for chunk in route.pieces(handle, render, failure):
                yield chunk
        finally:  # the client left too: what was generated counts
            count_tokens(tc)
        yield b"data: [DONE]\n\n"

    async def collect(req: CompletionRequest, tc: TextCompletion, handle: AsyncRequestHandle) -> Any:
        try:
            err = await route.collect(handle, tc.add)
        finally:
            count_tokens(tc)
        if err is not None:
            return err
        front.count_finished(tc.finish_reason())
        return JSONResponse(tc.completion(req.echo))

    async def handle(request: Request) -> Response:
        try:
            req = route.parse(await request.body(), CompletionRequest)
            model = models.resolve(req.model)
            prompt = req.text(limits.max_prompt_chars)
            k = text_stage(engine.final_stage_ids, outputs)
            if k is None:
                raise BadRequest(f"model {model!r} gives no text: this pipeline has no text stage", "model")
            sampling = openai_sampling.map_sampling(req.sampling_fields(), engine.stage_params,
                                                    text_stage=k, last_stage=k)
            prompt_tokens = prompt_token_count(engine, outputs, prompt)
            check_context(engine, outputs, prompt_tokens, req.max_tokens, "prompt")
        except BadRequest as exc:
            return route.bad(exc)
        except openai_sampling.SamplingError as exc:
            return route.error(400, str(exc), param=exc.param)
        admitted = await route.admit(prompt, final_stage_id=k, sampling=sampling, priority=req.priority)
        if isinstance(admitted, Response):
            return admitted
        tc = TextCompletion(model, prompt, k, req.max_tokens, token_limit, outputs,
                            prompt_tokens=prompt_tokens)
        if req.stream:
            return route.stream(stream(req, tc, admitted))
        answer = await route.wait(partial(collect, req, tc, admitted), request)
        return answer if answer.status_code != 200 else route.ok(answer)

    return Route(COMPLETIONS, handle, methods=["POST"])
