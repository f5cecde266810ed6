"""The lean Trio HTTP server against a small ASGI app over real loopback sockets, raw-socket clients.

Each test runs the server in its own Trio run (:func:`serving`), which also
checks that the server left no connection, task or file descriptor behind.
Timeouts are tested on the autojump clock; everything else waits on events
or on ``wait_all_tasks_blocked``, never on time.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import pytest
import trio
import trio.testing
from wsproto import ConnectionType, WSConnection
from wsproto.events import (
    AcceptConnection,
    BytesMessage,
    CloseConnection,
    RejectConnection,
    RejectData,
    Request,
    TextMessage,
)

from tests.conftest import live_task_names
from trio_orch.http.limits import HTTPLimits
from trio_orch.serve.trio_http import ServerState, serve

HANG = 10.0


class App:
    """The test app: routes by path, and tells the test what it saw."""

    def __init__(self) -> None:
        self.disconnected = trio.Event()
        self.release = trio.Event()  #: lets /stream end
        self.sent = 0  #: body messages /big got through
        self.ws_disconnect: dict[str, Any] | None = None
        self.ws_done = trio.Event()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "websocket":
            await self.websocket(scope, receive, send)
            return
        path = scope["path"]
        if path == "/boom":
            raise RuntimeError("a bug before the answer")
        if path == "/noread":  # answers without reading the body
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
            await send({"type": "http.response.body", "body": b"no"})
            return
        body = b""
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message["body"]
            if not message["more_body"]:
                break
        if path == "/scope":
            shown = {k: v for k, v in scope.items() if k not in ("server", "client", "headers")}
            data = repr(sorted(shown.items())).encode()
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-length", str(len(data)).encode())]})
            await send({"type": "http.response.body", "body": data})
        elif path == "/stream":
            await self.stream(receive, send)
        elif path == "/peek-stream":  # Starlette's is_disconnected(): a receive under a cancelled scope
            with trio.CancelScope() as peek:
                peek.cancel()
                assert (await receive())["type"] != "http.disconnect"
            await self.stream(receive, send)
        elif path == "/boom-after":
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"half", "more_body": True})
            raise RuntimeError("a bug mid-answer")
        elif path == "/big":
            await send({"type": "http.response.start", "status": 200, "headers": []})
            for _ in range(BIG_CHUNKS):
                await send({"type": "http.response.body", "body": b"x" * BIG_CHUNK, "more_body": True})
                self.sent += 1
            await send({"type": "http.response.body", "body": b""})
        elif path == "/nowait":
            await send({"type": "http.response.start", "status": 200, "headers": []})
            with trio.CancelScope() as scope_:
                scope_.cancel()  # a send that checkpointed would raise Cancelled here
                for _ in range(50):
                    await send({"type": "http.response.body", "body": b"tick\n", "more_body": True})
            assert not scope_.cancelled_caught
            await send({"type": "http.response.body", "body": b""})
        else:  # echo, with a content-length
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"text/plain"),
                                    (b"content-length", str(len(body)).encode())]})
            await send({"type": "http.response.body", "body": body})

    async def stream(self, receive: Any, send: Any) -> None:
        """Chunks until the test releases it; watches ``receive`` for the client leaving, as SSE does."""
        async with trio.open_nursery() as nursery:
            async def watch() -> None:
                if (await receive())["type"] == "http.disconnect" and not self.release.is_set():
                    self.disconnected.set()
                    nursery.cancel_scope.cancel()

            nursery.start_soon(watch)
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"text/event-stream")]})
            await send({"type": "http.response.body", "body": b"data: first\n\n", "more_body": True})
            await self.release.wait()
            await send({"type": "http.response.body", "body": b"data: last\n\n", "more_body": False})

    async def websocket(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        assert (await receive())["type"] == "websocket.connect"
        try:
            if scope["path"] == "/deny":
                await send({"type": "websocket.http.response.start", "status": 403,
                            "headers": [(b"content-length", b"6")]})
                await send({"type": "websocket.http.response.body", "body": b"denied"})
                return
            await send({"type": "websocket.accept", "subprotocol": scope["subprotocols"][0]})
            while True:
                message = await receive()
                if message["type"] == "websocket.disconnect":
                    self.ws_disconnect = message
                    return
                if message.get("text") == "close please":
                    await send({"type": "websocket.close", "code": 4000, "reason": "as asked"})
                    continue
                await send({"type": "websocket.send", **{k: v for k, v in message.items() if k != "type"}})
        finally:
            self.ws_done.set()


BIG_CHUNK = 1 << 20
BIG_CHUNKS = 32  #: 32 MiB: more than loopback sockets buffer


def open_sockets() -> set[str]:
    """The sockets this process holds open (by inode): a leak is one the server left behind."""
    out = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:"):
            out.add(target)
    return out


@asynccontextmanager
async def serving(app: App, limits: HTTPLimits | None = None) -> AsyncIterator[tuple[int, ServerState]]:
    """The server on a loopback port: ``(port, state)``; on exit, shut down and checked clean."""
    before = open_sockets()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    port = sock.getsockname()[1]
    state = ServerState(limits or HTTPLimits())
    stop = trio.Event()
    with trio.fail_after(HANG):
        async with trio.open_nursery() as nursery:
            await nursery.start(partial(serve, app, sock, state, shutdown_trigger=stop.wait))
            try:
                yield port, state
            finally:
                stop.set()
    assert sock.fileno() == -1, "the listening socket was left open"
    assert state.connections == set()
    assert not [n for n in live_task_names() if "trio_http" in n]
    assert open_sockets() <= before, "a socket was left open"


async def connect(port: int) -> trio.SocketStream:
    return await trio.open_tcp_stream("127.0.0.1", port)


async def read_until(stream: trio.SocketStream, end: bytes, data: bytes = b"") -> bytes:
    """Read until ``data`` ends with ``end`` (AssertionError if the server closes first)."""
    while not data.endswith(end):
        chunk = await stream.receive_some(1 << 16)
        assert chunk, f"closed before {end!r}: {data[-200:]!r}"
        data += chunk
    return data


async def read_to_eof(stream: trio.SocketStream) -> bytes:
    data = b""
    try:
        while chunk := await stream.receive_some(1 << 16):
            data += chunk
    except trio.BrokenResourceError:  # a reset
        data += b"<reset>"
    return data


def post(path: str, body: bytes = b"", extra: str = "") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nhost: t\r\ncontent-length: {len(body)}\r\n{extra}\r\n").encode() + body


async def test_a_kept_alive_connection_serves_requests_in_turn_and_pipelined_ones_in_order() -> None:
    async with serving(App()) as (port, _), await connect(port) as s:
        await s.send_all(post("/echo", b"one"))
        first = await read_until(s, b"one")
        assert first.startswith(b"HTTP/1.1 200 OK\r\n") and b"content-length: 3\r\n" in first
        await s.send_all(post("/echo", b"two") + post("/echo", b"three") + post("/echo", b"four"))
        data = await read_until(s, b"four")
        assert [part.rsplit(b"\r\n\r\n", 1)[1] for part in data.split(b"HTTP/1.1 ")[1:]] == [
            b"two", b"three", b"four"]


async def test_the_scope_has_every_standard_key() -> None:
    async with serving(App()) as (port, _), await connect(port) as s:
        await s.send_all(b"GET /sc%6fpe?a=1 HTTP/1.1\r\nhost: t\r\nconnection: close\r\n\r\n")
        data = await read_to_eof(s)
    body = data.partition(b"\r\n\r\n")[2].decode()
    for item in ("('asgi', {'version': '3.0', 'spec_version': '2.3'})", "('http_version', '1.1')",
                 "('method', 'GET')", "('path', '/scope')", "('query_string', b'a=1')",
                 "('raw_path', b'/sc%6fpe')", "('root_path', '')", "('scheme', 'http')", "('type', 'http')"):
        assert item in body, body


async def test_a_streamed_answer_is_chunked_and_ends_with_the_last_chunk() -> None:
    app = App()
    async with serving(app) as (port, _), await connect(port) as s:
        await s.send_all(post("/stream"))
        head = await read_until(s, b"data: first\n\n\r\n")
        assert b"transfer-encoding: chunked\r\n" in head and b"\r\n\r\nd\r\ndata: first\n\n\r\n" in head
        app.release.set()
        assert await read_until(s, b"0\r\n\r\n") == b"c\r\ndata: last\n\n\r\n0\r\n\r\n"
        await s.send_all(post("/echo", b"again"))  # the connection carries on
        await read_until(s, b"again")


async def test_a_send_taken_by_the_kernel_at_once_is_no_checkpoint() -> None:
    async with serving(App()) as (port, _), await connect(port) as s:
        await s.send_all(post("/nowait"))
        assert (await read_until(s, b"0\r\n\r\n")).count(b"tick") == 50


async def test_head_answers_without_a_body_and_keeps_the_connection() -> None:
    async with serving(App()) as (port, _), await connect(port) as s:
        await s.send_all(b"HEAD /echo HTTP/1.1\r\nhost: t\r\n\r\n" + post("/echo", b"next"))
        data = await read_until(s, b"next")
    first, second = data.split(b"HTTP/1.1 ")[1:]
    assert first.endswith(b"\r\n\r\n") and b"content-length: 0" in first
    assert second.endswith(b"\r\n\r\nnext")


async def test_expect_100_continue_is_answered_when_the_app_reads_the_body() -> None:
    async with serving(App()) as (port, _), await connect(port) as s:
        await s.send_all(post("/echo", extra="expect: 100-continue\r\n").replace(b"length: 0", b"length: 4"))
        assert await read_until(s, b"\r\n\r\n") == b"HTTP/1.1 100 Continue\r\n\r\n"
        await s.send_all(b"body")
        assert (await read_until(s, b"body")).startswith(b"HTTP/1.1 200 OK")


async def test_a_chunked_upload_reaches_the_app_whole() -> None:
    async with serving(App()) as (port, _), await connect(port) as s:
        await s.send_all(b"POST /echo HTTP/1.1\r\nhost: t\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\n")
        await s.send_all(b"2\r\nde\r\n0\r\n\r\n")
        assert (await read_until(s, b"abcde")).startswith(b"HTTP/1.1 200 OK")


@pytest.mark.parametrize(("request_bytes", "status"), [
    (b"GET / HTTP/1.1\r\nbad header line\r\n\r\n", b"400"),
    (b"GET / HTTP/1.1\r\nhost: t\r\nx-big: " + b"x" * 2000 + b"\r\n\r\n", b"431")])
async def test_a_malformed_request_is_400_a_head_too_large_431_then_closed(request_bytes: bytes,
                                                                          status: bytes) -> None:
    async with serving(App(), HTTPLimits(max_head_bytes=1024)) as (port, state), await connect(port) as s:
        await s.send_all(request_bytes)
        data = await read_to_eof(s)
        assert data.startswith(b"HTTP/1.1 " + status) and b"connection: close" in data
        assert b'"error"' in data and state.bad_requests == 1


async def test_a_head_not_complete_within_the_header_timeout_is_closed(autojump_clock: Any) -> None:
    config = HTTPLimits(header_timeout=3.0, keep_alive_timeout=100.0)
    async with serving(App(), config) as (port, state), await connect(port) as s:
        start = trio.current_time()
        await s.send_all(b"GET / HTTP/1.1\r\nhost: t\r\n")  # the head never ends
        assert await read_to_eof(s) == b""
        assert trio.current_time() - start >= 3.0 and state.header_timeouts == 1


async def test_an_idle_kept_alive_connection_is_closed_after_the_keep_alive_timeout(
        autojump_clock: Any) -> None:
    config = HTTPLimits(header_timeout=100.0, keep_alive_timeout=2.0)
    async with serving(App(), config) as (port, state), await connect(port) as s:
        await s.send_all(post("/echo", b"x"))
        await read_until(s, b"\r\n\r\nx")
        answered = trio.current_time()
        assert await read_to_eof(s) == b""
        assert 2.0 <= trio.current_time() - answered < 100.0
        assert state.header_timeouts == 0  # an idle connection is no slow head


@pytest.mark.parametrize("path", ["/stream", "/peek-stream"])
async def test_a_client_leaving_mid_stream_reaches_the_app_as_http_disconnect(path: str) -> None:
    app = App()
    async with serving(app) as (port, _):
        s = await connect(port)
        await s.send_all(post(path))
        await read_until(s, b"data: first\n\n\r\n")
        await s.aclose()
        await app.disconnected.wait()


async def test_a_slow_reader_holds_the_apps_send_back() -> None:
    app = App()
    async with serving(app) as (port, _), await connect(port) as s:
        await s.send_all(post("/big"))
        await trio.testing.wait_all_tasks_blocked()  # the server waits for room: the kernel's buffers full
        assert 0 < app.sent < BIG_CHUNKS
        received, tail = 0, b""
        while not tail.endswith(b"0\r\n\r\n"):
            chunk = await s.receive_some(1 << 20)
            assert chunk
            received += len(chunk)
            tail = (tail + chunk)[-16:]
        assert app.sent == BIG_CHUNKS and received > BIG_CHUNK * BIG_CHUNKS


async def test_an_app_error_before_the_answer_is_a_500_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.ERROR, "trio_orch.serve.trio_http"):
        async with serving(App()) as (port, _), await connect(port) as s:
            await s.send_all(post("/boom"))
            data = await read_to_eof(s)
    assert data.startswith(b"HTTP/1.1 500") and b'"internal_error"' in data
    assert sum("a bug before the answer" in r.getMessage() for r in caplog.records) == 1


async def test_an_app_error_mid_answer_closes_the_connection(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.ERROR, "trio_orch.serve.trio_http"):
        async with serving(App()) as (port, _), await connect(port) as s:
            await s.send_all(post("/boom-after"))
            data = await read_to_eof(s)
    assert data.startswith(b"HTTP/1.1 200") and data.endswith(b"4\r\nhalf\r\n")  # no last chunk: cut
    assert sum("a bug mid-answer" in r.getMessage() for r in caplog.records) == 1


async def test_the_drain_closes_idle_connections_lets_a_stream_finish_and_refuses_new_ones() -> None:
    app = App()
    stop = trio.Event()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    port = sock.getsockname()[1]
    state = ServerState(HTTPLimits(), graceful_timeout=HANG)
    before = open_sockets()
    with trio.fail_after(HANG):
        async with trio.open_nursery() as nursery:
            await nursery.start(partial(serve, app, sock, state, shutdown_trigger=stop.wait))
            idle, streaming = await connect(port), await connect(port)
            await idle.send_all(post("/echo", b"x"))
            await read_until(idle, b"\r\n\r\nx")
            await streaming.send_all(post("/stream"))
            await read_until(streaming, b"data: first\n\n\r\n")
            stop.set()
            assert await read_to_eof(idle) == b""  # closed at once: it had no request in progress
            with pytest.raises(OSError):
                await connect(port)
            app.release.set()
            tail = await read_to_eof(streaming)
            assert tail.endswith(b"data: last\n\n\r\n0\r\n\r\n")  # finished, then closed
            await idle.aclose()
            await streaming.aclose()
    assert not app.disconnected.is_set() and state.connections == set()
    assert open_sockets() < before  # the listening socket is gone too, and nothing else is left


async def test_the_drain_cancels_what_outlives_the_graceful_timeout(autojump_clock: Any) -> None:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    stop = trio.Event()
    with trio.fail_after(HANG):
        async with trio.open_nursery() as nursery:
            await nursery.start(partial(serve, App(), sock, ServerState(graceful_timeout=5.0),
                                        shutdown_trigger=stop.wait))
            async with await connect(sock.getsockname()[1]) as s:
                await s.send_all(post("/stream"))
                await read_until(s, b"data: first\n\n\r\n")
                stop.set()
                draining = trio.current_time()
                assert await read_to_eof(s) == b""  # cut at the deadline: the stream never ended
                assert trio.current_time() - draining >= 5.0


async def test_past_the_connection_limit_a_new_connection_is_answered_503() -> None:
    async with serving(App(), HTTPLimits(max_connections=1)) as (port, state), await connect(port) as held:
        await held.send_all(post("/echo", b"x"))
        await read_until(held, b"\r\n\r\nx")
        async with await connect(port) as extra:
            await extra.send_all(post("/echo", b"y"))
            data = await read_to_eof(extra)
        assert data.startswith(b"HTTP/1.1 503") and b"retry-after: 1" in data and state.refused == 1


async def ws_client(port: int, path: str, subprotocols: list[str] | None = None
                    ) -> tuple[trio.SocketStream, WSConnection, list[Any]]:
    """A WebSocket handshake: the stream, the client connection and the events it got."""
    stream = await connect(port)
    ws = WSConnection(ConnectionType.CLIENT)
    await stream.send_all(ws.send(Request(host="t", target=path, subprotocols=subprotocols or ["p1", "p2"])))
    events: list[Any] = []
    while not any(isinstance(e, AcceptConnection) or (isinstance(e, RejectData) and e.body_finished)
                  for e in events):
        ws.receive_data(await stream.receive_some(1 << 16) or None)
        events.extend(ws.events())
    return stream, ws, events


async def ws_next(stream: trio.SocketStream, ws: WSConnection) -> Any:
    while True:
        for event in ws.events():
            return event
        ws.receive_data(await stream.receive_some(1 << 16) or None)


async def test_a_websocket_session_echoes_text_and_bytes_then_closes_as_asked() -> None:
    app = App()
    async with serving(app) as (port, state):
        stream, ws, events = await ws_client(port, "/echo")
        assert events[0].subprotocol == "p1" and state.websockets == 1
        await stream.send_all(ws.send(TextMessage(data="hello")))
        assert (await ws_next(stream, ws)).data == "hello"
        await stream.send_all(ws.send(BytesMessage(data=b"\x00\x01")))
        assert (await ws_next(stream, ws)).data == b"\x00\x01"
        await stream.send_all(ws.send(TextMessage(data="close please")))
        close = await ws_next(stream, ws)
        assert isinstance(close, CloseConnection) and (close.code, close.reason) == (4000, "as asked")
        await stream.send_all(ws.send(close.response()))
        await app.ws_done.wait()
        assert await read_to_eof(stream) == b""
        await stream.aclose()
    assert app.ws_disconnect is not None and app.ws_disconnect["code"] == 4000


async def test_a_websocket_denial_is_the_apps_http_answer() -> None:
    async with serving(App()) as (port, _):
        stream, _, events = await ws_client(port, "/deny")
        assert isinstance(events[0], RejectConnection) and events[0].status_code == 403
        assert b"".join(e.data for e in events if isinstance(e, RejectData)) == b"denied"
        await stream.aclose()


async def test_a_websocket_message_over_the_limit_closes_with_1009() -> None:
    app = App()
    async with serving(app, HTTPLimits(max_body_bytes=1000)) as (port, _):
        stream, ws, _ = await ws_client(port, "/echo")
        await stream.send_all(ws.send(BytesMessage(data=b"x" * 2000)))
        close = await ws_next(stream, ws)
        assert isinstance(close, CloseConnection) and close.code == 1009
        await app.ws_done.wait()
        await stream.aclose()
    assert app.ws_disconnect is not None and app.ws_disconnect["code"] == 1009


def client_frame(first: int, length_field: bytes, payload: bytes = b"") -> bytes:
    """A raw client frame: its first byte, its (masked) length field, a zero mask, its payload."""
    return bytes([first, 0x80 | length_field[0]]) + length_field[1:] + b"\0\0\0\0" + payload


@pytest.mark.parametrize(("frame", "code"), [
    (client_frame(0x83, b"\x00"), 1002),  # a reserved opcode
    (client_frame(0x82, b"\x7f" + (1 << 63).to_bytes(8, "big")), 1002),  # a 64-bit length with its MSB set
    (client_frame(0x82, b"\x7f" + (1 << 40).to_bytes(8, "big")), 1009),  # a terabyte announced: at once
    (client_frame(0x82, b"\x7e" + (1001).to_bytes(2, "big")), 1009),  # over the limit, before any payload
], ids=["opcode", "msb", "terabyte", "over-limit"])
async def test_a_websocket_protocol_error_ends_with_a_close_frame_and_its_code(frame: bytes, code: int
                                                                              ) -> None:
    app = App()
    async with serving(app, HTTPLimits(max_body_bytes=1000)) as (port, _):
        stream, ws, _ = await ws_client(port, "/echo")
        await stream.send_all(frame)
        close = await ws_next(stream, ws)
        assert isinstance(close, CloseConnection) and close.code == code
        assert await read_to_eof(stream) == b""  # then the connection ends
        await app.ws_done.wait()
        await stream.aclose()
    assert app.ws_disconnect is not None and app.ws_disconnect["code"] == code


async def test_a_websocket_client_that_vanishes_ends_the_session_with_1006() -> None:
    app = App()
    async with serving(app) as (port, _):
        stream, _, _ = await ws_client(port, "/echo")
        await stream.aclose()
        await app.ws_done.wait()
    assert app.ws_disconnect == {"type": "websocket.disconnect", "code": 1006}


async def test_an_http10_answer_without_a_length_is_ended_by_the_close() -> None:
    app = App()
    app.release.set()
    async with serving(app) as (port, _), await connect(port) as s:
        await s.send_all(b"POST /stream HTTP/1.0\r\ncontent-length: 0\r\n\r\n")
        data = await read_to_eof(s)
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and b"connection: close" in head and b"chunked" not in head
    assert body == b"data: first\n\ndata: last\n\n"


async def test_an_answer_that_leaves_a_100_continue_unsent_closes_the_connection() -> None:
    """The client may or may not send its body once the final answer came first: it cannot go on."""
    async with serving(App()) as (port, _), await connect(port) as s:
        expecting = post("/noread", extra="expect: 100-continue\r\n").replace(b"length: 0", b"length: 9")
        await s.send_all(expecting)
        data = await read_to_eof(s)
    assert data.startswith(b"HTTP/1.1 200") and b"100 Continue" not in data
    assert b"connection: close" in data and data.endswith(b"\r\n\r\nno")


async def test_a_client_leaving_mid_upload_reaches_the_app_as_http_disconnect() -> None:
    seen: list[str] = []
    done = trio.Event()

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        while True:
            message = await receive()
            seen.append(message["type"])
            if message["type"] == "http.disconnect":
                done.set()
                return

    async with serving(app) as (port, _):  # type: ignore[arg-type]
        s = await connect(port)
        await s.send_all(post("/up", b"").replace(b"length: 0", b"length: 100") + b"part")
        await s.aclose()
        await done.wait()
    assert seen[-1] == "http.disconnect" and set(seen) <= {"http.request", "http.disconnect"}



class _Steps(trio.abc.Instrument):
    """Counts the steps of one task: a schedule point in it ends a step."""

    def __init__(self, task: trio.lowlevel.Task) -> None:
        self.task = task
        self.steps = 0

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        if task is self.task:
            self.steps += 1


async def test_a_read_that_finds_bytes_waiting_is_no_schedule_point_but_every_17th_in_a_row_is() -> None:
    from trio_orch.serve.trio_http.transport import READS_WITHOUT_WAIT, Transport

    a, b = socket.socketpair()
    with b, trio.socket.from_stdlib_socket(a) as ours:
        transport = Transport(ours)
        steps = _Steps(trio.lowlevel.current_task())
        trio.lowlevel.add_instrument(steps)
        try:
            yielded = []
            for _ in range(2 * READS_WITHOUT_WAIT + 1):
                b.send(b"x")  # a plain socket: no schedule point here
                before = steps.steps
                assert await transport.recv(1) == b"x"
                yielded.append(steps.steps - before)
            b.shutdown(socket.SHUT_WR)
            assert await transport.recv() == b""  # the end of the stream is read at once as well
        finally:
            trio.lowlevel.remove_instrument(steps)
    expect = [0] * (2 * READS_WITHOUT_WAIT + 1)
    expect[READS_WITHOUT_WAIT] = expect[2 * READS_WITHOUT_WAIT] = 1
    assert yielded == expect


async def test_a_read_that_must_wait_is_a_schedule_point_and_a_close_under_it_ends_it_broken() -> None:
    from trio_orch.serve.trio_http.transport import Transport

    a, b = socket.socketpair()
    with b:
        transport = Transport(trio.socket.from_stdlib_socket(a))
        with trio.CancelScope() as scope:
            scope.cancel()
            b.send(b"waiting")
            await transport.recv()  # a cancel point even with bytes waiting
            pytest.fail("a cancelled read returned")  # pragma: no cover
        assert await transport.recv() == b"waiting"

        async def sender() -> None:
            await trio.testing.wait_all_tasks_blocked()
            b.send(b"later")

        async with trio.open_nursery() as nursery:
            nursery.start_soon(sender)
            assert await transport.recv() == b"later"  # waited for it

        async def closer() -> None:
            await trio.testing.wait_all_tasks_blocked()
            transport.abort()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(closer)
            assert await transport.recv() == b""  # the socket closed while the read waited
        assert transport.broken
