"""The threaded front's acceptor: refusing a flood costs a few system calls, off the event loop.

The event loop's own accept builds a transport and a protocol for every
connection (on a small box, 100-300 us of Python each) before anybody can
look at the request, and it runs on the loop that also serves the admitted
requests: under a burst of a thousand requests, every step of an admitted
request waits behind a batch of connections that will be refused.
:class:`Acceptor` takes the listening socket away from the loop and accepts
in a thread of its own, at a lower CPU priority (refusing a flood must not
take CPU from the requests that were admitted).  For each new connection it
peeks at what the client already sent and asks the limiter for the
request-line decision
(:meth:`~trio_orch.uvicorn_front.ConnectionLimiter.line_decision`):

* a request the engine would shed, complete in the socket buffer, is read,
  answered 429 and closed right here -- the request was consumed, so the
  close resets nothing and the client gets its answer;
* while the engine is full, a connection that has not sent anything yet is
  watched as a raw socket (bounded in number and in time: the header
  timeout) so that it can be refused the same way;
* every other connection goes to the event loop, the decision already made,
  and gets uvicorn's protocol there (a request shed with its body still on
  the way is answered by the protocol).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import selectors
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

__all__ = ["Acceptor", "request_complete", "waited"]

log = logging.getLogger("trio_orch.accept")

#: accept errors that mean "out of resources": pause accepting instead of spinning on them
_RESOURCE_ERRORS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})


def request_complete(data: bytes) -> bool:
    """Whether ``data`` holds a whole HTTP/1.1 request with a ``Content-Length`` body (or none)."""
    end = data.find(b"\r\n\r\n")
    if end < 0:
        return False
    length = 0
    for line in data[:end].split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        name = name.strip().lower()
        if name == b"transfer-encoding":
            return False
        if name == b"content-length":
            value = value.strip()
            if not value.isdigit():
                return False
            length = int(value)
    return len(data) >= end + 4 + length


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


class Acceptor:
    """Accepts on one listening socket in its own thread; see the module docstring.

    ``limiter``: the :class:`~trio_orch.uvicorn_front.ConnectionLimiter` whose
    decisions and counters apply (they are thread-safe).  ``hand_over(conn,
    decision)`` is called in this thread for each connection the loop must
    serve; it must only schedule work on the loop.  ``nice``: added to the
    thread's niceness (Linux; raising it needs no privilege).  ``max_wait``:
    during a flood (the limiter says so), a request whose bytes already
    waited longer than this many seconds before the acceptor got to it is
    shed even if there is room now -- the server is behind, and serving it
    now would serve it late (None: no such bound).
    """

    def __init__(self, sock: socket.socket, limiter: Any,
                 hand_over: Callable[[socket.socket, str | None], None], *, nice: int = 10,
                 max_wait: float | None = None, retry_delay: float = 1.0, peek_bytes: int = 8192,
                 max_waiting: int = 4096) -> None:
        self.sock = sock
        self.limiter = limiter
        self.hand_over = hand_over
        self.nice = nice
        self.max_wait = max_wait
        self.retry_delay = retry_delay
        self.peek_bytes = peek_bytes
        self.max_waiting = max_waiting
        #: while the engine is full: connections accepted before they sent anything -> give-up time
        self.waiting: dict[int, tuple[socket.socket, float]] = {}
        self._stop = False
        self._wake_r = self._wake_w = -1
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("the acceptor is running")
        self._stop = False
        self._wake_r, self._wake_w = os.pipe()
        self.sock.setblocking(False)
        self._thread = threading.Thread(target=self._run, name="trio-orch-accept", daemon=True)
        self._thread.start()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop accepting and wait for the thread (idempotent).  Connections already handed over
        carry on; those that have not sent a request yet are closed."""
        if self._thread is None:
            return
        self._stop = True
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"x")
        self._thread.join(timeout)
        self._thread = None
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)

    # ------------------------------------------------------------------ the thread
    def _run(self) -> None:
        if self.nice and sys.platform.startswith("linux"):  # per-thread niceness is Linux's
            with contextlib.suppress(OSError):
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), self.nice)
        ep = selectors.DefaultSelector()
        listen_fd = self.sock.fileno()
        ep.register(self._wake_r, selectors.EVENT_READ)
        ep.register(listen_fd, selectors.EVENT_READ)
        paused_until = 0.0
        try:
            while not self._stop:
                now = time.monotonic()
                if paused_until and now >= paused_until:
                    ep.register(listen_fd, selectors.EVENT_READ)
                    paused_until = 0.0
                deadlines = [paused_until] if paused_until else []
                if self.waiting:  # parked in order, all for the same time: the first ends first
                    deadlines.append(next(iter(self.waiting.values()))[1])
                timeout = max(0.0, min(deadlines) - now) if deadlines else None
                for key, _ in ep.select(timeout):
                    fd = key.fd
                    if fd == listen_fd:
                        if not self._accept_all(ep):
                            ep.unregister(listen_fd)
                            paused_until = time.monotonic() + self.retry_delay
                    elif fd != self._wake_r:
                        self._sent_something(ep, fd)
                self._expire(ep, time.monotonic())
        except Exception:  # never die silently: the server would stop accepting
            log.exception("the acceptor failed; no new connections are accepted")
        finally:
            for conn, _ in self.waiting.values():
                conn.close()
            self.waiting.clear()
            ep.close()

    def _accept_all(self, ep: selectors.BaseSelector) -> bool:
        """Accept until the backlog is empty; False when out of resources (pause accepting)."""
        while not self._stop:
            try:
                conn, _ = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return True
            except ConnectionAbortedError:
                continue
            except OSError as exc:
                if exc.errno not in _RESOURCE_ERRORS:
                    raise
                # the same words as asyncio's, so the flood filter keeps this to a line per interval
                log.error("socket.accept() out of system resource: %s; pausing accepts for %gs",
                          exc, self.retry_delay)
                return False
            conn.setblocking(False)
            self._take(ep, conn)
        return True

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
        if data is None:
            if self.limiter.full() and len(self.waiting) < self.max_waiting:
                self.waiting[conn.fileno()] = (conn, time.monotonic() + self.limiter.header_timeout)
                ep.register(conn.fileno(), selectors.EVENT_READ)  # a flood: wait for its request line
            else:
                self.hand_over(conn, None)  # the protocol decides at the request line
            return
        late = self.max_wait is not None and self.limiter.flooded() and waited(conn) > self.max_wait
        decision = self.limiter.line_decision(data, late)
        if decision == "shed" and request_complete(data):
            self._refuse(conn, len(data))
            return
        self.hand_over(conn, decision)

    def _sent_something(self, ep: selectors.BaseSelector, fd: int) -> None:
        entry = self.waiting.pop(fd, None)
        if entry is None:
            return
        ep.unregister(fd)
        self._take(ep, entry[0])

    def _expire(self, ep: selectors.BaseSelector, now: float) -> None:
        while self.waiting:
            fd, (conn, deadline) = next(iter(self.waiting.items()))  # the oldest first
            if deadline > now:
                return
            del self.waiting[fd]
            ep.unregister(fd)
            self.limiter.count_closed("header_timeout")
            conn.close()

    def _refuse(self, conn: socket.socket, consumed: int) -> None:
        """Answer 429 on the raw socket: consume the request, answer, close.

        With the request read, the close sends a FIN after the answer (no
        reset): the client reads the whole answer, then the end.
        """
        self.limiter.count_closed("shed")
        try:
            conn.recv(consumed)
            conn.send(self.limiter.shed_response())
        except OSError:
            pass  # the client went away: nothing to answer
        finally:
            conn.close()
