"""The asyncio references' ZMQ stage client (pyzmq's asyncio sockets).

The twin of :class:`trio_orch.cluster.transport.ZmqStageClient` for the asyncio
orchestrators: one DEALER socket per worker replica, bound here (the worker
connects), speaking :mod:`stages.wire`.  ``receive`` awaits one multipart
message, then takes whatever else is already queued without waiting, so a
burst comes back as one batch (``pump(deliver)``: the same batches pushed,
for a shell with the push path); pyzmq's asyncio socket handles the
edge-triggered ZMQ fd.  The replica is dead when it sends ``Dying``, when its
process exits (``mark_dead``), or after ``heartbeat_timeout`` seconds of
silence; ``receive`` then raises :class:`ReplicaDied`, after the outputs that
came before.  :mod:`bench.refs.launcher` starts the workers behind them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any

import zmq
import zmq.asyncio

from stages.wire import (
    Abort,
    Dying,
    Heartbeat,
    InboundMsg,
    OutboundMsg,
    Outputs,
    Ready,
    RequestError,
    Shutdown,
    Submit,
    Submits,
    Update,
    WireCodec,
    WireError,
)
from trio_orch.cluster.transport import ReplicaDied
from trio_orch.types import StageOutput, StageUnavailable

__all__ = ["AsyncZmqStageClient"]

log = logging.getLogger("bench.refs.transport")


class AsyncZmqStageClient:
    """A stage client for one worker replica over a pyzmq asyncio DEALER socket."""

    def __init__(self, ctx: zmq.asyncio.Context, address: str, *, stage_id: int = 0, replica: int = 0,
                 heartbeat_timeout: float | None = None, name: str | None = None) -> None:
        self.stage_id = stage_id
        self.replica = replica
        self.name = name or f"stage{stage_id}.r{replica}"
        self.address = address
        self.heartbeat_timeout = heartbeat_timeout
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.linger = 0
        self.sock.bind(address)
        self.in_codec = WireCodec(OutboundMsg)
        self.out_codec = WireCodec(InboundMsg)
        self.ready: Ready | None = None
        self.dead_reason: str | None = None
        self.closed = False
        self.garbage_frames = 0
        self.pid: int | None = None  # the worker process, when open_worker_stages started it
        self._pending: list[StageOutput] = []
        self._died = asyncio.Event()
        #: as the Trio client: requests this replica holds, and submits held for it while it is busy
        self._working: set[str] = set()
        self._held: list[Submit] = []

    #: a submit's priority and deadline go to the worker, which batches by them
    accepts_priority = True

    def __repr__(self) -> str:
        return f"<AsyncZmqStageClient {self.name} {self.address}>"

    @property
    def alive(self) -> bool:
        return self.dead_reason is None and not self.closed

    def mark_dead(self, reason: str) -> None:
        if self.dead_reason is None:
            self.dead_reason = reason
            self._working.clear()
            self._held.clear()
            self._died.set()

    # ------------------------------------------------------------------ stage-client protocol
    async def submit(self, request_id: str, payload: Any, *, downstream: int = -1,
                     sampling: dict[str, Any] | None = None, resumable: bool = False,
                     companion_of: str | None = None, priority: int = 0,
                     deadline_in: float | None = None) -> None:
        """Send a submit (``resumable``: more input follows through :meth:`update`; a companion
        needs nothing here: one replica is always its parent's; ``priority``/``deadline_in``
        (seconds left): the worker's batch order, as the Trio client sends them)."""
        self.check_alive()
        self._release_held()
        self._working.add(request_id)
        msg = Submit(request_id, payload, downstream, sampling, resumable, priority, deadline_in)
        await self.sock.send_multipart(self.out_codec.encode(msg), copy=False)

    def submit_nowait(self, request_id: str, payload: Any, *, downstream: int = -1,
                      sampling: dict[str, Any] | None = None, resumable: bool = False,
                      companion_of: str | None = None, priority: int = 0,
                      deadline_in: float | None = None) -> bool:
        """The Trio client's ``submit_nowait``: at once to an idle replica; to a busy one held until the
        loop's next iteration, when every submit held by then leaves as one ``Submits`` message.
        (pyzmq's asyncio socket sends in call order, queueing what it cannot send at once.)"""
        self.check_alive()
        msg = Submit(request_id, payload, downstream, sampling, resumable, priority, deadline_in)
        if self._working:
            self._working.add(request_id)
            self._held.append(msg)
            if len(self._held) == 1:
                asyncio.get_running_loop().call_soon(self._release_held)
            return True
        self._working.add(request_id)
        self._send_now(msg)
        return True

    def _release_held(self) -> None:
        held, self._held = self._held, []
        if held and self.alive:
            self._send_now(held[0] if len(held) == 1 else Submits(held))

    def _send_now(self, msg: Any) -> None:
        fut = self.sock.send_multipart(self.out_codec.encode(msg), copy=False)
        if not fut.done():
            fut.add_done_callback(self._sent)
        else:
            self._sent(fut)

    def _sent(self, fut: Any) -> None:
        exc = None if fut.cancelled() else fut.exception()
        if exc is not None:
            self.mark_dead(f"send failed: {exc!r}")

    async def update(self, request_id: str, payload: Any, *, final: bool = False,
                     sampling: Any = None) -> None:
        """Send the next input segment of a resumable request (the worker keeps its sampling)."""
        self.check_alive()
        self._release_held()
        self._working.add(request_id)
        await self.sock.send_multipart(self.out_codec.encode(Update(request_id, payload, final)), copy=False)

    def check_alive(self) -> None:
        """Raise :class:`StageUnavailable` once the replica is dead or this client closed."""
        if not self.alive:
            raise StageUnavailable(f"{self.name} is not running: {self.dead_reason or 'closed'}")

    async def abort(self, request_ids: list[str]) -> None:
        if request_ids and self.alive:
            self._release_held()
            self._working.difference_update(request_ids)
            await self.sock.send_multipart(self.out_codec.encode(Abort(list(request_ids))), copy=False)

    async def receive(self) -> list[StageOutput]:
        """Wait for at least one output; raise :class:`ReplicaDied` once dead and drained."""
        while not self._pending:
            if self.dead_reason is not None or self.closed:
                raise ReplicaDied(f"{self.name}: {self.dead_reason or 'closed'}")
            await self._recv_some()
        batch, self._pending = self._pending, []
        return batch

    async def pump(self, deliver: Callable[[list[StageOutput]], None]) -> None:
        """The push path, as the Trio client offers it: each batch goes to ``deliver`` as it is read.

        Called in the reading task, synchronously, so a shell that routes a
        pushed batch at once (``asyncio-taskgroup``) saves its queue hop to the
        dispatcher; raises :class:`ReplicaDied` once dead and drained, as
        :meth:`receive` does.
        """
        while True:
            deliver(await self.receive())

    async def aclose(self) -> None:
        """Ask the worker to stop (best effort) and close the socket; idempotent."""
        if self.closed:
            return
        self.closed = True
        if self.dead_reason is None:
            with contextlib.suppress(zmq.ZMQError):
                await self.sock.send_multipart(self.out_codec.encode(Shutdown("orchestrator closing")),
                                               flags=zmq.NOBLOCK)
        self.sock.close()

    # ------------------------------------------------------------------ internals
    async def wait_ready(self) -> Ready:
        while self.ready is None:
            if self.dead_reason is not None:
                raise ReplicaDied(f"{self.name}: {self.dead_reason}")
            await self._recv_some()
        return self.ready

    async def _recv_some(self) -> None:
        """Wait for one message (or death/silence), then take every message already queued."""
        recv = asyncio.ensure_future(self.sock.recv_multipart(copy=False))
        died = asyncio.ensure_future(self._died.wait())
        # heartbeats are owed once the worker is ready, as the Trio client counts them: before
        # that, the launcher's startup timeout bounds the wait (a worker importing torch on a busy
        # machine can be silent for longer than a heartbeat timeout)
        silence = self.heartbeat_timeout if self.ready is not None else None
        try:
            done, _ = await asyncio.wait({recv, died}, timeout=silence, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            # Cancelled (e.g. the polling loop's 1 ms wait_for): a message that arrived in the
            # same loop iteration is already out of the socket -- keep it, or it is lost.
            died.cancel()
            if recv.done() and not recv.cancelled() and recv.exception() is None:
                self._handle(recv.result())
            else:
                recv.cancel()
            raise
        died.cancel()
        if not recv.done():
            recv.cancel()
        if recv not in done or recv.cancelled():
            if not done:
                self.mark_dead(f"no message for {self.heartbeat_timeout}s (missed heartbeats)")
            return
        self._handle(recv.result())
        while True:
            try:
                frames = await self.sock.recv_multipart(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self._handle(frames)

    def _handle(self, frames: list[Any]) -> None:
        try:
            msg = self.in_codec.decode(frames)
        except WireError as exc:
            self.garbage_frames += 1
            log.error("%s: dropped a garbage message from the worker: %s", self.name, exc)
            return
        t = type(msg)
        if t is Outputs:
            working = self._working
            for it in msg.items:
                if it.finished or it.error is not None:
                    working.discard(it.request_id)
                self._pending.append(StageOutput(it.request_id, it.data, it.finished, it.error,
                                                 t_produced=it.t_produced))
        elif t is RequestError:
            self._working.discard(msg.request_id)
            self._pending.append(StageOutput(msg.request_id, None, True, msg.message))
        elif t is Ready:
            self.ready = msg
        elif t is Dying:
            self.mark_dead(f"worker is dying: {msg.reason}")
        elif t is not Heartbeat:
            log.debug("%s: ignoring %s", self.name, t.__name__)
