"""Bad input and hostile clients against the real server on loopback: 4xx with OpenAI's body, limits.

Every malformed input below once reached a stage (and came back as a 503) or
crashed the handler (a plain-text 500 with a traceback): each now gets a 4xx
naming what is wrong, the server counts it, and keeps serving.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.http_helpers import HANG, Served, chat, metrics, wait_until
from trio_orch.engine import ThreadEngine
from trio_orch.http.limits import HTTPLimits
from trio_orch.http.metrics import FrontMetrics
from trio_orch.testing.toy_pipeline import toy_pipeline

LIMITS = HTTPLimits(max_body_bytes=64 << 10, max_prompt_chars=2000, max_json_depth=16, body_timeout=0.5,
                    header_timeout=0.5)


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    s = Served(ThreadEngine(toy_pipeline(token_delay=0.001, audio_delay=0.001)).start(), limits=LIMITS)
    yield s
    s.stop()


@pytest.fixture()
def client(served: Served) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=served.url, timeout=HANG) as c:
        yield c


def body_with(**fields: object) -> bytes:
    return json.dumps({"messages": [{"role": "user", "content": "hi"}], **fields}).encode()


def read_all(s: socket.socket) -> str:
    """Everything the server sends until it closes the connection."""
    data = b""
    while chunk := s.recv(65536):
        data += chunk
    return data.decode()


HI = b'{"messages": [{"role": "user", "content": "hi"}]'
JSON = {"content-type": "application/json"}

#: (request body, headers, status, param named, message fragment)
CASES = [
    (body_with(max_tokens=2**64), JSON, 400, "max_tokens", "between 1 and"),
    (HI + b', "max_tokens": 1000000000000000000000000000000}', JSON, 400, "max_tokens", "between 1 and"),
    (body_with(max_completion_tokens=-1), JSON, 400, "max_completion_tokens", "between 1 and"),
    (body_with(seed=2**63), JSON, 400, "seed", "64-bit"),
    (b'{"messages": [{"role": "user", "content": "\\ud800"}]}', JSON, 400, "messages[0].content",
     "lone surrogate"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "user": "\\udfff x"}', JSON, 400, "user",
     "lone surrogate"),
    (b"[" * 10_000 + b"]" * 10_000, JSON, 400, None, "nests deeper"),
    (HI + b', "user": ' + b"[" * 20 + b"]" * 20 + b"}", JSON, 400, "user", "nests deeper"),
    (HI + b', "seed": ' + b"7" * 5000 + b"}", JSON, 400, None, "malformed JSON"),
    (HI + b', "temperature": NaN}', JSON, 400, None, "NaN is not a JSON number"),
    (HI + b', "temperature": Infinity}', JSON, 400, None, "Infinity is not a JSON number"),
    (HI + b', "temperature": 1e400}', JSON, 400, "temperature", "between"),
    (b'{"messages": [{"role": "user", "content": "caf\xe9"}]}', JSON, 400, None, "not valid UTF-8"),
    (body_with(model="m" * 1000), JSON, 400, "model", "longer than"),
    (json.dumps(chat("x" * 5000)).encode(), JSON, 400, "messages", "over the limit of 2000"),
    (b"x" * (65 << 10), JSON, 413, None, "over the limit of 65536 bytes"),
    (body_with(), {"content-type": "text/plain"}, 415, None, "must be JSON"),
    (body_with(), {"content-type": "application/x-www-form-urlencoded"}, 415, None, "must be JSON"),
    (body_with(), {}, 415, None, "must be JSON"),
]


@pytest.mark.parametrize(("body", "headers", "status", "param", "fragment"), CASES,
                         ids=[f"{c[2]}-{c[4][:24]}" for c in CASES])
def test_every_malformed_input_gets_a_4xx_with_an_openai_body(client: httpx.Client, body: bytes,
                                                               headers: dict[str, str], status: int,
                                                               param: str | None, fragment: str) -> None:
    before = metrics(client)
    key = f"trio_orch_http_requests_total{{route=/v1/chat/completions,status={status}}}"
    r = client.post("/v1/chat/completions", content=body, headers=headers)
    assert r.status_code == status
    err = r.json()["error"]
    assert fragment in err["message"] and err["type"] == "invalid_request_error"
    assert err["param"] == param
    assert metrics(client)[key] == before.get(key, 0) + 1
    assert metrics(client).get("trio_orch_errors_total{kind=stage_unavailable}", 0) == 0  # no stage saw it
    ok = client.post("/v1/chat/completions", json=chat("still here"))
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"] == "You said: still here"


def test_a_declared_body_over_the_limit_is_refused_before_it_is_read(served: Served) -> None:
    with socket.create_connection(("127.0.0.1", served.port), timeout=HANG) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                  b"content-length: 50000000\r\n\r\n{")  # 50 MB announced, one byte sent
        reply = read_all(s)
    assert reply.startswith("HTTP/1.1 413") and "request_too_large" in reply


def test_a_slow_body_gets_408_and_a_client_that_leaves_mid_upload_costs_one_log_line(
        served: Served, client: httpx.Client, caplog: pytest.LogCaptureFixture) -> None:
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"content-length: 100\r\n\r\n")
    with socket.create_connection(("127.0.0.1", served.port), timeout=HANG) as s:
        s.sendall(head + b'{"messages": ')  # and nothing more: the body timeout (0.5 s) answers
        reply = read_all(s)
    assert reply.startswith("HTTP/1.1 408") and "did not arrive within 0.5s" in reply
    before = metrics(client)["trio_orch_http_client_disconnects_total"]
    with caplog.at_level(logging.INFO, logger="trio_orch.http"):
        with socket.create_connection(("127.0.0.1", served.port), timeout=HANG) as s:
            s.sendall(head + b'{"messages": ')
        wait_until(lambda: metrics(client)["trio_orch_http_client_disconnects_total"] == before + 1,
                   "the disconnect counted")
    lines = [r for r in caplog.records if "during its upload" in r.getMessage()]
    assert len(lines) == 1 and lines[0].exc_info is None  # one line, no traceback


def test_an_unexpected_error_is_an_openai_shaped_500_that_is_counted(
        served: Served, client: httpx.Client, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    async def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("a bug in the front")

    monkeypatch.setattr(served.engine, "add_request_async", broken)
    with caplog.at_level(logging.ERROR, logger="trio_orch.http"):
        r = client.post("/v1/chat/completions", json=chat("hi"))
    assert r.status_code == 500
    assert r.json()["error"]["type"] == "server_error" and r.json()["error"]["code"] == "internal_error"
    assert "a bug in the front" not in r.text  # the details go to the log, not to the client
    assert metrics(client)["trio_orch_http_requests_total{route=/v1/chat/completions,status=500}"] >= 1
    assert sum("a bug in the front" in r.getMessage() for r in caplog.records) == 1


def test_a_connection_that_sends_no_request_head_is_closed_after_the_header_timeout(served: Served) -> None:
    with socket.create_connection(("127.0.0.1", served.port), timeout=HANG) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n")  # the head never ends
        assert s.recv(1024) == b""  # closed by the server (0.5 s), not by our timeout
    with httpx.Client(base_url=served.url, timeout=HANG) as c:
        assert metrics(c)["trio_orch_http_connections_closed_total{reason=header_timeout}"] >= 1


def test_a_connection_that_drips_its_head_is_closed_at_the_deadline_however_slowly_it_sends(
        served: Served) -> None:
    """Slowloris: a byte now and then keeps uvicorn's own keep-alive timer from ever running; the head
    deadline still closes the connection once the head is late."""
    before = served.deadline.closed
    end = time.monotonic() + HANG
    closed = False
    with socket.create_connection(("127.0.0.1", served.port), timeout=HANG) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nx-slow: ")
        s.settimeout(LIMITS.header_timeout / 5)  # the drip interval: a byte per wait for the close
        while not closed and time.monotonic() < end:
            try:
                s.sendall(b"x")
                closed = s.recv(1024) == b""
            except TimeoutError:
                continue  # not closed yet: one more byte
            except OSError:  # reset: closed while we were still sending
                closed = True
    assert closed, "a dripping head held its connection"
    wait_until(lambda: served.deadline.closed == before + 1, "the close counted")


def test_a_kept_alive_connection_gets_a_full_deadline_for_each_head(served: Served) -> None:
    """The deadline restarts with each answer, and never cuts a request in progress."""
    with socket.create_connection(("127.0.0.1", served.port), timeout=HANG) as s:
        for _ in range(3):
            s.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
            data = b""
            while b"\r\n\r\n" not in data or not data.endswith(b"}"):
                data += s.recv(65536)
            assert data.startswith(b"HTTP/1.1 200")
        assert s.recv(1024) == b""  # then idle: closed by a timeout (keep-alive or head), not by us


def test_at_the_connection_limit_a_new_request_gets_503() -> None:
    """``--max-connections`` is uvicorn's ``limit_concurrency``: past it, a request is refused with 503
    rather than queued (the connections that hold the limit are served as usual)."""
    s = Served(ThreadEngine(toy_pipeline(token_delay=0.001)).start(), max_connections=2)
    held = [socket.create_connection(("127.0.0.1", s.port), timeout=HANG) for _ in range(2)]
    try:
        wait_until(lambda: s.open_connections() == 2, "both connections accepted")
        with httpx.Client(base_url=s.url, timeout=HANG) as c:
            assert c.get("/health").status_code == 503
        for conn in held:
            conn.close()
        wait_until(lambda: s.open_connections() == 0, "the connections gone")
        with httpx.Client(base_url=s.url, timeout=HANG) as c:
            assert c.get("/health").status_code == 200
    finally:
        for conn in held:
            conn.close()
        s.stop()


def test_a_log_flood_becomes_one_line_per_interval_with_a_count() -> None:
    from trio_orch.http.logs import RateLimitFilter

    flt = RateLimitFilter(("out of system resource",), interval=3600)
    records = [logging.LogRecord("asyncio", logging.ERROR, __file__, 1, "socket.accept() out of system "
                                 "resource", None, None) for _ in range(1000)]
    passed = [r for r in records if flt.filter(r)]
    assert len(passed) == 1
    other = logging.LogRecord("asyncio", logging.ERROR, __file__, 1, "something else", None, None)
    assert flt.filter(other)
    flt.interval = 0.0  # the interval is over: the next one says how many were held back
    nxt = logging.LogRecord("asyncio", logging.ERROR, __file__, 1, "socket.accept() out of system resource",
                            None, None)
    assert flt.filter(nxt) and "999 more like this" in nxt.getMessage()


async def test_the_middleware_refuses_once_the_requests_it_let_in_fill_the_engines_capacity() -> None:
    """Sans-I/O: the ASGI middleware alone, with an app that holds its requests until released."""
    import trio
    import trio.testing

    from trio_orch.http.limits import LimitsMiddleware, Shedder

    release = trio.Event()
    entered: list[int] = []

    async def app(scope: dict, receive: object, send: object) -> None:  # type: ignore[type-arg]
        entered.append(scope["n"])
        await release.wait()
        await send({"type": "http.response.start", "status": 200, "headers": []})  # type: ignore[operator]
        await send({"type": "http.response.body", "body": b"{}"})  # type: ignore[operator]

    front = FrontMetrics()
    shedder = Shedder(lambda: False, frozenset({"/v1/chat/completions"}), front, capacity=lambda: 2)
    mw = LimitsMiddleware(app, HTTPLimits(), front, shedder)
    sent: dict[int, list[dict[str, object]]] = {}
    bodies_read: list[int] = []

    async def call(n: int) -> None:
        scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "n": n,
                 "headers": [(b"content-type", b"application/json"), (b"content-length", b"2")]}

        async def receive() -> dict[str, object]:
            bodies_read.append(n)
            return {"type": "http.request", "body": b"{}", "more_body": False}

        async def send(message: dict[str, object]) -> None:
            sent.setdefault(n, []).append(message)

        await mw(scope, receive, send)

    async with trio.open_nursery() as nursery:
        for n in range(3):  # together: all three pass the first check, then read their bodies
            nursery.start_soon(call, n)
        await trio.testing.wait_all_tasks_blocked()
        assert len(entered) == 2 and front.pending == 2  # the third found the capacity taken
        (refused,) = [n for n in range(3) if n not in entered]
        assert sent[refused][0]["status"] == 429  # asked again once its body was in
        await call(3)  # the capacity is taken: refused before its body is read
        assert sent[3][0]["status"] == 429 and 3 not in bodies_read
        release.set()
    assert front.pending == 0 and front.shed == 2
    await call(4)  # the first two answered: room again
    assert sent[4][0]["status"] == 200


async def test_uploads_hold_no_admission_room_and_body_reads_are_bounded_apart() -> None:
    """Uploads in progress (valid or not) are not on their way to the engine: with the Shedder's
    capacity at 1 and two uploads trickling in, a small valid request is still let in; past
    ``max_body_reads`` an upload waits for a read slot, unread; a body the route refuses holds no room."""
    import trio
    import trio.testing

    from trio_orch.http.limits import LimitsMiddleware, Shedder

    async def app(scope: dict, receive: object, send: object) -> None:  # type: ignore[type-arg]
        body = (await receive())["body"]  # type: ignore[operator]
        status = 200 if body == b"{}" else 400  # as the route: a prompt over the limit is a 400
        await send({"type": "http.response.start", "status": status, "headers": []})  # type: ignore[operator]
        await send({"type": "http.response.body", "body": b"{}"})  # type: ignore[operator]

    front = FrontMetrics()
    shedder = Shedder(lambda: False, frozenset({"/v1/chat/completions"}), front, capacity=lambda: 1)
    limits = HTTPLimits(max_body_reads=3, body_timeout=HANG, min_body_rate=0)  # slots alone, no rate
    mw = LimitsMiddleware(app, limits, front, shedder)
    statuses: dict[str, int] = {}
    read: list[str] = []
    finish: dict[str, trio.Event] = {}

    async def post(name: str, body: bytes, trickle: bool = False) -> None:
        """A POST; ``trickle``: its last chunk waits for ``finish[name]``."""
        finish[name] = trio.Event()
        scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions",
                 "headers": [(b"content-type", b"application/json"),
                             (b"content-length", str(len(body) + trickle).encode())]}
        parts = [body, b"x"] if trickle else [body]

        async def receive() -> dict[str, object]:
            if name not in read:
                read.append(name)
            part = parts.pop(0)
            if not parts and trickle:
                await finish[name].wait()
            return {"type": "http.request", "body": part, "more_body": bool(parts)}

        async def send(message: dict[str, object]) -> None:
            if message["type"] == "http.response.start":
                statuses[name] = int(message["status"])  # type: ignore[call-overload]

        await mw(scope, receive, send)

    async with trio.open_nursery() as nursery:
        for name in ("up1", "up2"):
            nursery.start_soon(post, name, b"y" * 1000, True)
        await trio.testing.wait_all_tasks_blocked()
        assert sorted(read) == ["up1", "up2"] and front.pending == 0  # uploads hold no admission room
        await post("valid", b"{}")
        assert statuses["valid"] == 200 and front.shed == 0  # let in, not refused with 429
        nursery.start_soon(post, "up3", b"y" * 1000, True)
        nursery.start_soon(post, "up4", b"y" * 1000, True)
        await trio.testing.wait_all_tasks_blocked()
        assert len(read) == 4  # valid, up1, up2 and one of up3/up4: the other waits, unread
        finish["up1"].set()  # its body completes: the route refuses it; its read slot passes on
        await trio.testing.wait_all_tasks_blocked()
        assert statuses["up1"] == 400 and front.pending == 0 and len(read) == 5
        for event in finish.values():
            event.set()
    assert [statuses[n] for n in ("up2", "up3", "up4")] == [400] * 3
    assert front.pending == 0 and front.shed == 0


async def test_a_body_that_stops_flowing_loses_its_read_slot_and_one_at_full_speed_waits_for_no_slow_one(
        autojump_clock: object) -> None:
    """Two read slots, both taken by bodies trickling a byte a second: each gets a 408 once a window
    (after the first) brings less than the minimum rate, and a whole body waiting behind them is read
    then -- not after the body timeout.  A long upload that keeps the rate, and a small body whose
    rest comes slowly but whole within a window, are read to the end."""
    import trio

    from trio_orch.http.limits import LimitsMiddleware

    async def app(scope: dict, receive: object, send: object) -> None:  # type: ignore[type-arg]
        body = (await receive())["body"]  # type: ignore[operator]
        await send({"type": "http.response.start", "status": 200, "headers": []})  # type: ignore[operator]
        await send({"type": "http.response.body", "body": b"%d" % len(body)})  # type: ignore[operator]

    front = FrontMetrics()
    limits = HTTPLimits(max_body_reads=2, body_timeout=600, min_body_rate=1024, body_rate_window=2.0)
    mw = LimitsMiddleware(app, limits, front)
    answers: dict[str, tuple[int, float, bytes]] = {}

    async def post(name: str, parts: list[tuple[float, bytes]]) -> None:
        """A POST whose body comes as ``parts``: (seconds to wait first, bytes)."""
        size = sum(len(p) for _, p in parts)
        scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions",
                 "headers": [(b"content-type", b"application/json"), (b"content-length", b"%d" % size)]}
        status = 0
        due: dict[int, float] = {}  # when each part arrives, fixed at the first ask

        async def receive() -> dict[str, object]:  # cancel-safe, as a server's: nothing lost to a cancel
            await trio.sleep_until(due.setdefault(len(parts), trio.current_time() + parts[0][0]))
            part = parts.pop(0)[1]
            return {"type": "http.request", "body": part, "more_body": bool(parts)}

        async def send(message: dict[str, object]) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])  # type: ignore[call-overload]
            else:
                answers[name] = (status, trio.current_time(), bytes(message["body"]))  # type: ignore[call-overload]

        await mw(scope, receive, send)

    start = trio.current_time()
    async with trio.open_nursery() as nursery:
        for name in ("slow1", "slow2"):
            nursery.start_soon(post, name, [(1.0, b"x")] * 100)
        await trio.sleep(0.5)
        assert front.body_reads == 2
        nursery.start_soon(post, "fast", [(0.0, b"{}")])
    assert [answers[n][0] for n in ("slow1", "slow2")] == [408, 408]
    assert b"slower than 1024 bytes/s over 2s" in answers["slow1"][2]
    status, at, body = answers["fast"]
    assert (status, body) == (200, b"2") and at - start == pytest.approx(4.0, abs=0.01)  # not 600 s
    assert front.body_reads == 0

    steady = [(1.0, b"y" * 1500)] * 20  # 20 s at 1,500 bytes/s: above the minimum all along
    tail = [(0.0, b"z" * 40), (3.5, b"z" * 10)]  # its last 10 bytes late, but whole in their window
    async with trio.open_nursery() as nursery:
        nursery.start_soon(post, "steady", steady)
        nursery.start_soon(post, "tail", tail)
    assert answers["steady"][0::2] == (200, b"30000") and answers["tail"][0::2] == (200, b"50")


def test_a_websocket_session_outlives_the_header_timeout_and_leaves_the_connection_count(
        served: Served, monkeypatch: pytest.MonkeyPatch) -> None:
    """After the upgrade the connection belongs to the WebSocket: never closed as a slow request head,
    and no longer counted once the session ends."""
    from websockets.sync.client import connect

    wait_until(lambda: served.open_connections() == 0, "the earlier tests' connections gone")
    closed_before = served.deadline.closed
    looked = threading.Event()  # the head deadline armed at connect ran out and looked at the connection
    check = served.deadline.check

    def check_and_tell(proto: Any, seen: Any) -> None:
        check(proto, seen)
        looked.set()

    monkeypatch.setattr(served.deadline, "check", check_and_tell)
    with connect(f"ws://127.0.0.1:{served.port}/v1/realtime", open_timeout=HANG) as ws:
        assert json.loads(ws.recv(timeout=HANG))["type"] == "session.created"
        assert looked.wait(HANG), "the header timeout never ran out"  # idle past it, then:
        ws.send(json.dumps({"type": "still.here"}))  # the session answers (an unknown event: an error event)
        assert json.loads(ws.recv(timeout=HANG))["type"] == "error"
        assert served.open_connections() == 1
    wait_until(lambda: served.open_connections() == 0, "the ended session no longer counted")
    assert served.deadline.closed == closed_before  # nothing was closed by the head deadline


def test_a_realtime_client_that_vanishes_mid_response_costs_no_traceback(
        served: Served, caplog: pytest.LogCaptureFixture) -> None:
    from websockets.sync.client import connect

    with caplog.at_level(logging.INFO):
        for _ in range(5):
            with connect(f"ws://127.0.0.1:{served.port}/v1/realtime", open_timeout=HANG) as ws:
                assert json.loads(ws.recv(timeout=HANG))["type"] == "session.created"
                ws.send(json.dumps({"type": "conversation.item.create", "item": {
                    "type": "message", "role": "user",
                    "content": [{"type": "input_text", "text": "long " * 50}]}}))
                ws.send(json.dumps({"type": "response.create"}))
                ws.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
                ws.socket.shutdown(socket.SHUT_RDWR)  # gone, no close frame, while the server answers
        wait_until(lambda: served.engine.stats().active_requests == 0, "every session's request aborted")
    server_side = [r for r in caplog.records if not r.name.startswith("websockets.client")]  # the client
    assert not [r for r in server_side if r.exc_info or r.levelno >= logging.ERROR], caplog.text  # we cut
