"""``serve --loop trio``: the HTTP app and the orchestrator in one Trio run, on the lean server or hypercorn.

One Trio run, one root nursery: the engine task (pipeline, worker pools,
orchestrator: :class:`~trio_orch.engine.trio_engine.TrioEngine`), the HTTP
server serving the Starlette app (which runs on AnyIO's Trio backend) and
the signal watcher.  No thread sits between a request handler and the
orchestrator: a request is admitted by a function call and each dispatcher
batch wakes the handler's task directly.  A client that disconnects
cancels its handler's scope (the request is aborted on every stage); a hard
stop is one cancel of the root nursery.

The server (``serve --http-server``): ``lean`` (default) is
:mod:`trio_orch.serve.trio_http`, h11 for parsing and a write path with no
checkpoint per streamed chunk when the socket takes the bytes (hypercorn's
Trio worker costs about four times uvicorn's CPU per streamed request; this
one about uvicorn's); ``hypercorn`` is hypercorn's Trio worker, kept
selectable.  :func:`server_config` gives either its settings, and
:func:`serve_http` serves with the one its config names.

Drain, as the threaded front does it: the first SIGINT/SIGTERM stops
accepting work (``/health`` and new requests answer 503 ``draining``),
lets in-flight requests finish for up to ``shutdown_timeout`` seconds,
gives the rest their ``shutdown`` terminal and stops the workers; then the
HTTP server shuts down the hypercorn way (stop accepting, idle connections
closed, a deadline of ``graceful_timeout`` on its connection nursery's
cancel scope), its listener closed at once -- the connections still queued
on it answered 503 ``draining`` rather than reset
(:mod:`trio_orch.serve.listener`), a new one refused from then on.  A second
signal ends the drain at once; a third cancels everything.

The HTTP limits on the lean server (:class:`~trio_orch.serve.trio_http.LeanConfig`):
``max_head_bytes`` (431 past it), ``header_timeout`` (a complete head within
that long of connecting or of the previous answer), ``keep_alive_timeout``
(idle between requests), ``max_connections`` (past it a new connection is
answered 503), ``max_body_bytes`` as the WebSocket message limit (1009);
``backlog`` is the serve command's listen call.  On hypercorn
(:func:`hypercorn_config`): ``backlog`` -> ``backlog``, ``max_head_bytes`` ->
``h11_max_incomplete_size``, ``keep_alive_timeout`` and ``header_timeout``
-> ``keep_alive_timeout``: hypercorn's idle timer closes a connection with
no request in progress -- including one that has not finished its request
head -- so a slow head is closed after the smaller of the two.
``read_timeout`` stays off: hypercorn applies it to every read, so it would
also cut a streamed answer or a WebSocket session whose client sends
nothing for that long.  hypercorn has no connection-count limit, so
``--max-connections`` is refused with ``--http-server hypercorn``
(see docs/operating.md).
"""

from __future__ import annotations

import logging
import signal
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import trio
from hypercorn.config import Config, Sockets
from hypercorn.trio.run import worker_serve
from hypercorn.utils import wrap_app

from trio_orch.engine import EngineStartupError, TrioEngine
from trio_orch.http.limits import HTTPLimits
from trio_orch.http.metrics import FrontMetrics
from trio_orch.serve import trio_http
from trio_orch.serve.listener import close_spare, spare
from trio_orch.serve.trio_http import LeanConfig, ServerState

__all__ = ["TrioServeOutcome", "hypercorn_config", "serve_http", "serve_trio", "server_config"]

log = logging.getLogger("trio_orch.serve.command")


def hypercorn_config(limits: HTTPLimits, *, log_level: str = "warning", graceful_timeout: float = 5.0
                     ) -> Config:
    """hypercorn's settings for ``limits`` (see the module docstring); graceful shutdown, no access log."""
    config = Config()
    config.keep_alive_timeout = min(limits.keep_alive_timeout, limits.header_timeout)
    config.read_timeout = None
    config.backlog = limits.backlog
    config.graceful_timeout = graceful_timeout
    config.loglevel = log_level.upper()
    config.accesslog = None
    config.include_server_header = False
    config.h11_max_incomplete_size = limits.max_head_bytes  # a request head; LimitsMiddleware bounds bodies
    config.websocket_max_message_size = limits.max_body_bytes
    return config


def server_config(limits: HTTPLimits, http_server: str = "lean", *, log_level: str = "warning",
                  graceful_timeout: float = 5.0) -> LeanConfig | Config:
    """The settings of ``http_server`` (``lean`` or ``hypercorn``) for ``limits``."""
    if http_server == "lean":
        return LeanConfig.from_limits(limits, graceful_timeout=graceful_timeout)
    if http_server == "hypercorn":
        return hypercorn_config(limits, log_level=log_level, graceful_timeout=graceful_timeout)
    raise ValueError(f"unknown HTTP server {http_server!r}: lean or hypercorn")


