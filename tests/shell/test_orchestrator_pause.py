"""pause()/resume() through the Trio orchestrator, against scripted stages."""

from __future__ import annotations

from functools import partial

import pytest
import trio
import trio.testing

from trio_orch import OrchError, OrchOutput, open_orchestrator
from trio_orch.testing import ScriptedStage


async def test_pause_wait_lets_started_requests_finish_and_admits_nothing_until_resume() -> None:
    stage = ScriptedStage(0)
    async with open_orchestrator([stage], {0}) as orch:
        await orch.add_request("old", "p")
        async with trio.open_nursery() as nursery:
            paused = trio.Event()

            async def pause() -> None:
                await orch.pause("wait")
                paused.set()

            nursery.start_soon(pause)
            await trio.testing.wait_all_tasks_blocked()
            assert orch.paused == "wait" and not paused.is_set()  # "old" is still in flight
            nursery.start_soon(orch.add_request, "new", "p")  # accepted, waits: backpressure
            await trio.testing.wait_all_tasks_blocked()
            assert stage.submissions == [("old", "p")] and orch.router.is_queued("new")
            await stage.emit("old", "done", finished=True)
            assert await orch.next_output() == OrchOutput("old", 0, "done", True)
            await trio.testing.wait_all_tasks_blocked()
            assert paused.is_set() and stage.submissions == [("old", "p")]
            await orch.resume()
        assert stage.submissions == [("old", "p"), ("new", "p")] and orch.paused is None


async def test_pause_abort_ends_in_flight_requests_and_shutdown_while_paused_ends_the_queued() -> None:
    stages = [ScriptedStage(0), ScriptedStage(1)]
    async with open_orchestrator(stages, {1}) as orch:
        await orch.add_request("a", "p")
        await orch.pause("abort")
        msg = await orch.next_output()
        assert isinstance(msg, OrchError) and (msg.request_id, msg.kind) == ("a", "aborted")
        assert stages[0].aborts == ["a"]
        async with trio.open_nursery() as nursery:
            nursery.start_soon(partial(orch.add_request, "queued", "p"))
            await trio.testing.wait_all_tasks_blocked()
            orch.request_shutdown()
    msgs = [m async for m in orch.outputs()]
    assert [(m.request_id, m.kind) for m in msgs] == [("queued", "shutdown")]


async def test_pause_keep_freezes_the_stages_and_resume_wakes_them() -> None:
    stage = ScriptedStage(0)
    calls: list[str] = []

    async def record(name: str) -> None:
        calls.append(name)

    stage.on_rpc("pause", partial(record, "pause"))
    stage.on_rpc("resume", partial(record, "resume"))
    async with open_orchestrator([stage], {0}) as orch:
        await orch.add_request("r", "p")
        await orch.pause("keep")  # returns at once: "r" stays where it is
        assert calls == ["pause"] and orch.router.is_started("r")
        await orch.resume()
        assert calls == ["pause", "resume"]
        with pytest.raises(ValueError, match="pause mode"):
            await orch.pause("nap")
