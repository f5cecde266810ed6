"""The Trio ZMQ stage client: one worker replica behind the stage-client protocol.

One *owner task* (:meth:`ZmqStageClient.run`) does every operation on the
socket.  Other tasks talk to it through memory channels: ``submit``/``abort``/
``rpc`` put encoded messages in the outbound channel and wake the owner out of
its fd wait (by cancelling that wait's scope); the owner puts outputs in the
inbound channel that ``receive`` reads.  The owner waits with
``trio.lowlevel.wait_readable`` on the socket's ``ZMQ_FD`` and, after EVERY
wakeup and after every send, drains the socket to ``EAGAIN``: the ZMQ fd is
edge-triggered, so a message left behind would never wake us again (a hang).
``aclose`` from another task uses ``trio.lowlevel.notify_closing``; the
socket itself is always closed by the owner.

A message is sent at once from the calling task when nothing is queued
before it (no owner wake-up), with one exception that batches by structure:
a submit to a *busy* replica -- one that holds a request it has not finished
-- is held until the owner's next turn, and every submit held by then leaves
in one ``Submits`` message.  What one scheduler pass decides for a busy
replica thus arrives together and shares the worker's next step, while a
submit to an idle replica (a request alone) goes out at once.  Any other
message sends the held submits first, so the order is kept.

An undecodable message is logged, counted in ``garbage_frames`` and dropped;
the socket keeps working.  A message larger than ``max_message_bytes`` is
logged and counted in ``oversized_messages``; if it carries outputs, each of
its requests gets a per-request error instead (so none of them hangs).
The replica is declared dead (``receive`` raises
:class:`ReplicaDied` once the outputs received before were delivered) when it
sends the ``Dying`` sentinel, misses heartbeats for ``heartbeat_timeout``
seconds, or when the launcher calls :meth:`mark_dead` (process exit).  Before
that, a replica silent for :data:`SUSPECT_AFTER_HEARTBEATS` heartbeat
intervals is *suspect* (:attr:`ZmqStageClient.suspect`): not dead yet, but
making no progress (hung, SIGSTOPped), which ``/health`` reports at once.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import trio
import zmq

from stages.auth import DOMAIN, Authenticator, Security
from stages.credentials import peer_pid
from stages.wire import (
    Abort,
    Cordoned,
    Dying,
    Heartbeat,
    InboundMsg,
    Leaving,
    OutboundMsg,
    Outputs,
    Peers,
    Ready,
    RequestError,
    Rpc,
    RpcReply,
    Shutdown,
    Submit,
    Submits,
    Update,
    WireCodec,
    WireError,
    frames_nbytes,
)
from trio_orch.types import StageDied, StageOutput, StageUnavailable

__all__ = ["SUSPECT_AFTER_HEARTBEATS", "ReplicaDied", "RpcError", "ZmqStageClient"]

log = logging.getLogger("trio_orch.cluster.transport")

#: what a sink gets: a batch of outputs, or the replica's death
Event = list[StageOutput] | BaseException
Sink = Callable[["ZmqStageClient", Event], None]

#: a ready replica silent for this many heartbeat intervals is suspect (two heartbeats missed in a row:
#: one late heartbeat on a busy machine is not enough)
SUSPECT_AFTER_HEARTBEATS = 3


class ReplicaDied(StageDied):
    """The worker replica behind a client is gone (exit, dying sentinel, silence).

    A stage death as far as a caller of that one client is concerned; a replica
    pool turns it into per-request ``replica_died`` outputs and keeps serving.
    """


class RpcError(RuntimeError):
    """The worker answered an RPC with an error (an unknown method, a bad argument, a failed call)."""


class ZmqStageClient:
    """A :class:`~trio_orch.types.StageClient` for one worker replica.

    The client BINDS ``address`` (the worker connects), so the launcher can
    start the worker after the socket exists.  Start :meth:`run` in a nursery
    (``await nursery.start(client.run)``) before using it.  ``sink``, if
    given, receives every event instead of the client's own channel (a
    :class:`~trio_orch.cluster.pool.ReplicaPool` merges its replicas this way).
    """

    #: a submit's priority and deadline go to the worker, which batches by them
    accepts_priority = True

    def __init__(self, ctx: zmq.Context, address: str, *, stage_id: int = 0, replica: int = 0,
                 heartbeat_timeout: float | None = None, sink: Sink | None = None,
                 name: str | None = None, max_message_bytes: int | None = None,
                 security: Security | None = None, authenticator: Authenticator | None = None,
                 heartbeat_interval: float | None = None) -> None:
        self.stage_id = stage_id
        self.replica = replica
        self.name = name or f"stage{stage_id}.r{replica}"
        self.address = address
        self.heartbeat_timeout = heartbeat_timeout
        #: how often the worker sends heartbeats (None: unknown, nothing is ever suspect)
        self.heartbeat_interval = heartbeat_interval
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.linger = 0
        #: how the worker must authenticate (pipeline secret on ipc, its key on tcp); kept for a replacement
        self.security = security
        self.authenticator = authenticator
        if security is not None:
            security.server(self.sock, address, domain=self.zap_domain(address))
            if authenticator is not None and address.startswith("ipc://"):
                authenticator.launches.guard(self.zap_domain(address))  # its launched worker alone
        self.sock.bind(address)
        if address.startswith("tcp://"):
            self.address = self.sock.last_endpoint.decode()  # the port a ":0" bind got
        if authenticator is not None:
            authenticator.watch(self.sock)
        #: called with this client when the worker announces it leaves (stops taking new requests)
        self.on_leaving: Callable[[ZmqStageClient], None] | None = None
        self.leaving = False
        #: if set, :meth:`aclose` first asks the worker to exit with this reason (a remote replica has
        #: no launcher that stops it), and lets the message go out for up to ``close_linger_ms``
        self.farewell: str | None = None
        self.close_linger_ms = 0
        self.in_codec = WireCodec(OutboundMsg)
        self.out_codec = WireCodec(InboundMsg)
        self.ready: Ready | None = None
        #: the pid its worker was launched as: a ``Ready`` from any other process is refused (None: any)
        self.expected_pid: int | None = None
        self.ready_event = trio.Event()
        self.dead_reason: str | None = None
        self.dead_event = trio.Event()
        self.closed = False
        self.garbage_frames = self.oversized_messages = 0
        self.max_message_bytes = max_message_bytes
        self.messages_in = self.messages_out = 0
        self.input_bytes = 0  #: bytes of the requests' inputs (submits, input segments) encoded for it
        self.last_heard = trio.current_time()
        # Outbound: other tasks put encoded messages in this channel and wake the owner; the
        # owner alone sends them.  ``_stalled`` holds the one message the high-water mark refused.
        self._out_send, self._out_recv = trio.open_memory_channel[list[Any]](math.inf)
        self._stalled: list[Any] | None = None
        self._queued = 0  # messages in the outbound channel (not counting _stalled)
        #: requests this replica holds (submitted here; no finishing output, error or abort seen yet)
        self._working: set[str] = set()
        self._held: list[Submit] = []  # submits to this busy replica, for the owner's next turn
        self._send, self._recv = trio.open_memory_channel[list[StageOutput]](math.inf)
        self._sink: Sink = sink or self._to_channel
        self._wake: trio.CancelScope | None = None
        self._waiting_fd = False
        self._owner_running = False
        self._owner_done = trio.Event()
        self._calls: dict[int, tuple[trio.Event, list[RpcReply]]] = {}
        self._call_ids = itertools.count(1)

    def __repr__(self) -> str:
        state = "dead" if self.dead_reason else "ready" if self.ready else "starting"
        return f"<ZmqStageClient {self.name} {self.address} {state}>"

    def zap_domain(self, address: str) -> str:
        """The ZAP domain of this replica's control socket: on TCP, only its own worker's key passes;
        on ipc, only the worker launched for it (its launch's ticket, from its pid)."""
        return f"{DOMAIN}:ctl:{self.name}"

    @property
    def alive(self) -> bool:
        return self.dead_reason is None and not self.closed

    @property
    def suspect_after(self) -> float | None:
        """Seconds of silence after which a ready replica is suspect (None: never)."""
        if not self.heartbeat_interval or self.heartbeat_interval <= 0:
            return None
        after = SUSPECT_AFTER_HEARTBEATS * self.heartbeat_interval
        return min(after, self.heartbeat_timeout) if self.heartbeat_timeout else after

    def silent_for(self) -> float:
        """Seconds since the last message from the worker (must run in the client's Trio run)."""
        return max(0.0, trio.current_time() - self.last_heard)

    @property
    def suspect(self) -> bool:
        """Ready and alive, but silent past :attr:`suspect_after`: missed heartbeats, not yet dead."""
        after = self.suspect_after
        return (after is not None and self.alive and self.ready is not None
                and self.silent_for() > after)

    # ------------------------------------------------------------------ stage-client protocol
    async def submit(self, request_id: str, payload: Any, *, downstream: int = -1,
                     sampling: dict[str, Any] | None = None, resumable: bool = False,
                     companion_of: str | None = None, priority: int = 0,
                     deadline_in: float | None = None) -> None:
        """Queue a submit; raise :class:`StageUnavailable` if the replica is dead or closed.

        ``resumable``: more input segments follow through :meth:`update`.
        ``priority``/``deadline_in`` (seconds left): the worker's batch order.
        ``companion_of`` is accepted for the stage-client protocol and needs
        nothing here: one replica is always its companion's parent's.
        """
        self.submit_nowait(request_id, payload, downstream=downstream, sampling=sampling,
                           resumable=resumable, priority=priority, deadline_in=deadline_in)
        await trio.lowlevel.checkpoint()

    def submit_nowait(self, request_id: str, payload: Any, *, downstream: int = -1,
                      sampling: dict[str, Any] | None = None, resumable: bool = False,
                      companion_of: str | None = None, priority: int = 0,
                      deadline_in: float | None = None) -> bool:
        """:meth:`submit` without its checkpoint; always True.

        Sent at once when the replica holds nothing; to a busy one, held for
        the owner's next turn, which sends every submit held by then as one
        message (see the module docstring).
        """
        self._check_alive()
        msg = Submit(request_id, payload, downstream, sampling, resumable, priority, deadline_in)
        working = self._working
        if working:
            working.add(request_id)
            held = self._held
            held.append(msg)
            if len(held) == 1:
                self._poke()
            return True
        working.add(request_id)
        self._queue(msg)
        return True

    async def update(self, request_id: str, payload: Any, *, final: bool = False,
                     sampling: Any = None) -> None:
        """Queue the next input segment of a resumable request (``final``: its last one).

        ``sampling`` is accepted for the stage-client protocol and not sent:
        the worker keeps the parameters the request was submitted with.
        Raises :class:`StageUnavailable` if the replica is dead or closed.
        """
        self._check_alive()
        self._working.add(request_id)  # its next segment: the replica holds it again
        self._queue(Update(request_id, payload, final))
        await trio.lowlevel.checkpoint()

    async def abort(self, request_ids: list[str]) -> None:
        self.abort_nowait(request_ids)
        await trio.lowlevel.checkpoint()

    def abort_nowait(self, request_ids: list[str]) -> None:
        """Synchronous :meth:`abort` (queues the message; a no-op once dead or closed)."""
        if request_ids and self.alive:
            self._working.difference_update(request_ids)
            self._queue(Abort(list(request_ids)))

    async def receive(self) -> list[StageOutput]:
        """Wait for at least one output; raise :class:`ReplicaDied` once dead and drained."""
        try:
            batch = await self._recv.receive()
        except (trio.EndOfChannel, trio.ClosedResourceError):
            raise ReplicaDied(f"{self.name}: {self.dead_reason or 'closed'}") from None
        while True:
            try:
                batch.extend(self._recv.receive_nowait())
            except (trio.WouldBlock, trio.EndOfChannel):
                return batch

    async def aclose(self) -> None:
        """Close the socket (via the owner if it runs); idempotent."""
        if self.closed:
            return
        if self.farewell is not None and self.dead_reason is None:
            self._out_send.send_nowait(self.out_codec.encode(Shutdown(self.farewell)))
        self.closed = True
        if self._owner_running:
            self._poke()
            await self._owner_done.wait()
        else:
            self._close_socket()
        self._send.close()

    # ------------------------------------------------------------------ extras
    async def wait_ready(self) -> Ready:
        """Wait for the worker's ``Ready`` handshake; raise ReplicaDied if it dies first."""
        async with trio.open_nursery() as nursery:
            async def watch_death() -> None:
                await self.dead_event.wait()
                nursery.cancel_scope.cancel()

            nursery.start_soon(watch_death)
            await self.ready_event.wait()
            nursery.cancel_scope.cancel()
        if self.ready is None:
            raise ReplicaDied(f"{self.name} died before it was ready: {self.dead_reason}")
        return self.ready

    async def rpc(self, method: str, args: Sequence[Any] = (), kwargs: Mapping[str, Any] | None = None,
                  timeout: float = 5.0) -> Any:
        """Call ``method(*args, **kwargs)`` on the worker (stages/control.py) and return its value.

        Raises :class:`RpcError` when the worker answers with an error,
        ``TimeoutError`` when it does not answer within ``timeout`` seconds (a
        hung or stopped process), :class:`ReplicaDied` when it dies first and
        :class:`StageUnavailable` when it is already dead.
        """
        reply = await self._call(lambda cid: Rpc(cid, method, list(args), dict(kwargs or {})), timeout)
        if reply.error is not None:
            raise RpcError(reply.error)
        return reply.result

    async def abort_confirmed(self, request_ids: list[str], timeout: float = 5.0) -> list[str]:
        """Abort and wait until the worker confirms; return the ids it held (and stopped).

        Raises as :meth:`rpc` does (``TimeoutError``: not confirmed in time).
        """
        reply = await self._call(lambda call_id: Abort(list(request_ids), call_id), timeout)
        return list(reply.result or [])

    async def _call(self, make: Callable[[int], Any], timeout: float) -> RpcReply:
        """Send ``make(call_id)`` and wait for the ``RpcReply`` with that id."""
        self._check_alive()
        call_id = next(self._call_ids)
        done = trio.Event()
        slot: list[RpcReply] = []
        self._calls[call_id] = (done, slot)
        try:
            self._queue(make(call_id))
            with trio.fail_after(timeout):
                await done.wait()
        except trio.TooSlowError:
            raise TimeoutError(f"{self.name}: no answer within {timeout:g}s") from None
        finally:
            self._calls.pop(call_id, None)
        if not slot:
            raise ReplicaDied(f"{self.name}: {self.dead_reason}")
        return slot[0]

    def confirm_cordoned(self) -> None:
        """Tell a leaving worker that nothing more will be placed on it."""
        if self.alive:
            self._queue(Cordoned())

    def send_peers(self, peers: Peers) -> None:
        """Tell the worker where the next stage's replicas take chunks now (membership changed)."""
        if self.alive:
            self._queue(peers)

    def request_shutdown(self, reason: str = "") -> None:
        """Ask the worker to exit (best effort; the launcher enforces it)."""
        if self.alive:
            self._queue(Shutdown(reason))

    def mark_dead(self, reason: str) -> None:
        """Declare the replica dead (idempotent); wakes receivers and waiters."""
        if self.dead_reason is not None:
            return
        self.dead_reason = reason
        self._working.clear()
        self._held.clear()
        self.dead_event.set()
        for done, _ in self._calls.values():
            done.set()
        self._sink(self, ReplicaDied(f"{self.name} died: {reason}"))

    # ------------------------------------------------------------------ the owner task
    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Own the socket until closed or cancelled; closes it on the way out."""
        if self._owner_running or self.closed:
            raise RuntimeError(f"{self.name}: run() may be started once, before aclose()")
        self._owner_running = True
        fd = self.sock.getsockopt(zmq.FD)
        self.last_heard = trio.current_time()
        task_status.started()
        try:
            while not self.closed:
                if self._held:
                    self._release_held()
                self._flush()
                self._drain()
                if self.closed:
                    break
                if self._stalled is not None and self.sock.getsockopt(zmq.EVENTS) & zmq.POLLOUT:
                    continue  # room again: send the rest before waiting
                deadline = math.inf
                if self.heartbeat_timeout and self.ready is not None and self.dead_reason is None:
                    deadline = self.last_heard + self.heartbeat_timeout
                self._wake = trio.CancelScope(deadline=deadline)
                with self._wake:
                    self._waiting_fd = True
                    try:
                        await trio.lowlevel.wait_readable(fd)
                    except trio.ClosedResourceError:
                        break  # aclose() from another task used notify_closing
                    finally:
                        self._waiting_fd = False
                self._wake = None
                if trio.current_time() >= deadline and self.dead_reason is None:
                    self._drain()  # a message may have arrived at the last moment
                    if trio.current_time() >= self.last_heard + (self.heartbeat_timeout or math.inf):
                        self.mark_dead(f"no message for {self.heartbeat_timeout:.1f}s (missed heartbeats)")
        finally:
            self.closed = True
            try:
                if self._held:
                    self._release_held()
                self._flush()
            except Exception:  # pragma: no cover - best effort on the way out
                pass
            self._close_socket()
            self._send.close()
            self._owner_done.set()

    def _close_socket(self) -> None:
        self.sock.close(linger=self.close_linger_ms)
        if self.authenticator is not None and self.address.startswith("ipc://"):
            self.authenticator.forget(self.zap_domain(self.address))  # a replacement binds it anew
        if self.address.startswith("ipc://"):  # libzmq may leave the file behind
            with contextlib.suppress(OSError):
                os.unlink(self.address[len("ipc://"):])

    def _poke(self) -> None:
        """Wake the owner out of its fd wait (new work queued, or closing)."""
        if self._waiting_fd:
            if self.closed:
                trio.lowlevel.notify_closing(self.sock.getsockopt(zmq.FD))
            elif self._wake is not None:
                self._wake.cancel()

    def _queue(self, msg: Any) -> None:
        """Send now from the calling task if nothing is queued before it; else queue and wake the owner.

        Still one writer: the task runs between checkpoints, the socket is only
        touched by this thread, and a message is only sent here when the
        owner has nothing queued or stalled (order is kept).  A send may
        process libzmq's pending commands and consume the edge of the
        (edge-triggered) ``ZMQ_FD``: if input is waiting afterwards, the owner
        is woken to drain it.  This saves the owner's wake-up per submit.
        """
        if self._held:
            self._release_held()  # the submits held before it go first
        frames = self.out_codec.encode(msg)
        self.input_bytes += frames_nbytes(frames) if type(msg) in (Submit, Update) else 0
        if self._waiting_fd and self._stalled is None and not self._queued and not self.closed:
            try:
                self.sock.send_multipart(frames, zmq.NOBLOCK, copy=False)
            except zmq.Again:
                pass  # high-water mark: queue it, the owner waits for room
            else:
                self.messages_out += 1
                if self.sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                    self._poke()
                return
        self._queued += 1
        self._out_send.send_nowait(frames)
        self._poke()

    def _release_held(self) -> None:
        """Queue the held submits as one message (one ``Submit`` if alone), ahead of anything after."""
        held, self._held = self._held, []
        frames = self.out_codec.encode(held[0] if len(held) == 1 else Submits(held))
        self.input_bytes += frames_nbytes(frames)
        self._queued += 1
        self._out_send.send_nowait(frames)

    def _check_alive(self) -> None:
        if self.closed:
            raise StageUnavailable(f"{self.name} is closed")
        if self.dead_reason is not None:
            raise StageUnavailable(f"{self.name} is dead: {self.dead_reason}")

    def _flush(self) -> None:
        """Send queued messages until the queue is empty or ZMQ's high-water mark is hit."""
        while True:
            if self._stalled is None:
                try:
                    self._stalled = self._out_recv.receive_nowait()
                except (trio.WouldBlock, trio.EndOfChannel):
                    return
                self._queued -= 1
            try:
                self.sock.send_multipart(self._stalled, zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return  # high-water mark: the owner waits for POLLOUT
            self._stalled = None
            self.messages_out += 1

    def _drain(self) -> None:
        """Receive until EAGAIN; hand outputs to the sink in one batch."""
        batch: list[StageOutput] = []
        heard = False
        while True:
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            self.messages_in += 1
            if not heard:  # one clock read per drain: what arrives together was heard together
                heard = True
                self.last_heard = trio.current_time()
            try:
                msg = self.in_codec.decode(frames)
            except WireError as exc:
                self.garbage_frames += 1
                log.error("%s: dropped a garbage message from the worker: %s", self.name, exc)
                continue
            t = type(msg)
            if self.max_message_bytes is not None:
                size = sum(map(len, frames))
                if size > self.max_message_bytes:
                    self._oversized(msg, size, batch)
                    continue
            if t is Outputs:
                working = self._working
                for it in msg.items:
                    if it.finished or it.error is not None:
                        working.discard(it.request_id)
                    batch.append(StageOutput(it.request_id, it.data, it.finished, it.error,
                                             t_produced=it.t_produced, timing=it.timing))
            elif t is Heartbeat:
                pass
            elif t is RequestError:
                self._working.discard(msg.request_id)
                batch.append(StageOutput(msg.request_id, None, True, msg.message))
            elif t is Ready:
                if self._ready_from(msg, frames[0]):
                    self.ready = msg
                    self.ready_event.set()
            elif t is RpcReply:
                call = self._calls.get(msg.call_id)
                if call is not None:
                    call[1].append(msg)
                    call[0].set()
            elif t is Leaving:
                self.leaving = True
                if self.on_leaving is not None:
                    self.on_leaving(self)
            elif t is Dying:
                if batch:
                    self._sink(self, batch)
                    batch = []
                self.mark_dead(f"worker is dying: {msg.reason}")
        if batch:
            self._sink(self, batch)

    def _ready_from(self, msg: Ready, frame: Any) -> bool:
        """Is this ``Ready`` from the launched worker?  Its pid, and on ipc the peer's (``SO_PEERCRED``)."""
        if self.expected_pid is None:
            return True
        try:
            peer = peer_pid(frame.get("Peer-Address"))
        except (zmq.ZMQError, AttributeError):  # no metadata (a plain bytes frame)
            peer = None
        if msg.pid == self.expected_pid and peer in (None, self.expected_pid):
            return True
        sender = "?" if peer is None else peer
        why = (f"refused a Ready on {self.name}'s control socket from pid {sender} (it says pid "
               f"{msg.pid}): the worker launched for it is pid {self.expected_pid}")
        if self.authenticator is not None:
            self.authenticator.report("ready:stranger", why)
        else:
            log.warning("%s", why)
        return False

    def _oversized(self, msg: Any, size: int, batch: list[StageOutput]) -> None:
        """Refuse a too-large message; fail the requests whose outputs it carried."""
        self.oversized_messages += 1
        why = f"worker sent a {size}-byte message, over the limit of {self.max_message_bytes} bytes"
        rids = [it.request_id for it in msg.items] if type(msg) is Outputs else []
        log.error("%s: %s (%s); dropped%s", self.name, why, type(msg).__name__,
                  f", failing requests {sorted(set(rids))[:5]}" if rids else "")
        for rid in dict.fromkeys(rids):
            self._working.discard(rid)
            batch.append(StageOutput(rid, None, True, f"{self.name}: {why}"))

    def _to_channel(self, client: ZmqStageClient, event: Event) -> None:
        if isinstance(event, BaseException):
            self._send.close()  # receive() raises ReplicaDied after the buffered outputs
            return
        try:
            self._send.send_nowait(event)
        except trio.ClosedResourceError:
            pass  # dead or closed: late outputs are dropped
