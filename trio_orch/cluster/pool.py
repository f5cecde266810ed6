"""A replica pool: N worker replicas of one stage behind one stage client.

A request is bound to one replica for its whole life (its KV cache lives
there).  New requests go to the live replica with the fewest requests in
flight (ties: lowest index), passing over a *suspect* one (silent past its
heartbeats: hung or stopped) while another is not.  When a replica dies it is evicted and every
request bound to it gets a per-request ``StageOutput(error_kind="replica_died")``
(the routing contract's replica death) while the other replicas keep serving; ``submit``
raises :class:`~trio_orch.types.StageUnavailable` when no replica is live;
``receive`` raises :class:`StageDied` only once every replica is dead and
no supervisor will bring one back (``supervised``; see
:mod:`trio_orch.cluster.supervisor`, which swaps a replacement in with
:meth:`ReplicaPool.replace_replica`).  A *cordoned* replica keeps serving
the requests it has but gets no new ones (a replica leaving the pool).

Async-chunk: a pool may have a ``downstream`` pool (the next stage).  When
it submits a request it first *reserves* the downstream replica for it, so
its worker knows where to stream that request's chunks; the downstream
pool's later (prewarm) submit then uses the reserved replica.  A prefill
stage hands its KV cache to the decode stage the same way (the reservation
outlives the prefill's finish; the forward uses it).

Resumable requests: ``update`` sends a request's next input segment to the
replica it is bound to (where its model state lives).  Such a request stays
bound while it finishes segments; it is unbound when it finishes the segment
its final update opened (or fails).

Companions (CFG): ``submit(..., companion_of=parent)`` places the companion
on its parent's replica.
"""

from __future__ import annotations

import logging
import math
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import trio

from trio_orch.cluster.transport import Event, RpcError, ZmqStageClient
from trio_orch.histogram import STAGE_TIME_BUCKETS, Histogram
from trio_orch.types import StageDied, StageOutput, StageUnavailable

__all__ = ["ReplicaPool", "StageTiming"]

log = logging.getLogger("trio_orch.cluster.pool")


@dataclass(slots=True)
class StageTiming:
    """When (``time.perf_counter``) one request was submitted / first answered / finished here.

    ``queue_s`` and ``compute_s`` are what the worker reported with the
    request's finishing output: seconds it waited for a place in the worker's
    batch, and seconds it then spent there (None: not reported).
    ``retried_from``: the replica it was on before, which died holding it (the
    routing core failed it over to ``replica``); None: its first placement here.
    """

    replica: int
    t_submit: float
    t_first: float | None = None
    t_done: float | None = None
    queue_s: float | None = None
    compute_s: float | None = None
    retried_from: int | None = None


