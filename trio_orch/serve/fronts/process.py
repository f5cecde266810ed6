"""An API-server process: the HTTP app on the shared listening socket, the engine over the head's socket.

Launched by the head of ``serve --api-server-count N`` (:mod:`.head`) as
``python -m trio_orch.serve.fronts.process --auth-fd A --listen-fd L``:
nothing secret on its command line or in its environment.  It locks itself
down first (:func:`stages.lockdown.lock_down`, in a fresh address space),
then asks for its credentials over the hand-over socket ``A``: the head
answers its pid alone, with the slot's address and one-time launch ticket,
the serve command line (so the app is built as the head's would be), the
API key and the admin token.  It serves the app with the lean Trio server on
the inherited listening socket ``L`` (every front accepts on the same
socket; the head accepts on none), its engine a
:class:`~.remote.RemoteEngine`.  SIGTERM or SIGINT: stop accepting, let the
responses in flight finish within the graceful timeout, exit 0.  Its
stand-in passes SIGHUP on when the head is gone: it exits at once.
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
    import trio

    return int(trio.run(_serve, given, own.listen_fd))


async def _serve(given: dict[str, Any], listen_fd: int) -> int:
    import logging
    import os
    import shutil
    import signal
    import socket

    import trio
    import zmq

    from stages.auth import Security
    from trio_orch.engine.api import EngineClosed
    from trio_orch.http.metrics import FrontMetrics
    from trio_orch.serve import command
    from trio_orch.serve.fronts.remote import RemoteEngine
    from trio_orch.serve.trio_front import HTTPServer

    name = f"front {given['index']}"
    logging.basicConfig(level=given.get("log_level", logging.WARNING),
                        format=f"%(asctime)s %(levelname)s {name} %(name)s: %(message)s")
    args = command.parse(given["argv"])
    limits, make_app = command.front_app(args)
    args.api_key, args.admin_token = given["api_key"], given["admin_token"]  # the head's, as it resolved them
    sock = socket.socket(fileno=listen_fd)
    ctx = zmq.Context()
    engine = RemoteEngine(ctx, given["address"], Security(b"", ticket=given["ticket"].encode()), name=name)
    front = FrontMetrics()
    engine.front = front
    server = HTTPServer(sock, limits, graceful_timeout=float(given["shutdown_timeout"]))
    try:
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM, signal.SIGHUP) as signals:
            async with trio.open_nursery() as nursery:
                await nursery.start(engine.run)
                app = make_app(engine, front, lambda: {**server.counters(), **engine.counters()})

                async def watch_signals() -> None:
                    async for signum in signals:
                        if signum == signal.SIGHUP:  # the stand-in's word: the head is gone (kill -9)
                            logging.getLogger("trio_orch.serve.fronts").warning("the head is gone: exiting")
                            shutil.rmtree(os.path.dirname(given["address"].removeprefix("ipc://")),
                                          ignore_errors=True)  # its sockets' directory: nobody else will
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
