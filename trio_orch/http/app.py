"""The HTTP app (Starlette, ASGI) over the Trio engine: what ``trio-orch serve`` serves.

Routes: ``POST /v1/chat/completions`` (non-streaming, or SSE with
``"stream": true``; ``modalities`` ``["text"]`` or ``["text", "audio"]``),
``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus text), and
the ``/v1/realtime`` WebSocket session (:mod:`trio_orch.http.realtime_server`).
The app is independent of the server that runs it (``trio-orch serve`` runs
it under uvicorn, :mod:`trio_orch.serve.uvicorn_front`); :class:`~trio_orch.http.limits.LimitsMiddleware`
applies the limits any ASGI server can.

A request is admitted before any byte of the answer goes out, so a refusal
is a status code: 429 with ``Retry-After`` when the engine sheds it
(:class:`~trio_orch.engine.base.Overloaded`), 503 when a stage of its path
has no live replica or the server is draining.  A client that goes away --
mid-stream or while waiting for a non-streamed answer -- aborts its request
in the orchestrator.  ``/health`` says ``ok``, ``degraded`` (a stage has no
live replica; per-stage live/total replicas), ``draining`` or ``down``.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from functools import partial
from typing import Any

import anyio
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from stages.registry import text_stage
from trio_orch.engine import AsyncRequestHandle, Engine, EngineClosed, Overloaded
from trio_orch.http.admin import admin_routes
from trio_orch.http.limits import HTTPLimits, LimitsMiddleware, Shedder
from trio_orch.http.metrics import CONTENT_TYPE, ExtraCounters, FrontMetrics, render
from trio_orch.http.openai_chat import (
    BadRequest,
    ChatRequest,
    ChatStream,
    error_body,
    map_chat_sampling,
    orch_error_status,
    parse_chat_request,
    parse_json_body,
)
from trio_orch.http.realtime_server import realtime_route
from trio_orch.types import OrchError

__all__ = ["SSEResponse", "create_app", "until_done_or_gone"]

log = logging.getLogger("trio_orch.serve.command")

CHAT = "/v1/chat/completions"


def _sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


async def _until_disconnect(receive: Receive) -> None:
    while True:
        if (await receive())["type"] == "http.disconnect":
            return


async def until_done_or_gone(fn: Callable[[], Awaitable[Any]], receive: Receive
                             ) -> tuple[Any, BaseException | None, bool]:
    """Run ``fn()`` unless the client disconnects first: ``(result, exception, client_left)``.

    A disconnect cancels ``fn`` (whatever it awaits is closed under it).
    """
    result: Any = None
    exc: BaseException | None = None
    left = False
    async with anyio.create_task_group() as tg:
        async def watch() -> None:
            nonlocal left
            await _until_disconnect(receive)
            left = True
            tg.cancel_scope.cancel()

        tg.start_soon(watch)
        try:
            result = await fn()
        except Exception as e:
            exc = e
        finally:
            tg.cancel_scope.cancel()
    return result, exc, left


class SSEResponse(StreamingResponse):
    """Server-sent events that watch for the client leaving, whatever the ASGI spec version.

    A watcher task reads ``receive`` for the client leaving.  If it goes
    first, the watcher cancels the wait for the next chunk, which closes the
    request's message iterator under the body (and so aborts the request in
    the orchestrator).  The watcher never cancels a ``send``: the server
    runs its own connection bookkeeping inside it (hypercorn answers the
    final body chunk with ``http.disconnect`` and then, still in that call,
    closes a ``Connection: close`` connection or re-arms its keep-alive
    timer), so cancelling there would leave the connection open with the
    response complete.  An ``http.disconnect`` once the last chunk is on its
    way is the end of the response, not the client leaving.  AnyIO: the same
    code on an asyncio or a Trio server.
    """

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[bytes], on_disconnect: Any = None) -> None:
        super().__init__(events, 200, {"cache-control": "no-cache", "x-accel-buffering": "no"},
                         self.media_type)
        self.events = events
        self.on_disconnect = on_disconnect

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        client_left = False
        finishing = False  # the last chunk is being sent: a disconnect now is the server's notice
        waiting: anyio.CancelScope | None = None  # set only while awaiting the next chunk
        error: BaseException | None = None
        events = self.events.__aiter__()
        async with anyio.create_task_group() as tg:
            async def watch() -> None:
                nonlocal client_left
                await _until_disconnect(receive)
                if finishing:
                    return
                client_left = True
                if waiting is not None:
                    waiting.cancel()  # the client left: stop waiting for the body's next chunk

            tg.start_soon(watch)
            try:
                await send({"type": "http.response.start", "status": self.status_code,
                            "headers": self.raw_headers})
                while not client_left:
                    with anyio.CancelScope() as waiting:
                        try:
                            chunk: bytes | None = await events.__anext__()
                        except StopAsyncIteration:
                            chunk = None
                    waiting = None
                    if client_left:
                        break
                    if chunk is None:
                        finishing = True
                        await send({"type": "http.response.body", "body": b"", "more_body": False})
                        break
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
            except OSError:  # the client went away while we were writing
                client_left = True
            except Exception as exc:
                error = exc
            finally:
                tg.cancel_scope.cancel()  # the watcher
        with anyio.CancelScope(shield=True):
            await self.events.aclose()  # type: ignore[attr-defined]
        if error is not None:
            raise error
        if client_left and self.on_disconnect is not None:
            self.on_disconnect()


def create_app(engine: Engine, *, model_name: str = "trio-orch",
               extra_metrics: Callable[[], ExtraCounters] | None = None,
               outputs: Sequence[str] | None = None, limits: HTTPLimits | None = None,
               front: FrontMetrics | None = None, token_limit: int | None = None,
               stage_names: Sequence[str] | None = None, admin_token: str | None = None) -> Starlette:
    """The ASGI app over a started :class:`Engine`.

    ``extra_metrics()`` returns more counters for ``/metrics`` (the supervisor's
    restarts).  ``outputs``: each stage's output modality
    (``stages.registry.outputs_of``); None judges outputs by their shape and
    takes stage 0 for text.  ``limits``: the HTTP limits (defaults of
    :class:`HTTPLimits`); ``front``: the counters shared with the server
    (set ``front.draining`` to drain); ``token_limit``: the text stage's own
    cap on generated tokens (for ``finish_reason``); ``stage_names`` label
    the stages in ``/health``; ``admin_token`` turns on the ``/admin/...``
    control routes behind that bearer token (:mod:`trio_orch.http.admin`).
    """
    limits = limits or HTTPLimits()
    front = front if front is not None else FrontMetrics()

    def error(status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
              code: str | None = None, retry_after: float | None = None) -> JSONResponse:
        front.count(CHAT, status)
        if status < 500:  # bad client input or shedding: say what was refused (counted by status)
            log.log(logging.INFO if status == 429 else logging.WARNING,
                    "refused a chat completion request (%d): %s", status, message)
        headers = {"retry-after": str(max(1, math.ceil(retry_after)))} if retry_after is not None else None
        return JSONResponse(error_body(message, kind, param, code), status_code=status, headers=headers)

    def final_stage_for(req: ChatRequest) -> int | None:
        finals = engine.final_stage_ids
        if req.audio:
            if outputs is not None and not any(outputs[k] in ("audio", "data") for k in finals):
                raise BadRequest("this pipeline has no audio output: ask for modalities [\"text\"]",
                                 "modalities")
            return None
        text = text_stage(finals, outputs)
        if text is None:
            raise BadRequest("this pipeline has no text-only output: "
                             "ask for modalities [\"text\", \"audio\"]", "modalities")
        return text  # text only: the request stops after the stage that gives text

    def disconnected() -> None:
        front.disconnects += 1
        log.info("a client disconnected before its answer; its request was aborted")

    async def chat_completions(request: Request) -> Response:
        if front.draining:
            return error(503, "the server is shutting down: not accepting new requests", "server_error",
                         code="draining", retry_after=1)
        try:
            body = parse_json_body(await request.body(), limits.max_json_depth)
            req = parse_chat_request(body, model_name, limits.max_prompt_chars)
            final = final_stage_for(req)
            map_chat_sampling(body, req, engine.stage_params, final_stage_ids=engine.final_stage_ids,
                              outputs=outputs, final_stage_id=final)
        except BadRequest as exc:
            return error(exc.status, str(exc), param=exc.param, code=exc.code)
        if not engine.running:
            why = engine.closed_reason or "it has not started"
            return error(503, f"the engine is not running: {why}", "server_error", code="engine_closed")
        try:
            handle = await engine.add_request_async(req.payload(), final_stage_id=final,
                                                    sampling=req.sampling, want_timings=not req.stream)
        except Overloaded as exc:
            return error(429, str(exc), "rate_limit_error", code="overloaded", retry_after=exc.retry_after)
        except EngineClosed as exc:
            return error(503, str(exc), "server_error", code="engine_closed")
        except ValueError as exc:
            return error(400, str(exc))
        if handle.rejection is not None:
            return failed(handle.rejection)
        if req.stream:
            front.count(CHAT, 200)
            return SSEResponse(_stream(req, handle), on_disconnect=disconnected)
        result, exc, left = await until_done_or_gone(partial(_collect, req, handle), request.receive)
        if left:  # the client left first: cancelling the collector aborted the request
            disconnected()
            front.count(CHAT, 499)
            return Response(status_code=499)
        if isinstance(exc, EngineClosed):
            return error(503, str(exc), "server_error", code="engine_closed")
        if exc is not None:
            raise exc
        if isinstance(result, OrchError):
            return failed(result)
        front.count(CHAT, 200)
        return JSONResponse(result)

    def failed(err: OrchError) -> JSONResponse:
        status = orch_error_status(err)
        return error(status, f"request failed: {err.kind}: {err.message}", "server_error", code=err.kind,
                     retry_after=1 if status == 503 else None)

    async def _collect(req: ChatRequest, handle: AsyncRequestHandle) -> dict[str, Any] | OrchError:
        cs = ChatStream(req, outputs, token_limit)
        async for msgs in handle.batches():
            for m in msgs:
                if isinstance(m, OrchError):
                    return m
                cs.add(m)
        observe_rtf(cs, handle)
        return cs.completion(cs.timings(handle.t_open, time.perf_counter(), handle.timings))

    def observe_rtf(cs: ChatStream, handle: AsyncRequestHandle) -> None:
        rtf = cs.real_time_factor(handle.t_open)
        if rtf is not None:
            front.rtf.observe(rtf)

    async def _stream(req: ChatRequest, handle: AsyncRequestHandle) -> AsyncIterator[bytes]:
        cs = ChatStream(req, outputs, token_limit)
        yield _sse(cs.first_chunk())
        gen = handle.batches()
        try:
            async for msgs in gen:  # one HTTP chunk per dispatcher batch
                out = []
                for m in msgs:
                    if isinstance(m, OrchError):
                        out.append(_sse(error_body(f"request failed: {m.kind}: {m.message}",
                                                   "server_error", code=m.kind)))
                        break
                    chunk = cs.add(m)
                    if chunk is not None:
                        out.append(_sse(chunk))
                    if m.finished:
                        observe_rtf(cs, handle)
                        out.append(_sse(cs.last_chunk()))
                        if req.include_usage:
                            out.append(_sse(cs.usage_chunk()))
                if out:
                    yield b"".join(out)
        except (EngineClosed, ValueError) as exc:
            yield _sse(error_body(str(exc), "server_error", code="engine_closed"))
        finally:
            await gen.aclose()
        yield b"data: [DONE]\n\n"

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [
            {"id": model_name, "object": "model", "created": 0, "owned_by": "trio-orch"}]})

    async def health(request: Request) -> Response:
        stats = await engine.stats_async()
        stages = [{"stage": k, "live": live, "total": total, "available": live > 0}
                  for k, (live, total) in enumerate(stats.replicas)]
        if stage_names is not None:
            for st, name in zip(stages, stage_names, strict=False):
                st["name"] = name
        body: dict[str, Any] = {"stages": stages, "stages_available": list(stats.stage_available),
                                "active_requests": stats.active_requests,
                                "queued_requests": stats.queued_requests + stats.admission_waiting}
        down = [k for k, a in enumerate(stats.stage_available) if not a]
        if front.draining or stats.draining:
            status = "draining"
        elif not stats.running:
            return JSONResponse({"status": "down", "reason": engine.closed_reason}, status_code=503)
        elif down:
            status = "degraded"
            body["unavailable_stages"] = down
        else:
            status = "ok"
        return JSONResponse({"status": status, **body}, status_code=200 if status == "ok" else 503)

    async def metrics(request: Request) -> Response:
        stats = await engine.stats_async()
        extra = extra_metrics() if extra_metrics is not None else None
        return Response(render(stats, front, extra, outputs), media_type=CONTENT_TYPE)

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        return JSONResponse(error_body(exc.detail, "invalid_request_error"), status_code=exc.status_code)

    shedder = Shedder(lambda: engine.shedding, frozenset({CHAT}), front, engine.retry_after,
                      capacity=lambda: engine.capacity)
    app = Starlette(routes=[
        Route(CHAT, chat_completions, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        realtime_route(engine, outputs),
        *admin_routes(engine, admin_token),
    ], exception_handlers={HTTPException: http_error},
        middleware=[Middleware(LimitsMiddleware, limits=limits, front=front, shedder=shedder)])
    app.state.shedder = shedder  # a front may refuse at the request line (uvicorn_config)
    return app
