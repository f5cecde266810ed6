"""One engine: the Trio engine with every admission option, and its thread adapter answering alike.

The same scenario -- a request streamed to its terminal, one accepted and
aborted, one shed, the control plane, a snapshot -- is played against the
engine in the test's own Trio run and against the thread adapter from
asyncio; the answers must be the same.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import trio
import trio.testing

from tests.waiting import await_until, run_async
from trio_orch import OrchError, OrchOutput, RpcResult
from trio_orch.engine import (
    EngineClosed,
    EngineStartupError,
    Overloaded,
    ThreadEngine,
    TrioEngine,
    open_trio_engine,
    static_pipeline,
)
from trio_orch.testing import ScriptedStage

OPTIONS: dict[str, Any] = {"max_inflight": [1], "request_queue_size": 1, "admission_timeout": 0.0,
                           "max_waiting": 0}


def scripted() -> ScriptedStage:
    stage = ScriptedStage(0)

    async def reload(path: str, check_only: bool = False) -> dict[str, Any]:
        return {"path": path, "check_only": check_only}

    stage.on_rpc("reload_weights", reload)
    return stage


async def scenario(engine: Any, stage: ScriptedStage, emit: Callable[..., None],
                   until: Callable[[Callable[[], bool]], Awaitable[None]]) -> dict[str, Any]:
    """The calls, through the names both engines have (``*_async`` for code written against both)."""
    out: dict[str, Any] = {"capacity": engine.capacity, "retry_after": engine.retry_after}
    first = await engine.add_request_async("a", request_id="first")
    await until(lambda: len(stage.submissions) == 1)
    second = await engine.add_request_async("b", request_id="second")
    await until(lambda: engine.orchestrator.has_room())  # the handler took it out; it waits for the stage
    third = await engine.add_request_async("c", request_id="third")  # fills the request channel
    with pytest.raises(Overloaded) as shed:
        await engine.add_request_async("d", request_id="shed")
    out["shed"] = (shed.value.retry_after, engine.shedding, engine.open_requests)
    emit("first", "x", True)
    out["first"] = [m async for m in first]
    out["abort"] = await engine.abort_confirmed_async("third")
    out["third"] = [m async for m in third]
    await until(lambda: len(stage.submissions) == 2)  # first's end made room: second started
    emit("second", "y", True)
    out["second"] = [m async for m in second]
    out["rpc"] = await engine.collective_rpc_async("reload_weights", ["/w"], {"check_only": True})
    out["weights"] = await engine.update_weights_async("/w")
    await engine.pause_async("wait")
    out["paused"] = engine.paused
    await engine.resume_async()
    stats = await engine.stats_async()
    out["stats"] = (stats.admitted, dict(stats.shed_by_reason), dict(stats.terminals_by_kind),
                    stats.open_streams, stats.admission_waiting, engine.paused)
    return out


EXPECTED: dict[str, Any] = {
    "capacity": 1 + 1 + 1,  # the stage's bound, the handler's one in hand, the channel; nobody may wait
    "retry_after": 1.0,
    "shed": (1.0, True, {"first", "second", "third"}),
    "first": [OrchOutput("first", 0, "x", True)],
    "abort": [],  # still in the request channel: no stage had it to confirm
    "third": [OrchError("third", None, "aborted", "aborted")],
    "rpc": [RpcResult(0, 0, {"path": "/w", "check_only": True}, None)],
    "weights": [RpcResult(0, 0, {"path": "/w", "check_only": False}, None)],
    "paused": "wait",
    "second": [OrchOutput("second", 0, "y", True)],
    "stats": (3, {"overloaded": 1}, {"finished": 2, "aborted": 1}, 0, 0, None),
}


def comparable(out: dict[str, Any]) -> dict[str, Any]:
    """The answers, with an error terminal's message (worded by whoever ended it) left out."""
    def norm(m: Any) -> Any:
        return OrchError(m.request_id, m.stage_id, m.kind, "aborted") if isinstance(m, OrchError) else m
    return {k: [norm(m) for m in v] if k in ("first", "second", "third") else v for k, v in out.items()}


async def test_the_trio_engine_answers_the_scenario() -> None:
    stage = scripted()
    async with open_trio_engine(static_pipeline([stage], {0}), **OPTIONS) as engine:
        async def until(pred: Callable[[], bool]) -> None:
            await trio.testing.wait_all_tasks_blocked()  # what the calls so far set off has happened
            assert pred()

        out = await scenario(engine, stage, stage.emit_nowait, until)
    assert comparable(out) == EXPECTED


