"""Admission control: the Trio shell waits for room, the engine sheds, replica counts follow the pool.

Scripted stages and fake replicas in process; virtual time (trio's
autojump clock) where a timeout is the point, so nothing here asserts on
wall-clock time.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from functools import partial
from typing import Any

import pytest
import trio
import trio.testing

from tests.waiting import await_until, run_async, settle, wait_until
from trio_orch import OrchError, OrchOutput, open_orchestrator
from trio_orch.cluster.pool import ReplicaPool
from trio_orch.cluster.transport import ReplicaDied
from trio_orch.engine import Overloaded, ThreadEngine, open_trio_engine, static_pipeline
from trio_orch.testing import ScriptedStage


class CountedStage(ScriptedStage):
    """A scripted stage that reports replicas (as a replica pool does) when the test says so."""

    def __init__(self, stage_id: int, live: int, total: int) -> None:
        super().__init__(stage_id)
        self.counts = (live, total)
        self.watchers: list[Callable[[int, int], None]] = []

    def replica_counts(self) -> tuple[int, int]:
        return self.counts

    def watch_replicas(self, callback: Callable[[int, int], None]) -> None:
        self.watchers.append(callback)

    def set_live(self, live: int) -> None:
        self.counts = (live, self.counts[1])
        for cb in self.watchers:
            cb(*self.counts)


# ---------------------------------------------------------------- the Trio shell
async def test_the_request_handler_waits_for_room_so_the_channel_fills_and_add_request_waits() -> None:
    stage = ScriptedStage(0)
    async with open_orchestrator([stage], {0}, max_inflight=[1], request_queue_size=1) as orch:
        await orch.add_request("r1", "a")  # started: the stage holds one of one
        await orch.add_request("r2", "b", wait_start=False)  # accepted; the handler waits for room
        await orch.add_request("r3", "c", wait_start=False)  # accepted; fills the channel
        returned: list[str] = []

        async def add_r4() -> None:
            await orch.add_request("r4", "d")
            returned.append("r4")

        async with trio.open_nursery() as nursery:
            nursery.start_soon(add_r4)
            await trio.testing.wait_all_tasks_blocked()
            stats = orch.statistics()
            assert returned == [] and stats.request_channel.tasks_waiting_send == 1  # full: r4 waits
            assert stage.submissions == [("r1", "a")]
            assert stats.core.queued == 3  # r2 (waiting for room), r3 (in the channel), r4 (accepted)
            await stage.emit("r1", "x", finished=True)  # room: r2 starts, r3 moves up, r4 gets in
            await trio.testing.wait_all_tasks_blocked()
            assert [rid for rid, _ in stage.submissions] == ["r1", "r2"]
            assert orch.router.is_queued("r3") and orch.router.is_queued("r4")
            await stage.emit("r2", "y", finished=True)
            await stage.emit("r3", "z", finished=True)
        assert returned == ["r4"]
        assert [rid for rid, _ in stage.submissions] == ["r1", "r2", "r3", "r4"]
        assert orch.statistics().core.claims_by_stage == (1,)


async def test_a_queued_request_still_ends_by_abort_or_deadline_while_it_waits_for_room(
        autojump_clock: trio.testing.MockClock) -> None:
    stage = ScriptedStage(0)
    async with open_orchestrator([stage], {0}, max_inflight=[1]) as orch:
        await orch.add_request("busy", "a")
        await orch.add_request("late", "b", wait_start=False, timeout=5)
        await orch.add_request("gone", "c", wait_start=False)
        await orch.abort("gone")
        with trio.fail_after(10):
            first, second = await orch.next_output(), await orch.next_output()
        assert (first.request_id, first.kind) == ("gone", "aborted")
        assert (second.request_id, second.kind) == ("late", "timeout")
        assert stage.submissions == [("busy", "a")]  # neither ever reached the stage


async def test_replica_counts_keep_availability_and_the_bound_in_step() -> None:
    stage = CountedStage(0, live=2, total=2)
    async with open_orchestrator([stage], {0}, max_inflight=[1]) as orch:
        assert orch.statistics().core.stage_limits == (2,)
        await orch.add_request("a", "p")
        await orch.add_request("b", "p")
        stage.set_live(1)  # one replica died: the bound halves; nothing new starts
        assert orch.statistics().core.stage_limits == (1,)
        await orch.add_request("c", "p", wait_start=False)
        await trio.testing.wait_all_tasks_blocked()
        assert [r for r, _ in stage.submissions] == ["a", "b"]
        stage.set_live(0)  # none left: the waiting request ends at once instead of waiting
        msg = await orch.next_output()
        assert isinstance(msg, OrchError) and (msg.request_id, msg.kind) == ("c", "stage_unavailable")
        assert orch.statistics().core.replicas_live == (0,)
        stage.set_live(2)  # back (the supervisor restarted them)
        await stage.emit("a", "x", finished=True)
        await orch.add_request("d", "p")
        assert [r for r, _ in stage.submissions] == ["a", "b", "d"]


async def test_a_second_shutdown_request_ends_a_drain_at_once(autojump_clock: trio.testing.MockClock) -> None:
    stage = ScriptedStage(0)
    async with trio.open_nursery() as nursery:
        async with open_orchestrator([stage], {0}) as orch:
            await orch.add_request("slow", "p")
            t0 = trio.current_time()
            orch.request_shutdown(timeout=100)
            nursery.start_soon(orch.wait_stopped)
            await trio.sleep(1)  # draining: the request may still finish
            assert orch.running is False and orch.router.is_live("slow")
            orch.request_shutdown()  # the operator insists
            msg = await orch.next_output()
            await orch.wait_stopped()
    assert isinstance(msg, OrchError) and msg.kind == "shutdown"
    assert trio.current_time() - t0 < 100  # virtual time: the drain did not run out its timeout


# ---------------------------------------------------------------- replica pools report their replicas
async def test_a_replica_pool_reports_deaths_replacements_and_cordons_the_moment_they_happen(
        autojump_clock: trio.testing.MockClock) -> None:
    class Fake:
        def __init__(self) -> None:
            self.replica = -1
            self.alive = True
            self.closed = False
            self.input_bytes = 0

        async def aclose(self) -> None:
            self.closed = True

    pool = ReplicaPool(0)
    fakes = [Fake(), Fake()]
    for f in fakes:
        pool.add_replica(f)  # type: ignore[arg-type]
    seen: list[tuple[int, int]] = []
    pool.watch_replicas(lambda live, total: seen.append((live, total)))
    assert pool.replica_counts() == (2, 2)
    fakes[0].alive = False
    pool.sink(fakes[0], ReplicaDied("gone"))  # type: ignore[arg-type]
    with trio.move_on_after(0.5):
        await pool.receive()  # handles the queued death (no outputs: it keeps waiting)
    assert seen == [(1, 2)]
    pool.cordon(1)
    assert seen[-1] == (0, 2)
    pool.uncordon(1)
    replacement = Fake()
    pool.replace_replica(0, replacement)  # type: ignore[arg-type]
    assert seen[-2:] == [(1, 2), (2, 2)]
    await pool.aclose()
    assert seen[-1] == (0, 2)


# ---------------------------------------------------------------- the thread bridge sheds
def test_the_engine_sheds_past_its_bounds_with_overloaded_and_counts_it() -> None:
    stage = ScriptedStage(0)
    engine = ThreadEngine(static_pipeline([stage], {0}), max_inflight=[1], request_queue_size=1,
                    admission_timeout=0.2, max_waiting=1).start()
    try:
        async def main() -> None:
            admitted = [await engine.add_request_async(p) for p in "abc"]  # started, waiting, queued
            waiter = asyncio.ensure_future(engine.add_request_async("d"))  # waits for room, at most 0.2 s
            await asyncio.sleep(0)  # d is posted; a snapshot (posted after it, in order) sees it wait
            assert (await engine.stats_async()).admission_waiting == 1
            with pytest.raises(Overloaded) as now:
                await engine.add_request_async("e")  # nobody else may wait: shed at once
            assert now.value.retry_after > 0
            with pytest.raises(Overloaded, match=r"no room within 0\.2s"):
                await waiter
            engine.call_soon(stage.emit_nowait, admitted[0].request_id, "x", True)
            async for msgs in admitted[0].batches():
                assert msgs[-1] == OrchOutput(admitted[0].request_id, 0, "x", True)
            # a's end makes room: b starts (asynchronously, in the Trio thread)
            await await_until(lambda: len(stage.submissions) >= 2, "b submitted")
            for h in admitted[1:]:
                h.close()

        run_async(main)
        stats = engine.stats()
        assert stats.admitted == 3 and dict(stats.shed_by_reason) == {"overloaded": 2}
        prompts = [p for _, p in stage.submissions]
        assert prompts[:2] == ["a", "b"] and "d" not in prompts and "e" not in prompts
    finally:
        engine.close()


def test_the_engine_refuses_a_request_whose_path_has_a_dead_stage_without_queueing_it() -> None:
    stages = [ScriptedStage(0), ScriptedStage(1)]
    engine = ThreadEngine(static_pipeline(stages, {0, 1})).start()
    try:
        engine.call_soon(stages[1].fail_nowait)
        wait_until(lambda: engine.stats().stage_available == (True, False), "stage 1 seen dead")

        async def main() -> tuple[Any, Any]:
            audio = await engine.add_request_async("p")  # path 0..1: stage 1 is dead
            text = await engine.add_request_async("p", final_stage_id=0)
            return audio, text

        audio, text = run_async(main)
        assert audio.rejection is not None and audio.rejection.kind == "stage_unavailable"
        assert text.rejection is None
        wait_until(lambda: bool(stages[0].submissions), "the text request submitted")
        text.close()
        assert stages[0].submissions == [(text.request_id, "p")]  # the refused one never reached stage 0
        assert engine.stats().shed_by_reason == {"stage_unavailable": 1}
    finally:
        engine.close()


async def test_the_trio_engine_sheds_after_its_admission_timeout(
        autojump_clock: trio.testing.MockClock) -> None:
    stage = ScriptedStage(0)
    factory = static_pipeline([stage], {0}, max_inflight=[1])
    async with open_trio_engine(factory, request_queue_size=1, admission_timeout=2.0) as engine:
        admitted = [engine.generate(p) for p in ("a", "b", "c")]  # started, waiting for room, queued
        late = engine.generate("d")
        async with trio.open_nursery() as nursery:
            for gen in admitted:
                nursery.start_soon(gen.__anext__)  # admitted; they wait for outputs
            await trio.testing.wait_all_tasks_blocked()
            t0 = trio.current_time()
            with pytest.raises(Overloaded):
                await late.__anext__()
            assert trio.current_time() - t0 >= 2.0  # virtual time: it waited its admission timeout
            nursery.cancel_scope.cancel()
        stats = engine.stats()
        assert stats.admitted == 3 and stats.shed_by_reason == {"overloaded": 1}
        assert len(stage.submissions) == 1 and stage.submissions[0][1] in ("a", "b", "c")


def test_the_shedding_hint_lasts_from_a_shed_until_the_request_channel_has_room() -> None:
    """What an HTTP front reads to refuse cheaply: on while full (not a fixed window), off once room."""
    stage = ScriptedStage(0)
    engine = ThreadEngine(static_pipeline([stage], {0}), max_inflight=[1], request_queue_size=1,
                    admission_timeout=0.0, max_waiting=0).start()
    try:
        async def main() -> None:
            async def room() -> None:  # the request handler took the last one out of the channel
                await await_until(lambda: engine.run_sync_in_trio(lambda: engine.orchestrator.has_room()),
                                  "room in the request channel")

            a = await engine.add_request_async("a")
            await room()
            b = await engine.add_request_async("b")
            await room()
            c = await engine.add_request_async("c")  # a started, b waits for room, c in the channel
            assert not engine.shedding
            with pytest.raises(Overloaded):
                await engine.add_request_async("d")
            assert engine.shedding
            await asyncio.to_thread(settle, engine)  # nothing ended: the room watcher saw none
            assert engine.shedding
            engine.call_soon(stage.emit_nowait, a.request_id, "x", True)  # a ends: c leaves the channel
            await await_until(lambda: not engine.shedding, "the shedding hint off")
            d = await engine.add_request_async("d")  # and the engine takes the next one again
            for h in (a, b, c, d):
                h.close()

        run_async(main)
        assert dict(engine.stats().shed_by_reason) == {"overloaded": 1}
    finally:
        engine.close()


# ---------------------------------------------------------------- capacity, and no queue at all
async def test_without_a_request_queue_nothing_waits_a_request_starts_at_once_or_is_refused() -> None:
    stage = ScriptedStage(0)
    async with open_orchestrator([stage], {0}, max_inflight=[1], request_queue_size=0) as orch:
        assert orch.has_room()  # the request handler waits for one from the moment it is ready
        orch.add_request_nowait("r1", "a")
        await trio.testing.wait_all_tasks_blocked()
        assert stage.submissions == [("r1", "a")]
        assert orch.has_room()  # the handler is free again, but the stage is at its bound:
        with pytest.raises(trio.WouldBlock):
            orch.add_request_nowait("r2", "b")  # it could not start: refused, not held
        assert not orch.router.is_live("r2")  # nothing was registered
        await stage.emit("r1", "x", finished=True)
        await trio.testing.wait_all_tasks_blocked()
        orch.add_request_nowait("r2", "b")  # room again
        await trio.testing.wait_all_tasks_blocked()
        assert [rid for rid, _ in stage.submissions] == ["r1", "r2"]
        await stage.emit("r2", "y", finished=True)


async def test_without_a_request_queue_a_startable_request_waits_for_a_busy_handler_not_refused() -> None:
    """The handler is doing a start's stage I/O: the next startable request is its next (one such),
    and its own input update still reaches the stage after its start."""
    stage = ScriptedStage(0)
    async with open_orchestrator([stage], {0}, max_inflight=[3], request_queue_size=0) as orch:
        stage.hold_submits()
        orch.add_request_nowait("r1", "a")
        await trio.testing.wait_all_tasks_blocked()  # the handler is in r1's submit
        assert orch.has_room()
        orch.add_request_nowait("r2", "b", resumable=True)  # could start: the handler's next
        assert not orch.has_room()
        with pytest.raises(trio.WouldBlock):
            orch.add_request_nowait("r3", "c")  # one next at most: refused, not held
        assert not orch.router.is_live("r3")
        async with trio.open_nursery() as nursery:
            nursery.start_soon(partial(orch.update_request, "r2", "b2", final=True))
            await trio.testing.wait_all_tasks_blocked()
            stage.release_submits()
        assert [rid for rid, _ in stage.submissions] == ["r1", "r2"]
        assert [u[0] for u in stage.updates] == ["r2"]
        await stage.emit("r1", "x", finished=True)
        await stage.emit("r2", "y", finished=True)


async def test_without_a_request_queue_the_handlers_next_gets_its_terminal_at_shutdown() -> None:
    stage = ScriptedStage(0)
    ledger: list[Any] = []
    async with open_orchestrator([stage], {0}, max_inflight=[3], request_queue_size=0,
                                 output_sink=ledger.extend) as orch:
        stage.hold_submits()
        orch.add_request_nowait("r1", "a")
        await trio.testing.wait_all_tasks_blocked()
        orch.add_request_nowait("r2", "b")
        orch.request_shutdown()
    ends = {m.request_id: m.kind for m in ledger if isinstance(m, OrchError)}
    assert ends == {"r1": "shutdown", "r2": "shutdown"}


async def test_capacity_is_what_the_stages_hold_plus_the_one_in_hand_and_the_channel() -> None:
    stages = [CountedStage(0, 2, 2), CountedStage(1, 1, 1)]
    async with open_orchestrator(stages, {1}, max_inflight=[3, 2], request_queue_size=5) as orch:
        assert orch.router.capacity() == 3 * 2 + 2 * 1  # per live replica, summed over the stages
        assert orch.capacity() == 8 + 1 + 5
        stages[0].set_live(1)  # a replica died: the estimate follows
        assert orch.router.capacity() == 3 + 2
    async with open_orchestrator([ScriptedStage(0), ScriptedStage(1)], {1}, max_inflight=[3, None]) as orch:
        assert orch.router.capacity() is None and orch.capacity() == float("inf")  # a stage has no bound


async def test_with_no_request_channel_the_capacity_is_what_the_stages_hold() -> None:
    """Nothing waits for room without a channel: the estimate is exact, and one more is refused."""
    stage = ScriptedStage(0)
    async with open_orchestrator([stage], {0}, max_inflight=[2], request_queue_size=0) as orch:
        assert orch.capacity() == 2
        for i in range(2):
            orch.add_request_nowait(f"r{i}", "x")
            await trio.testing.wait_all_tasks_blocked()  # the request handler takes it
        assert len(stage.submissions) == 2
        with pytest.raises(trio.WouldBlock):
            orch.add_request_nowait("r2", "x")


def test_the_engine_reports_its_capacity_to_any_thread() -> None:
    stage = ScriptedStage(0)
    cases = ((0.0, 4, 2 + 1 + 3), (1.0, 4, 2 + 1 + 3 + 4), (None, None, float("inf")))
    for timeout, waiting, expected in cases:  # nobody waits / four may wait / any number may
        engine = ThreadEngine(static_pipeline([stage], {0}), max_inflight=[2], request_queue_size=3,
                        admission_timeout=timeout, max_waiting=waiting)
        assert engine.capacity == float("inf")  # not started: no bound known yet
        engine.start()
        try:
            assert engine.capacity == expected
        finally:
            engine.close()
