"""Serving the app with uvicorn: connection limits, slow-header timeouts, drain on a signal.

Everything uvicorn-specific lives here (the app itself is server-neutral):

* :class:`ConnectionLimiter` and the H11 protocol subclass it makes hold the
  number of open connections at ``max_connections``.  When a new
  connection would pass it, the oldest connection that is idle (no request
  in progress) and has been open for at least ``min_idle`` seconds is
  closed to make room; if there is none (a burst of fresh connections, or
  every connection busy) the new one gets a plain ``503`` and is closed.  Idle sockets can
  therefore never use up the file descriptors a real request needs.  A
  connection that has not sent a complete request head within
  ``header_timeout`` seconds of connecting (or of its previous answer) is
  closed: a slow-header client cannot hold a socket forever.  uvicorn's own
  ``timeout_keep_alive`` closes idle keep-alive connections.
* :class:`DrainingServer` takes over SIGINT and SIGTERM from uvicorn: the
  first calls ``on_signal`` (the serve command starts its drain), a second
  ends the drain at once, a third exits without waiting.
* :func:`quiet_floods` rate-limits the accept-error lines asyncio logs when
  the process runs out of file descriptors.
"""

from __future__ import annotations

import asyncio
import json
import logging
import resource
import signal
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

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
    for name in ("asyncio", "uvicorn.error"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, RateLimitFilter) for f in logger.filters):
            logger.addFilter(flt)


class ConnectionLimiter:
    """Open connections of one server, oldest first; see the module docstring.  Event loop only."""

    def __init__(self, max_connections: int, header_timeout: float, min_idle: float = 1.0) -> None:
        self.max_connections = max_connections
        self.header_timeout = header_timeout
        self.min_idle = min(min_idle, header_timeout)
        self.open: OrderedDict[Any, float] = OrderedDict()  # connection -> when it was opened
        self.closed: dict[str, int] = {"idle_evicted": 0, "refused": 0, "header_timeout": 0, "shed": 0}
        #: the app's shed decision (``uvicorn_config`` sets it): a fresh connection whose request
        #: line is a POST to a shed path gets its 429 before any HTTP parsing
        self.shedder: Shedder | None = None

    def protocol_class(self) -> type[H11Protocol]:
        """An ``H11Protocol`` subclass bound to this limiter (uvicorn's ``http`` setting)."""
        limiter = self

        class LimitedH11Protocol(H11Protocol):
            def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
                super().connection_made(transport)
                limiter.opened(self)

            def connection_lost(self, exc: Exception | None) -> None:
                limiter.open.pop(self, None)
                super().connection_lost(exc)

            shed = False  # answered 429 at its request line: what the client sends after is dropped

            def data_received(self, data: bytes) -> None:
                if self.shed:
                    return
                if self.cycle is None and limiter.shed_early(self, data):
                    self.shed = True
                    return
                super().data_received(data)

        return LimitedH11Protocol

    @staticmethod
    def busy(proto: Any) -> bool:
        cycle = proto.cycle
        return cycle is not None and not cycle.response_complete

    def opened(self, proto: Any) -> None:
        now = proto.loop.time()
        if len(self.open) >= self.max_connections:
            old_enough = now - self.min_idle
            victim = None
            for p, t_open in self.open.items():  # oldest first
                if t_open > old_enough:
                    break
                if not self.busy(p):
                    victim = p
                    break
            if victim is None:
                self.refuse(proto)
                return
            self.open.pop(victim, None)
            self.closed["idle_evicted"] += 1
            victim.transport.close()
        self.open[proto] = now
        self._arm(proto, proto.cycle, False)

    def refuse(self, proto: Any) -> None:
        self.closed["refused"] += 1
        body = json.dumps({"error": {"message": f"the server is at its limit of {self.max_connections} "
                                                "connections, none idle; retry later",
                                     "type": "server_error", "param": None, "code": "too_many_connections"}})
        head = (f"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
                f"content-length: {len(body)}\r\nretry-after: 1\r\nconnection: close\r\n\r\n")
        proto.transport.write(head.encode() + body.encode())
        proto.transport.close()

    def shed_early(self, proto: Any, data: bytes) -> bool:
        """Answer a connection's first request with the shedder's 429 if its request line says so.

        Only the request line is looked at (``POST /path``): no headers parsed,
        no body read.  The answer is followed by a half-close (FIN after it),
        not a full close: a close with the body still unread would reset the
        connection and the client could lose the answer.  What it sends after
        is dropped; the header timeout closes the socket if the client does not.
        """
        shedder = self.shedder
        if shedder is None or not data.startswith(b"POST "):
            return False
        end = data.find(b" ", 5)
        if end < 0:
            return False  # a request line in pieces: the normal path decides
        route = data[5:end].split(b"?", 1)[0].decode("latin-1")
        if not shedder.refuse(route):
            return False
        self.closed["shed"] += 1
        transport = proto.transport
        transport.write(shedder.raw_response())
        if transport.can_write_eof():
            transport.write_eof()
        else:
            transport.close()
        return True

    def _arm(self, proto: Any, seen_cycle: Any, was_busy: bool) -> None:
        """Check in ``header_timeout`` seconds that ``proto`` started a request since ``seen_cycle``."""
        proto.loop.call_later(self.header_timeout, self._check, proto, seen_cycle, was_busy)

    def _check(self, proto: Any, seen_cycle: Any, was_busy: bool) -> None:
        if proto not in self.open:
            return  # closed meanwhile
        cycle = proto.cycle
        busy = self.busy(proto)
        if busy or was_busy or cycle is not seen_cycle:
            self._arm(proto, cycle, busy)  # a request came or runs: a full period for the next head
            return
        self.open.pop(proto, None)
        self.closed["header_timeout"] += 1
        proto.transport.close()

    def counters(self) -> dict[str, tuple[str, dict[tuple[tuple[str, str], ...], int]]]:
        """For ``/metrics`` (the ``extra_counters`` shape)."""
        return {"trio_orch_http_connections_closed": (
            "connections the server closed itself: idle ones evicted at the connection limit, new ones "
            "refused with 503 when all were busy, ones that sent no complete request head in time, "
            "ones answered 429 at their request line while the engine shed",
            {(("reason", k),): n for k, n in sorted(self.closed.items())})}


class DrainingServer(uvicorn.Server):
    """A uvicorn server whose SIGINT/SIGTERM handling is ``on_signal(signum)``.

    uvicorn would stop accepting and give connections a fixed grace period;
    the serve command instead keeps answering (``/health`` says draining)
    while in-flight requests finish, then sets ``should_exit`` itself.
    """

    def __init__(self, config: uvicorn.Config, on_signal: Callable[[int], None]) -> None:
        super().__init__(config)
        self.on_signal = on_signal

    def handle_exit(self, sig: int, frame: Any) -> None:
        self.on_signal(sig)


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
