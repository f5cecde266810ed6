"""Every engine API takes ``priority``: the thread adapter (threads, asyncio) and the Trio engine."""

from __future__ import annotations

import asyncio

import pytest
import trio
import trio.testing

from tests.waiting import HANG, await_until, run_async, wait_until
from trio_orch.engine import ThreadEngine, static_pipeline
from trio_orch.engine.trio_engine import open_trio_engine
from trio_orch.testing import ScriptedStage
from trio_orch.types import OrchOutput


def submitted(stage: ScriptedStage) -> list[str]:
    return [rid for rid, _ in stage.submissions]


def test_the_thread_adapter_starts_a_later_urgent_request_first_from_threads_and_asyncio() -> None:
    stage = ScriptedStage(0)
    with ThreadEngine(static_pipeline([stage], {0}), max_inflight=[1]) as engine:
        busy = engine.add_request("p", request_id="busy")
        wait_until(lambda: submitted(stage) == ["busy"], "busy submitted")
        lows = [engine.add_request("p", request_id=f"low{i}", priority=5) for i in range(2)]

        async def urgent() -> str:
            h = await engine.add_request_async("p", request_id="urgent", priority=-5)
            return h.request_id

        assert asyncio.run(urgent()) == "urgent"
        with pytest.raises(ValueError, match="priority must be an int"):
            engine.add_request("p", request_id="bad", priority="high")  # type: ignore[arg-type]
        for rid in ["busy", "urgent", "low0", "low1"]:
            wait_until(lambda rid=rid: submitted(stage)[-1] == rid, f"{rid} submitted")  # type: ignore[misc]
            engine.call_soon(stage.emit_nowait, rid, "x", True)
        assert submitted(stage) == ["busy", "urgent", "low0", "low1"]
        for h in [busy, *lows]:
            assert h.get(timeout=HANG) == OrchOutput(h.request_id, 0, "x", True)


async def test_the_trio_engine_passes_priority_on_and_refuses_a_bad_one(
        autojump_clock: trio.testing.MockClock) -> None:
    stage = ScriptedStage(0)
    async with open_trio_engine(static_pipeline([stage], {0}), max_inflight=[1]) as engine:
        busy = await engine.add_request_async("p", request_id="busy")
        with trio.fail_after(HANG):  # a hang guard: until the stage holds it (the pipeline is full)
            while submitted(stage) != ["busy"]:
                await trio.sleep(0.001)
        low = await engine.add_request_async("p", request_id="low", priority=1)
        results: list[str] = []

        async def urgent() -> None:
            async for m in engine.generate("p", request_id="urgent", priority=-1):
                results.append(m.request_id)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(urgent)
            with trio.fail_after(HANG):  # a hang guard: until both wait in the start queue
                while engine.stats().queued_requests < 2:
                    await trio.sleep(0.001)
            with pytest.raises(ValueError, match="priority must be an int"):
                await engine.add_request_async("p", priority=1.5)  # type: ignore[arg-type]
            for rid in ["busy", "urgent", "low"]:
                with trio.fail_after(HANG):  # a hang guard, not a timing
                    while submitted(stage)[-1:] != [rid]:
                        await trio.testing.wait_all_tasks_blocked()
                        await trio.sleep(0)
                await stage.emit(rid, "x", finished=True)
        assert submitted(stage) == ["busy", "urgent", "low"] and results == ["urgent"]
        assert busy.request_id == "busy" and low.request_id == "low"


def test_the_thread_adapters_asyncio_generate_takes_priority_and_refuses_a_bad_one() -> None:
    """``ThreadEngine.generate`` (what the asyncio serving front streams through) passes priority on."""
    stage = ScriptedStage(0)
    with ThreadEngine(static_pipeline([stage], {0}), max_inflight=[1]) as engine:
        busy = engine.add_request("p", request_id="busy")
        wait_until(lambda: submitted(stage) == ["busy"], "busy submitted")
        low = engine.add_request("p", request_id="low", priority=5)

        async def main() -> list[str]:
            with pytest.raises(ValueError, match="priority must be an int"):
                async for _ in engine.generate("p", request_id="bad", priority=None):  # type: ignore[arg-type]
                    pass
            got: list[str] = []

            async def urgent() -> None:
                async for m in engine.generate("p", request_id="urgent", priority=-5):
                    got.append(m.request_id)

            task = asyncio.create_task(urgent())
            await await_until(lambda: engine.stats().queued_requests == 2, "urgent and low queued")
            for rid in ["busy", "urgent", "low"]:
                await await_until(lambda rid=rid: submitted(stage)[-1] == rid, f"{rid} submitted")  # type: ignore[misc]
                engine.call_soon(stage.emit_nowait, rid, "x", True)
            await task
            return got

        assert run_async(main) == ["urgent"]
        assert submitted(stage) == ["busy", "urgent", "low"]
        for h in (busy, low):
            assert h.get(timeout=HANG) == OrchOutput(h.request_id, 0, "x", True)
