"""The threaded front's acceptor process: refusing a flood costs a few system calls, off the server.

The event loop's own accept builds a transport and a protocol for every
connection (on a small box, 100-300 us of Python each) before anybody can
look at the request, and it runs on the loop that also serves the admitted
requests.  An acceptor *thread* moved that work off the loop but not off
the interpreter: each refusal still held the GIL that the loop and the
engine thread need to move an admitted request along, and a low-priority
thread holding the GIL stalls them all (priority inversion).  So the
listening socket is accepted on by a process of its own (stdlib only, run
as ``python -m trio_orch.serve.acceptor``) at a low CPU priority: under a burst,
refusing a thousand requests cannot take the GIL, and takes little CPU,
from the requests that were admitted.

For each new connection it peeks at what the client already sent and
decides at the request line (:meth:`~trio_orch.serve.accept_gate.Gate.line_decision`):

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
a :class:`~trio_orch.serve.accept_gate.Board`: a few numbers in a shared mapped
file, each written by one side only, read without locks (an estimate).  The
server (:class:`~trio_orch.serve.acceptor_process.AcceptorProcess`) writes its
side and folds the acceptor's counts into its metrics.  The acceptor stops
when the server closes its end of the Unix socket, or dies.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import math
import os
import selectors
import signal
import socket
import sys
import time
from collections.abc import Callable, Sequence

from trio_orch.serve.accept_gate import DECISIONS, Board, Gate, request_complete, waited

__all__ = ["Acceptor", "main"]

log = logging.getLogger("trio_orch.accept")

#: accept errors that mean "out of resources": pause accepting instead of spinning on them
_RESOURCE_ERRORS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})


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


def lower_priority(nice: int) -> None:
    """Add ``nice`` to this process's niceness (lowering its priority needs no privilege)."""
    if nice > 0:
        with contextlib.suppress(OSError):
            os.nice(nice)


def main(argv: Sequence[str] | None = None) -> int:
    """The acceptor process: ``python -m trio_orch.serve.acceptor CONFIG_JSON`` (started by the server)."""
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
