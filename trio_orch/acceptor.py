"""The threaded front's acceptor process: refusing a flood costs a few system calls, off the server.

The event loop's own accept builds a transport and a protocol for every
connection (on a small box, 100-300 us of Python each) before anybody can
look at the request, and it runs on the loop that also serves the admitted
requests.  An acceptor *thread* moved that work off the loop but not off
the interpreter: each refusal still held the GIL that the loop and the
engine thread need to move an admitted request along, and a low-priority
thread holding the GIL stalls them all (priority inversion).  So the
listening socket is accepted on by a process of its own (stdlib only, run
as ``python -m trio_orch.acceptor``) at a low CPU priority: under a burst,
refusing a thousand requests cannot take the GIL, and takes little CPU,
from the requests that were admitted.

For each new connection it peeks at what the client already sent and
decides at the request line (:meth:`Gate.line_decision`):

* a request the engine would shed, complete in the socket buffer, is read,
  answered 429 and closed right here -- the request was consumed, so the
  close resets nothing and the client gets its answer;
* a connection that has not sent anything yet is watched as a raw socket
  (bounded in number): for ``settle`` seconds (0.1) if there is room -- a
  client sends its request right after connecting, and a burst's
  connections accepted early must not reach the server undecided -- and,
  while the engine is full, until the header timeout, so that it can be
  refused the same way; a connection still silent after its settle time
  goes to the server, whose connection limits apply to it (during a flood
  it waits here for its line instead);
* every other connection is passed to the server over a Unix socket
  (``SCM_RIGHTS``), the decision already made, and gets uvicorn's protocol
  there (a request shed with its body still on the way is answered by the
  protocol).

What the decision needs from the server -- the requests it let through and
has not answered, the engine's capacity, whether the engine sheds -- is on
a :class:`Board`: a few numbers in a shared mapped file, each written by
one side only, read without locks (an estimate, as the thread's was).  The
server (:class:`AcceptorProcess`) writes its side and folds the acceptor's
counts into its metrics.  The acceptor stops when the server closes its end
of the Unix socket, or dies.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import math
import mmap
import os
import selectors
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["Acceptor", "AcceptorProcess", "Board", "Gate", "refuses", "request_complete", "shed_route",
           "waited"]

log = logging.getLogger("trio_orch.accept")

#: accept errors that mean "out of resources": pause accepting instead of spinning on them
_RESOURCE_ERRORS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})

#: a connection's decision on the Unix socket, one byte: let through and counted ("held"), to
#: be answered 429 ("shed"), for the server to decide at its request line (None), or that too
#: but nothing was sent yet ("silent": an idle connection, which the server's limits may close)
DECISIONS: dict[str | None, bytes] = {None: b"-", "held": b"h", "shed": b"s", "silent": b"0"}
_DECODE = {v: k for k, v in DECISIONS.items()}


def request_complete(data: bytes) -> bool:
    """Whether ``data`` holds a whole HTTP/1.1 request with a ``Content-Length`` body (or none)."""
    end = data.find(b"\r\n\r\n")
    if end < 0:
        return False
    head = data[:end].lower()
    if b"\r\ntransfer-encoding:" in head:
        return False
    at = head.find(b"\r\ncontent-length:")
    if at < 0:
        return len(data) >= end + 4
    stop = head.find(b"\r\n", at + 17)
    value = head[at + 17:stop if stop >= 0 else len(head)].strip()
    if not value.isdigit():
        return False
    return len(data) >= end + 4 + int(value)


def shed_route(data: bytes, paths: frozenset[str]) -> str | None:
    """The route of ``data``'s request line if it is a POST to one of ``paths`` (which load sheds).

    Only the request line is looked at (``POST /path``): no headers parsed,
    no body read.  None: another request, or the line is not complete yet.
    """
    if not data.startswith(b"POST "):
        return None
    end = data.find(b" ", 5)
    if end < 0:
        return None
    route = data[5:end].split(b"?", 1)[0].decode("latin-1")
    return route if route in paths else None


def waited(conn: socket.socket) -> float:
    """Seconds since the last bytes of ``conn`` arrived (Linux ``TCP_INFO``; 0.0 where unknown).

    For a request read at once, how long it waited in the server's queues
    before anybody looked at it.
    """
    try:
        info = conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 104)
    except (AttributeError, OSError):
        return 0.0
    if len(info) < 56:
        return 0.0
    return struct.unpack_from("I", info, 52)[0] / 1000  # tcpi_last_data_recv, in ms


class Board:
    """Numbers shared by the server and its acceptor process (a mapped file; one writer per slot).

    Slots, by who writes them -- the server: ``HELD`` (requests to a shed
    path it let through and has not answered), ``ACKED`` (how many of the
    acceptor's "held" hand-overs it has counted into ``HELD``), ``CAPACITY``,
    ``SHEDDING`` (1.0 while the engine sheds), ``LAST_REFUSAL`` (its own,
    ``time.monotonic()``); the acceptor: ``ANSWERED`` (429s it sent itself),
    ``TIMED_OUT`` (parked connections closed at the header timeout), and one
    ``REFUSED`` count per shed path.  Aligned 8-byte slots: a reader sees
    a whole old or new value.
    """

    HELD, ACKED, CAPACITY, SHEDDING, LAST_REFUSAL, ANSWERED, TIMED_OUT, REFUSED = range(8)

    def __init__(self, fd: int, paths: int) -> None:
        self.size = 8 * (self.REFUSED + paths)
        self._map = mmap.mmap(fd, self.size)
        self.slots = memoryview(self._map).cast("d")

    @classmethod
    def create(cls, paths: int) -> tuple[Board, int]:
        """A new board (all zero, ``CAPACITY`` unbounded) and the descriptor a child maps it by."""
        with tempfile.TemporaryFile() as f:  # unlinked: nothing is left on disk
            fd = os.dup(f.fileno())
        os.ftruncate(fd, 8 * (cls.REFUSED + paths))
        board = cls(fd, paths)
        board.slots[cls.CAPACITY] = math.inf
        board.slots[cls.LAST_REFUSAL] = -math.inf
        return board, fd

    def __getitem__(self, slot: int) -> float:
        return self.slots[slot]

    def __setitem__(self, slot: int, value: float) -> None:
        self.slots[slot] = value

    def close(self) -> None:
        with contextlib.suppress(BufferError):
            self.slots.release()
            self._map.close()


class Gate:
    """The acceptor's admission view: the server's numbers on the board, plus its own hand-overs.

    ``pending`` = the server's ``HELD`` + the "held" hand-overs the server has
    not counted yet; a request to a shed path is refused once the engine
    sheds or ``pending`` reaches the capacity (the same rule as the server's
    :class:`~trio_orch.http_limits.Shedder`, :func:`refuses`).
    """

    def __init__(self, board: Board, paths: Sequence[str], response: bytes, header_timeout: float) -> None:
        self.board = board
        self.paths = frozenset(paths)
        self.slot = {p: Board.REFUSED + i for i, p in enumerate(paths)}
        self.response = response
        self.header_timeout = header_timeout
        self.handed_held = board[Board.ACKED]  # a restarted acceptor: what its forerunner passed is counted
        self.last_refusal = -math.inf

    def pending(self) -> float:
        b = self.board
        return b[Board.HELD] + self.handed_held - b[Board.ACKED]

    def full(self) -> bool:
        """Whether a request to a shed path would be refused now."""
        b = self.board
        return refuses(b[Board.SHEDDING] > 0, self.pending(), b[Board.CAPACITY])

    def flooded(self, window: float = 1.0) -> bool:
        """Full now, or a request was refused (here or by the server) within the last ``window`` s."""
        last = max(self.last_refusal, self.board[Board.LAST_REFUSAL])
        return self.full() or time.monotonic() - last < window

    def line_decision(self, data: bytes, shed: bool = False) -> str | None:
        """``"shed"`` (answer 429), ``"held"`` (a request to a shed path let through), or None
        (another request, or its line is incomplete: the server decides).  ``shed``: refuse it
        regardless (it waited too long during a flood)."""
        route = shed_route(data, self.paths)
        if route is None:
            return None
        if shed or self.full():
            self.last_refusal = time.monotonic()
            self.board[self.slot[route]] += 1
            return "shed"
        self.handed_held += 1
        return "held"

    def count(self, slot: int) -> None:
        self.board[slot] += 1


def refuses(shedding: bool, pending: float, capacity: float) -> bool:
    """The shed rule: refuse while the engine sheds, or once ``pending`` requests fill its capacity."""
    return shedding or pending >= capacity


class Acceptor:
    """The accept loop of the acceptor process; see the module docstring.

    ``hand_over(conn, decision)`` passes a connection the server must serve (see ``DECISIONS``).
    ``max_wait``: during a flood (:meth:`Gate.flooded`), a request whose
    bytes already waited longer than this many seconds before the acceptor
    got to it is shed even if there is room now -- the server is behind, and
    serving it now would serve it late (None: no such bound).
    """

    def __init__(self, sock: socket.socket, gate: Gate,
                 hand_over: Callable[[socket.socket, str | None], None], *, max_wait: float | None = None,
                 retry_delay: float = 1.0, peek_bytes: int = 8192,
                 max_waiting: int = 4096, settle: float = 0.1, log_every: float = 10.0) -> None:
        self.sock = sock
        self.gate = gate
        self.hand_over = hand_over
        self.max_wait = max_wait
        self.retry_delay = retry_delay
        self.peek_bytes = peek_bytes
        self.max_waiting = max_waiting
        self.settle = settle
        self.log_every = log_every
        self._logged = -math.inf
        #: while the engine is full: connections accepted before they sent anything -> give-up time
        self.waiting: dict[int, tuple[socket.socket, float]] = {}
        #: connections accepted with room and nothing sent yet, given ``settle`` seconds to send
        #: their request line before they go to the server undecided -> that time
        self.settling: dict[int, tuple[socket.socket, float]] = {}

    def run(self, stop_fd: int) -> None:
        """Accept until ``stop_fd`` becomes readable (the server closed its end, or died)."""
        self.sock.setblocking(False)
        ep = selectors.DefaultSelector()
        listen_fd = self.sock.fileno()
        ep.register(stop_fd, selectors.EVENT_READ)
        ep.register(listen_fd, selectors.EVENT_READ)
        paused_until = 0.0
        try:
            while True:
                now = time.monotonic()
                if paused_until and now >= paused_until:
                    ep.register(listen_fd, selectors.EVENT_READ)
                    paused_until = 0.0
                deadlines = [paused_until] if paused_until else []
                for parked in (self.waiting, self.settling):  # in order, one duration each:
                    if parked:  # the first ends first
                        deadlines.append(next(iter(parked.values()))[1])
                timeout = max(0.0, min(deadlines) - now) if deadlines else None
                for key, _ in ep.select(timeout):
                    fd = key.fd
                    if fd == stop_fd:
                        return
                    if fd == listen_fd:
                        if not self._accept_all(ep):
                            ep.unregister(listen_fd)
                            paused_until = time.monotonic() + self.retry_delay
                    else:
                        self._sent_something(ep, fd)
                self._expire(ep, time.monotonic())
        finally:
            for parked in (self.waiting, self.settling):
                for conn, _ in parked.values():
                    conn.close()
                parked.clear()
            ep.close()

    def _accept_all(self, ep: selectors.BaseSelector) -> bool:
        """Accept until the backlog is empty; False when out of resources (pause accepting)."""
        while True:
            try:
                conn, _ = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return True
            except ConnectionAbortedError:
                continue
            except OSError as exc:
                if exc.errno not in _RESOURCE_ERRORS:
                    raise
                now = time.monotonic()
                if now - self._logged >= self.log_every:  # a line per interval, not a flood
                    self._logged = now
                    log.error("socket.accept() out of system resource: %s; pausing accepts for %gs",
                              exc, self.retry_delay)
                return False
            conn.setblocking(False)
            self._take(ep, conn)

    def _take(self, ep: selectors.BaseSelector, conn: socket.socket) -> None:
        try:
            data: bytes | None = conn.recv(self.peek_bytes, socket.MSG_PEEK)
        except (BlockingIOError, InterruptedError):
            data = None  # nothing sent yet
        except OSError:
            data = b""  # reset before it was accepted
        if data == b"":
            conn.close()  # gone before it asked anything
            return
        gate = self.gate
        if data is None:
            if len(self.waiting) + len(self.settling) >= self.max_waiting:
                self.hand_over(conn, "silent")  # the server decides at the request line
            elif gate.full():  # a flood: wait for its request line
                self.waiting[conn.fileno()] = (conn, time.monotonic() + gate.header_timeout)
                ep.register(conn.fileno(), selectors.EVENT_READ)
            else:  # a client sends its request right after connecting: decide here if it does
                self.settling[conn.fileno()] = (conn, time.monotonic() + self.settle)
                ep.register(conn.fileno(), selectors.EVENT_READ)
            return
        late = self.max_wait is not None and gate.flooded() and waited(conn) > self.max_wait
        decision = gate.line_decision(data, late)
        if decision == "shed" and request_complete(data):
            self._refuse(conn, len(data))
            return
        self.hand_over(conn, decision)

    def _sent_something(self, ep: selectors.BaseSelector, fd: int) -> None:
        entry = self.waiting.pop(fd, None) or self.settling.pop(fd, None)
        if entry is None:
            return
        ep.unregister(fd)
        self._take(ep, entry[0])

    def _expire(self, ep: selectors.BaseSelector, now: float) -> None:
        while self.settling:  # silent since it connected: the server's limits apply to it now
            fd, (conn, deadline) = next(iter(self.settling.items()))  # the oldest first
            if deadline > now:
                break
            del self.settling[fd]
            if self.gate.flooded():  # a flood is on: it waits for its line here
                self.waiting[fd] = (conn, now + self.gate.header_timeout)
            else:
                ep.unregister(fd)
                self.hand_over(conn, "silent")
        while self.waiting:
            fd, (conn, deadline) = next(iter(self.waiting.items()))  # the oldest first
            if deadline > now:
                return
            del self.waiting[fd]
            ep.unregister(fd)
            self.gate.count(Board.TIMED_OUT)
            conn.close()

    def _refuse(self, conn: socket.socket, consumed: int) -> None:
        """Answer 429 on the raw socket: consume the request, answer, close.

        With the request read, the close sends a FIN after the answer (no
        reset): the client reads the whole answer, then the end.
        """
        self.gate.count(Board.ANSWERED)
        try:
            conn.recv(consumed)
            conn.send(self.gate.response)
        except OSError:
            pass  # the client went away: nothing to answer
        finally:
            conn.close()


# ---------------------------------------------------------------------- the server's side
class AcceptorProcess:
    """The server's handle on one acceptor process for ``sock``.

    The board exists from the start, so that the server can publish its
    numbers before the process decides anything.  ``start()`` spawns the
    process; :meth:`received` (call it when :attr:`channel` is readable)
    returns the connections it passed over, with their decisions (a closed
    channel sets :attr:`lost`); the server writes its numbers with
    :meth:`publish` and collects the acceptor's counts with :meth:`counts`.
    ``stop()`` closes the channel and waits for the process (it may be
    started again); ``close()`` also frees the board.  Both are idempotent.
    ``nice``: added to the process's niceness.  10 gives it about a tenth of
    a core that a worker also wants; 19 starved it on a saturated core (a
    burst then took seconds to refuse, and connects waited).
    """

    def __init__(self, sock: socket.socket, *, paths: Sequence[str], response: bytes, header_timeout: float,
                 max_wait: float | None = None, nice: int = 10, retry_delay: float = 1.0,
                 max_waiting: int = 4096) -> None:
        self.sock = sock
        self.paths = sorted(paths)
        self.config: dict[str, Any] = {
            "paths": self.paths, "response": response.decode("latin-1"), "header_timeout": header_timeout,
            "max_wait": max_wait, "nice": nice, "retry_delay": retry_delay, "max_waiting": max_waiting,
            "log_level": logging.getLogger().getEffectiveLevel()}
        self.board: Board | None
        self.board, self._board_fd = Board.create(len(self.paths))
        self.channel: socket.socket | None = None
        self.proc: subprocess.Popen[bytes] | None = None
        self.lost = False  #: the channel closed without a stop: the process died
        self._folded = [0.0] * (Board.REFUSED + len(self.paths))

    def start(self) -> None:
        if self.proc is not None:
            raise RuntimeError("the acceptor is running")
        if self.board is None:
            raise RuntimeError("the acceptor was closed")
        mine, theirs = socket.socketpair(socket.AF_UNIX, _CHANNEL_TYPE)
        try:
            fds = {"listen": self.sock.fileno(), "channel": theirs.fileno(), "board": self._board_fd}
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "trio_orch.acceptor", json.dumps({**self.config, **fds})],
                pass_fds=tuple(fds.values()), stdin=subprocess.DEVNULL)
        except BaseException:
            mine.close()
            raise
        finally:
            theirs.close()
        mine.setblocking(False)
        self.channel, self.lost = mine, False

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def received(self, limit: int = 256) -> list[tuple[socket.socket, str | None]]:
        """The connections passed over since the last call (up to ``limit``; never blocks)."""
        out: list[tuple[socket.socket, str | None]] = []
        chan = self.channel
        while chan is not None and len(out) < limit:
            try:
                msg, fds, _, _ = socket.recv_fds(chan, 16, 4)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                msg, fds = b"", []
            if not msg and not fds:
                self.lost = True
                break
            conns = [socket.socket(fileno=fd) for fd in fds]
            for conn in conns[1:]:  # one per message; more would be a bug: never leak them
                conn.close()
            if conns:
                out.append((conns[0], _DECODE.get(msg[:1])))
        return out

    def acknowledge_held(self) -> None:
        """A "held" hand-over was counted into the server's ``HELD`` (write ``HELD`` first)."""
        if self.board is not None:
            self.board[Board.ACKED] += 1

    def publish(self, *, held: int | None = None, capacity: float | None = None,
                shedding: bool | None = None, last_refusal: float | None = None) -> None:
        b = self.board
        if b is None:
            return
        if held is not None:
            b[Board.HELD] = held
        if capacity is not None:
            b[Board.CAPACITY] = capacity
        if shedding is not None:
            b[Board.SHEDDING] = 1.0 if shedding else 0.0
        if last_refusal is not None:
            b[Board.LAST_REFUSAL] = last_refusal

    def counts(self) -> tuple[int, int, dict[str, int]]:
        """What the acceptor counted since the last call: (429s it answered, parked connections
        timed out, refusals by route)."""
        b = self.board
        if b is None:
            return 0, 0, {}
        delta = [0] * len(self._folded)
        for i in range(Board.ANSWERED, len(self._folded)):  # the acceptor's slots
            n = b[i]
            delta[i], self._folded[i] = int(n - self._folded[i]), n
        return (delta[Board.ANSWERED], delta[Board.TIMED_OUT],
                {p: delta[Board.REFUSED + i] for i, p in enumerate(self.paths) if delta[Board.REFUSED + i]})

    def stop(self, timeout: float = 5.0) -> None:
        """Close the channel (the process stops accepting, closes what it parked, exits) and wait."""
        if self.channel is not None:
            self.channel.close()
            self.channel = None
        proc, self.proc = self.proc, None
        if proc is not None:
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def close(self, timeout: float = 5.0) -> None:
        """Stop, then free the board (its counts are gone: fold them first)."""
        self.stop(timeout)
        if self.board is not None:
            self.board.close()
            self.board = None
            os.close(self._board_fd)


_CHANNEL_TYPE = getattr(socket, "SOCK_SEQPACKET", socket.SOCK_DGRAM)


# ---------------------------------------------------------------------- the process
def lower_priority(nice: int) -> None:
    """Add ``nice`` to this process's niceness (lowering its priority needs no privilege)."""
    if nice > 0:
        with contextlib.suppress(OSError):
            os.nice(nice)


def main(argv: Sequence[str] | None = None) -> int:
    """The acceptor process: ``python -m trio_orch.acceptor CONFIG_JSON`` (started by the server)."""
    cfg = json.loads((sys.argv[1:] if argv is None else argv)[0])
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the server decides
    logging.basicConfig(level=cfg["log_level"], format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    lower_priority(cfg["nice"])
    sock = socket.socket(fileno=cfg["listen"])
    channel = socket.socket(fileno=cfg["channel"])
    board = Board(cfg["board"], len(cfg["paths"]))
    gate = Gate(board, cfg["paths"], cfg["response"].encode("latin-1"), cfg["header_timeout"])

    def hand_over(conn: socket.socket, decision: str | None) -> None:
        try:
            socket.send_fds(channel, [DECISIONS[decision]], [conn.fileno()])
        finally:
            conn.close()  # the server has its own descriptor now

    acceptor = Acceptor(sock, gate, hand_over, max_wait=cfg["max_wait"], retry_delay=cfg["retry_delay"],
                        max_waiting=cfg["max_waiting"])
    try:
        acceptor.run(channel.fileno())
    except (BrokenPipeError, ConnectionError):
        return 0  # the server went away while a connection was on its way: it is stopping
    except Exception:  # never die silently: the server falls back to accepting itself
        log.exception("the acceptor failed")
        return 1
    finally:
        sock.close()
        channel.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
