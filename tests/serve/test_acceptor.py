"""The threaded front's acceptor process: raw refusals under a flood, decisions passed over, parking.

Real listening sockets, a real acceptor process and real clients on
loopback; the limiter and the shedder are the serve command's own classes,
with the engine's answers (``shedding``, ``capacity``) given as plain
values a test can change.  The decision rules themselves (:class:`Gate`
over a :class:`Board`) are tested without any I/O.
"""

from __future__ import annotations

import json
import math
import os
import queue
import select
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from trio_orch.http.limits import Shedder
from trio_orch.http.metrics import FrontMetrics
from trio_orch.serve.accept_gate import Board, Gate, request_complete, shed_route, waited
from trio_orch.serve.acceptor_process import AcceptorProcess
from trio_orch.serve.connection_limits import ConnectionLimiter

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
    """A listening socket, a limiter with a shedder, a real acceptor process, and a thread that does
    the server's side (as ``DrainingServer`` does on its loop): take over what the acceptor passes,
    publish the engine's numbers, fold its counts.  What was handed over lands in ``handed``."""

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
        self.acceptor = AcceptorProcess(self.sock, paths=[CHAT], response=self.limiter.shedder.raw_response(),
                                        header_timeout=header_timeout, max_wait=max_wait)
        self.limiter.acceptors.append(self.acceptor)
        self.lock = threading.Lock()  # the server side runs in one thread at a time (as on a loop)
        self.done = False
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self.done:
            with self.lock:
                chan = self.acceptor.channel
                if chan is not None and select.select([chan], [], [], 0)[0]:
                    for conn, decision in self.acceptor.received():
                        self.limiter.took_over(self.acceptor, decision)
                        self.handed.put((conn, decision))
                self.limiter.refresh()
            time.sleep(0.002)

    def start(self) -> None:
        with self.lock:
            self.limiter.refresh()  # as the server does: its numbers first
            self.acceptor.start()
        self.published()

    def stop(self) -> None:
        with self.lock:
            self.acceptor.stop()

    def published(self) -> None:
        """Wait until the acceptor's board shows the engine's numbers as they are now."""
        def shown() -> bool:
            board = self.acceptor.board
            return board is not None and board[Board.CAPACITY] == self.engine.capacity and (
                board[Board.SHEDDING] == float(self.engine.shedding))
        wait_for(shown, "the numbers published")

    def connect(self, data: bytes = b"") -> socket.socket:
        c = socket.create_connection(("127.0.0.1", self.port), timeout=HANG)
        if data:
            c.sendall(data)
        return c

    def sent_before_accept(self, data: bytes) -> socket.socket:
        """A connection whose request is in the socket buffer before the acceptor looks at it."""
        if self.acceptor.running:
            self.stop()
        c = self.connect(data)
        time.sleep(0.01)  # loopback: the bytes are in the server's buffer
        self.start()
        return c

    def next_handed(self) -> tuple[socket.socket, str | None]:
        return self.handed.get(timeout=HANG)

    def close(self) -> None:
        proc = self.acceptor.proc
        self.done = True
        with self.lock:
            self.acceptor.close()
        self.thread.join(HANG)
        assert not self.acceptor.running and (proc is None or proc.poll() is not None)
        self.sock.close()
        while not self.handed.empty():
            self.handed.get()[0].close()


