"""The threaded front's acceptor: raw refusals under a flood, decisions handed to the loop, parking.

Real listening sockets and real clients on loopback; the limiter and the
shedder are the serve command's own classes, with the engine's answers
(``shedding``, ``capacity``) given as plain values a test can change.
"""

from __future__ import annotations

import json
import queue
import socket
import time
from collections.abc import Iterator
from typing import Any

import pytest

from trio_orch.acceptor import Acceptor, request_complete, waited
from trio_orch.http_limits import Shedder
from trio_orch.metrics import FrontMetrics
from trio_orch.uvicorn_front import ConnectionLimiter

HANG = 10.0
CHAT = "/v1/chat/completions"
BODY = b'{"messages": [{"role": "user", "content": "hi"}]}'
POST = (b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        + f"content-length: {len(BODY)}\r\n\r\n".encode())


class Engine:
    """What the shedder asks the engine: whether it sheds, how many requests it can hold."""

    def __init__(self) -> None:
        self.shedding = False
        self.capacity = 4.0


class Rig:
    """A listening socket, a limiter with a shedder, an acceptor; what it handed over lands in ``handed``."""

    def __init__(self, *, header_timeout: float = 10.0, max_wait: float | None = None) -> None:
        self.engine = Engine()
        self.front = FrontMetrics()
        self.limiter = ConnectionLimiter(100, header_timeout)
        self.limiter.shedder = Shedder(lambda: self.engine.shedding, frozenset({CHAT}), self.front,
                                       capacity=lambda: self.engine.capacity)
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(128)
        self.port = self.sock.getsockname()[1]
        self.handed: queue.Queue[tuple[socket.socket, str | None]] = queue.Queue()
        self.acceptor = Acceptor(self.sock, self.limiter, lambda c, d: self.handed.put((c, d)),
                                 max_wait=max_wait)

    def connect(self, data: bytes = b"") -> socket.socket:
        c = socket.create_connection(("127.0.0.1", self.port), timeout=HANG)
        if data:
            c.sendall(data)
        return c

    def sent_before_accept(self, data: bytes) -> socket.socket:
        """A connection whose request is in the socket buffer before the acceptor looks at it."""
        if self.acceptor.running:
            self.acceptor.stop()
        c = self.connect(data)
        time.sleep(0.01)  # loopback: the bytes are in the server's buffer
        self.acceptor.start()
        return c

    def next_handed(self) -> tuple[socket.socket, str | None]:
        return self.handed.get(timeout=HANG)

    def close(self) -> None:
        self.acceptor.stop()
        assert not self.acceptor.running
        self.sock.close()
        while not self.handed.empty():
            self.handed.get()[0].close()


@pytest.fixture
def rig() -> Iterator[Rig]:
    r = Rig()
    r.acceptor.start()
    yield r
    r.close()


def read_all(c: socket.socket) -> bytes:
    out = b""
    while chunk := c.recv(65536):  # until the server's FIN: a reset would raise here
        out += chunk
    return out


def wait_for(pred: Any, what: str) -> None:
    end = time.monotonic() + HANG
    while not pred():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.005)


