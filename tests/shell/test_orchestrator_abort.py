"""Acknowledged aborts and the partial output an error terminal carries (scripted stages)."""

from __future__ import annotations

import trio
import trio.testing

from trio_orch import OrchError, OrchOutput, RpcResult, StageOutput, open_orchestrator
from trio_orch.core import Router
from trio_orch.testing import Misbehaviour, ScriptedStage


async def test_abort_returns_each_confirmation_and_the_terminal_carries_the_partial_output() -> None:
    stages = [ScriptedStage(0), ScriptedStage(1), ScriptedStage(2)]
    async with open_orchestrator(stages, {0, 2}, async_chunk=True) as orch:
        await orch.add_request("r1", "hi")
        await stages[0].emit("r1", "Hel")
        await stages[0].emit("r1", "lo", finished=True)
        await stages[2].emit("r1", "wav0")
        acks = await orch.abort("r1")
        # stage 0 had finished: only stages 1 and 2 held it, and each confirmed
        assert acks == [RpcResult(1, 0, ["r1"], None), RpcResult(2, 0, ["r1"], None)]
        assert stages[1].aborts == stages[2].aborts == ["r1"] and stages[0].aborts == []
        msgs = [await orch.next_output() for _ in range(4)]
        assert [type(m) for m in msgs] == [OrchOutput, OrchOutput, OrchOutput, OrchError]
        err = msgs[-1]
        assert isinstance(err, OrchError) and err.kind == "aborted"
        assert err.partial == {0: ["Hel", "lo"], 2: ["wav0"]}
        assert await orch.abort("r1") == []  # ended: a no-op, nothing asked


async def test_a_held_terminal_output_is_part_of_the_partial_output() -> None:
    stages = [ScriptedStage(0), ScriptedStage(1)]
    async with open_orchestrator(stages, {1}, async_chunk=True) as orch:
        await orch.add_request("r", "x")
        await stages[1].emit("r", "last", finished=True)  # held: stage 0 has not finished
        await orch.abort("r")
        err = await orch.next_output()
        assert isinstance(err, OrchError) and err.partial == {1: ["last"]}


async def test_a_replica_that_does_not_confirm_is_reported_and_the_others_are_not_held_up(
        autojump_clock: trio.testing.MockClock) -> None:
    stages = [ScriptedStage(0), ScriptedStage(1, misbehaviour=Misbehaviour(hang_abort=True))]
    async with open_orchestrator(stages, {1}, async_chunk=True) as orch:
        await orch.add_request("r", "x")
        t0 = trio.current_time()
        acks = await orch.abort("r", timeout=3)
        assert trio.current_time() - t0 >= 3  # it waited for stage 1's deadline, no longer
        assert acks[0] == RpcResult(0, 0, ["r"], None)
        assert acks[1].stage_id == 1 and acks[1].value is None and "timeout" in (acks[1].error or "")
        err = await orch.next_output()
        assert isinstance(err, OrchError) and err.kind == "aborted"  # the terminal did not wait
        await orch.add_request("r2", "y")  # admission still served
        await stages[0].emit("r2", "a", finished=True)
        await stages[1].emit("r2", "b", finished=True)
        assert await orch.next_output() == OrchOutput("r2", 1, "b", True)


async def test_a_queued_request_is_aborted_without_asking_any_stage() -> None:
    stages = [ScriptedStage(0)]
    async with open_orchestrator(stages, {0}) as orch:
        await orch.pause("wait")
        await orch.add_request("q", "x", wait_start=False)
        assert await orch.abort("q") == []
        err = await orch.next_output()
        assert isinstance(err, OrchError) and err.kind == "aborted" and err.partial is None
        assert stages[0].submissions == []


def test_the_core_keeps_partial_output_only_until_the_request_ends() -> None:
    r = Router(2, {0, 1})
    r.start(r.accept("a", "p"))
    r.route(0, StageOutput("a", "x", True))
    [*_, last] = r.route(1, StageOutput("a", "y", True))
    assert last.message == OrchOutput("a", 1, "y", True)  # finished: no partial on an output
    r.start(r.accept("b", "p"))
    r.route(0, StageOutput("b", "x"))
    [emit, *_] = r.expire("b")
    assert emit.message.kind == "timeout" and emit.message.partial == {0: ["x"]}
    assert OrchError("b", None, "timeout", "request deadline exceeded") == emit.message  # not compared
