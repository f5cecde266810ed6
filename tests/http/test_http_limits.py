"""Bad input and hostile clients against the real server on loopback: 4xx with OpenAI's body, limits.

Every malformed input below once reached a stage (and came back as a 503) or
crashed the handler (a plain-text 500 with a traceback): each now gets a 4xx
naming what is wrong, the server counts it, and keeps serving.
"""

from __future__ import annotations

import json
import logging
import socket
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.http_helpers import HANG, Served, chat, metrics, wait_until
from trio_orch.engine import Engine
from trio_orch.http.limits import HTTPLimits
from trio_orch.http.metrics import FrontMetrics
from trio_orch.testing.toy_pipeline import toy_pipeline

LIMITS = HTTPLimits(max_body_bytes=64 << 10, max_prompt_chars=2000, max_json_depth=16, body_timeout=0.5,
                    header_timeout=0.5)


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    s = Served(Engine(toy_pipeline(token_delay=0.001, audio_delay=0.001)).start(), limits=LIMITS,
               max_connections=40)
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
    with caplog.at_level(logging.INFO, logger="trio_orch.serve.command"):
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
    with caplog.at_level(logging.ERROR, logger="trio_orch.serve.command"):
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


def test_idle_connections_never_lock_out_a_real_request(served: Served) -> None:
    served.limiter.min_idle = 0.0  # every idle connection may go (the default spares fresh ones for 1 s)
    idle = [socket.create_connection(("127.0.0.1", served.port), timeout=HANG) for _ in range(120)]
    try:  # three times the limit (40): the longest-idle ones make room as new ones arrive
        wait_until(lambda: served.limiter.closed["idle_evicted"] >= 80,  # each reaches the server once
                   "the oldest idle connections evicted")  # it stays silent past the acceptor's settle time
        with httpx.Client(base_url=served.url, timeout=HANG) as c:  # at the limit, every one idle
            r = c.post("/v1/chat/completions", json=chat("through the crowd"))
            assert r.status_code == 200
            assert metrics(c)["trio_orch_http_connections_closed_total{reason=idle_evicted}"] >= 81
        closed = 0
        for s in idle[:80]:
            s.settimeout(HANG)
            closed += s.recv(1) == b""
        assert closed == 80  # the oldest ones were closed by the server
    finally:
        for s in idle:
            s.close()


@pytest.mark.processes
def test_at_the_connection_limit_with_no_idle_connection_old_enough_a_new_one_is_refused_clearly() -> None:
    s = Served(Engine(toy_pipeline(token_delay=0.001)).start(), max_connections=2)
    s.limiter.min_idle = 60.0  # no connection is old enough to be evicted
    held = [socket.create_connection(("127.0.0.1", s.port), timeout=HANG) for _ in range(2)]
    try:
        wait_until(lambda: len(s.limiter.open) == 2, "both connections accepted")
        with socket.create_connection(("127.0.0.1", s.port), timeout=HANG) as extra:
            reply = b""
            while chunk := extra.recv(4096):
                reply += chunk
        head, body = reply.split(b"\r\n\r\n", 1)
        assert head.startswith(b"HTTP/1.1 503") and b"retry-after: 1" in head
        assert json.loads(body)["error"]["code"] == "too_many_connections"
        assert s.limiter.closed["refused"] == 1 and s.limiter.closed["idle_evicted"] == 0
    finally:
        for c in held:
            c.close()
        s.stop()


def test_a_log_flood_becomes_one_line_per_interval_with_a_count() -> None:
    from trio_orch.http.limits import RateLimitFilter

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
    from trio_orch.http.metrics import FrontMetrics

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
        for n in range(3):
            nursery.start_soon(call, n)
        await trio.testing.wait_all_tasks_blocked()
        assert len(entered) == 2 and mw.pending == 2  # the third found the capacity taken
        (refused,) = [n for n in range(3) if n not in entered]
        assert sent[refused][0]["status"] == 429 and refused not in bodies_read  # before its body
        release.set()
    assert mw.pending == 0 and front.shed == 1
    await call(3)  # the first two answered: room again
    assert sent[3][0]["status"] == 200


