"""Serving the app with uvicorn: connection limits, slow-header timeouts, drain on a signal.

Everything uvicorn-specific lives here (the app itself is server-neutral):

* :class:`ConnectionLimiter` and the H11 protocol subclass it makes hold the
  number of open connections at ``max_connections``.  When a new
  connection would pass it, the oldest connection that is idle (no request
  in progress) and has been open for at least ``min_idle`` seconds is
  closed to make room; if there is none (a burst of fresh connections, or
  every connection busy) the new one gets a plain ``503`` and is closed.
  Idle sockets can therefore never use up the file descriptors a real
  request needs.  A
  connection that has not sent a complete request head within
  ``header_timeout`` seconds of connecting (or of its previous answer) is
  closed: a slow-header client cannot hold a socket forever.  uvicorn's own
  ``timeout_keep_alive`` closes idle keep-alive connections.  The limiter
  also makes the request-line decision of the shedder (``line_decision``)
  and counts the requests it let through (``held``).
* :class:`LingeringClose` wraps each connection's transport: a close sends
  FIN after the answer and drops what the client still sends, so unread
  request bytes never turn into a reset that loses the answer.
* :class:`DrainingServer` takes over SIGINT and SIGTERM from uvicorn: the
  first calls ``on_signal`` (the serve command starts its drain), a second
  ends the drain at once, a third exits without waiting.  It accepts through
  an :class:`~trio_orch.acceptor.AcceptorProcess` instead of the event loop
  (falling back to the loop if that process dies).
* :func:`quiet_floods` rate-limits the accept-error lines logged when the
  process runs out of file descriptors.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import resource
import signal
import socket
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from trio_orch.acceptor import AcceptorProcess, shed_route, waited
from trio_orch.http_limits import HTTPLimits, RateLimitFilter, Shedder

__all__ = ["ConnectionLimiter", "DrainingServer", "default_max_connections", "quiet_floods", "uvicorn_config"]

log = logging.getLogger("trio_orch.server")

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
        self.max_accept_wait = max_accept_wait  #: see :class:`~trio_orch.acceptor.Acceptor` ``max_wait``
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

        Only the request line is looked at (:func:`~trio_orch.acceptor.shed_route`).
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


class DrainingServer(uvicorn.Server):
    """A uvicorn server whose SIGINT/SIGTERM handling is ``on_signal(signum)``, accepting through
    an :class:`~trio_orch.acceptor.AcceptorProcess`.

    uvicorn would stop accepting and give connections a fixed grace period;
    the serve command instead keeps answering (``/health`` says draining)
    while in-flight requests finish, then sets ``should_exit`` itself.  With
    a ``limiter``, each listening socket it is given is accepted on by an
    acceptor process (under a flood, refusals cost a few system calls in a
    process of their own, at a low CPU priority); the connections it
    passes over get uvicorn's protocol here, and uvicorn shuts them down as
    usual.  Every ``refresh`` seconds the limiter gives the acceptors the
    engine's numbers.  Should an acceptor die, this process accepts on the
    socket itself (the event loop's accept, the limiter's checks).
    """

    def __init__(self, config: uvicorn.Config, on_signal: Callable[[int], None],
                 limiter: ConnectionLimiter | None = None, *, acceptor_nice: int = 10,
                 refresh: float = 0.01) -> None:
        super().__init__(config)
        self.on_signal = on_signal
        self.limiter = limiter
        self.acceptor_nice = acceptor_nice
        self.refresh = refresh
        self.acceptors: list[AcceptorProcess] = []
        self._handovers: set[asyncio.Task[Any]] = set()
        self._refresher: asyncio.TimerHandle | None = None
        self._stopping = False

    def handle_exit(self, sig: int, frame: Any) -> None:
        self.on_signal(sig)

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        limiter = self.limiter
        if limiter is None or not sockets:
            await super().startup(sockets)
            return
        await super().startup([])  # uvicorn's state without a listener of its own
        loop = asyncio.get_running_loop()
        shedder = limiter.shedder
        for sock in sockets:
            acceptor = AcceptorProcess(
                sock, paths=sorted(shedder.paths) if shedder else [],
                response=shedder.raw_response() if shedder else b"", header_timeout=limiter.header_timeout,
                max_wait=limiter.max_accept_wait, nice=self.acceptor_nice)
            self.acceptors.append(acceptor)
            limiter.acceptors.append(acceptor)
            limiter.refresh()  # its board shows the engine's numbers before it decides anything
            acceptor.start()
            assert acceptor.channel is not None
            loop.add_reader(acceptor.channel.fileno(), self._take_over, loop, acceptor)
        self._refresher = loop.call_later(self.refresh, self._tick, loop)

    def _tick(self, loop: asyncio.AbstractEventLoop) -> None:
        assert self.limiter is not None
        self.limiter.refresh()
        self._refresher = loop.call_later(self.refresh, self._tick, loop)

    def _take_over(self, loop: asyncio.AbstractEventLoop, acceptor: AcceptorProcess) -> None:
        """The acceptor passed connections over: serve them, with its decisions."""
        assert self.limiter is not None
        for conn, decision in acceptor.received():
            self.limiter.took_over(acceptor, decision)
            self._serve_connection(loop, conn, decision)
        if acceptor.lost:
            assert acceptor.channel is not None
            loop.remove_reader(acceptor.channel.fileno())
            if not self._stopping:
                task = loop.create_task(self._accept_here(acceptor))
                self._handovers.add(task)
                task.add_done_callback(self._handovers.discard)

    async def _accept_here(self, acceptor: AcceptorProcess) -> None:
        """The acceptor process died: accept on its socket in this process (the loop's accept)."""
        sock = acceptor.sock
        code = None if acceptor.proc is None else acceptor.proc.poll()
        await asyncio.to_thread(acceptor.stop)  # its board stays: what it counted is still folded
        log.error("the acceptor process exited (%s); accepting on the event loop instead", code)
        loop = asyncio.get_running_loop()
        config = self.config

        def make_protocol() -> asyncio.Protocol:
            return config.http_protocol_class(  # type: ignore[call-arg]
                config=config, server_state=self.server_state, app_state=self.lifespan.state, _loop=loop)

        self.servers.append(await loop.create_server(make_protocol, sock=sock, backlog=config.backlog))

    def _serve_connection(self, loop: asyncio.AbstractEventLoop, conn: socket.socket,
                          decision: str | None) -> None:
        """Give an accepted connection uvicorn's protocol, with the acceptor's request-line decision."""
        config = self.config
        made: list[Any] = []

        def make_protocol() -> asyncio.Protocol:
            proto = config.http_protocol_class(  # type: ignore[call-arg]
                config=config, server_state=self.server_state, app_state=self.lifespan.state, _loop=loop)
            proto.spoke = decision != "silent"  # type: ignore[attr-defined]
            if decision in ("held", "shed"):
                proto.line_seen = True  # type: ignore[attr-defined]
                proto.held = decision == "held"  # type: ignore[attr-defined]
                proto.shed_on_open = decision == "shed"  # type: ignore[attr-defined]
            made.append(proto)
            return proto

        task = loop.create_task(loop.connect_accepted_socket(make_protocol, conn))
        self._handovers.add(task)

        def done(t: asyncio.Task[Any]) -> None:
            self._handovers.discard(t)
            if t.cancelled() or t.exception() is not None:
                conn.close()
                assert self.limiter is not None
                if not made and decision == "held":  # counted at the hand-over, never served
                    self.limiter.release_held()
                for proto in made:
                    self.limiter.release(proto)

        task.add_done_callback(done)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self._stopping = True
        if self._refresher is not None:
            self._refresher.cancel()
        loop = asyncio.get_running_loop()
        for acceptor in self.acceptors:
            if acceptor.channel is not None:
                loop.remove_reader(acceptor.channel.fileno())
            await asyncio.to_thread(acceptor.stop)
        if self.limiter is not None:
            self.limiter.refresh()  # the last of their counts
            self.limiter.acceptors.clear()
        for acceptor in self.acceptors:
            acceptor.close()
        await super().shutdown(sockets)


def uvicorn_config(app: Any, limits: HTTPLimits, limiter: ConnectionLimiter, *, log_level: str,
                   shutdown_grace: float = 5.0) -> uvicorn.Config:
    """uvicorn's settings for ``limits``: keep-alive timeout, our H11 protocol, no lifespan.

    The limiter takes the app's shedder (``app.state.shedder``, if it has one) so
    that it can refuse at the request line.
    """
    state = getattr(app, "state", None)
    limiter.shedder = getattr(state, "shedder", None)
    return uvicorn.Config(app, http=limiter.protocol_class(), log_level=log_level, lifespan="off",
                          timeout_keep_alive=max(1, round(limits.keep_alive_timeout)),
                          timeout_graceful_shutdown=max(1, round(shutdown_grace)))


def signal_name(signum: int) -> str:
    return signal.Signals(signum).name
