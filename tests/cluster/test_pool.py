"""ReplicaPool placement, binding, eviction and reservations, with in-process fake replicas."""

from __future__ import annotations

from typing import Any

import pytest
import trio
import trio.testing

from trio_orch.cluster.pool import ReplicaPool
from trio_orch.cluster.transport import ReplicaDied
from trio_orch.core import Action, Router, Submit, Update
from trio_orch.types import StageDied, StageOutput, StageUnavailable


class FakeReplica:
    """Stands in for a ZmqStageClient: records calls, emits through the pool's sink."""

    def __init__(self, pool: ReplicaPool) -> None:
        self.pool = pool
        self.replica = -1
        self.alive = True
        self.suspect = False  # what a ZmqStageClient says once silent past its heartbeats
        self.heartbeat_interval, self.heartbeat_timeout = 0.2, 5.0
        self.submits: list[tuple[str, Any, int]] = []
        self.updates: list[tuple[str, Any, bool]] = []
        self.aborts: list[str] = []
        self.dead_reason: str | None = None
        self.input_bytes = 0  # a ZmqStageClient counts what it encodes
        pool.add_replica(self)  # type: ignore[arg-type]

    async def submit(self, rid: str, payload: Any, *, downstream: int = -1, **opts: Any) -> None:
        if not self.alive:
            raise StageUnavailable("dead")
        self.submits.append((rid, payload, downstream))

    async def update(self, rid: str, payload: Any, *, final: bool = False) -> None:
        if not self.alive:
            raise StageUnavailable("dead")
        self.updates.append((rid, payload, final))

    async def abort(self, rids: list[str]) -> None:
        self.abort_nowait(rids)

    def abort_nowait(self, rids: list[str]) -> None:
        self.aborts.extend(rids)

    async def aclose(self) -> None:
        self.alive = False

    def silent_for(self) -> float:
        return 1.0

    def emit(self, rid: str, data: Any = None, finished: bool = False) -> None:
        self.pool.sink(self, [StageOutput(rid, data, finished)])  # type: ignore[arg-type]

    def die(self, why: str = "boom") -> None:
        self.alive = False
        self.dead_reason = why
        self.pool.sink(self, ReplicaDied(why))  # type: ignore[arg-type]


async def test_least_in_flight_placement_and_binding() -> None:
    pool = ReplicaPool(0)
    a, b = FakeReplica(pool), FakeReplica(pool)
    for i in range(4):
        await pool.submit(f"r{i}", i)
    assert [s[0] for s in a.submits] == ["r0", "r2"] and [s[0] for s in b.submits] == ["r1", "r3"]
    a.emit("r0", "x", finished=True)
    a.emit("r2", "y", finished=True)
    outs = await pool.receive()
    assert [o.data for o in outs] == ["x", "y"]
    assert pool.in_flight() == [0, 2]
    await pool.submit("r4", 4)  # a now has the fewest in flight
    assert pool.replica_of("r4") == 0 and pool.placements == [3, 2]


async def test_replica_death_fails_only_its_requests_and_evicts_it() -> None:
    pool = ReplicaPool(1, name="talker")
    a, b = FakeReplica(pool), FakeReplica(pool)
    for i in range(4):
        await pool.submit(f"r{i}", i)
    a.emit("r0", "partial")
    a.die("worker process exited with code -9")
    outs = await pool.receive()
    assert outs[0].data == "partial"
    died = {o.request_id: o for o in outs[1:]}
    assert set(died) == {"r0", "r2"}
    assert all(o.finished and o.error_kind == "replica_died" and "code -9" in o.error for o in died.values())
    assert pool.live_replicas() == [1]
    await pool.submit("r5", 5)
    assert b.submits[-1][0] == "r5"  # new work goes to the survivor
    b.die()
    outs = await pool.receive()
    assert {o.request_id for o in outs} == {"r1", "r3", "r5"}
    with pytest.raises(StageUnavailable):
        await pool.submit("r6", 6)
    with pytest.raises(StageDied, match="every replica is dead"):
        await pool.receive()


async def test_abort_goes_to_the_bound_replica_and_frees_it() -> None:
    pool = ReplicaPool(0)
    a, b = FakeReplica(pool), FakeReplica(pool)
    await pool.submit("r0", 0)
    await pool.submit("r1", 1)
    await pool.abort(["r1", "unknown"])
    assert b.aborts == ["r1"] and a.aborts == []
    assert pool.in_flight() == [1, 0]


async def test_downstream_reservation_routes_chunks_and_the_prewarm_submit() -> None:
    up, down = ReplicaPool(0), ReplicaPool(1)
    up.downstream = down
    u = FakeReplica(up)
    d0, d1 = FakeReplica(down), FakeReplica(down)
    await down.submit("busy", None)  # d0 has one in flight
    await up.submit("r1", "prompt")
    assert u.submits == [("r1", "prompt", 1)]  # stage 0 streams r1's chunks to replica 1
    await down.submit("r1", {"prewarm": 1})
    assert d1.submits == [("r1", {"prewarm": 1}, -1)] and d0.submits[-1][0] == "busy"


