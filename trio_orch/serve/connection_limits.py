"""What uvicorn does not do itself: a deadline for the request head, the fd limit, quiet log floods.

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

from uvicorn.protocols.http.h11_impl import H11Protocol

from trio_orch.http.logs import RateLimitFilter

__all__ = ["HeadDeadline", "default_max_connections", "quiet_floods"]

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


class HeadDeadline:
    """The request-head deadline of one uvicorn server, and how many connections it closed."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self.closed = 0  #: connections closed for not sending a complete request head in time

    def protocol_class(self) -> type[H11Protocol]:
        """uvicorn's H11 protocol with this deadline (uvicorn's ``http`` setting)."""
        deadline = self

        class HeadDeadlineH11Protocol(H11Protocol):
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
        transport.close()

    def counters(self) -> dict[str, tuple[str, dict[tuple[tuple[str, str], ...], int]]]:
        """For ``/metrics`` (the ``extra_counters`` shape)."""
        return {"trio_orch_http_connections_closed": (
            "connections the server closed itself because their request head did not arrive in time",
            {(("reason", "header_timeout"),): self.closed})}
