"""Companion requests (CFG) through the Trio orchestrator, against scripted stages."""

from __future__ import annotations

from typing import Any

import pytest
import trio

from trio_orch import OrchError, Orchestrator, OrchOutput, open_orchestrator
from trio_orch.testing import ScriptedStage


def cfg(k: int, prompt: Any, outputs: list, companions: dict | None = None) -> Any:
    return {"cond": outputs, "uncond": companions}


async def nxt(orch: Orchestrator) -> OrchOutput | OrchError:
    with trio.fail_after(5):
        return await orch.next_output()


async def test_parent_forwards_once_its_companion_finished_and_only_the_parent_is_seen() -> None:
    stages = [ScriptedStage(0), ScriptedStage(1)]
    async with open_orchestrator(stages, {1}, forward_fn=cfg) as orch:
        await orch.add_request("r1", "a cat", companions={"r1:neg": "blurry"})
        assert stages[0].submissions == [("r1", "a cat"), ("r1:neg", "blurry")]
        assert stages[0].companions == [("r1:neg", "r1")]
        await stages[0].emit("r1", "e", finished=True)
        assert stages[1].submissions == []  # waits for the companion
        await stages[0].emit("r1:neg", "n", finished=True)
        assert stages[1].submissions == [("r1", {"cond": ["e"], "uncond": {"r1:neg": ["n"]}})]
        await stages[1].emit("r1", "png", finished=True)
        assert await nxt(orch) == OrchOutput("r1", 1, "png", True)
        with pytest.raises(ValueError, match="duplicate"):
            await orch.add_request("x", "p", companions={"x": "same id"})
    assert [m async for m in orch.outputs()] == []


@pytest.mark.parametrize("how", ["abort", "companion_error", "shutdown"])
async def test_companions_end_with_their_parent(how: str) -> None:
    stages = [ScriptedStage(0), ScriptedStage(1)]
    async with open_orchestrator(stages, {1}, forward_fn=cfg) as orch:
        await orch.add_request("r1", "p", companions={"c1": "n1", "c2": "n2"})
        await stages[0].emit("c1", "x", finished=True)
        if how == "abort":
            await orch.abort("r1")
        elif how == "companion_error":
            await stages[0].emit("c2", None, error="out of memory")
        else:
            orch.request_shutdown()
        msg = await nxt(orch)
        assert isinstance(msg, OrchError) and msg.request_id == "r1"
        if how == "companion_error":
            assert msg.kind == "stage_failed" and "companion 'c2'" in msg.message
            assert stages[0].aborts == ["r1"]  # c2 is gone on its own, c1 had finished
        elif how == "abort":
            assert stages[0].aborts == ["r1", "c2"]
    assert [m async for m in orch.outputs()] == []
    assert orch.dropped_outputs == 0