@pytest.mark.parametrize(("data", "complete"), [
    (POST + BODY, True),
    (POST + BODY[:-1], False),
    (POST, False),
    (b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n", True),
    (b"POST / HTTP/1.1\r\ntransfer-encoding: chunked\r\n\r\n0\r\n\r\n", False),
    (b"POST / HTTP/1.1\r\ncontent-length: x1\r\n\r\n", False),
    (b"POST / HTTP/1.1\r\nhost: x\r\n", False),
])
def test_request_complete_needs_the_whole_head_and_the_declared_body(data: bytes, complete: bool) -> None:
    assert request_complete(data) is complete


def test_waited_tells_how_long_the_bytes_sat_unread() -> None:
    with socket.socket() as ls:
        ls.bind(("127.0.0.1", 0))
        ls.listen(1)
        with socket.create_connection(ls.getsockname(), timeout=HANG) as c:
            c.sendall(b"x")
            time.sleep(0.15)
            conn, _ = ls.accept()
            with conn:
                assert waited(conn) >= 0.1


def test_with_room_a_chat_request_is_handed_over_and_held_until_answered(rig: Rig) -> None:
    with rig.sent_before_accept(POST + BODY):
        conn, decision = rig.next_handed()
        assert decision == "held" and rig.limiter.held == 1
        conn.close()
    with rig.sent_before_accept(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n"):
        conn, decision = rig.next_handed()
        assert decision is None and rig.limiter.held == 1  # not a request that takes the engine's room
        conn.close()
    assert rig.limiter.closed["shed"] == 0 and not rig.front.requests


def test_when_full_a_complete_request_gets_its_429_from_the_acceptor_itself(rig: Rig) -> None:
    rig.engine.capacity = 0
    with rig.connect(POST + BODY) as c:
        answer = read_all(c)  # the whole answer, then FIN: no reset although the server closed
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 429 ") and b"\r\nretry-after: 1" in head
    assert json.loads(body)["error"]["code"] == "overloaded"
    assert rig.limiter.closed["shed"] == 1 and rig.front.shed == 1
    assert rig.front.requests == {(CHAT, 429): 1}
    assert rig.handed.empty()


def test_when_full_what_is_not_refused_there_goes_to_the_loop_with_the_decision(rig: Rig) -> None:
    rig.engine.shedding = True
    with rig.connect(POST + BODY[:5]):  # its body still on the way: the protocol answers
        conn, decision = rig.next_handed()
        assert decision == "shed"
        conn.close()
    with rig.connect(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n"):  # never refused for load
        conn, decision = rig.next_handed()
        assert decision is None
        conn.close()
    assert rig.front.shed == 1 and rig.limiter.closed["shed"] == 0  # counted once, answered by the loop


def test_when_full_a_silent_connection_is_parked_and_refused_once_it_asks(rig: Rig) -> None:
    rig.engine.capacity = 0
    with rig.connect() as c:
        wait_for(lambda: len(rig.acceptor.waiting) == 1, "the connection parked")
        c.sendall(POST + BODY)
        assert read_all(c).startswith(b"HTTP/1.1 429 ")
    assert not rig.acceptor.waiting and rig.handed.empty()
    rig.engine.capacity = 4  # room again: a silent connection goes to the loop at once
    with rig.connect():
        conn, decision = rig.next_handed()
        assert decision is None and not rig.acceptor.waiting
        conn.close()


def test_a_parked_connection_that_never_asks_is_closed_at_the_header_timeout() -> None:
    r = Rig(header_timeout=0.2)
    r.engine.capacity = 0
    r.acceptor.start()
    try:
        with r.connect() as c:
            assert read_all(c) == b""  # closed by the server, nothing said
        assert r.limiter.closed["header_timeout"] == 1 and not r.acceptor.waiting
    finally:
        r.close()


def test_stop_closes_the_parked_connections_and_ends_the_thread() -> None:
    r = Rig()
    r.engine.capacity = 0
    r.acceptor.start()
    with r.connect() as c:
        wait_for(lambda: len(r.acceptor.waiting) == 1, "the connection parked")
        r.close()
        assert read_all(c) == b""
    assert r.sock.fileno() == -1


def test_during_a_flood_a_request_that_waited_too_long_is_shed_even_with_room() -> None:
    r = Rig(max_wait=0.5)
    try:
        late = r.connect(POST + BODY)
        time.sleep(0.8)  # it sits in the accept queue: nobody accepts yet
        r.limiter.shedder.last_refusal = time.monotonic()  # a flood: the front just refused one
        r.acceptor.start()
        assert read_all(late).startswith(b"HTTP/1.1 429 ")
        late.close()
        with r.sent_before_accept(POST + BODY):  # fresh: let through
            conn, decision = r.next_handed()
            assert decision == "held"
            conn.close()
        r.limiter.shedder.last_refusal = -1e9  # no flood: waiting alone sheds nothing
        r.acceptor.stop()
        late = r.connect(POST + BODY)
        time.sleep(0.8)
        r.acceptor.start()
        conn, decision = r.next_handed()
        assert decision == "held"
        conn.close()
        late.close()
    finally:
        r.close()


CHILD = r"""
import logging, queue, resource, socket, sys, time
from trio_orch.acceptor import Acceptor
from trio_orch.uvicorn_front import ConnectionLimiter, quiet_floods

logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(name)s %(message)s")
quiet_floods()  # as the serve command does
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (48, hard))
ls = socket.socket()
ls.bind(("127.0.0.1", 0))
ls.listen(256)
handed = queue.Queue()
acceptor = Acceptor(ls, ConnectionLimiter(1000, 10.0), lambda c, d: handed.put(c), retry_delay=0.3)
acceptor.start()
print(ls.getsockname()[1], flush=True)
held = []
while len(held) < 60:
    try:
        held.append(handed.get(timeout=2.0))
    except queue.Empty:  # out of descriptors: accepting paused; free them, it must resume
        print("stalled", len(held), flush=True)
        for c in held:
            c.close()
        held.clear()
        break
n = 0
while n < 5:
    handed.get(timeout=10.0).close()
    n += 1
print("resumed", acceptor.running, flush=True)
acceptor.stop()
"""


def test_out_of_file_descriptors_the_acceptor_pauses_logs_once_and_resumes() -> None:
    """A child process with 48 descriptors takes 60 connections: accepting stalls (one log line, not
    a flood), and resumes once descriptors are free again."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    proc = subprocess.Popen([sys.executable, "-c", CHILD], cwd=root, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    clients: list[socket.socket] = []
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline())
        for _ in range(60):
            clients.append(socket.create_connection(("127.0.0.1", port), timeout=HANG))
        stalled = proc.stdout.readline().split()
        assert stalled[0] == "stalled" and 0 < int(stalled[1]) < 60
        assert proc.stdout.readline().split() == ["resumed", "True"]
        _, err = proc.communicate(timeout=HANG)
    finally:
        for c in clients:
            c.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    lines = [line for line in err.splitlines() if "out of system resource" in line]
    assert len(lines) == 1, err  # paused and retried every 0.3 s, logged once per 10 s
    assert "the acceptor failed" not in err
