"""``serve --loop trio``: the HTTP app and the engine in one Trio run, on the project's lean HTTP server.

The twin of :mod:`trio_orch.serve.asyncio_front`, with the same shape and
names: :func:`serve` is the whole run (start the engine, serve the app,
drain on a signal, stop), :class:`HTTPServer` the HTTP server alone.  Here
one Trio run with one root nursery holds the engine task (pipeline, worker
pools, orchestrator: :class:`~trio_orch.engine.TrioEngine`), the HTTP server
serving the Starlette app (which runs on AnyIO's Trio backend) and the signal
watcher.  No thread sits between a request handler and the orchestrator: a
request is admitted by a function call and each dispatcher batch wakes the
handler's task directly.  A client that disconnects cancels its handler's
scope (the request is aborted on every stage); a hard stop is one cancel of
the root nursery.

The server is the lean one (:mod:`trio_orch.serve.trio_http`): h11 parses
requests, and each streamed chunk is framed by hand and written straight to
the non-blocking socket, with no checkpoint when the kernel takes the bytes
(the per-chunk cost that made another Trio server about four times
uvicorn's CPU per streamed request: docs/performance.md).  It applies the
HTTP limits as they are, no mapping between (``max_head_bytes``: 431 past it;
``header_timeout``; ``keep_alive_timeout``; ``max_connections``: past it a
new connection is answered 503; ``max_body_bytes`` as the WebSocket message
limit, 1009); ``backlog`` is the serve command's listen call.

Drain, as the asyncio front does it: the first SIGINT/SIGTERM stops
accepting work (``/health`` and new requests answer 503 ``draining``), lets
in-flight requests finish for up to ``shutdown_timeout`` seconds, gives the
rest their ``shutdown`` terminal and stops the workers; then the HTTP server
shuts down (stop accepting, idle connections closed, a deadline of
``graceful_timeout`` on its connection nursery's cancel scope), its listener
closed at once -- the connections still queued on it answered 503
``draining`` rather than reset (:mod:`trio_orch.serve.listener`), a new one
refused from then on.  A second signal ends the drain at once; a third
cancels everything.  If the engine stops on its own while serving, the
server stops with it.
"""

from __future__ import annotations

import signal
import socket
from typing import Any

import trio

from trio_orch.engine import EngineStartupError, TrioEngine
from trio_orch.http.limits import HTTPLimits
from trio_orch.http.metrics import ExtraCounters, FrontMetrics
from trio_orch.serve import throughput, trio_http
from trio_orch.serve.listener import close_spare, spare
from trio_orch.serve.options import ServeOptions, ServeOutcome, unfinished
from trio_orch.serve.signals import signal_name
from trio_orch.serve.trio_http import ServerState

__all__ = ["FRONT", "HTTPServer", "serve"]

#: how this front names itself when it announces where it serves
FRONT = "Trio front"


class HTTPServer:
    """The lean server serving an app on the listening ``sock`` within ``limits`` until :meth:`stop`.

    :meth:`counters` are its own for ``/metrics`` (connections closed for a
    late request head).  Once it closed ``sock``, the connections still
    queued on it are answered 503 ``draining`` and the listener is closed for
    good.
    """

    def __init__(self, sock: socket.socket, limits: HTTPLimits, *, graceful_timeout: float = 5.0) -> None:
        self.sock = sock
        self.state = ServerState(limits, graceful_timeout=graceful_timeout)
        self._stop = trio.Event()

    def counters(self) -> ExtraCounters:
        return self.state.counters()

    def open_connections(self) -> int:
        """HTTP connections open now (a WebSocket session counts)."""
        return len(self.state.connections)

    async def serve(self, app: Any, *, task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED
                    ) -> None:
        """Serve ``app`` until :meth:`stop` (or a cancel); ``task_status`` gets the URL once accepting."""
        listener = spare(self.sock)
        try:
            async def answer_queued() -> None:
                await trio.to_thread.run_sync(close_spare, listener)

            await trio_http.serve(app, self.sock, self.state, shutdown_trigger=self._stop.wait,
                                  on_listener_closed=answer_queued, task_status=task_status)
        finally:
            listener.close()

    def stop(self) -> None:
        """Stop serving (in the server's Trio run): after the responses in flight, bounded by the graceful
        timeout (a caller that will not wait cancels :meth:`serve`, as a third signal does)."""
        self._stop.set()


def serve(options: ServeOptions) -> ServeOutcome:
    """The whole ``serve --loop trio`` run; see the module docstring.  Blocks; main thread."""
    out = ServeOutcome()
    trio.run(_serve, options, out)
    return out


async def _serve(options: ServeOptions, out: ServeOutcome) -> None:
    engine = TrioEngine(options.pipeline, **options.engine)
    front = FrontMetrics()
    server = HTTPServer(options.sock, options.limits)
    engine_done = trio.Event()

    async def run_engine(task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        try:
            await engine.run(task_status=task_status)
        finally:
            engine_done.set()
            if not out.stopped_by and out.served and out.died is None:
                out.died = engine.closed_reason or "its orchestrator stopped"
            server.stop()  # the engine is gone: the server follows it

    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as root:
            async def watch_signals() -> None:
                async for signum in signals:
                    name = signal_name(signum)
                    out.stopped_by.append(name)
                    if not out.served or len(out.stopped_by) >= 3:  # starting, or the operator insists
                        root.cancel_scope.cancel()
                    elif len(out.stopped_by) == 1:
                        front.draining = True
                        print(f"{name}: draining (up to {options.shutdown_timeout:g}s; again to stop at "
                              "once) ...", flush=True)
                        engine.request_stop(options.shutdown_timeout)
                    else:
                        engine.end_drain()

            root.start_soon(watch_signals)
            try:
                with trio.fail_after(options.startup_timeout):
                    await root.start(run_engine)
            except (EngineStartupError, trio.TooSlowError) as exc:
                out.startup_error = (exc if isinstance(exc, EngineStartupError) else EngineStartupError(
                    f"engine did not become ready within {options.startup_timeout}s"))
                root.cancel_scope.cancel()
                return
            app = options.make_app(engine, front, server.counters)
            server_done = trio.Event()

            async def http(task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED) -> None:
                try:
                    await server.serve(app, task_status=task_status)
                finally:
                    server_done.set()

            await root.start(http)
            out.served = True
            host, port = options.sock.getsockname()[:2]
            options.announce(host, port, FRONT)
            if options.stats_interval:
                root.start_soon(throughput.run_trio, engine, front, options.stats_interval)
            await engine_done.wait()
            out.unfinished = unfinished(engine)
            await server_done.wait()  # stopped with the engine: the server bounds this by graceful_timeout
            root.cancel_scope.cancel()  # the signal watcher and the throughput line
