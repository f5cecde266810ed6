"""The control recipes on the engines (Trio, threads, asyncio), against scripted stages.

What the recipes promise is an order of events: ``update_weights`` reloads only once
the requests in flight finished, and starts nothing until every replica holds the new
weights; ``sleep`` keeps the engine paused until ``wake_up``.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import trio
import trio.testing

from trio_orch import OrchError, OrchOutput, RpcResult
from trio_orch.engine import ControlError, EngineClosed, ThreadEngine, open_trio_engine, static_pipeline
from trio_orch.testing import ScriptedStage


def recording(stage: ScriptedStage, log: list[str], *, refuse: str | None = None) -> None:
    """Answer reload_weights / sleep / wake_up on ``stage``, writing each call into ``log``."""
    async def reload(path: str, check_only: bool = False) -> dict[str, Any]:
        log.append(f"{'check' if check_only else 'load'}{stage.stage_id}:{path}")
        if refuse and refuse in path:
            raise ValueError(f"{path!r} does not fit")
        return {"path": path}

    async def sleep(level: int = 1) -> dict[str, Any]:
        log.append(f"sleep{stage.stage_id}:{level}")
        return {"asleep": level}

    async def wake_up() -> dict[str, Any]:
        log.append(f"wake{stage.stage_id}")
        return {"asleep": 0}

    stage.on_rpc("reload_weights", reload)
    stage.on_rpc("sleep", sleep)
    stage.on_rpc("wake_up", wake_up)


async def test_update_weights_reloads_between_the_requests_it_lets_finish_and_those_it_holds() -> None:
    stages = [ScriptedStage(0), ScriptedStage(1)]
    log: list[str] = []
    for s in stages:
        recording(s, log)
        s.on_submit = lambda k, rid: log.append(f"submit{k}:{rid}")
    async with open_trio_engine(static_pipeline(stages, {1}, forward_fn=lambda k, p, o: o)) as engine, \
            trio.open_nursery() as nursery:
        outs: dict[str, list[Any]] = {}

        async def run(rid: str) -> None:
            outs[rid] = [m async for m in engine.generate("p", request_id=rid)]

        nursery.start_soon(run, "old")
        await trio.testing.wait_all_tasks_blocked()
        results: list[list[RpcResult]] = []

        async def update() -> None:
            results.append(await engine.update_weights_async("/w.pt", stage_ids=[1]))

        nursery.start_soon(update)
        await trio.testing.wait_all_tasks_blocked()
        assert engine.paused == "wait" and not any(e.startswith(("check", "load")) for e in log)
        nursery.start_soon(run, "new")  # accepted, held while paused
        await trio.testing.wait_all_tasks_blocked()
        await stages[0].emit("old", "a", finished=True)
        await stages[1].emit("old", "b", finished=True)  # the last request in flight: the reload goes on
        await trio.testing.wait_all_tasks_blocked()
        assert results == [[RpcResult(1, 0, {"path": "/w.pt"}, None)]] and engine.paused is None
        await stages[0].emit("new", "c", finished=True)
        await stages[1].emit("new", "d", finished=True)
    assert log == ["submit0:old", "submit1:old", "check1:/w.pt", "load1:/w.pt", "submit0:new", "submit1:new"]
    assert [m.data for m in outs["old"]] == ["b"] and [m.data for m in outs["new"]] == ["d"]


async def test_a_refused_file_changes_no_replica_and_the_engine_resumes() -> None:
    stages = [ScriptedStage(0), ScriptedStage(1)]
    log: list[str] = []
    recording(stages[0], log)
    recording(stages[1], log, refuse="bad")
    async with open_trio_engine(static_pipeline(stages, {1})) as engine:
        with pytest.raises(ControlError, match=r"nothing changed.*stage 1 replica 0.*does not fit") as info:
            await engine.update_weights_async("/bad.pt")
        assert [r.error is None for r in info.value.results] == [True, False]
        assert sorted(log) == ["check0:/bad.pt", "check1:/bad.pt"]  # concurrent checks; nobody loaded it
        assert engine.paused is None
        with pytest.raises(ValueError, match="invalid stage ids"):
            await engine.update_weights_async("/w.pt", stage_ids=[5])


async def test_sleep_holds_new_requests_until_wake_up() -> None:
    stages = [ScriptedStage(0)]
    log: list[str] = []
    recording(stages[0], log)
    stages[0].on_submit = lambda k, rid: log.append(f"submit:{rid}")
    async with open_trio_engine(static_pipeline(stages, {0})) as engine, trio.open_nursery() as nursery:
        assert [r.value for r in await engine.sleep_async(2)] == [{"asleep": 2}]
        assert engine.paused == "wait"

        async def run() -> None:
            [m async for m in engine.generate("p", request_id="r")]

        nursery.start_soon(run)
        await trio.testing.wait_all_tasks_blocked()
        assert log == ["sleep0:2"]  # the request waits, no error
        await engine.wake_up_async()
        await trio.testing.wait_all_tasks_blocked()
        assert log == ["sleep0:2", "wake0", "submit:r"] and engine.paused is None
        await stages[0].emit("r", "x", finished=True)


async def test_a_pause_that_does_not_drain_in_time_is_lifted(autojump_clock: trio.testing.MockClock) -> None:
    stages = [ScriptedStage(0)]
    async with open_trio_engine(static_pipeline(stages, {0})) as engine, trio.open_nursery() as nursery:
        async def run() -> None:
            [m async for m in engine.generate("p", request_id="stuck")]

        nursery.start_soon(run)
        await trio.testing.wait_all_tasks_blocked()
        with pytest.raises(TimeoutError, match="did not finish within 5s"):
            await engine.update_weights_async("/w.pt", drain_timeout=5)
        assert engine.paused is None and stages[0].rpc_calls == []
        await stages[0].emit("stuck", "x", finished=True)


def test_the_thread_bridge_offers_it_to_plain_threads_and_asyncio() -> None:
    stages = [ScriptedStage(0)]
    log: list[str] = []
    recording(stages[0], log)
    engine = ThreadEngine(static_pipeline(stages, {0})).start()
    try:
        assert engine.collective_rpc("reload_weights", ["/a"], {"check_only": True}) == [
            RpcResult(0, 0, {"path": "/a"}, None)]
        assert engine.update_weights("/b")[0].error is None
        handle = engine.add_request("p", request_id="r")
        engine.call_soon(stages[0].emit_nowait, "r", "partial")
        assert handle.get(timeout=10) == OrchOutput("r", 0, "partial", False)
        assert engine.abort_confirmed("r") == [RpcResult(0, 0, ["r"], None)]
        err = handle.get(timeout=10)
        assert isinstance(err, OrchError) and err.kind == "aborted" and err.partial == {0: ["partial"]}

        async def from_asyncio() -> list[RpcResult]:
            await engine.pause_async("wait")
            assert engine.paused == "wait"
            await engine.resume_async()
            return await engine.collective_rpc_async("nosuch")

        [unknown] = asyncio.run(from_asyncio())
        assert unknown.error == "unknown rpc method 'nosuch'"
        assert log == ["check0:/a", "check0:/b", "load0:/b"]
    finally:
        engine.close()
    with pytest.raises(EngineClosed):
        engine.collective_rpc("stats")
    assert engine.paused is None
