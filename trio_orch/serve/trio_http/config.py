"""The lean server's settings (the serve command's HTTP limits) and the state its connections share."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from trio_orch.http.limits import HTTPLimits

if TYPE_CHECKING:
    from trio_orch.serve.trio_http.connection import HTTPConnection

__all__ = ["LeanConfig", "ServerState"]


@dataclass(frozen=True)
class LeanConfig:
    """What the server enforces itself; the body limits and timeouts stay with the app's middleware."""

    max_head_bytes: int = 64 << 10  #: request line and headers, else 431
    header_timeout: float = 10.0  #: a complete head within this long of connecting or of the last answer
    keep_alive_timeout: float = 5.0  #: an idle kept-alive connection (no byte of a next request) is closed
    max_message_bytes: int = 4 << 20  #: a WebSocket message, else close 1009
    max_connections: int | None = None  #: past it a new connection is answered 503 and closed
    graceful_timeout: float = 5.0  #: on shutdown, how long in-flight responses may still take
    #: a body the app did not read, read and dropped after its answer to keep the connection (else closed)
    max_drain_bytes: int = 1 << 20

    @classmethod
    def from_limits(cls, limits: HTTPLimits, *, graceful_timeout: float = 5.0) -> LeanConfig:
        return cls(max_head_bytes=limits.max_head_bytes, header_timeout=limits.header_timeout,
                   keep_alive_timeout=limits.keep_alive_timeout, max_message_bytes=limits.max_body_bytes,
                   max_connections=limits.max_connections, graceful_timeout=graceful_timeout)


@dataclass
class ServerState:
    """One server's shared state: its settings, whether it drains, its connections and counters."""

    config: LeanConfig
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
