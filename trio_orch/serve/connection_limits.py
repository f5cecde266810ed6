"""What uvicorn does not do itself: RFC 9112 framing, a lingering close, a deadline for the request head,
the fd limit, quiet log floods.

* :class:`FrontH11Protocol` is uvicorn's H11 protocol on
  :class:`~trio_orch.serve.framing.StrictConnection` (the framing rules the
  lean server keeps too: 400 and a close for Content-Length with
  Transfer-Encoding, 505 for an unknown HTTP version, 431 for a head over the
  limit however it arrived), answering those refusals as the app answers
  (OpenAI's JSON error) where uvicorn would write a plain-text 400.  Its
  close lingers: our side ends, the client's input is read and dropped for a
  moment (:data:`~trio_orch.serve.framing.LINGER_SECONDS`), then the socket
  closes -- a close with input unread is a reset, and a client still sending
  (a body announced over the limit) would lose its 413 with it.  An idle
  connection (the keep-alive timeout, the head deadline, a shutdown between
  requests) has no answer at stake and closes at once, as on the lean server.

* :class:`HeadDeadline` makes uvicorn's H11 protocol close a connection that
  has not sent a complete request head within ``timeout`` seconds of
  connecting or of its previous answer.  uvicorn's own ``timeout_keep_alive``
  starts only after a first answer and stops at the first byte of the next
  request, so without it a client that connects and says nothing, or drips
  a head a byte at a time (slowloris), holds its socket forever.  It is the
  one place this package leans on uvicorn's protocol (``cycle``,
  ``on_response_complete``), so ``pyproject.toml`` pins uvicorn to the
  range it is tested with.
* :func:`default_max_connections` raises the soft file-descriptor limit and
  leaves room for everything but connections (uvicorn's
  ``limit_concurrency`` by default).
* :func:`quiet_floods` rate-limits the accept-error lines logged when the
  process runs out of file descriptors.
"""

from __future__ import annotations

import asyncio
import logging
import resource
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from trio_orch.http.logs import RateLimitFilter
from trio_orch.serve.framing import LINGER_BYTES, LINGER_SECONDS, StrictConnection, error_answer, error_code

__all__ = ["FrontH11Protocol", "HeadDeadline", "default_max_connections", "quiet_floods"]

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


class LingeringTransport:
    """An asyncio transport whose ``close`` lingers (see the module docstring); the rest is the transport's.

    Only while its protocol is the HTTP one: once a WebSocket took the
    connection over, a close is the plain one.
    """

    def __init__(self, transport: asyncio.Transport, protocol: FrontH11Protocol) -> None:
        self.transport = transport
        self.protocol = protocol
        self.lingering = False
        self.dropped = 0
        self.linger = True  #: whether a close lingers (not once the connection is idle)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.transport, name)

    def is_closing(self) -> bool:
        return self.lingering or self.transport.is_closing()

    def close(self) -> None:
        real = self.transport
        if self.lingering or real.is_closing():
            return
        if not self.linger or real.get_protocol() is not self.protocol or not real.can_write_eof():
            real.close()
            return
        self.lingering = True
        real.write_eof()  # after what is buffered: the answer goes first
        real.resume_reading()
        self.protocol.loop.call_later(LINGER_SECONDS, real.close)

    def drop(self, data: bytes) -> None:
        """Input that came while lingering: dropped, within :data:`LINGER_BYTES`."""
        self.dropped += len(data)
        if self.dropped > LINGER_BYTES:
            self.transport.close()


class FrontH11Protocol(H11Protocol):
    """uvicorn's H11 protocol with the framing rules and the lingering close of the module docstring."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.conn = StrictConnection(self.config.h11_max_incomplete_event_size or (64 << 10))

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(LingeringTransport(transport, self))  # type: ignore[arg-type]

    def data_received(self, data: bytes) -> None:
        transport = self.transport
        if isinstance(transport, LingeringTransport) and transport.lingering:
            transport.drop(data)
            return
        super().data_received(data)

    def close_idle(self) -> None:
        """Close at once: no request is in progress, no answer at stake."""
        try:
            self.conn.send(h11.ConnectionClosed())  # as uvicorn's own closes of an idle connection
        except h11.LocalProtocolError:
            pass
        if isinstance(self.transport, LingeringTransport):
            self.transport.linger = False
        self.transport.close()

    def shutdown(self) -> None:
        if self.cycle is None or self.cycle.response_complete:
            self.close_idle()
        else:
            super().shutdown()

    def timeout_keep_alive_handler(self) -> None:
        if not self.transport.is_closing():
            self.close_idle()

    def send_400_response(self, msg: str) -> None:
        """The refusal of a malformed head, as the lean server answers it; the connection closes."""
        refusal = self.conn.refusal if isinstance(self.conn, StrictConnection) else None
        status = refusal.error_status_hint if refusal is not None else 400
        self.transport.write(error_answer(status, f"malformed request: {refusal or msg}", error_code(status)))
        self.transport.close()


class HeadDeadline:
    """The request-head deadline of one uvicorn server, and how many connections it closed."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self.closed = 0  #: connections closed for not sending a complete request head in time

    def protocol_class(self) -> type[FrontH11Protocol]:
        """The front's H11 protocol with this deadline (uvicorn's ``http`` setting)."""
        deadline = self

        class HeadDeadlineH11Protocol(FrontH11Protocol):
            def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
                super().connection_made(transport)
                deadline.arm(self)

            def on_response_complete(self) -> None:
                super().on_response_complete()
                deadline.arm(self)

        return HeadDeadlineH11Protocol

    def arm(self, proto: Any) -> None:
        """In ``timeout`` seconds, close ``proto``'s connection unless a request started since now."""
        proto.loop.call_later(self.timeout, self.check, proto, proto.cycle)

    def check(self, proto: Any, seen: Any) -> None:
        transport = proto.transport
        if transport is None or transport.is_closing() or transport.get_protocol() is not proto:
            return  # closed meanwhile, or a WebSocket now (its own protocol, its own timeouts)
        if proto.cycle is not seen or (seen is not None and not seen.response_complete):
            return  # a request came (or still runs): its answer arms the next deadline
        self.closed += 1
        proto.close_idle()

    def counters(self) -> dict[str, tuple[str, dict[tuple[tuple[str, str], ...], int]]]:
        """For ``/metrics`` (the ``extra_counters`` shape)."""
        return {"trio_orch_http_connections_closed": (
            "connections the server closed itself because their request head did not arrive in time",
            {(("reason", "header_timeout"),): self.closed})}
