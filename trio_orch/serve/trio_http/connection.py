"""One HTTP/1.1 connection of the lean server: its request cycles, the ASGI ``http`` scope, keep-alive.

One Trio task per connection reads a request head (within the header and
keep-alive deadlines), runs the app, and either starts the next cycle or
closes.  The body is read as the app asks for it (``receive``), so an
upload the app does not want is not buffered; ``Expect: 100-continue`` is
answered when the app first asks.  Once the body is in, the task that
calls ``receive`` reads on from the socket: the client closing the
connection while the response streams reaches the app as
``http.disconnect`` (the SSE responses abort their request on it), and
bytes of a pipelined next request are kept for the next cycle.  The
response goes out as the app sends it: framed by :mod:`.protocol`, written
by :class:`~.transport.Transport` without a checkpoint when the kernel takes
the bytes.  After the client left, ``send`` drops what it is given (ASGI
2.3: the app learns it from ``receive``).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from trio_orch.serve.framing import error_answer, error_code
from trio_orch.serve.trio_http.config import MAX_DRAIN_BYTES, ServerState
from trio_orch.serve.trio_http.protocol import (
    CLOSED,
    END,
    BadRequest,
    Framing,
    RequestHead,
    RequestReader,
    response_head,
)
from trio_orch.serve.trio_http.transport import Transport
from trio_orch.serve.trio_http.websocket import serve_websocket

__all__ = ["ASGIApp", "HTTPConnection", "asgi_scope"]

log = logging.getLogger("trio_orch.serve.trio_http")

ASGIApp = Callable[[dict[str, Any], Any, Any], Awaitable[None]]
CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
DISCONNECT = {"type": "http.disconnect"}


def asgi_scope(kind: str, head: RequestHead, server: Any, client: Any) -> dict[str, Any]:
    """The ASGI scope of ``head`` (``kind`` "http" or "websocket"), every standard key."""
    scope = {"type": kind, "asgi": {"version": "3.0", "spec_version": "2.3"},
             "http_version": head.http_version, "server": server, "client": client,
             "scheme": "http" if kind == "http" else "ws", "root_path": "", "path": head.path,
             "raw_path": head.raw_path, "query_string": head.query_string, "headers": head.headers}
    if kind == "http":
        scope["method"] = head.method
    return scope


class _Cycle:
    """One request and its response, as the connection's task and the app's tasks see it."""

    __slots__ = ("bad_body", "body_done", "complete", "continued", "framing", "gone", "head", "left",
                 "pending", "started", "watching")

    def __init__(self, head: RequestHead) -> None:
        self.head = head
        self.body_done = False
        self.left = False  #: the client closed its side or went away before the response was complete
        self.bad_body: BadRequest | None = None  #: the body broke its framing (a malformed chunk): a 400
        self.pending: bytes | None = None  #: body bytes that came with the head, for the first receive
        self.continued = False  #: the 100 Continue went out
        self.started = False
        self.complete = False
        self.framing: Framing | None = None
        self.gone = trio.Event()  #: the client left, or the response is complete: receive says disconnect
        self.watching: trio.CancelScope | None = None  #: the task reading on for the client leaving


class HTTPConnection:
    """One accepted connection; :meth:`run` serves it to its end and closes its socket."""

    def __init__(self, app: ASGIApp, transport: Transport, state: ServerState, *, refuse: bool = False
                 ) -> None:
        self.app = app
        self.transport = transport
        self.state = state
        self.limits = state.limits
        self.reader = RequestReader(self.limits.max_head_bytes)
        self.refuse = refuse  #: past the connection limit: its request is answered 503
        self.idle_scope: trio.CancelScope | None = None  #: set while awaiting a request, none of it in
        self.eof = False  #: the client closed its side
        try:
            self.server = tuple(transport.sock.getsockname()[:2])
            self.client: Any = tuple(transport.sock.getpeername()[:2])
        except OSError:
            self.server = self.client = None

    def close_if_idle(self) -> None:
        """The server drains: a connection waiting for a next request, none of it sent, closes now.

        One whose request already waits in the kernel is served instead
        (the app answers it 503 draining): closing it would reset it.
        """
        if self.idle_scope is not None and self._idle():
            self.idle_scope.cancel()

    def _idle(self) -> bool:
        return self.reader.buffered == 0 and not self.transport.pending()

    async def run(self) -> None:
        try:
            await self._serve()
        finally:
            self.transport.abort()

    async def _serve(self) -> None:
        since = trio.current_time()
        first = True
        while True:
            head = await self._next_head(since, first)
            if head is None:
                return
            if self.refuse:
                self.state.refused += 1
                await self.transport.write(error_answer(
                    503, "too many connections: retry later", "too_many_connections", "server_error",
                    {"retry-after": "1"}))
                await self.transport.close()
                return
            if head.websocket:
                self.state.websockets += 1
                try:
                    scope = asgi_scope("websocket", head, self.server, self.client)
                    await serve_websocket(self.app, self.transport, self.reader.leftover(), head, scope,
                                          self.limits)
                finally:
                    self.state.websockets -= 1
                return
            if not await self._cycle(head):
                await self.transport.close()
                return
            self.reader.next_cycle()
            since, first = trio.current_time(), False

    async def _next_head(self, since: float, first: bool) -> RequestHead | None:
        """The next request head, or None once the connection is to close (after any answer it needs)."""
        head_deadline = since + self.limits.header_timeout
        idle_deadline = head_deadline if first else since + self.limits.keep_alive_timeout
        while True:
            try:
                event = self.reader.next_event()
            except BadRequest as exc:
                self.state.bad_requests += 1
                log.debug("a bad request (%d): %s", exc.status, exc)
                await self.transport.write(error_answer(exc.status, f"malformed request: {exc}",
                                                        error_code(exc.status)))
                await self.transport.close()
                return None
            if isinstance(event, RequestHead):
                return event
            if event is CLOSED or self.eof or (self.state.draining and self._idle()):
                return None
            idle = self.reader.buffered == 0
            with trio.CancelScope(deadline=min(head_deadline, idle_deadline) if idle else head_deadline
                                  ) as scope:
                if idle:
                    self.idle_scope = scope
                data = await self.transport.recv()
            self.idle_scope = None
            if scope.cancelled_caught:  # a deadline, or the drain
                if not self.state.draining and (first or not idle):
                    self.state.header_timeouts += 1
                return None
            self._feed(data)

    def _feed(self, data: bytes) -> None:
        if not data:
            self.eof = True
        self.reader.feed(data)

    async def _cycle(self, head: RequestHead) -> bool:
        """Serve one request; whether the connection may carry the next one."""
        cycle = _Cycle(head)
        try:
            cycle.pending = self._take_body(cycle)  # what came with the head; a bodyless request ends here
        except BadRequest:
            return False

        async def receive() -> dict[str, Any]:
            return await self._receive(cycle)

        async def send(message: dict[str, Any]) -> None:
            await self._send(cycle, message)

        try:
            await self.app(asgi_scope("http", head, self.server, self.client), receive, send)
        except Exception as exc:
            log.error("the ASGI app raised while serving %s %s: %s: %s", head.method, head.path,
                      type(exc).__name__, exc, exc_info=exc)
            if not cycle.started:
                await self.transport.write(error_answer(
                    500, "internal server error: the error was logged", "internal_error", "server_error"))
            return False
        finally:
            self._end(cycle)
        if not cycle.started:
            if cycle.bad_body is not None:  # the app was told http.disconnect; the client gets its 400
                self.state.bad_requests += 1
                await self.transport.write(error_answer(400, f"malformed request body: {cycle.bad_body}",
                                                        "bad_request"))
                return False
            if cycle.left:  # the app was told http.disconnect (and logged the leave): nobody to answer
                log.debug("the client left before its answer to %s %s", head.method, head.path)
                return False
            log.error("the ASGI app returned without a response to %s %s", head.method, head.path)
            await self.transport.write(error_answer(
                500, "internal server error: the app sent no response", "internal_error", "server_error"))
            return False
        assert cycle.framing is not None
        if not cycle.complete or not cycle.framing.keep_alive or self.transport.broken or self.eof:
            return False
        if self.state.draining:
            return False
        return cycle.body_done or await self._drop_body(cycle)

    def _take_body(self, cycle: _Cycle) -> bytes:
        """The body bytes already buffered (no I/O); ``body_done`` once it ended.  May raise BadRequest."""
        parts: list[bytes] = []
        while not cycle.body_done:
            event = self.reader.next_event()
            if isinstance(event, bytes):
                parts.append(event)
            elif event is END:
                cycle.body_done = True
            else:
                break
        return b"".join(parts) if len(parts) != 1 else parts[0]

    async def _receive(self, cycle: _Cycle) -> dict[str, Any]:
        if cycle.pending is not None:
            data, cycle.pending = cycle.pending, None
            if data or cycle.body_done:
                return {"type": "http.request", "body": data, "more_body": not cycle.body_done}
        if not cycle.body_done and not cycle.gone.is_set():
            if cycle.head.expect_continue and not cycle.continued and not cycle.started:
                cycle.continued = True
                await self.transport.write(CONTINUE)
            while not cycle.gone.is_set():
                try:
                    data = self._take_body(cycle)
                except BadRequest as exc:
                    log.debug("a bad request body: %s", exc)
                    cycle.bad_body = exc
                    self.eof = True  # nothing more can be read from this connection
                    break
                if data or cycle.body_done:
                    return {"type": "http.request", "body": data, "more_body": not cycle.body_done}
                chunk = await self.transport.recv()
                if not chunk:  # the client left during its upload (or closed its side short of the body)
                    cycle.left = True
                    self._feed(b"")
                    break
                self._feed(chunk)
            self._end(cycle)
            return DISCONNECT
        await self._watch(cycle)
        return DISCONNECT

    async def _watch(self, cycle: _Cycle) -> None:
        """Until the client leaves or the response is complete, reading on (a next request is kept)."""
        if cycle.gone.is_set():
            return
        if cycle.watching is not None or self.eof:  # another task reads already, or nothing more to read
            await cycle.gone.wait()
            return
        ahead = 0  # bytes of a next request read meanwhile
        try:
            with trio.CancelScope() as cycle.watching:
                while not cycle.gone.is_set():
                    if ahead >= self.limits.max_head_bytes:  # enough of a next request: read no further
                        await cycle.gone.wait()
                        break
                    chunk = await self.transport.recv()
                    ahead += len(chunk)
                    self._feed(chunk)
                    if not chunk:
                        cycle.left = not cycle.complete
                        self._end(cycle)
        finally:  # also when the caller's own scope cancels it (a peek at "disconnected yet?")
            cycle.watching = None

    def _end(self, cycle: _Cycle) -> None:
        """The client left or the response is complete: every ``receive`` now answers disconnect."""
        cycle.gone.set()
        if cycle.watching is not None:
            cycle.watching.cancel()

    async def _send(self, cycle: _Cycle, message: dict[str, Any]) -> None:
        kind = message["type"]
        if kind == "http.response.body":
            framing = cycle.framing
            if framing is None or cycle.complete:
                where = "after the response ended" if cycle.complete else "before http.response.start"
                raise RuntimeError(f"ASGI: {kind} {where}")
            more = message.get("more_body", False)
            data = framing.body(message.get("body", b""), more)
            if data:
                await self.transport.write(data)
            if not more:
                cycle.complete = True
                self._end(cycle)
            elif self.transport.broken:
                self._end(cycle)
        elif kind == "http.response.start":
            if cycle.started:
                raise RuntimeError("ASGI: a second http.response.start")
            head = cycle.head
            # a client still waiting for its 100 Continue may or may not send its body: close after
            waits = head.expect_continue and not cycle.continued and not cycle.body_done
            keep = head.keep_alive and not self.state.draining and not waits
            data, cycle.framing = response_head(message["status"], list(message.get("headers") or ()), head,
                                                keep_alive=keep)
            cycle.started = True
            await self.transport.write(data)
        else:
            raise RuntimeError(f"ASGI: unexpected message {kind!r} on an http connection")

    async def _drop_body(self, cycle: _Cycle) -> bool:
        """Read and drop the body the app left unread (bounded); whether the connection may go on."""
        dropped = 0
        with trio.move_on_after(self.limits.header_timeout):
            while dropped <= MAX_DRAIN_BYTES:
                try:
                    dropped += len(self._take_body(cycle))
                except BadRequest:
                    return False
                if cycle.body_done:
                    return True
                chunk = await self.transport.recv()
                if not chunk:
                    return False
                self._feed(chunk)
        return False
