"""``POST /v1/audio/speech``: OpenAI's text-to-speech route over the pipeline's audio stage.

The request and how it enters the pipeline are :mod:`trio_orch.openai.speech`'s
(:class:`~trio_orch.openai.speech.SpeechPlan`: one check of the request,
its stage-0 input and per-stage parameters).  The answer: ``pcm`` streams as
the vocoder makes it (a chunked body, one piece per dispatcher batch; a
request that fails midway ends its body early, and says so in the log);
``wav``, ``flac``, ``opus``, ``mp3`` and ``aac`` are sent whole, encoded once the
audio is all there (:func:`~trio_orch.openai.audio_out.encode_audio`, in a
worker thread: the event loop never waits on an encoder); ``stream_format:
sse`` sends ``speech.audio.delta`` events of base64 pcm, then
``speech.audio.done`` with usage.
"""

from __future__ import annotations

import base64
import logging
from collections.abc import AsyncIterator, Sequence
from functools import partial
from typing import Any

import anyio
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from trio_orch.engine.api import AcceptedRequest, EngineClient
from trio_orch.http.generation import OpenAIRoute
from trio_orch.http.limits import HTTPLimits
from trio_orch.http.metrics import FrontMetrics
from trio_orch.http.streaming import sse
from trio_orch.openai.audio_out import AUDIO_OUT, encode_audio
from trio_orch.openai.protocol import ServedModels, SpeechRequest
from trio_orch.openai.speech import Speech, SpeechPlan, Speed
from trio_orch.openai.validation import BadRequest, error_body
from trio_orch.types import OrchOutput

__all__ = ["SPEECH", "speech_route"]

log = logging.getLogger("trio_orch.http")

SPEECH = "/v1/audio/speech"


def speech_route(engine: EngineClient, *, models: ServedModels, outputs: Sequence[str] | None,
                 limits: HTTPLimits, front: FrontMetrics) -> Route:
    """``POST /v1/audio/speech`` over ``engine`` (``models``: the names it answers to)."""
    route = OpenAIRoute(engine, SPEECH, front, limits)
    plan = SpeechPlan(engine, outputs)

    def audio_of(sp: Speech, m: OrchOutput) -> bytes:
        """One output's audio; its finish counted."""
        if m.finished:
            front.count_finished("stop")
        return sp.add(m)

    def failure(code: str, message: str) -> bytes:
        return sse({"type": "error", **error_body(message, "server_error", code=code)})

    def events(sp: Speech, handle: AcceptedRequest, input_tokens: int) -> AsyncIterator[bytes]:
        def render(m: OrchOutput) -> bytes:
            data = audio_of(sp, m)
            out = b""
            if data:
                out = sse({"type": "speech.audio.delta", "audio": base64.b64encode(data).decode()})
            if m.finished:
                out += sse({"type": "speech.audio.done", "usage": {
                    "input_tokens": input_tokens, "output_tokens": sp.chunks,
                    "total_tokens": input_tokens + sp.chunks}})
            return out

        return route.body(handle, render, failure)

    def cut(code: str, message: str) -> bytes:
        log.warning("a pcm stream ended early (%s): %s", code, message)
        return b""

    async def whole(fmt: str, sp: Speech, handle: AcceptedRequest) -> Any:
        err = await route.collect(handle, partial(audio_of, sp))
        if err is not None:
            return err
        body = await anyio.to_thread.run_sync(encode_audio, b"".join(sp.pieces), sp.sample_rate, fmt)
        return Response(body, media_type=AUDIO_OUT[fmt].content_type)

    async def handle(request: Request) -> Response:
        try:
            req = route.parse(await request.body(), SpeechRequest)
            checked = plan.read(req, models, limits.max_prompt_chars)
        except BadRequest as exc:
            return route.bad(exc)
        admitted = await route.admit(checked.payload, final_stage_id=checked.final_stage_id,
                                     sampling=checked.sampling, priority=req.priority)
        if isinstance(admitted, Response):
            return admitted
        front.count_tokens(checked.input_tokens, {})
        sp = Speech(outputs, Speed(req.speed))
        if req.stream_format == "sse":
            return route.stream(events(sp, admitted, checked.input_tokens))
        if req.response_format == "pcm":
            pcm = route.body(admitted, partial(audio_of, sp), cut)
            return route.stream(pcm, AUDIO_OUT["pcm"].content_type)
        answer = await route.wait(partial(whole, req.response_format, sp, admitted), request)
        return answer if answer.status_code != 200 else route.ok(answer)

    return Route(SPEECH, handle, methods=["POST"])