def test_the_thread_adapter_answers_the_scenario_alike() -> None:
    stage = scripted()
    with ThreadEngine(static_pipeline([stage], {0}), **OPTIONS) as engine:
        def emit(*args: Any) -> None:
            engine.call_soon(stage.emit_nowait, *args)

        async def until(pred: Callable[[], bool]) -> None:
            await await_until(lambda: engine.run_sync_in_trio(pred))

        out = run_async(lambda: scenario(engine, stage, emit, until))
    assert comparable(out) == EXPECTED


async def test_open_trio_engine_sheds_past_max_waiting_and_counts_it(
        autojump_clock: trio.testing.MockClock) -> None:
    stage = ScriptedStage(0)
    factory = static_pipeline([stage], {0})
    async with open_trio_engine(factory, max_inflight=[1], request_queue_size=1, admission_timeout=5.0,
                                max_waiting=1) as engine, trio.open_nursery() as nursery:
        gens = [engine.generate(p, request_id=p) for p in "abcd"]  # started, in hand, in the channel, waiting
        for gen in gens:
            nursery.start_soon(gen.__anext__)
            await trio.testing.wait_all_tasks_blocked()
        assert engine.admission_waiting == 1 and engine.capacity == 1 + 1 + 1 + 1
        with pytest.raises(Overloaded, match="1 requests already wait for room"):
            await engine.generate("e").__anext__()  # nobody else may wait: shed at once
        assert engine.shedding
        nursery.cancel_scope.cancel()
    stats = engine.stats()
    assert stats.admitted == 3 and dict(stats.shed_by_reason) == {"overloaded": 1}
    assert [p for _, p in stage.submissions] == ["a"]


async def test_the_engine_in_the_callers_run_starts_drains_and_refuses_after() -> None:
    stage = ScriptedStage(0)
    engine = TrioEngine(static_pipeline([stage], {0}))
    with pytest.raises(EngineClosed, match="not started"):
        await engine.add_request_async("early")
    async with trio.open_nursery() as nursery:
        assert await nursery.start(engine.run) is engine and engine.running
        handle = await engine.add_request_async("p", request_id="r")
        engine.abort("nobody")  # unknown id: nothing happens
        engine.request_stop(drain=30)  # nothing new; r may still finish
        with pytest.raises(EngineClosed, match="the engine was closed"):
            await engine.add_request_async("late")
        await trio.testing.wait_all_tasks_blocked()
        assert engine.stats().draining
        await stage.emit("r", "done", finished=True)
        assert [m async for m in handle] == [OrchOutput("r", 0, "done", True)]
    assert engine.closed_reason == "the engine was closed" and not engine.running
    with pytest.raises(EngineClosed):
        engine.abort("r")
    with pytest.raises(RuntimeError, match="called twice"):
        await engine.run()


async def test_a_trio_engine_whose_pipeline_fails_raises_startup_error_from_nursery_start() -> None:
    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def broken() -> Any:
        raise OSError("no GPU here")
        yield  # pragma: no cover

    engine = TrioEngine(broken)
    async with trio.open_nursery() as nursery:
        with pytest.raises(EngineStartupError, match="no GPU here") as info:
            await nursery.start(engine.run)
    assert isinstance(info.value.__cause__, OSError) and isinstance(engine.failure, OSError)
    with pytest.raises(EngineClosed, match="failed to start"):
        await engine.add_request_async("x")


def test_the_adapters_control_forms_are_derived_from_the_engines_methods() -> None:
    """One table of names on the adapter: each form carries the engine method's name and documentation."""
    engine = ThreadEngine(static_pipeline([ScriptedStage(0)], {0}))
    for name in ("collective_rpc", "abort_confirmed", "pause", "resume", "sleep", "wake_up", "update_weights",
                 "start_profile", "stop_profile"):
        source = getattr(TrioEngine, f"{name}_async")  # the engine's one name for it
        assert getattr(engine, name).__doc__ == source.__doc__
        assert asyncio.iscoroutinefunction(getattr(engine, f"{name}_async"))
        assert not asyncio.iscoroutinefunction(getattr(engine, name))
        assert not hasattr(TrioEngine, name)  # no second name on the engine
    with pytest.raises(EngineClosed, match="not started"):
        engine.sleep()