async def test_a_submit_whose_reserved_replica_died_gets_replica_died(
        autojump_clock: trio.testing.MockClock) -> None:
    up, down = ReplicaPool(0), ReplicaPool(1)
    up.downstream = down
    FakeReplica(up)
    d0, d1 = FakeReplica(down), FakeReplica(down)
    await up.submit("r1", "prompt")
    assert down.replica_of("r1") == 0
    d0.die()
    with trio.move_on_after(0.05):  # autojump clock: the death is processed first (it has no output)
        await down.receive()
    assert down.live_replicas() == [1]
    await down.submit("r1", {"prewarm": 1})  # its chunks went to the dead replica: not to d1
    [o] = await down.receive()
    assert (o.request_id, o.error_kind, o.finished) == ("r1", "replica_died", True) and "reserved" in o.error
    assert d1.submits == [] and down.in_flight() == [0, 0]


async def test_a_companion_runs_on_its_parents_replica() -> None:
    pool = ReplicaPool(0)
    a, b = FakeReplica(pool), FakeReplica(pool)
    await pool.submit("other", None)  # a is busier: b gets the parent
    await pool.submit("r1", "a cat")
    await pool.submit("r1:neg", "blurry", companion_of="r1")
    assert [s[0] for s in b.submits] == ["r1", "r1:neg"] and [s[0] for s in a.submits] == ["other"]
    b.emit("r2", None)  # noise: never given, dropped as stray
    b.emit("r1", "e", finished=True)
    await pool.receive()
    await pool.submit("r1:neg2", "ugly", companion_of="r1")  # the parent already finished there
    assert b.submits[-1][0] == "r1:neg2"
    with pytest.raises(ValueError, match="never submitted"):
        await pool.submit("x:neg", "n", companion_of="x")
    b.die()
    await pool.receive()
    await pool.submit("r1:neg3", "late", companion_of="r1")  # its parent's replica is gone
    [o] = await pool.receive()
    assert o.request_id == "r1:neg3" and o.error_kind == "replica_died" and a.submits[-1][0] == "other"


async def test_a_handoff_reservation_outlives_the_upstream_finish_but_not_its_failure() -> None:
    up, down = ReplicaPool(0), ReplicaPool(1)
    up.downstream = down
    u = FakeReplica(up)
    d0, d1 = FakeReplica(down), FakeReplica(down)
    await down.submit("busy", None)
    await up.submit("r1", "prompt")
    await up.submit("r2", "prompt")
    assert [s[2] for s in u.submits] == [1, 0]  # each prefill knows its decode replica
    u.emit("r1", {"prefilled": 6}, finished=True)
    up.sink(u, [StageOutput("r2", None, True, error="out of memory")])  # type: ignore[arg-type]
    await up.receive()
    assert down.replica_of("r1") == 1 and down.replica_of("r2") is None
    assert d0.aborts == ["r2"] and d1.aborts == []  # r2's KV will never be used: dropped there
    await down.submit("r1", {"kv": "handed off"})  # the forward, after the prefill finished
    assert d1.submits == [("r1", {"kv": "handed off"}, -1)]


async def test_a_request_that_stops_upstream_frees_its_downstream_reservation() -> None:
    up, down = ReplicaPool(0), ReplicaPool(1)
    up.downstream = down
    u = FakeReplica(up)
    d = FakeReplica(down)
    await up.submit("text-only", "prompt")  # final_stage_id=0: stage 1 never gets a submit
    assert down.in_flight() == [1]
    u.emit("text-only", "done", finished=True)
    await up.receive()
    # a finish keeps the reservation (the next stage's submit may still be on its way) ...
    assert down.in_flight() == [1] and d.aborts == []
    # ... the orchestrator's abort of a request that stops upstream frees it
    await down.abort(["text-only"])
    assert down.in_flight() == [0] and down.replica_of("text-only") is None
    assert d.aborts == ["text-only"]  # the chunks streamed to it are dropped at once


async def test_an_upstream_failure_frees_the_downstream_reservation_at_once() -> None:
    up, down = ReplicaPool(0), ReplicaPool(1)
    up.downstream = down
    u, d = FakeReplica(up), FakeReplica(down)
    await up.submit("r1", "prompt")
    up.sink(u, [StageOutput("r1", None, True, error="boom")])  # type: ignore[arg-type]
    await up.receive()
    assert down.in_flight() == [0] and d.aborts == ["r1"]


async def test_a_used_reservation_is_not_aborted_when_upstream_finishes() -> None:
    up, down = ReplicaPool(0), ReplicaPool(1)
    up.downstream = down
    u, d = FakeReplica(up), FakeReplica(down)
    await up.submit("r1", "prompt")
    await down.submit("r1", {"prewarm": 1})
    u.emit("r1", "done", finished=True)
    await up.receive()
    assert d.aborts == [] and down.replica_of("r1") == 0


