"""The lean server's accept loop, connection limit and graceful drain.

:func:`serve` accepts on a listening socket the caller made (the serve
command listens before the engine starts, so connections queue meanwhile)
and runs one :class:`~.connection.HTTPConnection` task per connection in a
nursery of its own.  Past ``max_connections`` open connections, a new one
is still accepted, but its request is answered 503 and it is closed: a
refusal the client can read, not a stall in the kernel's queue.

Shutdown, as uvicorn do it: when ``shutdown_trigger()`` returns, the accept
loop stops and the listening socket is closed (``on_listener_closed`` runs
then: the serve command answers what is still queued on a duplicate of it,
:mod:`trio_orch.serve.listener`), connections waiting idle for a next
request are closed at once, responses in flight may finish -- each
connection closes after its answer -- until ``graceful_timeout`` seconds
have passed, set as the deadline of the connection nursery's cancel scope;
then what is left is cancelled.  Every socket is closed by its task's
``finally``: nothing outlives :func:`serve`.
"""

from __future__ import annotations

import errno
import logging
import socket
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from trio_orch.http.logs import RateLimitFilter
from trio_orch.serve.trio_http.config import ServerState
from trio_orch.serve.trio_http.connection import ASGIApp, HTTPConnection
from trio_orch.serve.trio_http.transport import Transport

__all__ = ["serve"]

log = logging.getLogger("trio_orch.serve.trio_http")
log.addFilter(RateLimitFilter(("accept: ",)))  # out of file descriptors: one line per 10 s, with a count

#: accept errors that mean "out of a resource for now": pause, then accept again
_RESOURCE_ERRORS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
_RESOURCE_PAUSE = 0.1


async def serve(app: ASGIApp, sock: socket.socket, state: ServerState | None = None, *,
                shutdown_trigger: Callable[[], Awaitable[Any]] | None = None,
                on_listener_closed: Callable[[], Awaitable[Any]] | None = None,
                task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED) -> None:
    """Serve ``app`` on the listening ``sock`` until ``shutdown_trigger()`` returns, then drain.

    ``task_status`` gets the URL served once accepting.  ``state`` (made
    here with the default limits if not given) holds the limits, the
    draining flag, the open connections and the counters.  ``sock`` is
    closed on return.
    """
    state = state if state is not None else ServerState()
    listener = trio.socket.from_stdlib_socket(sock)
    try:
        async with trio.open_nursery() as connections:
            with trio.CancelScope() as accepting:
                host, port = sock.getsockname()[:2]
                task_status.started([f"http://{host}:{port}"])

                async def wait_for_shutdown() -> None:
                    if shutdown_trigger is None:
                        await trio.sleep_forever()
                    await shutdown_trigger()
                    accepting.cancel()

                connections.start_soon(wait_for_shutdown)
                await _accept(app, listener, state, connections)
            # the drain
            state.draining = True
            listener.close()
            if on_listener_closed is not None:
                connections.start_soon(on_listener_closed)
            for conn in list(state.connections):
                conn.close_if_idle()
            connections.cancel_scope.deadline = trio.current_time() + state.graceful_timeout
    finally:
        listener.close()


async def _accept(app: ASGIApp, listener: trio.socket.SocketType, state: ServerState,
                  nursery: trio.Nursery) -> None:
    limit = state.limits.max_connections
    while True:
        try:
            sock, _ = await listener.accept()
        except OSError as exc:
            if exc.errno in _RESOURCE_ERRORS:
                log.error("accept: %s; pausing %gs", exc, _RESOURCE_PAUSE)
                await trio.sleep(_RESOURCE_PAUSE)
            continue  # ECONNABORTED and the like: that client is gone already
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError:
            pass
        refuse = limit is not None and len(state.connections) >= limit
        conn = HTTPConnection(app, Transport(sock), state, refuse=refuse)
        state.connections.add(conn)
        nursery.start_soon(_run, conn, state, name=f"trio_http connection {conn.client}")


async def _run(conn: HTTPConnection, state: ServerState) -> None:
    try:
        await conn.run()
    finally:
        state.connections.discard(conn)
