"""``/v1/realtime``: the session protocol (:mod:`trio_orch.openai.realtime`) over a Starlette WebSocket.

The official ``openai`` SDK connects here (``client.realtime.connect(model=...)``
with ``base_url=http://HOST:PORT/v1``: ``ws://HOST:PORT/v1/realtime?model=...``,
its key as ``Authorization: Bearer``, which this route leaves to the app's
``/v1`` guard).  A ``model`` the server does not serve is refused at the
handshake with a 404 ``model_not_found``, as a chat naming it would be, so a
client pointed at the wrong server finds out.  One task reads client frames and performs the actions the
protocol returns (add the session's request, send it the next input segment,
cancel it); each request's messages stream back as events from a task of
their own.  Sends are serialised by one lock.  Whatever ends the socket --
the client closing it, a network error, the server stopping -- the request
is aborted on every stage if it has not ended (the engine's handle is
closed), so a session leaves nothing behind.

The session counts into the same counters as the HTTP routes
(:class:`~trio_orch.http.metrics.FrontMetrics`): each input segment's tokens
as prompt tokens, each text output as a generated token of its stage, and
each response that ends as a finished request (the text stage's
``finish_reason`` when it completed, ``abort`` when cancelled; a failed one
is counted by the engine's errors).  A client that closes the session with a
response in progress left before its answer, as a client of the HTTP routes
may: :meth:`~trio_orch.http.metrics.FrontMetrics.client_left` counts it.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
from collections.abc import Sequence
from typing import Any

import anyio
from starlette.responses import JSONResponse
from starlette.routing import WebSocketRoute
from starlette.websockets import WebSocket, WebSocketDisconnect

from stages.registry import as_text
from trio_orch.engine.api import AcceptedRequest, EngineClient, EngineClosed, Overloaded
from trio_orch.http.metrics import FrontMetrics
from trio_orch.openai.protocol import ServedModels
from trio_orch.openai.realtime import Append, Cancel, RealtimeSession, Start
from trio_orch.openai.tokenizer import prompt_token_count
from trio_orch.openai.validation import BadRequest, error_body
from trio_orch.types import Message, OrchOutput

__all__ = ["realtime_route", "run_session"]

log = logging.getLogger("trio_orch.http")

_ids = itertools.count()


def realtime_route(engine: EngineClient, outputs: Sequence[str] | None, path: str = "/v1/realtime",
                   models: ServedModels | None = None, front: FrontMetrics | None = None,
                   **limits: int) -> WebSocketRoute:
    """The Starlette route of the realtime endpoint over ``engine`` (``limits``: RealtimeSession's).

    ``models``: the served names (None: any ``model`` is echoed); ``front``: the counters to count into.
    """

    async def endpoint(ws: WebSocket) -> None:
        await run_session(ws, engine, outputs, models=models, front=front, **limits)

    return WebSocketRoute(path, endpoint)


async def run_session(ws: WebSocket, engine: EngineClient, outputs: Sequence[str] | None, *,
                      models: ServedModels | None = None, front: FrontMetrics | None = None,
                      **limits: int) -> None:
    """Serve one session on an accepted-to-be WebSocket until the client closes it."""
    model = ws.query_params.get("model")
    if models is not None:
        try:
            models.resolve(model)
        except BadRequest as exc:
            log.warning("refused a realtime session (%d): %s", exc.status, exc)
            body = error_body(str(exc), "invalid_request_error", exc.param, exc.code)
            await ws.send_denial_response(JSONResponse(body, status_code=exc.status))
            return
    answers = sorted({outputs[k] for k in engine.final_stage_ids}) if outputs is not None else []
    if answers and not set(answers) & {"text", "audio", "data"}:  # e.g. text2image: nothing to stream
        message = (f"this pipeline answers with {' and '.join(answers)}, not text or audio: it serves "
                   "no realtime session")
        log.warning("refused a realtime session: %s", message)
        await ws.send_denial_response(JSONResponse(error_body(message, "invalid_request_error", "model"),
                                                   status_code=400))
        return
    await ws.accept()
    session = RealtimeSession(f"sess_{os.getpid():x}_{next(_ids)}", final_stage_ids=engine.final_stage_ids,
                              outputs=outputs, stage_params=engine.stage_params,
                              model=model or (models.name if models is not None else None),
                              served=models.names if models is not None else None, **limits)
    lock = anyio.Lock()
    counted = Counted(front, engine, outputs, session.text_stage, path=ws.scope.get("path", "/v1/realtime"))

    async def send(events: list[dict[str, Any]]) -> None:
        counted.sent(events)
        async with lock:
            for e in events:
                await ws.send_text(json.dumps(e, separators=(",", ":")))

    handle: AcceptedRequest | None = None

    async def stream(h: AcceptedRequest) -> None:
        async for m in h:
            counted.output(m)
            await send(session.output(m))

    try:
        async with anyio.create_task_group() as tg:  # the response streams run beside the reader
            await send(session.opened())
            while True:
                try:
                    msg = await ws.receive()
                except WebSocketDisconnect:
                    break
                if msg["type"] == "websocket.disconnect":
                    break
                frame = msg.get("text")
                events, actions = session.receive(frame if frame is not None else msg.get("bytes") or b"")
                await send(events)
                for a in actions:
                    if type(a) is Start:
                        try:
                            h = await engine.add_request_async(
                                a.prompt, resumable=True, request_id=a.request_id,
                                final_stage_id=a.final_stage_id, sampling=a.sampling)
                        except (ValueError, RuntimeError, EngineClosed, Overloaded) as exc:  # shed, stopping
                            await send(session.request_failed(a.response_id, exc))
                            continue
                        handle = h
                        counted.prompt(a.prompt)
                        tg.start_soon(stream, h)
                    elif type(a) is Append and handle is not None and handle.request_id == a.request_id:
                        try:
                            await handle.update(a.segment)
                        except (ValueError, RuntimeError, EngineClosed) as exc:  # it ended meanwhile
                            await send(session.update_failed(a.response_id, exc))
                        else:
                            counted.prompt(a.segment)
                    elif type(a) is Cancel and handle is not None and handle.request_id == a.request_id:
                        handle.abort()
            tg.cancel_scope.cancel()
    except* WebSocketDisconnect:
        pass  # the client left while we sent (or read): the line below says so, no traceback
    finally:
        if session.response is not None:  # the client left before its response ended
            counted.left()
        if handle is not None and not handle.finished:
            handle.close()  # the client left while the request was live: abort it on every stage
            log.info("realtime session %s closed with its request live; the request was aborted",
                     session.session_id)


class Counted:
    """What one session adds to the front's token and finish-reason counters (nothing without ``front``)."""

    def __init__(self, front: FrontMetrics | None, engine: EngineClient, outputs: Sequence[str] | None,
                 text_stage: int | None, path: str) -> None:
        self.front, self.engine, self.outputs, self.text_stage = front, engine, outputs, text_stage
        self.path = path
        self.reason: str | None = None  # the text stage's finish_reason for the response in progress

    def prompt(self, segment: str) -> None:
        """An input segment the request was sent: its tokens (UTF-8 bytes where no tokenizer is known)."""
        if self.front is not None:
            n = prompt_token_count(self.engine, self.outputs, segment)
            self.front.count_tokens(n if n is not None else len(segment.encode()), {})

    def output(self, m: Message) -> None:
        """One message of the request: a text output is a generated token of its stage."""
        if self.front is not None and isinstance(m, OrchOutput):
            modality = self.outputs[m.stage_id] if self.outputs is not None else "data"
            if as_text(modality, m.data) is not None:
                self.front.count_tokens(0, {m.stage_id: 1})
                if (m.stage_id == self.text_stage and isinstance(m.data, dict)
                        and isinstance(m.data.get("finish_reason"), str)):
                    self.reason = m.data["finish_reason"]

    def sent(self, events: list[dict[str, Any]]) -> None:
        """Events about to be sent: a ``response.done`` is a finished request."""
        if self.front is None:
            return
        for e in events:
            if e.get("type") == "response.done":
                status = e["response"]["status"]
                if status == "completed":
                    self.front.count_finished(self.reason or "stop")
                elif status == "cancelled":
                    self.front.count_finished("abort")
                self.reason = None

    def left(self) -> None:
        """The client closed the session with a response in progress: that request was aborted."""
        if self.front is not None:
            self.front.client_left(self.path)
