"""What the lean server's connections share: the serve command's HTTP limits, the drain, the counters.

The server applies the connection limits of :class:`~trio_orch.http.limits.HTTPLimits`
itself, read as they are -- ``max_head_bytes`` (431 past it),
``header_timeout`` (a complete head within that long of connecting or of the
last answer), ``keep_alive_timeout`` (an idle kept-alive connection is
closed), ``max_connections`` (past it a new connection is answered 503),
``max_body_bytes`` as the WebSocket message limit (1009) -- so no second
table of settings stands between a ``serve`` flag and what it limits.  The
body limits and timeouts stay with the app's middleware.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from trio_orch.http.limits import HTTPLimits

if TYPE_CHECKING:
    from trio_orch.serve.trio_http.connection import HTTPConnection

__all__ = ["MAX_DRAIN_BYTES", "ServerState"]

#: a body the app did not read is read and dropped after its answer, up to this much, to keep the
#: connection (a longer one closes it)
MAX_DRAIN_BYTES = 1 << 20


@dataclass
class ServerState:
    """One server's shared state: its limits, how long a drain lets answers finish, whether it drains,
    its connections and counters."""

    limits: HTTPLimits = field(default_factory=HTTPLimits)
    graceful_timeout: float = 5.0  #: on shutdown, how long in-flight responses may still take
    draining: bool = False
    connections: set[HTTPConnection] = field(default_factory=set)
    header_timeouts: int = 0  #: connections closed because their request head did not arrive in time
    bad_requests: int = 0  #: connections answered 400 or 431 and closed
    refused: int = 0  #: connections answered 503 past ``max_connections``
    websockets: int = 0  #: WebSocket sessions open now

    def counters(self) -> dict[str, tuple[str, dict[tuple[tuple[str, str], ...], Any]]]:
        """For ``/metrics`` (the app's ``extra_metrics`` shape, as the asyncio front's head deadline)."""
        return {"trio_orch_http_connections_closed": (
            "connections the server closed itself because their request head did not arrive in time",
            {(("reason", "header_timeout"),): self.header_timeouts})}
