"""Resumable requests through the Trio orchestrator, against scripted stages (pytest-trio)."""

from __future__ import annotations

from functools import partial

import pytest
import trio
import trio.testing

from trio_orch import OrchError, Orchestrator, OrchOutput, open_orchestrator
from trio_orch.testing import ScriptedStage


def fwd(k: int, prompt: object, outs: list) -> str:
    return f"{k}>{'+'.join(map(str, outs))}"


async def nxt(orch: Orchestrator) -> OrchOutput | OrchError:
    with trio.fail_after(5):
        return await orch.next_output()


async def test_segments_reach_stage_zero_in_order_and_each_is_forwarded() -> None:
    stages = [ScriptedStage(0), ScriptedStage(1), ScriptedStage(2)]
    async with open_orchestrator(stages, {0, 2}, forward_fn=fwd) as orch:
        await orch.add_request("r1", "seg0", resumable=True)
        await orch.update_request("r1", "seg1")
        assert stages[0].submissions == [("r1", "seg0")] and stages[0].resumable == ["r1"]
        assert stages[0].updates == [("r1", "seg1")]
        await stages[0].emit("r1", "a", finished=True)  # segment 0 done at stage 0
        msg = await nxt(orch)
        assert msg == OrchOutput("r1", 0, "a", False) and msg.segment == 0 and msg.segment_done
        assert stages[1].submissions == [("r1", "0>a")]
        await orch.update_request("r1", "seg2", final=True)
        assert stages[0].updates == [("r1", "seg1"), ("r1", "seg2")] and stages[0].final_updates == ["r1"]
        await stages[0].emit("r1", "b", finished=True)
        await stages[0].emit("r1", "c", finished=True)
        assert [(m.data, m.segment, m.finished) for m in (await nxt(orch), await nxt(orch))] == [
            ("b", 1, False), ("c", 2, False)]
        assert stages[1].updates == [("r1", "0>b"), ("r1", "0>c")] and stages[1].final_updates == ["r1"]
        for data in ("x", "y", "z"):
            await stages[1].emit("r1", data, finished=True)
        assert stages[2].submissions == [("r1", "1>x")]
        assert stages[2].updates == [("r1", "1>y"), ("r1", "1>z")]
        for data in ("w0", "w1"):
            await stages[2].emit("r1", data, finished=True)
            assert not (await nxt(orch)).finished
        await stages[2].emit("r1", "w2", finished=True)
        last = await nxt(orch)
        assert last == OrchOutput("r1", 2, "w2", True) and last.segment == 2
        assert orch.active_requests == 0


async def test_bad_updates_raise_value_error_and_change_nothing() -> None:
    stages = [ScriptedStage(0)]
    async with open_orchestrator(stages, {0}) as orch:
        with pytest.raises(ValueError, match="unknown or ended"):
            await orch.update_request("ghost", "x")
        await orch.add_request("plain", "p")
        with pytest.raises(ValueError, match="resumable=True"):
            await orch.update_request("plain", "x")
        await orch.add_request("s", "p", resumable=True)
        await orch.update_request("s", "last", final=True)
        with pytest.raises(ValueError, match="final input segment"):
            await orch.update_request("s", "after")
        await orch.abort("s")
        assert isinstance(await nxt(orch), OrchError)
        with pytest.raises(ValueError, match="unknown or ended"):
            await orch.update_request("s", "after the terminal")
        assert stages[0].updates == [("s", "last")]
    with pytest.raises(RuntimeError, match="shut down"):
        await orch.update_request("plain", "x")


@pytest.mark.parametrize("how", ["abort", "deadline", "stage_error", "stage_death", "shutdown"])
async def test_a_session_ended_mid_stream_gets_one_terminal_and_nothing_after(
        how: str, autojump_clock: trio.testing.MockClock) -> None:
    stages = [ScriptedStage(0), ScriptedStage(1)]
    kinds = {"abort": "aborted", "deadline": "timeout", "stage_error": "stage_failed",
             "stage_death": "replica_died", "shutdown": "shutdown"}
    async with open_orchestrator(stages, {1}, forward_fn=fwd) as orch:
        await orch.add_request("r", "seg0", resumable=True, timeout=30 if how == "deadline" else None)
        await stages[0].emit("r", "a", finished=True)  # stage 0 idle (keeps its context), stage 1 busy
        await orch.update_request("r", "seg1")
        if how == "abort":
            await orch.abort("r")
        elif how == "deadline":
            await trio.sleep(31)
        elif how == "stage_error":
            await stages[1].emit("r", None, error="oom")
        elif how == "stage_death":
            await stages[1].fail(RuntimeError("gone"))
        else:
            orch.request_shutdown()
        msg = await nxt(orch)
        assert isinstance(msg, OrchError) and msg.kind == kinds[how]
        if how in ("abort", "deadline"):
            assert stages[0].aborts == ["r"] and stages[1].aborts == ["r"]
        if how != "shutdown":
            with pytest.raises(ValueError):
                await orch.update_request("r", "seg2")
            await stages[0].emit("r", "late", finished=True)
            assert orch.dropped_outputs >= 1 and orch.active_requests == 0
    assert [m async for m in orch.outputs()] == []


async def test_an_update_waits_behind_the_add_it_follows() -> None:
    """With the handler busy, add and update queue in order: the stage sees submit, then update."""
    stages = [ScriptedStage(0)]
    async with open_orchestrator(stages, {0}, request_queue_size=4) as orch:
        stages[0].hold_submits()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(partial(orch.add_request, "r", "seg0", resumable=True))
            await trio.testing.wait_all_tasks_blocked()
            assert orch.router.is_live("r") and stages[0].submissions == []
            nursery.start_soon(orch.update_request, "r", "seg1")
            await trio.testing.wait_all_tasks_blocked()
            stages[0].release_submits()
        assert stages[0].submissions == [("r", "seg0")] and stages[0].updates == [("r", "seg1")]