@pytest.fixture
def rig() -> Iterator[Rig]:
    r = Rig()
    r.start()
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
    assert rig.acceptor.board is not None and rig.acceptor.board[Board.HELD] == 1  # the acceptor sees it
    with rig.sent_before_accept(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n"):
        conn, decision = rig.next_handed()
        assert decision is None and rig.limiter.held == 1  # not a request that takes the engine's room
        conn.close()
    assert rig.limiter.closed["shed"] == 0 and not rig.front.requests


def test_when_full_a_complete_request_gets_its_429_from_the_acceptor_itself(rig: Rig) -> None:
    rig.engine.capacity = 0
    rig.published()
    with rig.connect(POST + BODY) as c:
        answer = read_all(c)  # the whole answer, then FIN: no reset although the server closed
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 429 ") and b"\r\nretry-after: 1" in head
    assert json.loads(body)["error"]["code"] == "overloaded"
    wait_for(lambda: rig.front.shed == 1, "the refusal folded into the server's counts")
    assert rig.limiter.closed["shed"] == 1 and rig.front.requests == {(CHAT, 429): 1}
    assert rig.handed.empty()


def test_the_acceptor_lets_through_no_more_than_the_capacity_before_the_server_counts_them(rig: Rig) -> None:
    """Its own hand-overs count until the server acknowledges them: a burst read in one go cannot
    all be let through while the server is behind."""
    got: list[tuple[socket.socket, str | None]] = []
    with rig.lock:  # the server side is "busy": nothing is taken over meanwhile
        clients = [rig.connect(POST + BODY) for _ in range(8)]
        answered: list[socket.socket] = []
        end = time.monotonic() + HANG
        while len(answered) < 4 and time.monotonic() < end:  # capacity 4: the other four are refused
            answered += select.select([c for c in clients if c not in answered], [], [], 0.05)[0]
    try:
        assert len(answered) == 4 and all(read_all(c).startswith(b"HTTP/1.1 429 ") for c in answered)
        got = [rig.next_handed() for _ in range(4)]
        assert [d for _, d in got] == ["held"] * 4 and rig.limiter.held == 4
    finally:
        for conn, _ in got:
            conn.close()
        for c in clients:
            c.close()


def test_when_full_what_is_not_refused_there_goes_to_the_loop_with_the_decision(rig: Rig) -> None:
    rig.engine.shedding = True
    rig.published()
    with rig.connect(POST + BODY[:5]):  # its body still on the way: the protocol answers
        conn, decision = rig.next_handed()
        assert decision == "shed"
        conn.close()
    with rig.connect(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n"):  # never refused for load
        conn, decision = rig.next_handed()
        assert decision is None
        conn.close()
    wait_for(lambda: rig.front.shed == 1, "the refusal folded into the server's counts")
    assert rig.limiter.closed["shed"] == 0  # counted once, answered by the loop


def test_when_full_a_silent_connection_is_parked_and_refused_once_it_asks(rig: Rig) -> None:
    rig.engine.capacity = 0
    rig.published()
    with rig.connect() as c:
        with pytest.raises(queue.Empty):
            rig.handed.get(timeout=0.2)  # accepted and parked: nothing was passed over
        c.sendall(POST + BODY)
        assert read_all(c).startswith(b"HTTP/1.1 429 ")
    assert rig.handed.empty()
    rig.engine.capacity = 4  # room again, the flood still on: decided at its line, let through
    rig.published()
    with rig.connect() as c:
        c.sendall(POST + BODY)
        conn, decision = rig.next_handed()
        assert decision == "held"
        conn.close()


def test_with_room_a_silent_connection_settles_briefly_and_during_a_flood_waits_for_its_line(
        rig: Rig) -> None:
    """Room and no flood: silent past the settle time, it goes to the server undecided (its limits
    apply).  Room during a flood (a refusal just now): it stays with the acceptor until it asks."""
    with rig.connect():
        conn, decision = rig.next_handed()  # after the settle time (0.1 s)
        assert decision == "silent"
        conn.close()
    rig.limiter.shedder.last_refusal = time.monotonic()  # the server just refused one: a flood
    wait_for(lambda: rig.acceptor.board is not None and rig.acceptor.board[Board.LAST_REFUSAL] > 0,
             "the flood published")
    with rig.connect() as c:
        with pytest.raises(queue.Empty):
            rig.handed.get(timeout=0.4)  # well past the settle time: still with the acceptor
        c.sendall(POST + BODY)
        conn, decision = rig.next_handed()
        assert decision == "held"  # there is room: decided at its line
        conn.close()


def test_a_parked_connection_that_never_asks_is_closed_at_the_header_timeout() -> None:
    r = Rig(header_timeout=0.2)
    r.engine.capacity = 0
    r.start()
    try:
        with r.connect() as c:
            assert read_all(c) == b""  # closed by the server, nothing said
        wait_for(lambda: r.limiter.closed["header_timeout"] == 1, "the timeout folded into the counts")
        assert r.handed.empty()
    finally:
        r.close()


def test_stop_closes_the_parked_connections_and_ends_the_process() -> None:
    r = Rig()
    r.engine.capacity = 0
    r.start()
    with r.connect() as c:
        with pytest.raises(queue.Empty):
            r.handed.get(timeout=0.2)  # parked
        r.close()
        assert read_all(c) == b""
    assert r.sock.fileno() == -1


def test_during_a_flood_a_request_that_waited_too_long_is_shed_even_with_room() -> None:
    r = Rig(max_wait=0.5)
    try:
        late = r.connect(POST + BODY)
        time.sleep(0.8)  # it sits in the accept queue: nobody accepts yet
        r.limiter.shedder.last_refusal = time.monotonic()  # a flood: the front just refused one
        r.start()
        assert read_all(late).startswith(b"HTTP/1.1 429 ")
        late.close()
        with r.sent_before_accept(POST + BODY):  # fresh: let through
            conn, decision = r.next_handed()
            assert decision == "held"
            conn.close()
        r.limiter.shedder.last_refusal = -1e9  # no flood: waiting alone sheds nothing
        r.stop()
        late = r.connect(POST + BODY)
        time.sleep(1.2)  # longer than the acceptor's own memory of its last refusal
        r.start()
        conn, decision = r.next_handed()
        assert decision == "held"
        conn.close()
        late.close()
    finally:
        r.close()


def test_the_acceptor_exits_when_the_server_dies() -> None:
    """Its end of the channel reads EOF when the server's end closes, however that happens."""
    r = Rig()
    r.start()
    proc = r.acceptor.proc
    assert proc is not None
    try:
        with r.lock:
            assert r.acceptor.channel is not None
            r.acceptor.channel.close()  # as the kernel does for a server killed with -9
            r.acceptor.channel = None
            proc.wait(HANG)
        assert proc.returncode == 0
    finally:
        r.close()


# ---------------------------------------------------------------------- the rules, without I/O
def board(capacity: float = 2.0) -> Board:
    b, fd = Board.create(1)
    os.close(fd)
    b[Board.CAPACITY] = capacity
    return b


@pytest.mark.parametrize(("data", "route"), [
    (b"POST /v1/chat/completions HTTP/1.1\r\n", CHAT),
    (b"POST /v1/chat/completions?x=1 HTTP/1.1\r\n", CHAT),
    (b"POST /v1/chat/completions", None),  # the line is not complete yet
    (b"GET /v1/chat/completions HTTP/1.1\r\n", None),
    (b"POST /health HTTP/1.1\r\n", None),
])
def test_shed_route_reads_only_the_request_line(data: bytes, route: str | None) -> None:
    assert shed_route(data, frozenset({CHAT})) == route


def test_the_gate_counts_its_own_hand_overs_until_the_server_acknowledges_them() -> None:
    b = board(capacity=2)
    gate = Gate(b, [CHAT], b"429", 10.0)
    assert gate.line_decision(POST) == "held" and gate.line_decision(POST) == "held"
    assert gate.line_decision(POST) == "shed" and b[Board.REFUSED] == 1  # 2 on their way: full
    b[Board.HELD] = 2  # the server counted both ...
    b[Board.ACKED] = 2  # ... and acknowledged them
    assert gate.pending() == 2 and gate.full()
    b[Board.HELD] = 1  # one answered
    assert not gate.full() and gate.line_decision(POST) == "held"
    assert gate.line_decision(b"GET /health HTTP/1.1\r\n") is None  # never a load decision
    b.close()


def test_the_gate_refuses_while_the_engine_sheds_or_when_told_to() -> None:
    b = board(capacity=math.inf)
    gate = Gate(b, [CHAT], b"429", 10.0)
    assert not gate.flooded()
    assert gate.line_decision(POST, shed=True) == "shed"  # waited too long during a flood
    assert gate.flooded()  # it refused one just now
    b[Board.SHEDDING] = 1.0
    assert gate.full() and gate.line_decision(POST) == "shed"
    assert b[Board.REFUSED] == 2 and gate.pending() == 0
    b.close()


def test_the_server_collects_what_the_acceptor_counted_once() -> None:
    with socket.socket() as ls:
        acc = AcceptorProcess(ls, paths=[CHAT, "/b"], response=b"429", header_timeout=1.0)
        b = acc.board  # the numbers only: no process is started
        assert b is not None
        b[Board.ANSWERED] += 3
        b[Board.TIMED_OUT] += 1
        b[Board.REFUSED + 1] += 5  # by sorted path: the chat route is second
        assert acc.counts() == (3, 1, {"/v1/chat/completions": 5})
        assert acc.counts() == (0, 0, {})  # folded once
        acc.close()
        assert acc.board is None and acc.counts() == (0, 0, {})


CHILD = r"""
import resource, select, socket
from trio_orch.serve.acceptor_process import AcceptorProcess

soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (48, hard))  # the acceptor process inherits it
ls = socket.socket()
ls.bind(("127.0.0.1", 0))
ls.listen(256)
acc = AcceptorProcess(ls, paths=["/x"], response=b"429", header_timeout=30.0, retry_delay=0.3)
acc.publish(capacity=0)  # full: silent connections are parked in the acceptor
acc.start()
print(ls.getsockname()[1], flush=True)
n = 0
while n < 5:
    select.select([acc.channel], [], [], 10.0)
    for conn, decision in acc.received():
        conn.close()
        n += 1
    assert not acc.lost
print("resumed", acc.running, flush=True)
acc.close()
"""


def test_out_of_file_descriptors_the_acceptor_pauses_logs_once_and_resumes() -> None:
    """A full acceptor process with 48 descriptors parks 60 silent connections: accepting stalls (one
    log line, not a flood), and resumes once the clients leave and descriptors are free again."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    proc = subprocess.Popen([sys.executable, "-c", CHILD], cwd=root, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    clients: list[socket.socket] = []
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline())
        for _ in range(60):
            clients.append(socket.create_connection(("127.0.0.1", port), timeout=HANG))
        time.sleep(1.0)  # parked until the descriptors ran out; retried every 0.3 s since
        for c in clients:
            c.close()
        clients = [socket.create_connection(("127.0.0.1", port), timeout=HANG) for _ in range(5)]
        for c in clients:
            c.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
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
