"""``serve --loop asyncio``: uvicorn on asyncio in the main thread, the engine in a Trio thread beside it.

The twin of :mod:`trio_orch.serve.trio_front`, with the same shape and
names: :func:`serve` is the whole run (start the engine, serve the app,
drain on a signal, stop), :class:`HTTPServer` the HTTP server alone.  Here
the engine is the thread adapter (:class:`~trio_orch.engine.ThreadEngine`:
its Trio run in a daemon thread), the server uvicorn.

The HTTP limits become uvicorn's settings in one place (:func:`server_config`):
``max_connections`` -> ``limit_concurrency`` (past it a new request gets
uvicorn's 503), ``backlog`` -> ``backlog``, ``keep_alive_timeout`` ->
``timeout_keep_alive``, ``max_head_bytes`` -> ``h11_max_incomplete_event_size``,
``max_body_bytes`` -> ``ws_max_size`` (a WebSocket frame, as the lean server
bounds a message); ``header_timeout`` is the
:class:`~trio_orch.serve.connection_limits.HeadDeadline` on its H11
protocol, which also keeps the lean server's framing rules and lingering close
(:class:`~trio_orch.serve.connection_limits.FrontH11Protocol`).  Everything uvicorn-specific lives here and in
:mod:`trio_orch.serve.connection_limits` (the app itself is server-neutral).

Drain: :class:`DrainingServer` takes SIGINT and SIGTERM over from uvicorn.
The first stops accepting work (``/health`` and new requests answer 503
``draining``; the listening socket stays open so a load balancer sees it),
lets in-flight requests finish for up to ``shutdown_timeout`` seconds, gives
the rest their ``shutdown`` terminal, stops the workers, then the HTTP
server; the second ends the drain at once; the third is uvicorn's forced
exit.  When uvicorn stops it closes its listening socket; the connections
still queued on it are answered 503 ``draining`` first rather than reset
(:mod:`trio_orch.serve.listener`), and a new connection is refused from then
on.  If the engine's thread ends on its own while serving (a crash), the
server stops with it: serving only 503s would hide the failure from
whoever restarts the process.
"""

from __future__ import annotations

import asyncio
import signal
import socket
import sys
import threading
from collections.abc import Callable, Mapping
from typing import Any

import uvicorn

from trio_orch.engine import EngineStartupError, ThreadEngine
from trio_orch.http.limits import HTTPLimits
from trio_orch.http.metrics import ExtraCounters, FrontMetrics
from trio_orch.serve import throughput
from trio_orch.serve.connection_limits import HeadDeadline, quiet_floods
from trio_orch.serve.listener import close_spare, spare
from trio_orch.serve.options import ServeOptions, ServeOutcome, unfinished
from trio_orch.serve.signals import signal_name

__all__ = ["FRONT", "DrainingServer", "HTTPServer", "serve", "server_config"]

#: how this front names itself when it announces where it serves
FRONT = "asyncio front"


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


def server_config(app: Any, limits: HTTPLimits, deadline: HeadDeadline, *, log_level: str,
                  graceful_timeout: float = 5.0, ssl: Mapping[str, Any] | None = None) -> uvicorn.Config:
    """uvicorn's settings for ``limits`` (see the module docstring); no lifespan, no server header, no
    access log of uvicorn's own (the app writes one line per request on either front); ``ssl``:
    uvicorn's ``ssl_*`` settings."""
    return uvicorn.Config(app, http=deadline.protocol_class(), log_level=log_level, lifespan="off",
                          limit_concurrency=limits.max_connections, backlog=limits.backlog,
                          timeout_keep_alive=limits.keep_alive_timeout,  # type: ignore[arg-type]  # a float is fine
                          h11_max_incomplete_event_size=limits.max_head_bytes, server_header=False,
                          ws_max_size=limits.max_body_bytes, access_log=False,
                          timeout_graceful_shutdown=max(1, round(graceful_timeout)), **(ssl or {}))


