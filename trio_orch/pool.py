"""A replica pool: N worker replicas of one stage behind one stage client.

A request is bound to one replica for its whole life (its KV cache lives
there).  New requests go to the live replica with the fewest requests in
flight (ties: lowest index).  When a replica dies it is evicted and every
request bound to it gets a per-request ``StageOutput(error_kind="replica_died")``
(DESIGN §3 replica death) while the other replicas keep serving; ``submit``
raises :class:`~trio_orch.types.StageUnavailable` when no replica is live;
``receive`` raises :class:`StageDead` only once every replica is dead (no
replica ever comes back: there is no respawn).

Async-chunk: a pool may have a ``downstream`` pool (the next stage).  When
it submits a request it first *reserves* the downstream replica for it, so
its worker knows where to stream that request's chunks; the downstream
pool's later (prewarm) submit then uses the reserved replica.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import trio

from trio_orch.transport import Event, ZmqStageClient
from trio_orch.types import StageOutput, StageUnavailable

__all__ = ["ReplicaPool", "StageDead", "StageTiming"]


class StageDead(RuntimeError):
    """Every replica of a stage is dead."""


@dataclass(slots=True)
class StageTiming:
    """When (``time.perf_counter``) one request was submitted / first answered / finished here."""

    replica: int
    t_submit: float
    t_first: float | None = None
    t_done: float | None = None


class ReplicaPool:
    """A :class:`~trio_orch.types.StageClient` over the replicas of one stage.

    Create the replicas with ``sink=pool.sink`` and register them with
    :meth:`add_replica`; their owner tasks run elsewhere (the launcher's
    nursery).  ``placements`` counts submits per replica; ``replica_of(rid)``
    says where an active request lives; ``timings`` keeps the last
    ``keep_timings`` requests' :class:`StageTiming`.
    """

    def __init__(self, stage_id: int, *, name: str | None = None, keep_timings: int = 1024) -> None:
        self.stage_id = stage_id
        self.name = name or f"stage{stage_id}"
        self.replicas: list[ZmqStageClient] = []
        self.placements: list[int] = []
        self.downstream: ReplicaPool | None = None
        self.timings: OrderedDict[str, StageTiming] = OrderedDict()
        self.keep_timings = keep_timings
        self.deaths: list[str] = []
        self._bound: dict[str, int] = {}
        self._reserved: dict[str, int] = {}
        self._reserved_at: OrderedDict[str, float] = OrderedDict()
        self.reservation_ttl = 120.0
        self._load: list[int] = []
        self._evicted: set[int] = set()
        self._send, self._recv = trio.open_memory_channel[tuple[int, Event]](math.inf)
        self._closed = False

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
        """Where replica clients put their outputs and their death (synchronous)."""
        try:
            self._send.send_nowait((client.replica, event))
        except trio.ClosedResourceError:
            pass

    def live_replicas(self) -> list[int]:
        return [i for i, c in enumerate(self.replicas) if c.alive and i not in self._evicted]

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
        idx = self._place()
        self._reserved[request_id] = idx
        self._reserved_at[request_id] = time.monotonic()
        self._load[idx] += 1
        return idx

    def release_reservation(self, request_id: str) -> None:
        """Forget a reservation that no submit used (the request ended upstream)."""
        idx = self._reserved.pop(request_id, None)
        self._reserved_at.pop(request_id, None)
        if idx is not None:
            self._load[idx] -= 1

    def _expire_reservations(self) -> None:
        """Drop reservations no submit used in time (e.g. a text-only request upstream)."""
        cutoff = time.monotonic() - self.reservation_ttl
        while self._reserved_at:
            rid, t = next(iter(self._reserved_at.items()))
            if t >= cutoff:
                break
            self.release_reservation(rid)

    def _place(self) -> int:
        live = self.live_replicas()
        if not live:
            raise StageUnavailable(f"{self.name} has no live replica")
        return min(live, key=lambda i: (self._load[i], i))

    # ------------------------------------------------------------------ stage-client protocol
    async def submit(self, request_id: str, payload: Any) -> None:
        if self._closed:
            raise StageUnavailable(f"{self.name} is closed")
        if request_id in self._bound:
            raise ValueError(f"{self.name}: request {request_id!r} is already active here")
        idx = self._reserved.pop(request_id, None)
        self._reserved_at.pop(request_id, None)
        if idx is not None:
            self._load[idx] -= 1
            if idx not in self.live_replicas():
                # Upstream already streams this request's chunks to that replica.
                raise StageUnavailable(f"{self.name}: replica {idx} reserved for {request_id!r} died")
        else:
            idx = self._place()
        downstream = -1
        if self.downstream is not None:
            downstream = self.downstream.reserve(request_id)
        self._bound[request_id] = idx
        self._load[idx] += 1
        self.placements[idx] += 1
        self._remember(request_id, StageTiming(idx, time.perf_counter()))
        try:
            await self.replicas[idx].submit(request_id, payload, downstream=downstream)
        except BaseException:
            self._unbind(request_id)
            raise

    async def abort(self, request_ids: list[str]) -> None:
        by_replica: dict[int, list[str]] = {}
        for rid in request_ids:
            self.release_reservation(rid)
            idx = self._unbind(rid)
            if idx is not None:
                by_replica.setdefault(idx, []).append(rid)
        for idx, rids in by_replica.items():
            await self.replicas[idx].abort(rids)

    async def receive(self) -> list[StageOutput]:
        """At least one output; per-request ``replica_died`` outputs on a replica's death."""
        while True:
            if not self.live_replicas() and self.replicas:
                try:
                    item = self._recv.receive_nowait()
                except (trio.WouldBlock, trio.EndOfChannel):
                    raise StageDead(f"{self.name}: every replica is dead: {'; '.join(self.deaths)}") from None
            else:
                try:
                    item = await self._recv.receive()
                except trio.EndOfChannel:
                    raise StageDead(f"{self.name} is closed") from None
            outs: list[StageOutput] = []
            self._handle(item, outs)
            while True:
                try:
                    self._handle(self._recv.receive_nowait(), outs)
                except (trio.WouldBlock, trio.EndOfChannel):
                    break
            if outs:
                return outs

    async def aclose(self) -> None:
        self._closed = True
        for c in self.replicas:
            await c.aclose()
        self._send.close()

    # ------------------------------------------------------------------ internals
    def _handle(self, item: tuple[int, Event], outs: list[StageOutput]) -> None:
        idx, event = item
        if isinstance(event, BaseException):
            self._evict(idx, str(event), outs)
            return
        now = time.perf_counter()
        for o in event:
            tm = self.timings.get(o.request_id)
            if tm is not None and tm.replica == idx:
                if tm.t_first is None:
                    tm.t_first = now
                if o.finished or o.error is not None:
                    tm.t_done = now
            if (o.finished or o.error is not None) and self._bound.get(o.request_id) == idx:
                self._unbind(o.request_id)
            outs.append(o)

    def _evict(self, idx: int, reason: str, outs: list[StageOutput]) -> None:
        if idx in self._evicted:
            return
        self._evicted.add(idx)
        self.deaths.append(reason)
        for rid in [r for r, i in self._bound.items() if i == idx]:
            self._unbind(rid)
            outs.append(StageOutput(rid, None, True, error=f"{self.name}: {reason}",
                                    error_kind="replica_died", t_produced=time.perf_counter()))
        for rid in [r for r, i in self._reserved.items() if i == idx]:
            self.release_reservation(rid)

    def _unbind(self, request_id: str) -> int | None:
        idx = self._bound.pop(request_id, None)
        if idx is not None:
            self._load[idx] -= 1
        return idx

    def _remember(self, request_id: str, timing: StageTiming) -> None:
        self.timings[request_id] = timing
        self.timings.move_to_end(request_id)
        while len(self.timings) > self.keep_timings:
            self.timings.popitem(last=False)
