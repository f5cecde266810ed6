"""The Trio shell starts queued requests in the core's order: priority, deadline, arrival (with aging)."""

from __future__ import annotations

from typing import Any

import trio
import trio.testing

from trio_orch.shell.orchestrator import Orchestrator, open_orchestrator
from trio_orch.testing import ScriptedStage
from trio_orch.types import OrchOutput


async def first_chunks(orch: Orchestrator, n: int) -> list[str]:
    """The ids in the order their first output arrived, until ``n`` requests finished."""
    firsts: list[str] = []
    done = 0
    while done < n:
        m = await orch.next_output()
        assert isinstance(m, OrchOutput), m
        if m.request_id not in firsts:
            firsts.append(m.request_id)
        done += m.finished
    return firsts


async def serve_one_at_a_time(stage: ScriptedStage, step: float = 1.0) -> None:
    """The stage answers each submit in turn: a first chunk, then (``step`` s later) its end."""
    answered = 0
    while True:
        await trio.testing.wait_all_tasks_blocked()
        if len(stage.submissions) > answered:
            rid = stage.submissions[answered][0]
            answered += 1
            await stage.emit(rid, "first")
            await trio.sleep(step)
            await stage.emit(rid, "last", finished=True)
        else:
            await trio.sleep(step / 10)


async def test_a_later_urgent_request_starts_before_queued_low_priority_ones_and_all_complete(
        autojump_clock: trio.testing.MockClock) -> None:
    stage = ScriptedStage(0)
    async with open_orchestrator([stage], {0}, max_inflight=[1]) as orch:
        await orch.add_request("busy", "p")  # the pipeline is occupied
        for i in range(3):
            await orch.add_request(f"low{i}", "p", priority=5, wait_start=False)
            await trio.sleep(0.01)
        await orch.add_request("urgent", "p", priority=-5, wait_start=False)
        assert orch.queued_requests == 4 and [rid for rid, _ in stage.submissions] == ["busy"]
        async with trio.open_nursery() as nursery:
            nursery.start_soon(serve_one_at_a_time, stage)
            firsts = await first_chunks(orch, 5)
            nursery.cancel_scope.cancel()
        assert firsts == ["busy", "urgent", "low0", "low1", "low2"]  # equal priorities: arrival order
        assert orch.active_requests == 0 and orch.statistics().core.terminals_by_kind == {"finished": 5}


async def test_a_low_priority_request_is_not_starved_by_a_stream_of_urgent_ones(
        autojump_clock: trio.testing.MockClock) -> None:
    """One start per second, two urgent arrivals per second: aging still lets the low one start."""
    stage = ScriptedStage(0)
    async with open_orchestrator([stage], {0}, max_inflight=[1], priority_aging=1.0) as orch:
        await orch.add_request("busy", "p")
        await orch.add_request("low", "p", priority=5, wait_start=False)
        t0 = trio.current_time()
        async with trio.open_nursery() as nursery:

            async def urgent_stream() -> None:
                for i in range(60):
                    await trio.sleep(0.5)
                    await orch.add_request(f"urgent{i}", "p", priority=-5, wait_start=False)

            nursery.start_soon(urgent_stream)
            nursery.start_soon(serve_one_at_a_time, stage)
            while "low" not in [rid for rid, _ in stage.submissions]:
                await trio.sleep(0.1)
            waited = trio.current_time() - t0
            nursery.cancel_scope.cancel()
        ids = [rid for rid, _ in stage.submissions]
        ahead = ids[1:ids.index("low")]
        # only the urgent requests queued within (5 - -5) epochs of aging after it went ahead
        assert ahead and all(rid.startswith("urgent") for rid in ahead)
        assert len(ahead) <= 2 * 10  # two a second for (5 - -5) s
        assert waited < 60 * 0.5  # it started while the stream was still going


class PriorityStage(ScriptedStage):
    """A scripted stage that says it takes a submit's priority and deadline, and records them."""

    accepts_priority = True

    def __init__(self, stage_id: int) -> None:
        super().__init__(stage_id)
        self.schedules: list[tuple[str, int, float | None]] = []

    async def submit(self, request_id: str, payload: Any, *, priority: int = 0,
                     deadline_in: float | None = None, **kw: Any) -> None:
        self.schedules.append((request_id, priority, deadline_in))
        await super().submit(request_id, payload, **kw)


async def test_the_priority_and_the_time_left_go_with_every_submit_forwards_included(
        autojump_clock: trio.testing.MockClock) -> None:
    stages = [PriorityStage(0), PriorityStage(1)]
    async with open_orchestrator(stages, {1}) as orch:
        await orch.add_request("r", "p", priority=-3, timeout=20)
        await orch.add_request("plain", "p")
        await trio.sleep(5)
        await stages[0].emit("r", "a", finished=True)
        await trio.testing.wait_all_tasks_blocked()
        assert stages[0].schedules == [("r", -3, 20.0), ("plain", 0, None)]
        [(rid, prio, left)] = stages[1].schedules
        assert (rid, prio) == ("r", -3) and 14.9 < left <= 15.0  # the deadline, on the way
        await stages[1].emit("r", "b", finished=True)
        assert (await orch.next_output()).finished
