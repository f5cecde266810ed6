"""Serving the app with uvicorn: accepting through the acceptor process, drain on a signal.

Everything uvicorn-specific lives here and in :mod:`trio_orch.serve.connection_limits`
(the app itself is server-neutral).  :class:`DrainingServer` takes over
SIGINT and SIGTERM from uvicorn: the first calls ``on_signal`` (the serve
command starts its drain), a second ends the drain at once, a third exits
without waiting.  It accepts through an
:class:`~trio_orch.serve.acceptor_process.AcceptorProcess` instead of the event
loop (falling back to the loop if that process dies).
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable
from typing import Any

import uvicorn

from trio_orch.http.limits import HTTPLimits
from trio_orch.serve.acceptor_process import AcceptorProcess
from trio_orch.serve.connection_limits import ConnectionLimiter

__all__ = ["DrainingServer", "uvicorn_config"]

log = logging.getLogger("trio_orch.serve.command")


class DrainingServer(uvicorn.Server):
    """A uvicorn server whose SIGINT/SIGTERM handling is ``on_signal(signum)``, accepting through
    an :class:`~trio_orch.serve.acceptor.AcceptorProcess`.

    uvicorn would stop accepting and give connections a fixed grace period;
    the serve command instead keeps answering (``/health`` says draining)
    while in-flight requests finish, then sets ``should_exit`` itself.  With
    a ``limiter``, each listening socket it is given is accepted on by an
    acceptor process (under a flood, refusals cost a few system calls in a
    process of their own, at a low CPU priority); the connections it
    passes over get uvicorn's protocol here, and uvicorn shuts them down as
    usual.  Every ``refresh`` seconds the limiter gives the acceptors the
    engine's numbers.  Should an acceptor die, this process accepts on the
    socket itself (the event loop's accept, the limiter's checks).
    """

    def __init__(self, config: uvicorn.Config, on_signal: Callable[[int], None],
                 limiter: ConnectionLimiter | None = None, *, acceptor_nice: int = 10,
                 refresh: float = 0.01) -> None:
        super().__init__(config)
        self.on_signal = on_signal
        self.limiter = limiter
        self.acceptor_nice = acceptor_nice
        self.refresh = refresh
        self.acceptors: list[AcceptorProcess] = []
        self._handovers: set[asyncio.Task[Any]] = set()
        self._refresher: asyncio.TimerHandle | None = None
        self._stopping = False

    def handle_exit(self, sig: int, frame: Any) -> None:
        self.on_signal(sig)

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        limiter = self.limiter
        if limiter is None or not sockets:
            await super().startup(sockets)
            return
        await super().startup([])  # uvicorn's state without a listener of its own
        self.started = False  # not until the acceptors run (a test thread may be watching it)
        loop = asyncio.get_running_loop()
        shedder = limiter.shedder
        for sock in sockets:
            acceptor = AcceptorProcess(
                sock, paths=sorted(shedder.paths) if shedder else [],
                response=shedder.raw_response() if shedder else b"", header_timeout=limiter.header_timeout,
                max_wait=limiter.max_accept_wait, nice=self.acceptor_nice)
            self.acceptors.append(acceptor)
            limiter.acceptors.append(acceptor)
            limiter.refresh()  # its board shows the engine's numbers before it decides anything
            acceptor.start()
            assert acceptor.channel is not None
            loop.add_reader(acceptor.channel.fileno(), self._take_over, loop, acceptor)
        self._refresher = loop.call_later(self.refresh, self._tick, loop)
        self.started = True

    def _tick(self, loop: asyncio.AbstractEventLoop) -> None:
        assert self.limiter is not None
        self.limiter.refresh()
        self._refresher = loop.call_later(self.refresh, self._tick, loop)

    def _take_over(self, loop: asyncio.AbstractEventLoop, acceptor: AcceptorProcess) -> None:
        """The acceptor passed connections over: serve them, with its decisions."""
        assert self.limiter is not None
        for conn, decision in acceptor.received():
            self.limiter.took_over(acceptor, decision)
            self._serve_connection(loop, conn, decision)
        if acceptor.lost:
            assert acceptor.channel is not None
            loop.remove_reader(acceptor.channel.fileno())
            if not self._stopping:
                task = loop.create_task(self._accept_here(acceptor))
                self._handovers.add(task)
                task.add_done_callback(self._handovers.discard)

    async def _accept_here(self, acceptor: AcceptorProcess) -> None:
        """The acceptor process died: accept on its socket in this process (the loop's accept)."""
        sock = acceptor.sock
        code = None if acceptor.proc is None else acceptor.proc.poll()
        await asyncio.to_thread(acceptor.stop)  # its board stays: what it counted is still folded
        log.error("the acceptor process exited (%s); accepting on the event loop instead", code)
        loop = asyncio.get_running_loop()
        config = self.config

        def make_protocol() -> asyncio.Protocol:
            return config.http_protocol_class(  # type: ignore[call-arg]
                config=config, server_state=self.server_state, app_state=self.lifespan.state, _loop=loop)

        self.servers.append(await loop.create_server(make_protocol, sock=sock, backlog=config.backlog))

    def _serve_connection(self, loop: asyncio.AbstractEventLoop, conn: socket.socket,
                          decision: str | None) -> None:
        """Give an accepted connection uvicorn's protocol, with the acceptor's request-line decision."""
        config = self.config
        made: list[Any] = []

        def make_protocol() -> asyncio.Protocol:
            proto = config.http_protocol_class(  # type: ignore[call-arg]
                config=config, server_state=self.server_state, app_state=self.lifespan.state, _loop=loop)
            proto.spoke = decision != "silent"  # type: ignore[attr-defined]
            if decision in ("held", "shed"):
                proto.line_seen = True  # type: ignore[attr-defined]
                proto.held = decision == "held"  # type: ignore[attr-defined]
                proto.shed_on_open = decision == "shed"  # type: ignore[attr-defined]
            made.append(proto)
            return proto

        task = loop.create_task(loop.connect_accepted_socket(make_protocol, conn))
        self._handovers.add(task)

        def done(t: asyncio.Task[Any]) -> None:
            self._handovers.discard(t)
            if t.cancelled() or t.exception() is not None:
                conn.close()
                assert self.limiter is not None
                if not made and decision == "held":  # counted at the hand-over, never served
                    self.limiter.release_held()
                for proto in made:
                    self.limiter.release(proto)

        task.add_done_callback(done)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self._stopping = True
        if self._refresher is not None:
            self._refresher.cancel()
        loop = asyncio.get_running_loop()
        for acceptor in self.acceptors:
            if acceptor.channel is not None:
                loop.remove_reader(acceptor.channel.fileno())
            await asyncio.to_thread(acceptor.stop)
        if self.limiter is not None:
            self.limiter.refresh()  # the last of their counts
            self.limiter.acceptors.clear()
        for acceptor in self.acceptors:
            acceptor.close()
        await super().shutdown(sockets)


def uvicorn_config(app: Any, limits: HTTPLimits, limiter: ConnectionLimiter, *, log_level: str,
                   shutdown_grace: float = 5.0) -> uvicorn.Config:
    """uvicorn's settings for ``limits``: keep-alive timeout, our H11 protocol, no lifespan.

    The limiter takes the app's shedder (``app.state.shedder``, if it has one) so
    that it can refuse at the request line.
    """
    state = getattr(app, "state", None)
    limiter.shedder = getattr(state, "shedder", None)
    return uvicorn.Config(app, http=limiter.protocol_class(), log_level=log_level, lifespan="off",
                          timeout_keep_alive=max(1, round(limits.keep_alive_timeout)),
                          timeout_graceful_shutdown=max(1, round(shutdown_grace)))