class ReplicaPool:
    """A :class:`~trio_orch.types.StageClient` over the replicas of one stage.

    Create the replicas with ``sink=pool.sink`` and register them with
    :meth:`add_replica`; their owner tasks run elsewhere (the launcher's
    nursery).  ``placements`` counts submits per replica; ``replica_of(rid)``
    says where an active request lives; ``timings`` keeps the last
    ``keep_timings`` requests' :class:`StageTiming`.  A submit's priority and
    deadline are passed to its replica (``accepts_priority``).
    """

    def __init__(self, stage_id: int, *, name: str | None = None, keep_timings: int = 1024) -> None:
        self.stage_id = stage_id
        self.name = name or f"stage{stage_id}"
        self.replicas: list[ZmqStageClient] = []
        self.placements: list[int] = []
        self.downstream: ReplicaPool | None = None
        #: the downstream stage gets its submit after a request finished here (a prefill stage
        #: handing its KV cache to a decode stage): the reservation outlives the finish
        self.timings: OrderedDict[str, StageTiming] = OrderedDict()
        self.keep_timings = keep_timings
        self.deaths: list[str] = []
        self._bound: dict[str, int] = {}
        self._reserved: dict[str, int] = {}
        self._reserved_at: OrderedDict[str, float] = OrderedDict()
        #: requests whose input from the upstream stage was lost with a replica (a reservation, or
        #: a request it fed there): a submit of theirs gets replica_died, a resubmit too
        self._doomed: OrderedDict[str, None] = OrderedDict()
        self._fed: set[str] = set()  # bound requests whose replica the upstream stage chose and feeds
        self._died: OrderedDict[str, int] = OrderedDict()  # rid -> the replica that died holding it
        self.reservation_ttl = 120.0
        self._load: list[int] = []
        self._evicted: set[int] = set()
        self._send, self._recv = trio.open_memory_channel[tuple[int, Event, ZmqStageClient | None]](math.inf)
        self._closed = False
        #: a supervisor may bring replicas back: ``receive`` then waits instead of raising StageDied
        self.supervised = False
        self.cordoned: set[int] = set()
        self._late: list[StageOutput] = []  # replica_died outputs made outside receive()
        #: outputs a replica sent for a request it does not hold, dropped here: "unknown" (never
        #: given to it), "duplicate_finish" (it already finished it), "late" (after an abort; benign)
        self.stray_outputs: dict[str, int] = {"unknown": 0, "duplicate_finish": 0, "late": 0}
        self._ended: OrderedDict[str, tuple[int, bool]] = OrderedDict()  # rid -> (replica, finished)
        #: resumable requests bound here -> [segments sent and not finished, final segment sent]
        self._segments: dict[str, list[Any]] = {}
        # push fast path (``pump``): while set, the replicas' sink routes straight to the orchestrator
        self._deliver: Callable[[list[StageOutput]], None] | None = None
        self._pump_dead = trio.Event()
        self._replica_watchers: list[Callable[[int, int], None]] = []
        self._reported: tuple[int, int] | None = None
        #: seconds requests waited in a worker before its batch took them, and spent in the batch
        #: (reported by the workers with each request's finishing output)
        self.queue_seconds = Histogram(STAGE_TIME_BUCKETS)
        self.compute_seconds = Histogram(STAGE_TIME_BUCKETS)
        #: the stage before this one (set by the launcher): a request it finished and this stage got
        #: next has its hand-off timed, from its finishing output here to its submit there
        self.upstream: ReplicaPool | None = None
        #: seconds from the upstream stage's finishing output of a request to its submit here (the
        #: head's hand-off: the forward, the routing decision, the encoding)
        self.transfer_seconds = Histogram(STAGE_TIME_BUCKETS)
        self._input_bytes_before = 0  # what replaced replicas' clients had sent (the counter goes on)
        #: set by the orchestrator that routes through this pool: replicas join it through its core
        self.join_gate: Any = None
        #: slots a supervisor gave up (no restart will come) -> why, for ``/health``
        self.given_up: dict[int, str] = {}
        #: dead slots whose replacement is on its way -> what it waits for (``/health``: ``restart``)
        self.restart_notes: dict[int, str] = {}

    def __repr__(self) -> str:
        return f"<ReplicaPool {self.name}: {len(self.live_replicas())}/{len(self.replicas)} live>"

    # ------------------------------------------------------------------ replicas
    def add_replica(self, client: ZmqStageClient) -> int:
        """Register a replica (created with ``sink=self.sink``); return its index."""
        idx = len(self.replicas)
        client.replica = idx
        self.replicas.append(client)
        self.placements.append(0)
        self._load.append(0)
        return idx

    def sink(self, client: ZmqStageClient, event: Event) -> None:
        """Where replica clients put their outputs and their death (synchronous).

        While pumped, the event is handled right here, in the replica's socket
        owner task, and its outputs go straight to the orchestrator.
        """
        if self._deliver is not None:
            outs, self._late = self._late, []
            self._handle((client.replica, event, client), outs)
            self._push(outs)
            return
        try:
            self._send.send_nowait((client.replica, event, client))
        except trio.ClosedResourceError:
            pass

    def _push(self, outs: list[StageOutput]) -> None:
        deliver = self._deliver
        if outs and deliver is not None:
            deliver(outs)
        if self._all_dead():
            self._pump_dead.set()

    def _all_dead(self) -> bool:
        return self._closed or (bool(self.replicas) and not self.live_replicas() and not self.supervised)

    @property
    def closed(self) -> bool:
        return self._closed

    def replace_replica(self, idx: int, client: ZmqStageClient, reason: str = "replaced") -> None:
        """Put a new, ready ``client`` (made with ``sink=self.sink``) in slot ``idx``.

        The old client of that slot is evicted first if its death was not
        handled yet (its requests get ``replica_died``); its later events are
        ignored.  Keeping the index keeps async-chunk ``downstream`` indices valid.
        """
        if not 0 <= idx < len(self.replicas):
            raise IndexError(f"{self.name}: no replica slot {idx}")
        if idx not in self._evicted:
            self._evict(idx, reason, self._late)
        client.replica = idx
        self._input_bytes_before += self.replicas[idx].input_bytes
        self.replicas[idx] = client
        self._evicted.discard(idx)
        self._replicas_changed()
        self._wake()

    @property
    def input_bytes(self) -> int:
        """Bytes of the requests' inputs sent to this stage's replicas so far (replaced ones too)."""
        return self._input_bytes_before + sum(c.input_bytes for c in self.replicas)

    def cordon(self, idx: int) -> None:
        """Stop placing new requests on replica ``idx`` (it keeps its current ones)."""
        self.cordoned.add(idx)
        self._replicas_changed()

    def uncordon(self, idx: int) -> None:
        self.cordoned.discard(idx)
        self._replicas_changed()

    def replica_counts(self) -> tuple[int, int]:
        """(replicas that take new requests now, replica slots)."""
        if self._closed:
            return 0, len(self.replicas)
        return sum(1 for i in self.live_replicas() if i not in self.cordoned), len(self.replicas)

    def watch_replicas(self, callback: Callable[[int, int], None]) -> None:
        """Call ``callback(live, total)`` whenever :meth:`replica_counts` changes."""
        self._replica_watchers.append(callback)

    def _replicas_changed(self) -> None:
        counts = self.replica_counts()
        if counts != self._reported:
            self._reported = counts
            for cb in self._replica_watchers:
                cb(*counts)

    def give_up(self, idx: int, why: str) -> None:
        """A supervisor will not restart slot ``idx`` again; ``why`` is reported with its state."""
        self.given_up[idx] = why

    def note_restart(self, idx: int, note: str | None) -> None:
        """What the replacement of dead slot ``idx`` waits for (e.g. a node to place it on); None: clear."""
        if note is None:
            self.restart_notes.pop(idx, None)
        else:
            self.restart_notes[idx] = note

    def replica_states(self) -> list[dict[str, Any]]:
        """Each slot's state for ``/health`` (run in the pool's Trio run: silence is read now).

        ``state``: ``ready``; ``suspect`` (alive but silent past its heartbeats: hung or stopped,
        not yet declared dead); ``starting`` (no handshake yet); ``cordoned`` (leaving: takes no
        new request); ``restarting`` (dead, a supervisor brings it back; ``restart``, when given,
        says what the replacement waits for); ``given_up`` (dead, the supervisor stopped
        restarting it: ``reason`` says why); ``dead``; ``closed``.
        """
        out: list[dict[str, Any]] = []
        for idx, c in enumerate(self.replicas):
            st: dict[str, Any] = {"replica": idx}
            dead = not c.alive or idx in self._evicted
            if idx in self.given_up:
                st.update(state="given_up", given_up=True, reason=self.given_up[idx])
            elif self._closed:
                st["state"] = "closed"
            elif dead:
                last = self.deaths[-1] if self.deaths else "closed"
                st.update(state="restarting" if self.supervised else "dead",
                          reason=getattr(c, "dead_reason", None) or last)
                if idx in self.restart_notes and self.supervised:
                    st["restart"] = self.restart_notes[idx]
            elif getattr(c, "ready", True) is None:
                st["state"] = "starting"
            elif getattr(c, "suspect", False):
                silent = c.silent_for()
                dead_after = f"; dead after {c.heartbeat_timeout:g}s" if c.heartbeat_timeout else ""
                st.update(state="suspect", silent_s=round(silent, 3),
                          reason=f"no message for {silent:.1f}s (heartbeats every "
                                 f"{c.heartbeat_interval:g}s{dead_after})")
            elif idx in self.cordoned:
                st["state"] = "cordoned"
            else:
                st["state"] = "ready"
            out.append(st)
        return out

    def ready_info(self) -> dict[str, Any]:
        """What the first ready replica reported in its handshake (the model's ``info()``: its
        tokenizer, context length, token caps); empty while none is ready.  Any thread: each
        replica's handshake is set once."""
        for c in self.replicas:
            ready = c.ready
            if ready is not None and isinstance(ready.info, dict):
                return ready.info
        return {}

    def stop_supervision(self) -> None:
        """No replica will come back: ``receive`` raises StageDied once none is live."""
        self.supervised = False
        self._wake()

    def _wake(self) -> None:
        if self._deliver is not None:
            outs, self._late = self._late, []
            self._push(outs)
            return
        try:
            self._send.send_nowait((-1, [], None))
        except trio.ClosedResourceError:
            pass

    def live_replicas(self) -> list[int]:
        return [i for i, c in enumerate(self.replicas) if c.alive and i not in self._evicted]

    def timing_of(self, request_id: str) -> StageTiming | None:
        """This stage's :class:`StageTiming` of a recent request (None: not run here, or forgotten)."""
        return self.timings.get(request_id)

    def replica_of(self, request_id: str) -> int | None:
        return self._bound.get(request_id, self._reserved.get(request_id))

    def in_flight(self) -> list[int]:
        """Requests bound or reserved per replica."""
        return list(self._load)

    def reserve(self, request_id: str) -> int:
        """Pick (once) the replica that will serve ``request_id``; StageUnavailable if none."""
        idx = self.replica_of(request_id)
        if idx is not None and idx in self.live_replicas():
            return idx
        self._expire_reservations()
        self._doomed.pop(request_id, None)
        idx = self._place()
        self._reserved[request_id] = idx
        self._reserved_at[request_id] = time.monotonic()
        self._load[idx] += 1
        return idx

    def release_reservation(self, request_id: str, *, drop_chunks: bool = False) -> None:
        """Forget a reservation that no submit used (the request ended upstream).

        ``drop_chunks``: also abort the request on the reserved replica, whose
        inbox would otherwise hold the chunks streamed to it until they expire.
        """
        idx = self._reserved.pop(request_id, None)
        self._reserved_at.pop(request_id, None)
        if idx is not None:
            self._load[idx] -= 1
            if drop_chunks:
                abort_nowait = getattr(self.replicas[idx], "abort_nowait", None)
                if abort_nowait is not None:
                    abort_nowait([request_id])

    def _expire_reservations(self) -> None:
        """Drop reservations no submit used in time (e.g. a text-only request upstream)."""
        cutoff = time.monotonic() - self.reservation_ttl
        while self._reserved_at:
            rid, t = next(iter(self._reserved_at.items()))
            if t >= cutoff:
                break
            self.release_reservation(rid)

    def _place(self) -> int:
        """The least loaded live replica; a suspect one (silent past its heartbeats) only if all are."""
        live = [i for i in self.live_replicas() if i not in self.cordoned]
        if not live:
            raise StageUnavailable(f"{self.name} has no live replica")
        return min(live, key=lambda i: (getattr(self.replicas[i], "suspect", False), self._load[i], i))

    # ------------------------------------------------------------------ stage-client protocol
    accepts_priority = True

    async def submit(self, request_id: str, payload: Any, *, sampling: dict[str, Any] | None = None,
                     resumable: bool = False, companion_of: str | None = None, priority: int = 0,
                     deadline_in: float | None = None) -> None:
        """Bind ``request_id`` to a replica (its reserved one, else the least loaded) and submit it there.

        ``sampling``: this stage's parameters for the request, passed to the
        replica as they are.  ``resumable``: more input segments follow
        (:meth:`update`); the request stays bound.  ``companion_of``: the
        request is a companion (CFG) of that request and runs on its replica.
        A request whose replica was chosen before it died (a companion's
        parent's, or one reserved by the upstream stage, which already sends
        it data) gets a ``replica_died`` output.
        """
        placed = self._bind_submit(request_id, resumable, companion_of)
        if placed is None:
            return
        idx, downstream = placed
        opts = self._submit_options(sampling, resumable, priority, deadline_in)
        try:
            await self.replicas[idx].submit(request_id, payload, downstream=downstream, **opts)
        except BaseException:
            self._unbind(request_id)
            raise

    def submit_nowait(self, request_id: str, payload: Any, *, sampling: dict[str, Any] | None = None,
                      resumable: bool = False, companion_of: str | None = None, priority: int = 0,
                      deadline_in: float | None = None) -> bool:
        """:meth:`submit` done synchronously, where every live replica takes a submit so; whether it was.

        False (nothing done, nothing bound) when a replica has only the
        awaited ``submit``: the caller awaits :meth:`submit` then.
        """
        replicas = self.replicas
        if not all(hasattr(replicas[i], "submit_nowait") for i in self.live_replicas()):
            return False
        placed = self._bind_submit(request_id, resumable, companion_of)
        if placed is None:
            return True
        idx, downstream = placed
        try:
            replicas[idx].submit_nowait(request_id, payload, downstream=downstream,
                                        **self._submit_options(sampling, resumable, priority, deadline_in))
        except BaseException:
            self._unbind(request_id)
            raise
        return True

    def _bind_submit(self, request_id: str, resumable: bool,
                     companion_of: str | None) -> tuple[int, int] | None:
        """Choose the replica of a submit and bind the request to it: ``(replica, downstream replica)``.

        None when the replica it must go to is gone: its ``replica_died``
        output is on its way (:meth:`_lost`).  The state changes are all made
        here, before the I/O; the caller unbinds if the send raises.
        """
        if self._closed:
            raise StageUnavailable(f"{self.name} is closed")
        if request_id in self._bound:
            raise ValueError(f"{self.name}: request {request_id!r} is already active here")
        if companion_of is not None:
            idx = self._parent_replica(request_id, companion_of)
        elif request_id in self._doomed:
            self._lost(request_id, f"the replica reserved for {request_id!r} died")
            return None
        else:
            idx = self._reserved.pop(request_id, None)
            self._reserved_at.pop(request_id, None)
            if idx is not None:
                self._load[idx] -= 1
                self._fed.add(request_id)
            else:
                idx = self._place()
        if idx not in self.live_replicas():
            self._lost(request_id, f"replica {idx}, chosen for {request_id!r}, died")
            return None
        downstream = -1
        if self.downstream is not None:
            downstream = self.downstream.reserve(request_id)
        self._bound[request_id] = idx
        self._load[idx] += 1
        self.placements[idx] += 1
        now = time.perf_counter()
        retried_from = self._died.pop(request_id, None)
        self._remember(request_id, StageTiming(idx, now, retried_from=retried_from))
        up = self.upstream.timings.get(request_id) if self.upstream is not None else None
        if up is not None and up.t_done is not None and retried_from is None:
            self.transfer_seconds.observe(now - up.t_done)  # a hand-off (no prewarm submit, no failover)
        if resumable:
            self._segments[request_id] = [1, False]
        return idx, downstream

    @staticmethod
    def _submit_options(sampling: dict[str, Any] | None, resumable: bool, priority: int,
                        deadline_in: float | None) -> dict[str, Any]:
        """The replica's submit options: only those set."""
        opts: dict[str, Any] = {}
        if sampling is not None:
            opts["sampling"] = sampling
        if resumable:
            opts["resumable"] = True
        if priority:
            opts["priority"] = priority
        if deadline_in is not None:
            opts["deadline_in"] = deadline_in
        return opts

    async def update(self, request_id: str, payload: Any, *, final: bool = False,
                     sampling: Any = None) -> None:
        """The next input segment of a resumable request, to the replica it is bound to.

        Raises ``ValueError`` for a request not submitted here as resumable
        (or after its final segment) and :class:`StageUnavailable` when it is
        no longer bound here (it ended, or its replica's death was already
        answered).  A segment sent while its replica's death is on its way to
        the core (the replica is dead, or evicted and the request not
        resubmitted yet) is dropped instead: the core keeps every segment it
        sent to a stage that answered nothing, so its failover resends this one
        after the others, in order -- or the coming ``replica_died`` ends the
        request.  A raise here would end it ``stage_unavailable`` first.
        """
        if self._closed:
            raise StageUnavailable(f"{self.name} is closed")
        idx = self._bound.get(request_id)
        if idx is None:
            if request_id in self._died:  # evicted: its replica_died output is on its way
                return
            raise StageUnavailable(f"{self.name}: request {request_id!r} is not active here "
                                   "(it ended, or its replica died)")
        if getattr(self.replicas[idx], "dead_reason", None) is not None:
            return  # dead, its eviction not handled yet (the death event is queued): as above
        seg = self._segments.get(request_id)
        if seg is None:
            raise ValueError(f"{self.name}: request {request_id!r} was not submitted as resumable")
        if seg[1]:
            raise ValueError(f"{self.name}: request {request_id!r} already had its final segment")
        seg[0] += 1
        seg[1] = final
        await self.replicas[idx].update(request_id, payload, final=final)

    def _parent_replica(self, request_id: str, parent: str) -> int:
        """The replica a companion must run on: its parent's (bound now, or just finished there)."""
        idx = self._bound.get(parent)
        if idx is None:
            ended = self._ended.get(parent)
            if ended is None:
                raise ValueError(f"{self.name}: companion {request_id!r} of {parent!r}, "
                                 "which was never submitted here")
            idx = ended[0]
        return idx

    def _lost(self, request_id: str, why: str) -> None:
        """Answer a submit whose replica is gone with its ``replica_died`` output (not a raise:
        the request was bound to that replica before it died, as if it had been submitted)."""
        self._late.append(StageOutput(request_id, None, True, error=f"{self.name}: {why}",
                                      error_kind="replica_died", t_produced=time.perf_counter()))
        self._wake()

    async def abort(self, request_ids: list[str]) -> None:
        by_replica: dict[int, list[str]] = {}
        for rid in request_ids:
            # never submitted here (reserved by the upstream stage, which streams chunks to it):
            # free the reservation and tell that replica to drop the chunks
            self.release_reservation(rid, drop_chunks=True)
            idx = self._unbind(rid)
            if idx is not None:
                by_replica.setdefault(idx, []).append(rid)
        for idx, rids in by_replica.items():
            await self.replicas[idx].abort(rids)

    async def confirm_abort(self, request_ids: list[str], timeout: float = 5.0
                            ) -> list[tuple[int, Any, str | None]]:
        """Abort like :meth:`abort`, then wait until each replica that held one confirms it stopped.

        One ``(replica, ids it stopped, None)`` per replica asked, or
        ``(replica, None, error)`` for one that did not confirm within
        ``timeout`` (hung, stopped, dead): the replicas are asked concurrently,
        each under its own deadline.
        """
        by_replica: dict[int, list[str]] = {}
        for rid in request_ids:
            self.release_reservation(rid, drop_chunks=True)
            idx = self._unbind(rid)
            if idx is not None:
                by_replica.setdefault(idx, []).append(rid)
        return await self._each(sorted(by_replica),
                                lambda c, idx: c.abort_confirmed(by_replica[idx], timeout), timeout)

    async def rpc(self, method: str, args: Sequence[Any] = (), kwargs: Mapping[str, Any] | None = None,
                  timeout: float = 5.0) -> list[tuple[int, Any, str | None]]:
        """Call ``method(*args, **kwargs)`` on every live replica: ``(replica, value, error)`` each.

        The replicas are called concurrently, each under its own deadline: a
        hung or stopped one answers with its own timeout error while the
        others answer (and requests keep flowing).  No live replica: one
        ``(-1, None, error)``.
        """
        live = self.live_replicas()
        if not live:
            return [(-1, None, f"{self.name} has no live replica")]
        return await self._each(live, lambda c, idx: c.rpc(method, args, kwargs, timeout=timeout), timeout)

    async def _each(self, replicas: list[int], call: Callable[[ZmqStageClient, int], Awaitable[Any]],
                    timeout: float) -> list[tuple[int, Any, str | None]]:
        answers: dict[int, tuple[int, Any, str | None]] = {}

        async def one(idx: int) -> None:
            try:
                with trio.fail_after(timeout + 1.0):  # the client's own deadline comes first
                    answers[idx] = (idx, await call(self.replicas[idx], idx), None)
            except (trio.TooSlowError, TimeoutError):
                answers[idx] = (idx, None, f"timeout: replica {idx} did not answer within {timeout:g}s")
            except RpcError as exc:  # the worker's own error message names the method
                answers[idx] = (idx, None, str(exc))
            except Exception as exc:
                answers[idx] = (idx, None, f"{type(exc).__name__}: {exc}")

        async with trio.open_nursery() as nursery:
            for idx in replicas:
                nursery.start_soon(one, idx, name=f"{self.name}.replica[{idx}].call")
        return [answers[i] for i in replicas]

    async def receive(self) -> list[StageOutput]:
        """At least one output; per-request ``replica_died`` outputs on a replica's death."""
        while True:
            if not self.live_replicas() and self.replicas and not self.supervised and not self._late:
                try:
                    item = self._recv.receive_nowait()
                except (trio.WouldBlock, trio.EndOfChannel):
                    raise StageDied(f"{self.name}: every replica is dead: {'; '.join(self.deaths)}") from None
            else:
                try:
                    item = await self._recv.receive()
                except trio.EndOfChannel:
                    raise StageDied(f"{self.name} is closed") from None
            outs, self._late = self._late, []
            self._handle(item, outs)
            while True:
                try:
                    self._handle(self._recv.receive_nowait(), outs)
                except (trio.WouldBlock, trio.EndOfChannel):
                    break
            if outs:
                return outs

    async def pump(self, deliver: Callable[[list[StageOutput]], None]) -> None:
        """The push fast path (:class:`~trio_orch.types.PushStageClient`).

        From now on each replica event is handled synchronously in the
        replica's socket owner task and its outputs go to ``deliver``: one
        task hop less than ``receive``.  Returns by raising
        :class:`StageDied` once every replica is dead for good (or closed).
        """
        outs, self._late = self._late, []
        while True:  # what arrived before pumping started
            try:
                self._handle(self._recv.receive_nowait(), outs)
            except (trio.WouldBlock, trio.EndOfChannel):
                break
        self._deliver = deliver
        try:
            self._push(outs)
            await self._pump_dead.wait()
        finally:
            self._deliver = None
        if self._closed:
            raise StageDied(f"{self.name} is closed")
        raise StageDied(f"{self.name}: every replica is dead: {'; '.join(self.deaths)}")

    async def aclose(self) -> None:
        self._pump_dead.set()
        self._closed = True
        self._replicas_changed()
        for c in self.replicas:
            await c.aclose()
        self._send.close()

    # ------------------------------------------------------------------ internals
    def _handle(self, item: tuple[int, Event, ZmqStageClient | None], outs: list[StageOutput]) -> None:
        idx, event, client = item
        if isinstance(event, BaseException):
            if client is self.replicas[idx]:  # not a replaced replica's late death
                self._evict(idx, str(event), outs)
            return
        now = time.perf_counter()
        current = client is None or client is self.replicas[idx]
        bound, timings, append = self._bound, self.timings, outs.append  # (once per event, not per output)
        for o in event:
            rid = o.request_id
            held = bound.get(rid) == idx
            if current and not held and self._stray(idx, o):
                continue
            ends = o.finished or o.error is not None
            tm = timings.get(rid)
            if tm is not None and tm.replica == idx:
                if tm.t_first is None:
                    tm.t_first = now
                if ends:
                    tm.t_done = now
            if o.timing is not None:
                tm_q, tm_c = o.timing
                self.queue_seconds.observe(tm_q)
                self.compute_seconds.observe(tm_c)
                if tm is not None and tm.replica == idx:
                    tm.queue_s, tm.compute_s = tm_q, tm_c
            if ends and held:
                seg = self._segments.get(rid)
                if seg is not None and o.error is None:  # a resumable request finished a segment
                    seg[0] -= 1
                    if seg[0] > 0 or not seg[1]:
                        append(o)
                        continue
                self._unbind(rid, finished=True, keep_next=o.error is None)
            append(o)

    def _stray(self, idx: int, o: StageOutput) -> bool:
        """Classify, count and log an output of replica ``idx`` for a request it does not hold."""
        ended = self._ended.get(o.request_id)
        if ended is None or ended[0] != idx:
            kind, what = "unknown", "a request id it was never given"
        elif ended[1] and (o.finished or o.error is not None):
            kind, what = "duplicate_finish", "a request it had already finished"
        else:
            self.stray_outputs["late"] += 1  # raced with an abort or a death: expected
            return True
        n = self.stray_outputs[kind] = self.stray_outputs[kind] + 1
        if n <= 5 or n % 1000 == 0:
            log.error("%s replica %d sent an output for %s (%r); dropped (%d such so far)",
                      self.name, idx, what, o.request_id, n)
        return True

    def _evict(self, idx: int, reason: str, outs: list[StageOutput]) -> None:
        if idx in self._evicted:
            return
        self._evicted.add(idx)
        self.deaths.append(reason)
        self._replicas_changed()
        for rid in [r for r, i in self._bound.items() if i == idx]:
            if rid in self._fed:  # its input came from the upstream replica: a resubmit cannot replay it
                self._doomed[rid] = None
            self._unbind(rid)
            self._died[rid] = idx
            outs.append(StageOutput(rid, None, True, error=f"{self.name}: {reason}",
                                    error_kind="replica_died", t_produced=time.perf_counter()))
        for rid in [r for r, i in self._reserved.items() if i == idx]:
            self.release_reservation(rid)
            self._doomed[rid] = None  # upstream streams its chunks there: its submit must fail
        while len(self._doomed) > 4096:
            self._doomed.popitem(last=False)
        while len(self._died) > 4096:
            self._died.popitem(last=False)

    def _unbind(self, request_id: str, *, finished: bool = False, keep_next: bool = False) -> int | None:
        idx = self._bound.pop(request_id, None)
        self._segments.pop(request_id, None)
        self._fed.discard(request_id)
        if idx is not None:
            self._load[idx] -= 1
            if self.downstream is not None and not keep_next:
                # It ended here early (abort, error, death): the next stage will get no submit
                # for it (a decided one is followed by an abort), so free a reservation still
                # open there and tell that replica to drop the chunks already streamed to it.
                # A request that *finished* here keeps its reservation: its submit to the next
                # stage may still be on its way (the orchestrator yields between the submits of
                # one request); one that stops at this stage is dropped there by the
                # orchestrator's own abort (the routing core asks for it at start).
                self.downstream.release_reservation(request_id, drop_chunks=True)
            ended = self._ended
            ended[request_id] = (idx, finished)
            if len(ended) > 8192:
                ended.popitem(last=False)
        return idx

    def _remember(self, request_id: str, timing: StageTiming) -> None:
        self.timings[request_id] = timing
        self.timings.move_to_end(request_id)
        while len(self.timings) > self.keep_timings:
            self.timings.popitem(last=False)