async def serve_http(app: Any, sock: socket.socket, config: LeanConfig | Config, *,
                     shutdown_trigger: Callable[[], Any] | None = None, state: ServerState | None = None,
                     task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED) -> None:
    """Serve ``app`` on the listening ``sock`` until ``shutdown_trigger()`` returns (or a cancel).

    The server is the one ``config`` is for (a :class:`LeanConfig`: the lean
    server, whose counters go to ``state``; hypercorn's ``Config``: hypercorn).
    Once the server closed ``sock``, the connections still queued on it are
    answered 503 ``draining`` and the listener is closed for good.
    """
    listener = spare(sock)
    if isinstance(config, LeanConfig):
        try:
            async def answer_queued() -> None:
                await trio.to_thread.run_sync(close_spare, listener)

            await trio_http.serve(app, sock, config, state=state, shutdown_trigger=shutdown_trigger,
                                  on_listener_closed=answer_queued, task_status=task_status)
        finally:
            listener.close()
        return
    try:
        async with trio.open_nursery() as nursery:
            async def close_after_hypercorn() -> None:
                with trio.move_on_after(1.0):
                    while sock.fileno() != -1:  # hypercorn closes it as it stops accepting
                        await trio.sleep(0.001)
                await trio.to_thread.run_sync(close_spare, listener)

            async def trigger() -> None:
                if shutdown_trigger is None:
                    await trio.sleep_forever()
                else:
                    await shutdown_trigger()
                nursery.start_soon(close_after_hypercorn)

            await worker_serve(wrap_app(app, config.wsgi_max_body_size, "asgi"), config,
                               sockets=Sockets([], [sock], []), shutdown_trigger=trigger,
                               task_status=task_status)
    finally:
        listener.close()


@dataclass
class TrioServeOutcome:
    """How :func:`serve_trio` ended."""

    stopped_by: list[str] = field(default_factory=list)  #: the signals received, in order
    died: str | None = None  #: the engine stopped on its own while serving: why
    startup_error: BaseException | None = None  #: the pipeline did not start
    served: bool = False  #: the HTTP server was started


async def serve_trio(engine: TrioEngine, make_app: Callable[[TrioEngine], Any], sock: socket.socket,
                     config: LeanConfig | Config, front: FrontMetrics, *, startup_timeout: float,
                     shutdown_timeout: float, announce: Callable[[str, int], None],
                     state: ServerState | None = None) -> TrioServeOutcome:
    """The whole ``serve --loop trio`` run; see the module docstring."""
    out = TrioServeOutcome()
    engine_done = trio.Event()
    stop_server = trio.Event()

    async def run_engine(task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        try:
            await engine.run(task_status=task_status)
        finally:
            engine_done.set()
            if not out.stopped_by and out.served and out.died is None:
                out.died = engine.closed_reason or "its orchestrator stopped"
            stop_server.set()  # the engine is gone: the server follows it

    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as root:
            async def watch_signals() -> None:
                async for signum in signals:
                    name = signal.Signals(signum).name
                    out.stopped_by.append(name)
                    if not out.served or len(out.stopped_by) >= 3:  # starting, or the operator insists
                        root.cancel_scope.cancel()
                    elif len(out.stopped_by) == 1:
                        front.draining = True
                        print(f"{name}: draining (up to {shutdown_timeout:g}s; again to stop at once) ...",
                              flush=True)
                        engine.request_stop(shutdown_timeout)
                    else:
                        engine.end_drain()

            root.start_soon(watch_signals)
            try:
                with trio.fail_after(startup_timeout):
                    await root.start(run_engine)
            except (EngineStartupError, trio.TooSlowError) as exc:
                out.startup_error = (exc if isinstance(exc, EngineStartupError) else EngineStartupError(
                    f"engine did not become ready within {startup_timeout}s"))
                root.cancel_scope.cancel()
                return out
            app = make_app(engine)
            server_done = trio.Event()

            async def http(task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED) -> None:
                try:
                    await serve_http(app, sock, config, shutdown_trigger=stop_server.wait, state=state,
                                     task_status=task_status)
                finally:
                    server_done.set()

            await root.start(http)
            out.served = True
            host, port = sock.getsockname()[:2]
            announce(host, port)
            await engine_done.wait()
            await server_done.wait()  # stop_server is set: the server bounds this by graceful_timeout
            root.cancel_scope.cancel()  # the signal watcher
    return out
