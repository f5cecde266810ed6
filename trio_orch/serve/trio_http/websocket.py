"""The lean server's WebSocket sessions: an upgrade request handed to wsproto, the ASGI ``websocket`` scope.

The handshake is the app's to answer: ``websocket.accept`` (with its
subprotocol and headers), ``websocket.close`` before accepting (403), or a
whole HTTP answer through the denial extension
(``websocket.http.response.start`` / ``.body``: the middleware's 503 while
draining, the realtime route's 400/404).  Once accepted, one reader task
turns frames into ``websocket.receive`` messages on a small channel (a
client outpacing the app waits on it), answers pings and the client's
close, and ends the session with ``websocket.disconnect``.  A message over
the limits' ``max_body_bytes`` closes the session with 1009 -- at the frame's
header when the frame alone announces more (:class:`FrameLimit`), so a
client cannot hold the session waiting for an impossible length -- and a
frame wsproto cannot parse with its close code (1002 for a protocol error),
a close frame sent either way before the connection ends.  A ``send`` after the
session ended raises :class:`OSError` (the app's ``WebSocketDisconnect``).
On a cancel (the server's shutdown deadline) the client gets a 1001 close
frame if the socket takes it at once.
"""

from __future__ import annotations

import logging
from typing import Any

import trio
from wsproto import ConnectionType, WSConnection
from wsproto.connection import ConnectionState
from wsproto.events import (
    AcceptConnection,
    BytesMessage,
    CloseConnection,
    Ping,
    RejectConnection,
    RejectData,
    Request,
    TextMessage,
)
from wsproto.extensions import Extension
from wsproto.frame_protocol import CloseReason, Opcode, RsvBits
from wsproto.utilities import LocalProtocolError, RemoteProtocolError

from trio_orch.http.limits import HTTPLimits
from trio_orch.serve.framing import simple_response
from trio_orch.serve.trio_http.protocol import RequestHead
from trio_orch.serve.trio_http.transport import Transport

__all__ = ["SessionGone", "WebSocketSession", "serve_websocket"]

log = logging.getLogger("trio_orch.serve.trio_http")

MESSAGE_TOO_BIG = 1009


class FrameLimit(Extension):
    """The message limit applied at each frame's header: a frame announcing more is refused (1009).

    wsproto's extension hook is the one place a frame's length is seen
    before its payload.  Always on, never negotiated: its name is in no
    handshake, and it claims no reserved bit.
    """

    name = "trio-orch-frame-limit"

    def __init__(self, limit: int) -> None:
        self.limit = limit

    def enabled(self) -> bool:
        return True

    def offer(self) -> bool:  # a client's side: never offered
        return False

    def frame_inbound_header(self, proto: Any, opcode: Opcode, rsv: RsvBits, payload_length: int
                             ) -> CloseReason | RsvBits:
        if payload_length > self.limit:
            return CloseReason.MESSAGE_TOO_BIG
        return RsvBits(False, False, False)


class SessionGone(OSError):
    """``send`` on a WebSocket session that has ended (the client left or the close went out)."""


async def serve_websocket(app: Any, transport: Transport, leftover: bytes, head: RequestHead,
                          scope: dict[str, Any], limits: HTTPLimits) -> None:
    """Serve the upgrade request ``head`` as a WebSocket session, then close the connection."""
    ws = WSConnection(ConnectionType.SERVER)
    try:
        ws.initiate_upgrade_connection(head.headers, head.target)
        request = next(ws.events())
        assert isinstance(request, Request)
    except (RemoteProtocolError, StopIteration, AssertionError) as exc:
        await transport.write(simple_response(400, b'{"error":"bad WebSocket handshake"}'))
        await transport.close()
        log.debug("a bad WebSocket handshake: %s", exc)
        return
    scope["subprotocols"] = list(request.subprotocols)
    scope["extensions"] = {"websocket.http.response": {}}
    await WebSocketSession(app, transport, ws, limits, leftover).run(scope)


