"""A burst of adds reaches the stages back to back: no checkpoint between the submits of one burst.

Counted with a Trio instrument (task steps), never timed: with a stage
client that takes a submit synchronously (``submit_nowait``) the submits of
the burst happen within at most two task steps (the caller's, deciding at
once while nothing is in flight, and the dispatcher's, deciding together
what was queued meanwhile); with one that only has the awaited ``submit``
each costs a step of its own (the performer awaits them in order).
"""

from __future__ import annotations

import trio
import trio.testing

from trio_orch.shell.orchestrator import open_orchestrator
from trio_orch.testing import PushScriptedStage, ScriptedStage
from trio_orch.types import OrchError, OrchOutput, StageOutput, StageUnavailable


class Steps(trio.abc.Instrument):
    """How many task steps have begun."""

    def __init__(self) -> None:
        self.count = 0

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        self.count += 1


async def burst_steps(stage: ScriptedStage, n: int = 8) -> list[int]:
    """The task-step count at each submit of ``n`` adds made together; every request then finishes."""
    steps = Steps()
    seen: list[int] = []
    stage.on_submit = lambda k, rid: seen.append(steps.count)
    async with open_orchestrator([stage], {0}) as orch:
        await trio.testing.wait_all_tasks_blocked()
        trio.lowlevel.add_instrument(steps)
        try:
            for i in range(n):
                orch.add_request_nowait(f"r{i}", "p")
            await trio.testing.wait_all_tasks_blocked()
        finally:
            trio.lowlevel.remove_instrument(steps)
        assert [rid for rid, _ in stage.submissions] == [f"r{i}" for i in range(n)]  # in order, all of them
        for i in range(n):
            stage.emit_batch_nowait([StageOutput(f"r{i}", "done", True)])
        ends = [await orch.next_output() for _ in range(n)]
        assert sorted(m.request_id for m in ends) == sorted(f"r{i}" for i in range(n))
    return seen


async def test_a_burst_of_adds_is_submitted_within_one_task_step_where_the_stage_takes_it_synchronously(
        ) -> None:
    seen = await burst_steps(PushScriptedStage(0))
    # decided by the caller while nothing is in flight, else by the dispatcher together: one step or two
    assert len(set(seen)) <= 2, seen


async def test_with_an_awaited_submit_each_submit_of_the_burst_takes_a_step_of_its_own() -> None:
    seen = await burst_steps(ScriptedStage(0))
    assert len(set(seen)) == len(seen), seen


class RefusingStage(PushScriptedStage):
    """Takes submits synchronously, and refuses every one (a stage out of room, say)."""

    def submit_nowait(self, request_id: str, payload: object, **options: object) -> bool:
        raise StageUnavailable(f"{self.name} refuses {request_id!r}")


async def test_a_submit_refused_during_an_inline_start_ends_the_request_with_its_terminal() -> None:
    stage = RefusingStage(0)
    async with open_orchestrator([stage], {0}) as orch:
        await trio.testing.wait_all_tasks_blocked()
        orch.add_request_nowait("r", "p")  # alone, the handler parked: started right here, and refused
        msg = await orch.next_output()
        assert isinstance(msg, OrchError) and msg.request_id == "r" and "refuses 'r'" in msg.message
        assert orch.active_requests == 0 and stage.submissions == []


async def test_a_submit_the_stage_cannot_take_now_goes_to_the_dispatcher_and_still_happens() -> None:
    stage = PushScriptedStage(0)
    stage.hold_submits()  # submit_nowait says no while held: the start's submit is left to the dispatcher
    async with open_orchestrator([stage], {0}) as orch:
        await trio.testing.wait_all_tasks_blocked()
        orch.add_request_nowait("r", "p")
        await trio.testing.wait_all_tasks_blocked()
        assert stage.submissions == [] and orch.active_requests == 1  # started, its submit waiting
        stage.release_submits()
        await trio.testing.wait_all_tasks_blocked()
        assert [rid for rid, _ in stage.submissions] == ["r"]
        stage.emit_batch_nowait([StageOutput("r", "done", True)])
        assert await orch.next_output() == OrchOutput("r", 0, "done", True)