class HTTPServer:
    """uvicorn serving an app on the listening ``sock`` within ``limits`` until :meth:`stop`.

    ``on_signal(signum)`` takes SIGINT and SIGTERM over while it serves
    (default: ignore them).  :meth:`counters` are its own for ``/metrics``
    (connections closed for a late request head).
    """

    def __init__(self, sock: socket.socket, limits: HTTPLimits, *, log_level: str = "warning",
                 graceful_timeout: float = 5.0, on_signal: Callable[[int], None] | None = None,
                 ssl: Mapping[str, Any] | None = None) -> None:
        self.sock = sock
        self.limits = limits
        self.log_level = log_level
        self.ssl = ssl
        self.graceful_timeout = graceful_timeout
        self.on_signal = on_signal or (lambda signum: None)
        self.deadline = HeadDeadline(limits.header_timeout)
        self._server: DrainingServer | None = None
        self._stop = False

    def counters(self) -> ExtraCounters:
        return self.deadline.counters()

    @property
    def started(self) -> bool:
        return self._server is not None and self._server.started

    def open_connections(self) -> int:
        """HTTP connections open now (a WebSocket session counts once upgraded)."""
        return len(self._server.server_state.connections) if self._server is not None else 0

    def serve(self, app: Any) -> None:
        """Serve ``app`` until :meth:`stop` (blocks: uvicorn's own asyncio loop, in this thread)."""
        config = server_config(app, self.limits, self.deadline, log_level=self.log_level,
                               graceful_timeout=self.graceful_timeout, ssl=self.ssl)
        self._server = DrainingServer(config, self.on_signal)
        if self._stop:  # asked to stop before it ran
            self._server.should_exit = True
        self._server.run(sockets=[self.sock])

    def stop(self, *, force: bool = False) -> None:
        """Stop serving (any thread): after the responses in flight, or at once with ``force``."""
        self._stop = True
        server = self._server
        if server is not None:
            server.should_exit = True
            server.force_exit = server.force_exit or force


def serve(options: ServeOptions) -> ServeOutcome:
    """The whole ``serve --loop asyncio`` run; see the module docstring.  Blocks; main thread."""
    out = ServeOutcome()
    engine = ThreadEngine(options.pipeline, startup_timeout=options.startup_timeout, **options.engine)
    try:
        engine.start()
    except EngineStartupError as exc:
        out.startup_error = exc
        return out
    except KeyboardInterrupt:
        print("interrupted while starting: stopping the engine ...", file=sys.stderr, flush=True)
        _close(engine)
        return out
    front = FrontMetrics()
    stopping = threading.Event()

    def drain() -> None:
        engine.close(drain=options.shutdown_timeout)
        server.stop()

    def on_signal(signum: int, frame: Any = None) -> None:
        # Runs in a signal handler: set flags, start a thread, return.
        out.stopped_by.append(signal_name(signum))
        if len(out.stopped_by) == 1:
            stopping.set()
            front.draining = True
            print(f"{signal_name(signum)}: draining (up to {options.shutdown_timeout:g}s; again to stop "
                  "at once) ...", flush=True)
            threading.Thread(target=drain, name="trio-orch-drain", daemon=True).start()
        elif len(out.stopped_by) == 2:
            engine.end_drain()
        else:  # the operator insists: uvicorn's own forced exit
            server.stop(force=True)

    def watch_engine() -> None:
        """If the engine thread ends while we serve (a crash), stop the HTTP server too."""
        engine.join()
        if not stopping.is_set():
            out.died = engine.closed_reason or "its thread exited"
            server.stop()

    server = HTTPServer(options.sock, options.limits, log_level=options.log_level, on_signal=on_signal,
                        ssl=options.ssl)
    app = options.make_app(engine, front, server.counters)
    quiet_floods()
    for sig in (signal.SIGINT, signal.SIGTERM):  # until uvicorn takes them over (and after it gives back)
        signal.signal(sig, on_signal)
    threading.Thread(target=watch_engine, daemon=True, name="trio-orch-engine-watch").start()
    served = threading.Event()  # set once the server stopped: the throughput line stops with it
    if options.stats_interval:
        threading.Thread(target=throughput.run_thread, args=(engine, front, served, options.stats_interval),
                         daemon=True, name="trio-orch-throughput").start()
    host, port = options.sock.getsockname()[:2]
    options.announce(host, port, FRONT)
    out.served = True
    try:
        server.serve(app)
    finally:
        stopping.set()
        served.set()
        print("stopping the engine ...", flush=True)
        _close(engine)
        out.unfinished = unfinished(engine)
    return out


def _close(engine: ThreadEngine) -> None:
    """Close the engine; meanwhile SIGINT/SIGTERM only cut a drain short: the bounded cleanup must finish."""
    previous = {sig: signal.signal(sig, lambda signum, frame: engine.end_drain())
                for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        engine.close()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
