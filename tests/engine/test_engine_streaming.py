"""Resumable requests through the engine APIs: sync, asyncio (thread bridge) and Trio."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import trio

from tests.engine.test_bridge import make
from tests.waiting import run_async, settle, wait_until
from trio_orch import OrchError, OrchOutput
from trio_orch.engine import EngineClosed, open_trio_engine, static_pipeline
from trio_orch.testing import ScriptedStage


def test_sync_updates_reach_the_stage_in_order_and_the_terminal_waits_for_the_final_one() -> None:
    engine, stages = make(1, {0})
    with engine:
        h = engine.add_request("a", request_id="r1", resumable=True)
        engine.update_request("r1", "b")
        h.update("c", final=True)
        assert stages[0].updates == [("r1", "b"), ("r1", "c")]  # applied when the call returned
        assert stages[0].resumable == ["r1"] and stages[0].final_updates == ["r1"]
        for data in ("A", "B", "C"):
            engine.call_soon(stages[0].emit_nowait, "r1", data, True)
        msgs = list(h)
    assert [(m.data, m.segment, m.segment_done, m.finished) for m in msgs] == [
        ("A", 0, True, False), ("B", 1, True, False), ("C", 2, True, True)]


def test_sync_bad_updates_raise_value_error_and_change_nothing() -> None:
    engine, stages = make(1, {0})
    with engine:
        plain = engine.add_request("x", request_id="plain")
        with pytest.raises(ValueError, match="not added with resumable=True"):
            engine.update_request("plain", "more")
        with pytest.raises(ValueError, match="unknown or ended"):
            engine.update_request("nobody", "more")
        h = engine.add_request("a", request_id="r1", resumable=True)
        engine.update_request("r1", "last", final=True)
        with pytest.raises(ValueError, match="final input segment"):
            engine.update_request("r1", "too late")
        assert stages[0].updates == [("r1", "last")]
        h.abort()
        assert isinstance(list(h)[-1], OrchError)
        with pytest.raises(ValueError, match="unknown or ended"):
            engine.update_request("r1", "after the end")
        plain.close()
    with pytest.raises(EngineClosed):
        engine.update_request("r1", "closed")


def test_updates_made_while_the_request_waits_for_admission_follow_it_in() -> None:
    engine, stages = make(1, {0}, request_queue_size=1)

    async def scenario() -> list[Any]:
        engine.call_soon(stages[0].hold_submits)
        blocked = engine.add_request_async("a", request_id="r1")  # stuck in submit
        h1 = await blocked
        await asyncio.to_thread(wait_until, lambda: engine.stats().queued_requests == 0, "r1 taken")
        h2 = await engine.add_request_async("b", request_id="r2")  # fills the channel
        waiting = asyncio.ensure_future(engine.add_request_async("c", request_id="r3", resumable=True))
        await asyncio.to_thread(wait_until, lambda: engine.stats().admission_waiting == 1, "r3 waiting")
        first = asyncio.ensure_future(engine.update_request_async("r3", "c1"))
        second = asyncio.ensure_future(engine.update_request_async("r3", "c2", final=True))
        await asyncio.sleep(0)  # both posted
        await asyncio.to_thread(settle, engine)  # and taken up as far as they go
        assert not first.done() and stages[0].updates == []  # held until r3 is admitted
        engine.call_soon(stages[0].release_submits)
        h3 = await waiting
        await asyncio.gather(first, second)
        for h in (h1, h2, h3):
            h.close()
        return [rid for rid, _ in stages[0].submissions]

    with engine:
        submitted = run_async(scenario)
    assert submitted == ["r1", "r2", "r3"]
    assert stages[0].updates == [("r3", "c1"), ("r3", "c2")]


def test_asyncio_handle_streams_each_segment_and_closing_it_aborts() -> None:
    engine, stages = make(2, {0, 1})

    async def scenario() -> tuple[list[Any], list[str]]:
        seen = []
        async with await engine.add_request_async("hi", request_id="s1", resumable=True) as h:
            engine.call_soon(stages[0].emit_nowait, "s1", "t0", True)
            async for m in h:
                seen.append((m.stage_id, m.data, m.segment_done))
                if m.stage_id == 0:  # forwarded to stage 1: let it answer
                    engine.call_soon(stages[1].emit_nowait, "s1", "a0", True)
                if m.stage_id == 1:
                    break
            await h.update("more")
            engine.call_soon(stages[0].emit_nowait, "s1", "t1", False)
            seen.append(((m := await h.__anext__()).stage_id, m.data, m.segment))
        # leaving the block before the terminal aborted the session on every stage holding it
        await asyncio.to_thread(wait_until, lambda: "s1" in stages[0].aborts and "s1" in stages[1].aborts)
        return seen, list(stages[1].updates)

    with engine:
        seen, updates1 = run_async(scenario)
    assert seen == [(0, "t0", True), (1, "a0", True), (0, "t1", 1)]
    assert updates1 == []  # stage 0 never closed segment 1: nothing was forwarded
    assert stages[0].updates == [("s1", "more")]


async def test_trio_api_takes_updates_for_a_resumable_generate() -> None:
    stage = ScriptedStage(0)
    async with open_trio_engine(static_pipeline([stage], {0})) as engine:
        got: list[OrchOutput | OrchError] = []

        async def consume() -> None:
            async for m in engine.generate("a", request_id="r1", resumable=True):
                got.append(m)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(consume)
            await trio.testing.wait_all_tasks_blocked()
            await engine.update_request_async("r1", "b", final=True)
            with pytest.raises(ValueError, match="final input segment"):
                await engine.update_request_async("r1", "c")
            await stage.emit("r1", "A", finished=True)
            await stage.emit("r1", "B", finished=True)
        with pytest.raises(ValueError, match="unknown or ended"):
            await engine.update_request_async("r1", "d")
    assert stage.updates == [("r1", "b")]
    assert [(m.data, m.finished) for m in got] == [("A", False), ("B", True)]
    with pytest.raises(EngineClosed):
        await engine.update_request_async("r1", "e")
