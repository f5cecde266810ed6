"""``serve --loop asyncio``: the app under uvicorn, the serve flags as uvicorn's settings, drain on a signal.

Everything uvicorn-specific lives here and in
:mod:`trio_orch.serve.connection_limits` (the app itself is server-neutral).
:func:`uvicorn_config` maps the HTTP limits to uvicorn's own settings:
``max_connections`` -> ``limit_concurrency`` (past it a new request gets
uvicorn's 503), ``backlog`` -> ``backlog``, ``keep_alive_timeout`` ->
``timeout_keep_alive``, ``max_head_bytes`` -> ``h11_max_incomplete_event_size``,
``max_body_bytes`` -> ``ws_max_size`` (a WebSocket frame, as hypercorn's front does);
``header_timeout`` is the :class:`~trio_orch.serve.connection_limits.HeadDeadline`
on its H11 protocol.  :class:`DrainingServer` takes over SIGINT and SIGTERM
from uvicorn: each calls ``on_signal`` (the serve command drains on the
first, ends the drain on the second, exits on the third).  When uvicorn
stops it closes its listening sockets; the connections still queued on them
are answered 503 ``draining`` first rather than reset
(:mod:`trio_orch.serve.listener`), and a new connection is refused from then on.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable
from typing import Any

import uvicorn

from trio_orch.http.limits import HTTPLimits
from trio_orch.serve.connection_limits import HeadDeadline
from trio_orch.serve.listener import close_spare, spare

__all__ = ["DrainingServer", "uvicorn_config"]


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

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        """uvicorn's shutdown, with the connections queued on its listeners answered, not reset."""
        spares = [spare(s) for s in sockets or []]

        def close_spares() -> None:
            for s in spares:
                close_spare(s)

        for server in self.servers:
            server.close()  # stop accepting now (uvicorn's own close is then a no-op)
        answering = asyncio.ensure_future(asyncio.to_thread(close_spares))
        # A connection accepted a moment ago has its request unread: uvicorn's shutdown would close it
        # so, and a close with unread input is a reset.  Let the requests be read (and answered) first.
        await asyncio.sleep(0.05)
        try:
            await super().shutdown(sockets)
        finally:
            await answering


def uvicorn_config(app: Any, limits: HTTPLimits, deadline: HeadDeadline, *, max_connections: int | None,
                   log_level: str, shutdown_grace: float = 5.0) -> uvicorn.Config:
    """uvicorn's settings for ``limits`` (see the module docstring); no lifespan, no server header."""
    return uvicorn.Config(app, http=deadline.protocol_class(), log_level=log_level, lifespan="off",
                          limit_concurrency=max_connections, backlog=limits.backlog,
                          timeout_keep_alive=limits.keep_alive_timeout,  # type: ignore[arg-type]  # a float is fine
                          h11_max_incomplete_event_size=limits.max_head_bytes, server_header=False,
                          ws_max_size=limits.max_body_bytes,
                          timeout_graceful_shutdown=max(1, round(shutdown_grace)))
