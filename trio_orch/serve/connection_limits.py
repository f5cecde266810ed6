"""uvicorn's connections, limited: how many, how long a request head may take, how a close lingers.

* :class:`ConnectionLimiter` and the H11 protocol subclass it makes hold the
  number of open connections at ``max_connections``.  When a new
  connection would pass it, the oldest connection that is idle (no request
  in progress, none on its way) and has been open for at least
  ``min_idle`` seconds is closed to make room; if there is none (a burst of
  fresh connections, or every connection busy) the new one gets a plain
  ``503`` and is closed.  Idle sockets can therefore never use up the file
  descriptors a real request needs.  A connection that has not sent a
  complete request head within ``header_timeout`` seconds of connecting
  (or of its previous answer) is closed: a slow-header client cannot hold a
  socket forever.  uvicorn's own ``timeout_keep_alive`` closes idle
  keep-alive connections.  The limiter also makes the request-line
  decision of the shedder (``line_decision``), counts the requests it let
  through (``held``), and shares its numbers with the acceptor processes.
* :class:`LingeringClose` wraps each connection's transport: a close sends
  FIN after the answer and drops what the client still sends, so unread
  request bytes never turn into a reset that loses the answer.
* :func:`quiet_floods` rate-limits the accept-error lines logged when the
  process runs out of file descriptors.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import resource
import threading
from collections import OrderedDict
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

from trio_orch.http.limits import RateLimitFilter, Shedder
from trio_orch.serve.accept_gate import shed_route, waited
from trio_orch.serve.acceptor_process import AcceptorProcess

__all__ = ["ConnectionLimiter", "LingeringClose", "default_max_connections", "quiet_floods"]

_FLOODS = ("socket.accept() out of system resource", "Too many open files", "Invalid HTTP request received")


def default_max_connections(reserve: int = 1024) -> int:
    """Raise the soft file-descriptor limit to the hard one; leave ``reserve`` fds for everything else."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    if soft == resource.RLIM_INFINITY:
        soft = 1 << 20
    return max(16, soft - reserve if soft > 2 * reserve else soft // 2)


def quiet_floods(interval: float = 10.0) -> None:
    """At most one line per ``interval`` for each kind of log flood (asyncio accept errors, bad requests)."""
    flt = RateLimitFilter(_FLOODS, interval)
    for name in ("asyncio", "uvicorn.error"):  # the acceptor process limits its own lines
        logger = logging.getLogger(name)
        if not any(isinstance(f, RateLimitFilter) for f in logger.filters):
            logger.addFilter(flt)


class LingeringClose:
    """A transport whose ``close()`` lingers: half-close, drop what the client still sends, then close.

    A server that closes a socket with request bytes still unread makes the
    kernel reset the connection, and the client can lose the answer it was
    sent (a 413 for a body over the limit, a 429 answered before the body was
    read).  Like nginx's lingering close: FIN after the answer, reading on
    (the protocol drops it) until the client closes or ``linger`` seconds
    pass.  Everything else goes to the real transport.
    """

    def __init__(self, transport: asyncio.Transport, linger: float, owner: Any) -> None:
        self.transport = transport
        self.linger = linger
        self.owner = owner  # the HTTP protocol; after a WebSocket upgrade another one reads
        self.lingering = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self.transport, name)

    def is_closing(self) -> bool:
        return self.lingering or self.transport.is_closing()

    def close(self) -> None:
        t = self.transport
        if (self.lingering or t.is_closing() or not self.linger or not t.can_write_eof()
                or t.get_protocol() is not self.owner):
            t.close()
            return
        self.lingering = True
        t.write_eof()  # after what was written
        t.resume_reading()  # the protocol drops what arrives (it sees ``lingering``)
        asyncio.get_running_loop().call_later(self.linger, t.close)


