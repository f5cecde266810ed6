"""An API-server process: the HTTP app on the shared listening socket, the engine over the head's socket.

Launched by the head of ``serve --api-server-count N`` (:mod:`.head`) as
``python -m trio_orch.serve.fronts.process --auth-fd A --listen-fd L``:
nothing secret on its command line or in its environment.  It locks itself
down first (:func:`stages.lockdown.lock_down`, in a fresh address space),
then asks for its credentials over the hand-over socket ``A``: the head
answers its pid alone, with the slot's address and one-time launch ticket,
the serve command line (so the app is built as the head's would be), the
API key and the admin token.  It serves the app on the inherited listening
socket ``L`` (every front accepts on the same socket; the head accepts on
none), its engine a :class:`~.remote.RemoteEngine`, with the server the
serve command's ``--loop`` names: the lean Trio server in the remote
engine's own Trio run (``trio``), or uvicorn on asyncio in the main thread
with the remote engine in a Trio thread behind the thread adapter
(``asyncio``: :meth:`ThreadEngine.hosting <trio_orch.engine.ThreadEngine.hosting>`,
as a single-process ``serve --loop asyncio`` hosts the engine itself; TLS
then too).  SIGTERM or SIGINT: stop accepting, let the responses in flight
finish within the graceful timeout, exit 0.  Its stand-in passes SIGHUP on
when the head is gone: it exits at once.
"""

from __future__ import annotations

import json
import sys
from typing import Any


def main(argv: list[str] | None = None) -> int:
    from stages.lockdown import lock_down

    lock_down(fresh=True)  # before anything holds a secret
    import argparse

    p = argparse.ArgumentParser(prog="trio-orch-front")
    p.add_argument("--auth-fd", type=int, required=True)
    p.add_argument("--listen-fd", type=int, required=True)
    own = p.parse_args(sys.argv[1:] if argv is None else argv)
    from stages.credentials import receive_credentials

    given = json.loads(receive_credentials(own.auth_fd).decode())
    import logging

    from trio_orch.serve import command

    name = f"front {given['index']}"
    logging.basicConfig(level=given.get("log_level", logging.WARNING),
                        format=f"%(asctime)s %(levelname)s {name} %(name)s: %(message)s")
    args = command.parse(given["argv"])
    limits, make_app, ssl = command.front_app(args)
    args.api_key, args.admin_token = given["api_key"], given["admin_token"]  # the head's, as it resolved them
    if args.loop == "asyncio":
        return _serve_asyncio(given, own.listen_fd, name, limits, make_app, ssl, args)
    import trio

    return int(trio.run(_serve, given, own.listen_fd, name, limits, make_app))


def _remote(given: dict[str, Any], name: str) -> tuple[Any, Any, Any]:
    """The ZMQ context, this front's :class:`~.remote.RemoteEngine` and its HTTP counters."""
    import zmq

    from stages.auth import Security
    from trio_orch.http.metrics import FrontMetrics
    from trio_orch.serve.fronts.remote import RemoteEngine

    ctx = zmq.Context()
    engine = RemoteEngine(ctx, given["address"], Security(b"", ticket=given["ticket"].encode()), name=name)
    engine.front = FrontMetrics()
    return ctx, engine, engine.front


def _head_gone(given: dict[str, Any]) -> None:
    """The stand-in's word (SIGHUP): the head is gone (kill -9); remove its sockets' directory, as nobody
    else will."""
    import logging
    import os
    import shutil

    logging.getLogger("trio_orch.serve.fronts").warning("the head is gone: exiting")
    shutil.rmtree(os.path.dirname(given["address"].removeprefix("ipc://")), ignore_errors=True)


def _serve_asyncio(given: dict[str, Any], listen_fd: int, name: str, limits: Any, make_app: Any,
                   ssl: dict[str, Any] | None, args: Any) -> int:
    """``--loop asyncio``: uvicorn here, the remote engine in the thread adapter's Trio thread."""
    import signal
    import socket
    import threading

    from trio_orch.engine import EngineStartupError, ThreadEngine
    from trio_orch.serve.asyncio_front import HTTPServer
    from trio_orch.serve.connection_limits import quiet_floods

    ctx, remote, front = _remote(given, name)
    engine = ThreadEngine.hosting(remote, startup_timeout=args.startup_timeout, name=name)
    sock = socket.socket(fileno=listen_fd)
    stopping = threading.Event()

    def on_signal(signum: int, frame: Any = None) -> None:
        stopping.set()
        front.draining = True
        server.stop(force=signum == signal.SIGHUP)  # SIGTERM/SIGINT: the responses in flight finish first

    def on_hangup(signum: int, frame: Any) -> None:
        _head_gone(given)
        on_signal(signum)

    def watch_engine() -> None:
        """The head closed the connection (it is going): stop serving at once."""
        engine.join()
        if not stopping.is_set():
            server.stop(force=True)

    server = HTTPServer(sock, limits, log_level=args.uvicorn_log_level,
                        graceful_timeout=float(given["shutdown_timeout"]), on_signal=on_signal, ssl=ssl)
    for sig in (signal.SIGINT, signal.SIGTERM):  # until uvicorn takes them over (and after it gives back)
        signal.signal(sig, on_signal)
    signal.signal(signal.SIGHUP, on_hangup)
    try:
        engine.start()
    except EngineStartupError as exc:
        print(f"{name}: {exc}", flush=True)
        sock.close()
        ctx.destroy(linger=0)
        return 1
    try:
        app = make_app(engine, front, lambda: {**server.counters(), **remote.counters()})
        quiet_floods()
        threading.Thread(target=watch_engine, daemon=True, name="trio-orch-engine-watch").start()
        server.serve(app)
    finally:
        stopping.set()
        engine.close()
        sock.close()
        ctx.destroy(linger=0)
    return 0


async def _serve(given: dict[str, Any], listen_fd: int, name: str, limits: Any, make_app: Any) -> int:
    """``--loop trio``: the lean server and the remote engine in one Trio run."""
    import signal
    import socket

    import trio

    from trio_orch.engine.api import EngineClosed
    from trio_orch.serve.trio_front import HTTPServer

    sock = socket.socket(fileno=listen_fd)
    ctx, engine, front = _remote(given, name)
    server = HTTPServer(sock, limits, graceful_timeout=float(given["shutdown_timeout"]))
    try:
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM, signal.SIGHUP) as signals:
            async with trio.open_nursery() as nursery:
                await nursery.start(engine.run)
                app = make_app(engine, front, lambda: {**server.counters(), **engine.counters()})

                async def watch_signals() -> None:
                    async for signum in signals:
                        if signum == signal.SIGHUP:  # the stand-in's word: the head is gone (kill -9)
                            _head_gone(given)
                            nursery.cancel_scope.cancel()
                            return
                        front.draining = True
                        server.stop()  # stop accepting; the responses in flight finish first

                nursery.start_soon(watch_signals)
                await server.serve(app)
                nursery.cancel_scope.cancel()
    except* EngineClosed:  # the head closed the connection under a request: it is going
        pass
    finally:
        sock.close()
        ctx.destroy(linger=0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
