"""Collective RPC through the Trio orchestrator, against scripted stages (autojump clock)."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from trio_orch import OrchOutput, RpcResult, open_orchestrator
from trio_orch.testing import ScriptedStage


async def test_every_stage_answers_in_stage_order_with_values_and_errors() -> None:
    stages = [ScriptedStage(0), ScriptedStage(1), ScriptedStage(2)]

    async def stats(scale: int = 1) -> dict:
        return {"active": 3 * scale}

    async def boom(scale: int = 1) -> None:
        raise RuntimeError("no stats here")

    stages[0].on_rpc("stats", stats)
    stages[2].on_rpc("stats", boom)
    async with open_orchestrator(stages, {2}) as orch:
        results = await orch.collective_rpc("stats", kwargs={"scale": 2}, stage_ids=[2, 1, 0])
        assert results == [RpcResult(0, 0, {"active": 6}, None),
                           RpcResult(1, 0, None, "unknown rpc method 'stats'"),
                           RpcResult(2, 0, None, "RuntimeError: no stats here")]
        assert stages[0].rpc_calls == [("stats", (), {"scale": 2})]
        assert [r.stage_id for r in await orch.collective_rpc("stats", stage_ids=[1])] == [1]


@pytest.mark.parametrize("bad", [[3], [-1], ["0"], [True], [], "01"])
async def test_invalid_stage_ids_raise_and_call_nothing(bad: object) -> None:
    stages = [ScriptedStage(0), ScriptedStage(1)]
    async with open_orchestrator(stages, {1}) as orch:
        with pytest.raises(ValueError, match="stage"):
            await orch.collective_rpc("stats", stage_ids=bad)  # type: ignore[arg-type]
        assert stages[0].rpc_calls == stages[1].rpc_calls == []


async def test_a_hung_replica_gets_its_own_timeout_while_admission_and_routing_go_on(
        autojump_clock: trio.testing.MockClock) -> None:
    stages = [ScriptedStage(0), ScriptedStage(1)]

    async def hang() -> None:
        await trio.sleep_forever()

    async def quick() -> str:
        return "fine"

    stages[0].on_rpc("health", hang)
    stages[1].on_rpc("health", quick)
    async with open_orchestrator(stages, {1}, forward_fn=lambda k, p, o: o) as orch:
        async with trio.open_nursery() as nursery:
            answer: list[list[RpcResult]] = []

            async def call() -> None:
                answer.append(await orch.collective_rpc("health", timeout=30))

            nursery.start_soon(call)
            await trio.testing.wait_all_tasks_blocked()
            t0 = trio.current_time()
            await orch.add_request("r", "p")  # admission is served meanwhile
            await stages[0].emit("r", "a", finished=True)
            await stages[1].emit("r", "b", finished=True)
            assert await orch.next_output() == OrchOutput("r", 1, "b", True)
            assert trio.current_time() == t0 and not answer  # routed while the RPC still hangs
        (results,) = answer
        assert results[0].stage_id == 0 and results[0].value is None and "timeout" in results[0].error
        assert results[1] == RpcResult(1, 0, "fine", None)


async def test_shutdown_during_a_call_answers_it_instead_of_hanging() -> None:
    stage = ScriptedStage(0)

    async def hang() -> None:
        await trio.sleep_forever()

    stage.on_rpc("stats", hang)
    async with open_orchestrator([stage], {0}) as orch:
        async with trio.open_nursery() as nursery:
            got: list[list[RpcResult]] = []

            async def call() -> None:
                got.append(await orch.collective_rpc("stats", timeout=600))

            nursery.start_soon(call)
            await trio.testing.wait_all_tasks_blocked()
            orch.request_shutdown()
        assert got[0] == [RpcResult(0, -1, None, "orchestrator shut down during the call")]
    with pytest.raises(RuntimeError, match="not running"):
        await orch.collective_rpc("stats")