class ConnectionLimiter:
    """Open connections of one server, oldest first; see the module docstring.  Event loop only."""

    def __init__(self, max_connections: int, header_timeout: float, min_idle: float = 1.0,
                 max_accept_wait: float | None = None) -> None:
        self.max_connections = max_connections
        self.header_timeout = header_timeout
        self.max_accept_wait = max_accept_wait  #: the acceptor's ``max_wait``
        #: the acceptor processes deciding with this limiter's numbers (they read ``held`` on their board)
        self.acceptors: list[AcceptorProcess] = []
        self.linger = min(2.0, header_timeout)  #: seconds a closing connection drains (LingeringClose)
        self.min_idle = min(min_idle, header_timeout)
        self.open: OrderedDict[Any, float] = OrderedDict()  # connection -> when it was opened
        self.closed: dict[str, int] = {"idle_evicted": 0, "refused": 0, "header_timeout": 0, "shed": 0}
        self.held = 0  #: first requests to a shed path let through at their request line, not yet answered
        self.lock = threading.Lock()  #: ``held`` and ``closed`` (line decisions may come from any thread)
        #: the app's shed decision (``uvicorn_config`` sets it): a fresh connection whose request
        #: line is a POST to a shed path gets its 429 before any HTTP parsing
        self.shedder: Shedder | None = None

    def protocol_class(self) -> type[H11Protocol]:
        """An ``H11Protocol`` subclass bound to this limiter (uvicorn's ``http`` setting)."""
        limiter = self

        class LimitedH11Protocol(H11Protocol):
            def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
                super().connection_made(LingeringClose(transport, limiter.linger, self))  # type: ignore[arg-type]
                limiter.opened(self)
                if self.shed_on_open and not self.transport.is_closing():
                    limiter.answer_shed(self)

            def connection_lost(self, exc: Exception | None) -> None:
                limiter.open.pop(self, None)
                limiter.release(self)
                super().connection_lost(exc)

            line_seen = False  # its first request line was decided on (see line_decision)
            shed = False  # answered 429 at its request line: what the client sends after is dropped
            held = False  # its first request was let through and counts in limiter.held until answered
            shed_on_open = False  # the acceptor decided to shed it before its body arrived
            spoke = False  # its request had begun to arrive when the acceptor passed it over

            def data_received(self, data: bytes) -> None:
                if self.shed or self.transport.lingering:  # answered and closing: drop the rest
                    return
                if not self.line_seen and limiter.at_request_line(self, data) == "shed":
                    limiter.answer_shed(self)
                    return
                super().data_received(data)

            def on_response_complete(self) -> None:
                limiter.release(self)
                super().on_response_complete()

            def shutdown(self) -> None:
                self.transport.linger = 0  # the server is stopping: it does not wait for stragglers
                super().shutdown()

        return LimitedH11Protocol

    @staticmethod
    def upgraded(proto: Any) -> bool:
        """The connection became a WebSocket: another protocol reads it, with timeouts of its own."""
        transport = proto.transport
        return transport is not None and transport.get_protocol() is not proto

    @classmethod
    def busy(cls, proto: Any) -> bool:
        if cls.upgraded(proto):
            return True  # a WebSocket session is never an idle connection to evict
        cycle = proto.cycle
        return cycle is not None and not cycle.response_complete

    @classmethod
    def idle(cls, proto: Any) -> bool:
        """Evictable: no request in progress, and none already on its way (the acceptor saw its
        first bytes before the protocol has read them)."""
        return not cls.busy(proto) and not (proto.cycle is None and proto.spoke)

    def opened(self, proto: Any) -> None:
        now = proto.loop.time()
        if len(self.open) >= self.max_connections:
            old_enough = now - self.min_idle
            victim = None
            for p, t_open in self.open.items():  # oldest first
                if t_open > old_enough:
                    break
                if self.idle(p):
                    victim = p
                    break
            if victim is None:
                self.refuse(proto)
                return
            self.open.pop(victim, None)
            self.count_closed("idle_evicted")
            victim.transport.close()
        self.open[proto] = now
        self._arm(proto, proto.cycle, False)

    def refuse(self, proto: Any) -> None:
        self.count_closed("refused")
        body = json.dumps({"error": {"message": f"the server is at its limit of {self.max_connections} "
                                                "connections, none idle; retry later",
                                     "type": "server_error", "param": None, "code": "too_many_connections"}})
        head = (f"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
                f"content-length: {len(body)}\r\nretry-after: 1\r\nconnection: close\r\n\r\n")
        proto.transport.write(head.encode() + body.encode())
        proto.transport.close()

    def line_decision(self, data: bytes, shed: bool = False) -> str | None:
        """What a connection's first request line asks for: ``"shed"`` (answer 429 now), ``"held"``
        (a request to a shed path let through: it counts in ``held`` until answered), or None
        (not a POST to a shed path, or the line is not complete yet: the normal path decides).

        Only the request line is looked at (:func:`~trio_orch.serve.acceptor.shed_route`).
        The shedder refuses once the requests already let through fill the
        engine's capacity, so a burst read in one go cannot all reach the
        full HTTP path.  ``shed``: refuse it regardless.  Any thread.
        """
        shedder = self.shedder
        route = None if shedder is None else shed_route(data, shedder.paths)
        if route is None:
            return None
        assert shedder is not None
        with self.lock:
            if shedder.refuse(route, math.inf if shed else self.held):
                return "shed"
            self.held += 1
            self._publish_held()
        return "held"

    def took_over(self, acceptor: AcceptorProcess, decision: str | None) -> None:
        """A connection ``acceptor`` passed over with ``decision``: a "held" one counts from now."""
        if decision == "held":
            with self.lock:
                self.held += 1
                self._publish_held()
            acceptor.acknowledge_held()

    def _publish_held(self) -> None:
        for acceptor in self.acceptors:
            acceptor.publish(held=self.held)

    def refresh(self) -> None:
        """Give the acceptors the engine's numbers; fold what they counted into ours (on the loop)."""
        shedder = self.shedder
        for acceptor in self.acceptors:
            if shedder is not None:
                acceptor.publish(capacity=shedder.capacity(), shedding=shedder.shedding(),
                                 last_refusal=shedder.last_refusal)
            answered, timed_out, refused = acceptor.counts()
            with self.lock:
                self.closed["shed"] += answered
                self.closed["header_timeout"] += timed_out
            if shedder is not None:
                for route, n in refused.items():
                    shedder.refused_elsewhere(route, n)

    def at_request_line(self, proto: Any, data: bytes) -> str | None:
        """:meth:`line_decision` for the first data of ``proto``'s connection (a line in pieces:
        the normal path decides)."""
        proto.line_seen = True
        decision = self.line_decision(data, self.late(proto, data))
        proto.held = decision == "held"
        return decision

    def late(self, proto: Any, data: bytes) -> bool:
        """The acceptor's ``max_accept_wait`` rule, for a connection it passed over undecided: during
        a flood, a POST whose bytes waited longer than that before the loop read them is shed."""
        shedder = self.shedder
        if (self.max_accept_wait is None or shedder is None or not data.startswith(b"POST ")
                or not shedder.flooded(self.held)):
            return False
        sock = proto.transport.get_extra_info("socket")
        return sock is not None and waited(sock) > self.max_accept_wait


    def count_closed(self, reason: str) -> None:
        with self.lock:
            self.closed[reason] += 1

    def answer_shed(self, proto: Any) -> None:
        """Answer ``proto``'s connection 429 and close it (lingering: the client gets the answer)."""
        proto.shed = True
        self.count_closed("shed")
        assert self.shedder is not None
        proto.transport.write(self.shedder.raw_response())
        proto.transport.close()  # a lingering close (LingeringClose)

    def release(self, proto: Any) -> None:
        """``proto``'s first request was answered or its connection lost: it no longer counts."""
        if proto.held:
            proto.held = False
            self.release_held()

    def release_held(self) -> None:
        """A request let through at its request line was answered, or never served."""
        with self.lock:
            self.held -= 1
            self._publish_held()

    def _arm(self, proto: Any, seen_cycle: Any, was_busy: bool) -> None:
        """Check in ``header_timeout`` seconds that ``proto`` started a request since ``seen_cycle``."""
        proto.loop.call_later(self.header_timeout, self._check, proto, seen_cycle, was_busy)

    def _check(self, proto: Any, seen_cycle: Any, was_busy: bool) -> None:
        if proto not in self.open:
            return  # closed meanwhile
        if self.upgraded(proto):  # its connection_lost goes to the WebSocket protocol, not ours:
            if proto.transport.is_closing():
                self.open.pop(proto, None)  # the session ended
            else:
                self._arm(proto, proto.cycle, True)  # look again later
            return
        cycle = proto.cycle
        busy = self.busy(proto)
        if busy or was_busy or cycle is not seen_cycle:
            self._arm(proto, cycle, busy)  # a request came or runs: a full period for the next head
            return
        self.open.pop(proto, None)
        self.count_closed("header_timeout")
        proto.transport.close()

    def counters(self) -> dict[str, tuple[str, dict[tuple[tuple[str, str], ...], int]]]:
        """For ``/metrics`` (the ``extra_counters`` shape); the acceptors' counts folded in first."""
        self.refresh()
        return {"trio_orch_http_connections_closed": (
            "connections the server closed itself: idle ones evicted at the connection limit, new ones "
            "refused with 503 when all were busy, ones that sent no complete request head in time, "
            "ones answered 429 at their request line while the engine shed",
            {(("reason", k),): n for k, n in sorted(self.closed.items())})}
