"""``/v1/realtime``: the session protocol (:mod:`trio_orch.http.realtime`) over a Starlette WebSocket.

One task reads client frames and performs the actions the protocol returns
(add the request, send it more input, cancel it); once the request exists a
second task streams its messages back as events.  Sends are serialised by
one lock.  Whatever ends the socket -- the client closing it, a network
error, the server stopping -- the request is aborted on every stage if it
has not ended (the engine's handle is closed), so a session leaves nothing
behind.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
from collections.abc import Sequence
from typing import Any

import anyio
from starlette.routing import WebSocketRoute
from starlette.websockets import WebSocket, WebSocketDisconnect

from trio_orch.engine import AsyncRequestHandle, Engine, EngineClosed, Overloaded
from trio_orch.http.realtime import Append, Cancel, RealtimeSession, Start

__all__ = ["realtime_route", "run_session"]

log = logging.getLogger("trio_orch.http.realtime")

_ids = itertools.count()


def realtime_route(engine: Engine, outputs: Sequence[str] | None, path: str = "/v1/realtime",
                   **limits: int) -> WebSocketRoute:
    """The Starlette route of the realtime endpoint over ``engine`` (``limits``: RealtimeSession's)."""

    async def endpoint(ws: WebSocket) -> None:
        await run_session(ws, engine, outputs, **limits)

    return WebSocketRoute(path, endpoint)


async def run_session(ws: WebSocket, engine: Engine, outputs: Sequence[str] | None, **limits: int) -> None:
    """Serve one session on an accepted-to-be WebSocket until the client closes it."""
    await ws.accept()
    session = RealtimeSession(f"sess_{os.getpid():x}_{next(_ids)}", final_stage_ids=engine.final_stage_ids,
                              outputs=list(outputs) if outputs is not None else None, **limits)
    lock = anyio.Lock()

    async def send(events: list[dict[str, Any]]) -> None:
        async with lock:
            for e in events:
                await ws.send_text(json.dumps(e, separators=(",", ":")))

    handle: AsyncRequestHandle | None = None

    async def stream(h: AsyncRequestHandle) -> None:
        async for m in h:
            await send(session.output(m))

    try:
        async with anyio.create_task_group() as tg:  # the response stream runs beside the reader
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
                            handle = await engine.add_request_async(a.prompt, resumable=a.resumable,
                                                                    final_stage_id=a.final_stage_id,
                                                                    request_id=session.response_id)
                        except (ValueError, EngineClosed, Overloaded) as exc:  # shed: the session says so
                            await send(session.request_failed(exc))
                            break
                        await send(session.request_started(engine.final_stage_ids))
                        tg.start_soon(stream, handle)
                    elif type(a) is Append and handle is not None:
                        try:
                            await handle.update(a.segment, final=a.final)
                        except (ValueError, EngineClosed) as exc:
                            await send(session.update_failed(exc))
                    elif type(a) is Cancel and handle is not None:
                        handle.abort()
            tg.cancel_scope.cancel()
    except* WebSocketDisconnect:
        pass  # the client left while we sent (or read): the line below says so, no traceback
    finally:
        if handle is not None and not handle.finished:
            handle.close()  # the client left before the end: abort the request on every stage
            log.info("realtime session %s closed mid-response; its request was aborted", session.session_id)