async def test_pumped_pool_delivers_from_the_sink_and_ends_when_every_replica_died() -> None:
    pool = ReplicaPool(0)
    a, b = FakeReplica(pool), FakeReplica(pool)
    await pool.submit("early", 0)
    a.emit("early", "queued before pumping")  # goes through the channel: pump must flush it
    delivered: list[list[StageOutput]] = []
    async with trio.open_nursery() as nursery:
        ended: list[BaseException] = []

        async def pump() -> None:
            try:
                await pool.pump(delivered.append)
            except StageDied as exc:
                ended.append(exc)

        nursery.start_soon(pump)
        await trio.testing.wait_all_tasks_blocked()
        assert [[o.data for o in batch] for batch in delivered] == [["queued before pumping"]]
        await pool.submit("r", 1)  # placed on b (a holds "early")
        b.emit("r", "pushed", finished=True)  # delivered synchronously, no task hop
        assert delivered[-1][0].data == "pushed" and pool.in_flight() == [1, 0]
        a.die("killed")
        assert [(o.request_id, o.error_kind) for o in delivered[-1]] == [("early", "replica_died")]
        await trio.testing.wait_all_tasks_blocked()
        assert ended == []  # b still serves
        b.die("killed too")
        await trio.testing.wait_all_tasks_blocked()
        assert len(ended) == 1 and "every replica is dead" in str(ended[0])


async def test_a_suspect_replica_gets_no_new_request_while_another_makes_progress() -> None:
    pool = ReplicaPool(0)
    a, b = FakeReplica(pool), FakeReplica(pool)
    a.suspect = True  # silent past its heartbeats (hung, stopped)
    for i in range(3):
        await pool.submit(f"r{i}", i)
    assert a.submits == [] and [s[0] for s in b.submits] == ["r0", "r1", "r2"]
    b.suspect = True  # all suspect: placed by load again, not refused
    await pool.submit("r3", 3)
    assert [s[0] for s in a.submits] == ["r3"]
    assert [st["state"] for st in pool.replica_states()] == ["suspect", "suspect"]


async def test_replica_states_say_restarting_until_the_slot_is_given_up_with_why() -> None:
    pool = ReplicaPool(0)
    a, _ = FakeReplica(pool), FakeReplica(pool)
    pool.supervised = True
    a.die("worker process 7 exited with code -9")
    await pool.submit("r0", 0)  # served by b meanwhile
    states = pool.replica_states()
    assert [st["state"] for st in states] == ["restarting", "ready"]
    assert "exited with code -9" in states[0]["reason"]
    pool.give_up(0, "2 restarts within 60s; last death (exited): code -9")
    states = pool.replica_states()
    assert states[0] == {"replica": 0, "state": "given_up", "given_up": True,
                         "reason": "2 restarts within 60s; last death (exited): code -9"}
    pool.cordon(1)
    assert pool.replica_states()[1]["state"] == "cordoned"


async def perform(pool: ReplicaPool, actions: list[Action]) -> None:
    """What a shell does with the core's stage I/O (only submits and updates occur here)."""
    for a in actions:
        if type(a) is Submit:
            await pool.submit(a.request_id, a.payload, resumable=a.resumable)
        else:
            assert type(a) is Update
            await pool.update(a.request_id, a.payload, final=a.final)


@pytest.mark.parametrize("evicted", [False, True])
async def test_a_segment_sent_while_the_replica_s_death_is_on_its_way_goes_with_the_failover(
        evicted: bool) -> None:
    """The segment is not refused (which would end the request ``stage_unavailable``): the failover
    resends it after the earlier ones, in order, to the surviving replica."""
    router = Router(1, {0})
    pool = ReplicaPool(0)
    a, b = FakeReplica(pool), FakeReplica(pool)
    await perform(pool, router.add("r", "s0", resumable=True))
    await perform(pool, router.update("r", "s1"))
    assert pool.replica_of("r") == 0 and a.updates == [("r", "s1", False)]
    a.die("worker process exited with code -9")  # its death is queued, not handled yet
    if evicted:
        [died] = await pool.receive()  # handled by the pool; the core has not seen it yet
        assert pool.replica_of("r") is None
    else:
        died = None
    await perform(pool, router.update("r", "s2"))  # no raise: the core kept s2 for a failover
    if died is None:
        [died] = await pool.receive()
    assert died.error_kind == "replica_died"
    await perform(pool, router.route(0, died))  # the failover: the same segments, in order
    assert b.submits == [("r", "s0", -1)] and b.updates == [("r", "s1", False), ("r", "s2", False)]
    timing = pool.timing_of("r")
    assert timing is not None and (timing.replica, timing.retried_from) == (1, 0)
    await perform(pool, router.update("r", "s3", final=True))
    assert b.updates[-1] == ("r", "s3", True) and a.updates == [("r", "s1", False)]
    assert router.retried == [1] and "r" in router


async def test_an_update_for_a_request_that_ended_here_is_still_refused() -> None:
    pool = ReplicaPool(0)
    a = FakeReplica(pool)
    await pool.submit("r", "s0", resumable=True)
    await pool.update("r", "s1", final=True)
    for _ in range(2):
        a.emit("r", "o", finished=True)
    await pool.receive()
    with pytest.raises(StageUnavailable, match="not active here"):
        await pool.update("r", "late")
