"""Responses that watch for the client leaving: the SSE stream and the wait for a non-streamed answer.

Shared by every generation route (chat, images).  AnyIO: the same code on
an asyncio or a Trio server.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import anyio
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

__all__ = ["SSEResponse", "sse", "until_done_or_gone"]


def sse(obj: Any) -> bytes:
    """One server-sent event carrying ``obj`` as compact JSON."""
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
    the orchestrator).  The watcher never cancels a ``send`` (it cancels the
    body's scope only while the loop waits for a chunk): a server may run
    its own connection bookkeeping inside it (answer the final body chunk
    with ``http.disconnect`` and then, still in that call, close a
    ``Connection: close`` connection or re-arm its keep-alive timer), so
    cancelling there would leave the connection open with the response
    complete.  An ``http.disconnect`` once the last chunk is on its
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
        waiting = False  # awaiting the next chunk: the one place the watcher's cancel may land
        error: BaseException | None = None
        events = self.events.__aiter__()
        # One scope for the whole body, cancelled only while the loop waits for a chunk: entering a
        # cancel scope per chunk costs tens of microseconds on Trio (docs/performance.md)
        body = anyio.CancelScope()
        async with anyio.create_task_group() as tg:
            async def watch() -> None:
                nonlocal client_left
                await _until_disconnect(receive)
                if finishing:
                    return
                client_left = True
                if waiting:
                    body.cancel()  # the client left: stop waiting for the body's next chunk

            tg.start_soon(watch)
            try:
                await send({"type": "http.response.start", "status": self.status_code,
                            "headers": self.raw_headers})
                with body:
                    while not client_left:
                        waiting = True
                        try:
                            chunk: bytes | None = await events.__anext__()
                        except StopAsyncIteration:
                            chunk = None
                        finally:
                            waiting = False
                        if client_left:  # (a cancel made now is left pending: no checkpoint follows)
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
        # A finished async generator (its frame gone) has nothing left to close: no shielded scope
        # then, which is not free on Trio
        if getattr(self.events, "ag_frame", self) is not None:
            with anyio.CancelScope(shield=True):
                await self.events.aclose()  # type: ignore[attr-defined]
        if error is not None:
            raise error
        if client_left and self.on_disconnect is not None:
            self.on_disconnect()