def test_a_websocket_session_outlives_the_header_timeout_and_leaves_the_connection_count(
        served: Served) -> None:
    """After the upgrade the connection belongs to the WebSocket: never closed as a slow request head,
    never evicted as idle, and no longer counted once the session ends."""
    from websockets.sync.client import connect

    before = len(served.limiter.open)
    closed_before = dict(served.limiter.closed)
    with connect(f"ws://127.0.0.1:{served.port}/v1/realtime", open_timeout=HANG) as ws:
        assert json.loads(ws.recv(timeout=HANG))["type"] == "session.created"
        time.sleep(3 * LIMITS.header_timeout)  # idle, well past the header timeout
        ws.send(json.dumps({"type": "input_text_buffer.append", "text": "still here"}))
        ws.send(json.dumps({"type": "input_text_buffer.commit"}))
        assert json.loads(ws.recv(timeout=HANG))["type"] == "input_text_buffer.committed"
        assert served.limiter.busy(next(p for p in served.limiter.open if served.limiter.upgraded(p)))
    wait_until(lambda: len(served.limiter.open) == before, "the ended session no longer counted")
    assert served.limiter.closed == closed_before  # nothing was closed by a limit


def test_a_realtime_client_that_vanishes_mid_response_costs_no_traceback(
        served: Served, caplog: pytest.LogCaptureFixture) -> None:
    from websockets.sync.client import connect

    with caplog.at_level(logging.INFO):
        for _ in range(5):
            with connect(f"ws://127.0.0.1:{served.port}/v1/realtime", open_timeout=HANG) as ws:
                assert json.loads(ws.recv(timeout=HANG))["type"] == "session.created"
                ws.send(json.dumps({"type": "input_text_buffer.append", "text": "long " * 50}))
                ws.send(json.dumps({"type": "input_text_buffer.commit"}))
                ws.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
                ws.socket.shutdown(socket.SHUT_RDWR)  # gone, no close frame, while the server answers
        wait_until(lambda: served.engine.stats().active_requests == 0, "every session's request aborted")
    server_side = [r for r in caplog.records if not r.name.startswith("websockets.client")]  # the client
    assert not [r for r in server_side if r.exc_info or r.levelno >= logging.ERROR], caplog.text  # we cut


def test_a_connection_passed_over_undecided_is_shed_at_its_line_if_it_waited_long_in_a_flood() -> None:
    """The acceptor's ``max_accept_wait`` rule also holds where the loop decides: a POST whose bytes
    sat unread longer than that during a flood is refused even with room; without a flood it is not."""
    from types import SimpleNamespace

    from trio_orch.http.limits import Shedder
    from trio_orch.serve.connection_limits import ConnectionLimiter

    limiter = ConnectionLimiter(10, 10.0, max_accept_wait=0.1)
    limiter.shedder = shedder = Shedder(lambda: False, frozenset({"/v1/chat/completions"}), FrontMetrics(),
                                        capacity=lambda: 4.0)
    post = b"POST /v1/chat/completions HTTP/1.1\r\n"
    with socket.socket() as ls:
        ls.bind(("127.0.0.1", 0))
        ls.listen(1)
        with socket.create_connection(ls.getsockname(), timeout=HANG) as c:
            c.sendall(post)
            time.sleep(0.3)  # unread in the kernel, as behind a busy loop
            conn, _ = ls.accept()
            with conn:
                proto = SimpleNamespace(transport=SimpleNamespace(get_extra_info=lambda name: conn))
                assert not limiter.late(proto, post)  # no flood: waiting alone sheds nothing
                shedder.last_refusal = time.monotonic()  # a refusal just now: a flood
                assert limiter.late(proto, post)
                assert not limiter.late(proto, b"GET /health HTTP/1.1\r\n")  # only POSTs
                assert limiter.at_request_line(proto, post) == "shed" and limiter.held == 0
