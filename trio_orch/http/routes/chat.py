"""``POST /v1/chat/completions``: non-streaming, or SSE with ``"stream": true``.

``modalities`` ``["text"]`` or ``["text", "audio"]``.  The request is read by
the one chat check (:func:`trio_orch.openai.chat.read_chat_request`: the
schema, the messages and their media, the final stage this pipeline answers
it with, each sampling field on its stages, remote images fetched);
:class:`~trio_orch.openai.chat.ChatStream` turns the request's outputs into
``chat.completion.chunk`` objects or the whole completion (with the
``timings`` extension).  A text-only request stops at the pipeline's text
stage; an audio one runs every final stage.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Sequence
from functools import partial
from typing import Any

import anyio
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from trio_orch.engine.api import AcceptedRequest, EngineClient
from trio_orch.http.generation import OpenAIRoute
from trio_orch.http.limits import HTTPLimits
from trio_orch.http.metrics import FrontMetrics
from trio_orch.http.streaming import sse
from trio_orch.http.vllm_metrics import RequestTimer
from trio_orch.openai.chat import ChatRequest, ChatStream, read_chat_request
from trio_orch.openai.chat_template import ChatInput
from trio_orch.openai.protocol import ServedModels
from trio_orch.openai.validation import BadRequest, error_body, parse_json_body
from trio_orch.types import OrchError, OrchOutput

__all__ = ["CHAT", "chat_route"]

CHAT = "/v1/chat/completions"
DONE = b"data: [DONE]\n\n"


def chat_route(engine: EngineClient, *, models: ServedModels, outputs: Sequence[str] | None,
               limits: HTTPLimits, front: FrontMetrics, token_limit: int | None, chat: ChatInput) -> Route:
    """``POST /v1/chat/completions`` over ``engine`` (see :func:`~trio_orch.http.app.create_app`)."""
    route = OpenAIRoute(engine, CHAT, front, limits)

    def count_tokens(cs: ChatStream) -> None:
        front.count_tokens(cs.usage()["prompt_tokens"], cs.tokens_by_stage)

    def observe_rtf(cs: ChatStream, handle: AcceptedRequest) -> None:
        rtf = cs.real_time_factor(handle.t_open)
        if rtf is not None:
            front.rtf.observe(rtf)

    def failure(code: str, message: str) -> bytes:
        return sse(error_body(message, "server_error", code=code))

    def finished(cs: ChatStream, handle: AcceptedRequest, timer: RequestTimer) -> None:
        """The request ended with a finish reason: its real-time factor, reason and vLLM histograms."""
        observe_rtf(cs, handle)
        front.count_finished(cs.finish_reason())
        timer.finish(prompt_tokens=cs.usage()["prompt_tokens"], max_tokens=cs.req.max_tokens,
                     token_limit=token_limit, timings=handle.timings)

    def events(req: ChatRequest, handle: AcceptedRequest) -> AsyncIterator[bytes]:
        cs = ChatStream(req, outputs, token_limit)
        timer = front.timer(handle.t_open)

        def render(m: OrchOutput) -> bytes:
            chunk = cs.add(m)
            timer.saw(cs.text_outputs)
            out = sse(chunk) if chunk is not None else b""
            if m.finished:
                finished(cs, handle, timer)
                out += sse(cs.last_chunk())
                if req.include_usage:
                    out += sse(cs.usage_chunk())
            return out

        return route.body(handle, render, failure, first=sse(cs.first_chunk()), last=DONE,
                          on_end=partial(count_tokens, cs))

    async def answer(req: ChatRequest, handle: AcceptedRequest) -> dict[str, Any] | OrchError:
        """The non-streamed completion, or the request's error terminal."""
        cs = ChatStream(req, outputs, token_limit)
        timer = front.timer(handle.t_open)

        def absorb(m: OrchOutput) -> None:
            cs.add(m)
            timer.saw(cs.text_outputs)

        try:
            err = await route.collect(handle, absorb)
        finally:  # cancelled too (the client left): what was generated counts
            count_tokens(cs)
        if err is not None:
            return err
        timings = cs.timings(handle.t_open, time.perf_counter(), handle.timings)
        # an audio answer is encoded (an Opus, MP3 or AAC encoder may take a while): off the event loop
        out = (await anyio.to_thread.run_sync(cs.completion, timings) if req.audio
               else cs.completion(timings))
        finished(cs, handle, timer)
        return out

    async def handle(request: Request) -> Response:
        try:
            body = parse_json_body(await request.body(), limits.max_json_depth)
            req = await read_chat_request(body, models, engine=engine, outputs=outputs, chat=chat,
                                          max_prompt_chars=limits.max_prompt_chars)
        except BadRequest as exc:
            return route.bad(exc)
        admitted = await route.admit(req.payload(), final_stage_id=req.final_stage_id, sampling=req.sampling,
                                     want_timings=True, priority=req.priority)
        if isinstance(admitted, Response):
            return admitted
        if req.stream:
            return route.stream(events(req, admitted))
        result = await route.wait(partial(answer, req, admitted), request)  # 499 if the client left first
        return result if isinstance(result, Response) else route.ok(JSONResponse(result))

    return Route(CHAT, handle, methods=["POST"])