class WebSocketSession:
    """One session: the app's ``receive``/``send`` over wsproto and the socket."""

    def __init__(self, app: Any, transport: Transport, ws: WSConnection, limits: HTTPLimits,
                 leftover: bytes) -> None:
        self.app = app
        self.transport = transport
        self.ws = ws
        self.limits = limits
        self.leftover = leftover
        self.connected = False  #: websocket.connect was given to the app
        self.accepted = False
        self.denying = False  #: a denial answer is under way
        self.answered = False  #: the handshake got its HTTP answer instead (denial or 403)
        self.ended = False  #: no more frames go out: our close went out, or the client left
        self.disconnect: dict[str, Any] = {"type": "websocket.disconnect", "code": 1006}
        self.incoming, self.received = trio.open_memory_channel[dict[str, Any]](16)
        self.nursery: trio.Nursery | None = None

    async def run(self, scope: dict[str, Any]) -> None:
        try:
            async with trio.open_nursery() as nursery:
                self.nursery = nursery
                try:
                    await self.app(scope, self.receive, self.send)
                except Exception as exc:
                    log.error("the ASGI app raised in a WebSocket session on %s: %s: %s", scope["path"],
                              type(exc).__name__, exc, exc_info=exc)
                    await self._finish(500, 1011)
                else:
                    await self._finish(403, 1000)
                nursery.cancel_scope.cancel()  # the reader
        finally:
            if self.accepted and not self.ended and self.ws.state is ConnectionState.OPEN:
                try:
                    self.transport.write_nowait(self.ws.send(CloseConnection(code=1001)))
                except LocalProtocolError:
                    pass
            self.transport.abort()

    async def _finish(self, status: int, code: int) -> None:
        """The app returned: answer a handshake it left unanswered, close a session it left open."""
        if not self.accepted and not self.answered:
            if self.denying:
                return  # a denial body left unfinished: only the close ends it
            await self._write(RejectConnection(status_code=status))
        elif self.accepted and not self.ended:
            await self._close(code)

    async def receive(self) -> dict[str, Any]:
        if not self.connected:
            self.connected = True
            return {"type": "websocket.connect"}
        try:
            return await self.received.receive()
        except (trio.EndOfChannel, trio.ClosedResourceError):
            return self.disconnect

    async def send(self, message: dict[str, Any]) -> None:
        kind = message["type"]
        if kind == "websocket.send":
            if not self.accepted:
                raise RuntimeError("ASGI: websocket.send before websocket.accept")
            if self.ended or self.transport.broken:
                raise SessionGone("the WebSocket session has ended")
            text = message.get("text")
            await self._write(TextMessage(data=text) if text is not None
                              else BytesMessage(data=message.get("bytes") or b""))
            if self.transport.broken:
                raise SessionGone("the client is gone")
        elif kind == "websocket.accept":
            self._handshake_open(kind)
            await self._write(AcceptConnection(subprotocol=message.get("subprotocol"),
                                               extra_headers=list(message.get("headers") or ()),
                                               extensions=[FrameLimit(self.limits.max_body_bytes)]))
            self.accepted = True
            assert self.nursery is not None
            self.nursery.start_soon(self._read)
        elif kind == "websocket.close":
            if self.accepted:
                if not self.ended:
                    await self._close(message.get("code") or 1000, message.get("reason") or None)
            elif not self.answered:
                self._handshake_open(kind)
                await self._write(RejectConnection(status_code=403))
                self.answered = True
        elif kind == "websocket.http.response.start":
            self._handshake_open(kind)
            self.denying = True
            await self._write(RejectConnection(status_code=message["status"], has_body=True,
                                               headers=list(message.get("headers") or ())))
        elif kind == "websocket.http.response.body":
            if not self.denying or self.answered:
                raise RuntimeError(f"ASGI: {kind} without a denial under way")
            more = message.get("more_body", False)
            await self._write(RejectData(data=message.get("body", b""), body_finished=not more))
            self.answered = not more
        else:
            raise RuntimeError(f"ASGI: unexpected message {kind!r} on a WebSocket")

    def _handshake_open(self, kind: str) -> None:
        if self.accepted or self.answered or self.denying:
            raise RuntimeError(f"ASGI: {kind} after the handshake was answered")

    async def _write(self, event: Any) -> None:
        await self.transport.write(self.ws.send(event))

    async def _close(self, code: int, reason: str | None = None) -> None:
        self.ended = True
        if self.ws.state is ConnectionState.OPEN:
            await self._write(CloseConnection(code=code, reason=reason))

    async def _read(self) -> None:
        """Frames in, ASGI messages out, until the close or the client leaving."""
        parts: list[Any] = []
        size = 0
        data: bytes | None = self.leftover
        async with self.incoming:
            while True:
                if data:
                    self.ws.receive_data(data)
                for event in self.ws.events():
                    if isinstance(event, TextMessage | BytesMessage):
                        size += len(event.data)
                        if size > self.limits.max_body_bytes:
                            self.disconnect = {"type": "websocket.disconnect", "code": MESSAGE_TOO_BIG}
                            await self._close(MESSAGE_TOO_BIG, "message too big")
                            return
                        parts.append(event.data)
                        if event.message_finished:
                            message: dict[str, Any]
                            if isinstance(event, TextMessage):
                                message = {"type": "websocket.receive", "text": "".join(parts)}
                            else:
                                message = {"type": "websocket.receive", "bytes": b"".join(parts)}
                            await self.incoming.send(message)
                            parts, size = [], 0
                    elif isinstance(event, Ping):
                        await self._write(event.response())
                    elif isinstance(event, CloseConnection):
                        self.disconnect = {"type": "websocket.disconnect", "code": event.code,
                                           "reason": event.reason or ""}
                        if self.ws.state is ConnectionState.REMOTE_CLOSING:
                            await self._write(event.response())
                        elif self.ws.state is ConnectionState.OPEN:  # a frame that failed to parse
                            log.debug("a WebSocket protocol error (%d): %s", event.code, event.reason)
                            await self._close(event.code, event.reason)
                        self.ended = True
                        return
                data = await self.transport.recv()
                if not data:
                    self.ended = True
                    return
