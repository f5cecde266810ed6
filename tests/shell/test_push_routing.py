"""The push fast path: a pushed batch is routed by whoever delivers it while the dispatcher is idle.

What must hold whichever way a batch goes (routed at once, or queued for the
dispatcher): outputs of one stage reach the consumer in the order the stage
produced them, and the stage I/O they cause (a forward to the next stage)
still happens, in decision order.
"""

from __future__ import annotations

import trio
import trio.testing

from trio_orch.shell.orchestrator import open_orchestrator
from trio_orch.testing import PushScriptedStage
from trio_orch.types import OrchOutput, StageOutput


async def test_pushed_outputs_keep_their_order_and_their_forward_happens() -> None:
    stages = [PushScriptedStage(0), PushScriptedStage(1)]
    async with open_orchestrator(stages, {0, 1}) as orch:
        await orch.add_request("a", "p")
        await trio.testing.wait_all_tasks_blocked()  # the dispatcher waits: the next push routes at once
        stages[0].emit_batch_nowait([StageOutput("a", 0, False)])
        for i in range(1, 10):  # the rest while the first one's effects may still be queued
            stages[0].emit_batch_nowait([StageOutput("a", i, i == 9)])
        got = [await orch.next_output() for _ in range(10)]
        assert [(m.stage_id, m.data) for m in got] == [(0, i) for i in range(10)]
        with trio.fail_after(5):
            while not stages[1].submissions:  # stage 0 finished: the request goes on to stage 1
                await trio.sleep(0)
        assert stages[1].submissions[0][0] == "a"
        stages[1].emit_batch_nowait([StageOutput("a", "end", True)])
        last = await orch.next_output()
        assert isinstance(last, OrchOutput) and (last.stage_id, last.data, last.finished) == (1, "end", True)
        assert orch.active_requests == 0


async def test_a_burst_pushed_between_checkpoints_is_routed_in_order_across_requests() -> None:
    stage = PushScriptedStage(0)
    async with open_orchestrator([stage], {0}) as orch:
        for rid in ("x", "y"):
            await orch.add_request(rid, "p")
        await trio.testing.wait_all_tasks_blocked()
        for i in range(20):
            stage.emit_batch_nowait([StageOutput("x" if i % 2 else "y", i, i >= 18)])
        got = [await orch.next_output() for _ in range(20)]
        assert [m.data for m in got] == list(range(20))
        assert {m.request_id for m in got if m.finished} == {"x", "y"}
