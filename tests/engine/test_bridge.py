"""The thread bridge: sync, asyncio and Trio callers; backpressure; cancellation; the fatal drain.

Sync tests drive an :class:`ThreadEngine` (Trio in its own thread) with
:class:`ScriptedStage` stages; stage outputs are injected *in the Trio
thread* with ``engine.call_soon``.  ``wait_until`` (tests/waiting.py) polls
the Trio thread's state with a generous bound: it only guards against a
hang, it asserts nothing about timing.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
import trio
import trio.testing

from tests.waiting import HANG, await_until, run_async, wait_until
from trio_orch import OrchError, OrchOutput
from trio_orch.engine import (
    EngineClosed,
    EngineStartupError,
    PipelineSpec,
    ThreadEngine,
    open_trio_engine,
    static_pipeline,
)
from trio_orch.engine import demux as demux_mod
from trio_orch.testing import ScriptedStage


def make(num: int = 3, finals: set[int] | None = None, **kw: Any) -> tuple[ThreadEngine, list[ScriptedStage]]:
    stages = [ScriptedStage(k) for k in range(num)]
    engine = ThreadEngine(static_pipeline(stages, finals or {0, num - 1}), **kw)
    return engine, stages


class Boom(BaseException):
    """Escapes the orchestrator's readers (they only catch Exception): kills the Trio thread."""


class KillableStage(ScriptedStage):
    """A stage whose receive() can be made to raise a BaseException: the orchestrator dies."""

    def kill(self) -> None:
        self.fail_nowait(Boom("the orchestrator thread was killed"))  # type: ignore[arg-type]


# ---------------------------------------------------------------- sync callers
def test_sync_request_streams_outputs_to_its_terminal() -> None:
    engine, stages = make(3, {0, 2})
    with engine:
        h = engine.add_request("hello there", request_id="r1")  # returns once accepted
        wait_until(lambda: stages[0].submissions == [("r1", "hello there")], "submission")
        engine.call_soon(stages[0].emit_nowait, "r1", "hi", False)
        engine.call_soon(stages[0].emit_nowait, "r1", "there", True)
        assert h.get(timeout=HANG) == OrchOutput("r1", 0, "hi", False)
        assert h.get(timeout=HANG) == OrchOutput("r1", 0, "there", False)
        wait_until(lambda: len(stages[1].submissions) == 1, "forward to stage 1")
        engine.call_soon(stages[1].emit_nowait, "r1", "codes", True)
        wait_until(lambda: len(stages[2].submissions) == 1, "forward to stage 2")
        engine.call_soon(stages[2].emit_nowait, "r1", "wav", True)
        assert list(h) == [OrchOutput("r1", 2, "wav", True)]
        assert h.finished
        with pytest.raises(RuntimeError, match="already delivered its terminal"):
            h.get()
        observed = engine.latency.count
        assert observed >= 2  # one observation per message taken
        stats = engine.stats()
        assert stats.terminals_by_kind == {"finished": 1}
        assert stats.outputs_routed == 3
        # the id is free again after the terminal
        engine.add_request("again", request_id="r1").close()


def test_sync_bad_calls_raise_and_register_nothing() -> None:
    engine, stages = make(3, {0, 2})
    with pytest.raises(EngineClosed, match="not started"):
        engine.add_request("x")
    with engine:
        h = engine.add_request("x", request_id="dup")
        with pytest.raises(ValueError, match="duplicate request id"):
            engine.add_request("y", request_id="dup")
        with pytest.raises(ValueError, match="out of range"):
            engine.add_request("y", final_stage_id=7)
        with pytest.raises(ValueError, match="non-empty str"):
            engine.add_request("y", request_id="")
        with pytest.raises(ValueError, match="request_timeout"):
            engine.add_request("y", request_timeout=-1)
        wait_until(lambda: len(stages[0].submissions) == 1, "submission")
        assert [rid for rid, _ in stages[0].submissions] == ["dup"]
        assert engine.stats().active_requests == 1
        h.close()


def test_sync_get_timeout_and_explicit_abort() -> None:
    engine, stages = make(1, {0})
    with engine:
        h = engine.add_request("x", request_id="r1")
        with pytest.raises(TimeoutError):
            h.get(timeout=0.05)
        h.abort()
        m = h.get(timeout=HANG)
        assert isinstance(m, OrchError) and m.kind == "aborted"
        wait_until(lambda: stages[0].aborts == ["r1"], "abort reached the stage")  # sent after the terminal
        engine.abort("unknown-id")  # no-op


def test_sync_iteration_left_early_aborts() -> None:
    engine, stages = make(1, {0})
    with engine:
        h = engine.add_request("x", request_id="r1")
        wait_until(lambda: len(stages[0].submissions) == 1, "submitted")
        engine.call_soon(stages[0].emit_nowait, "r1", "a", False)
        for m in h:
            assert m.data == "a"
            break
        wait_until(lambda: stages[0].aborts == ["r1"], "abort after break")
        wait_until(lambda: engine.stats().active_requests == 0)
        # generate_sync closed early aborts too
        gen = engine.generate_sync("y", request_id="r2")
        threading.Thread(target=lambda: (
            wait_until(lambda: len(stages[0].submissions) == 2, "submitted"),
            engine.call_soon(stages[0].emit_nowait, "r2", "b", False))).start()
        assert next(gen).data == "b"  # the generator starts (and submits) here
        gen.close()
        wait_until(lambda: stages[0].aborts == ["r1", "r2"], "abort after close")


def test_sync_backpressure_blocks_then_times_out_without_submitting() -> None:
    engine, stages = make(1, {0}, request_queue_size=1)
    with engine:
        engine.call_soon(stages[0].hold_submits)
        h1 = engine.add_request("a", request_id="r1")  # taken by the handler, stuck in submit
        wait_until(lambda: engine.stats().queued_requests == 0, "r1 taken by the handler")
        h2 = engine.add_request("b", request_id="r2")  # fills the channel
        with pytest.raises(TimeoutError, match="request channel stayed full"):
            engine.add_request("c", request_id="r3", timeout=0.1)
        # a blocked caller in another thread is admitted once there is room
        got: list[Any] = []
        t = threading.Thread(target=lambda: got.append(engine.add_request("d", request_id="r4")))
        t.start()
        wait_until(lambda: engine.stats().admission_waiting == 1, "r4 waiting for room")
        assert not got
        engine.call_soon(stages[0].release_submits)
        t.join(HANG)
        assert got and got[0].request_id == "r4"
        wait_until(lambda: len(stages[0].submissions) == 3, "submissions")
        assert [rid for rid, _ in stages[0].submissions] == ["r1", "r2", "r4"]
        engine.add_request("c2", request_id="r3").close()  # r3 was never registered
        for h in (h1, h2, got[0]):
            h.close()


# ---------------------------------------------------------------- asyncio callers
def test_asyncio_generate_and_one_wake_per_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    engine, stages = make(1, {0})
    wakes: list[int] = []
    real_wake = demux_mod.wake

    def counting_wake(by_loop: Any) -> None:
        wakes.append(sum(len(v) for v in by_loop.values()))
        real_wake(by_loop)

    monkeypatch.setattr(demux_mod, "wake", counting_wake)

    async def scenario() -> None:
        results: dict[str, list[Any]] = {}

        async def consume(rid: str) -> None:
            results[rid] = [m async for m in engine.generate(f"p-{rid}", request_id=rid)]

        rids = [f"r{i}" for i in range(8)]
        tasks = [asyncio.create_task(consume(r)) for r in rids]
        streams = engine.demux.streams
        await await_until(lambda: all(r in streams and streams[r].waiter is not None for r in rids)
                          and len(stages[0].submissions) == len(rids),
                          "every request at the stage and its consumer waiting")  # else outputs are unrouted

        def burst() -> None:  # one Trio callback: one reader batch, one dispatcher batch
            for r in rids:
                for i in range(5):
                    stages[0].emit_nowait(r, i, i == 4)

        engine.call_soon(burst)
        await asyncio.gather(*tasks)
        for r in rids:
            assert [m.data for m in results[r]] == [0, 1, 2, 3, 4]
            assert results[r][-1].finished and not any(m.finished for m in results[r][:-1])
        assert wakes == [len(rids)]  # one loop wake for the whole batch of 40 outputs

    with engine:
        run_async(scenario)


def test_asyncio_generate_batches_yields_one_list_per_dispatcher_batch() -> None:
    engine, stages = make(1, {0})

    async def scenario() -> list[list[Any]]:
        gen = engine.generate_batches("p", request_id="b1")
        first = asyncio.ensure_future(gen.__anext__())
        await await_until(lambda: stages[0].submissions != [], "submitted")
        engine.call_soon(lambda: [stages[0].emit_nowait("b1", i, i == 4) for i in range(5)])
        batches = [await first]
        batches += [b async for b in gen]
        return batches

    with engine:
        batches = run_async(scenario)
    assert [[m.data for m in b] for b in batches] == [[0, 1, 2, 3, 4]]
    assert batches[-1][-1].finished


def test_asyncio_cancellation_and_early_close_abort() -> None:
    engine, stages = make(1, {0})

    async def scenario() -> None:
        async def consume(rid: str) -> None:
            async for _ in engine.generate("p", request_id=rid):
                pass

        task = asyncio.create_task(consume("cancelled"))
        await await_until(lambda: stages[0].submissions != [], "submitted")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await await_until(lambda: stages[0].aborts == ["cancelled"], "abort on cancel")

        agen = engine.generate("p", request_id="closed")  # starts at the first __anext__
        first = asyncio.ensure_future(agen.__anext__())
        await await_until(lambda: len(stages[0].submissions) == 2, "submitted")
        engine.call_soon(stages[0].emit_nowait, "closed", "x", False)
        assert (await first).data == "x"
        await agen.aclose()
        await await_until(lambda: stages[0].aborts == ["cancelled", "closed"], "abort on aclose")

        agen = engine.generate("p", request_id="aborted")
        first = asyncio.ensure_future(agen.__anext__())
        await await_until(lambda: len(stages[0].submissions) == 3, "submitted")
        engine.abort("aborted")
        m = await first
        assert isinstance(m, OrchError) and m.kind == "aborted"
        with pytest.raises(StopAsyncIteration):
            await agen.__anext__()
        with pytest.raises(ValueError, match="out of range"):
            await engine.generate("p", final_stage_id=3).__anext__()

    with engine:
        run_async(scenario)
        wait_until(lambda: engine.stats().active_requests == 0)


def test_asyncio_backpressure_waits_without_blocking_the_loop_and_cancel_withdraws() -> None:
    engine, stages = make(1, {0}, request_queue_size=1)

    async def scenario() -> None:
        engine.call_soon(stages[0].hold_submits)
        gens = {rid: engine.generate("p", request_id=rid) for rid in ("a", "b", "c", "d")}
        firsts = {rid: asyncio.ensure_future(g.__anext__()) for rid, g in gens.items()}
        # a: stuck in submit; b: in the channel; c and d: waiting in the bridge
        await await_until(lambda: engine.stages and len(engine.open_requests) == 4)
        stats = await engine.stats_async()
        await await_until(lambda: engine.admission_waiting == 2, "two waiting for room")
        ticks = 0
        for _ in range(5):  # the loop keeps running while they wait
            await asyncio.sleep(0)
            ticks += 1
        assert ticks == 5 and stats.running
        firsts["c"].cancel()  # cancel one waiting for room: never submitted
        await await_until(lambda: "c" not in engine.open_requests, "c withdrawn")
        engine.call_soon(stages[0].release_submits)
        await await_until(lambda: len(stages[0].submissions) == 3, "a, b, d submitted")
        assert [rid for rid, _ in stages[0].submissions] == ["a", "b", "d"]
        for rid in ("a", "b", "d"):
            engine.call_soon(stages[0].emit_nowait, rid, rid, True)
            assert (await firsts[rid]) == OrchOutput(rid, 0, rid, True)
        assert "c" not in stages[0].aborts

    with engine:
        run_async(scenario)


def test_abort_while_waiting_for_room_gives_aborted_terminal() -> None:
    engine, stages = make(1, {0}, request_queue_size=1)
    with engine:
        engine.call_soon(stages[0].hold_submits)
        engine.add_request("a", request_id="a")
        wait_until(lambda: engine.stats().queued_requests == 0)
        engine.add_request("b", request_id="b")

        async def scenario() -> list[Any]:
            agen = engine.generate("p", request_id="c")
            first = asyncio.ensure_future(agen.__anext__())
            await await_until(lambda: engine.admission_waiting == 1, "c waiting")
            engine.abort("c")
            return [await first]

        [m] = run_async(scenario)
        assert isinstance(m, OrchError) and m.kind == "aborted" and "waiting for room" in m.message
        engine.call_soon(stages[0].release_submits)
        wait_until(lambda: len(stages[0].submissions) == 2)
        assert [rid for rid, _ in stages[0].submissions] == ["a", "b"]


# ---------------------------------------------------------------- the fatal drain
def test_close_drains_every_waiter_then_every_call_raises() -> None:
    engine, stages = make(1, {0}, request_queue_size=1)
    engine.start()
    engine.call_soon(stages[0].hold_submits)
    routed = engine.add_request("a", request_id="routed")  # handler stuck submitting it
    wait_until(lambda: engine.stats().queued_requests == 0)
    queued = engine.add_request("b", request_id="queued")  # in the channel, not handled
    blocked: list[Any] = []
    t = threading.Thread(target=lambda: blocked.append(engine.add_request("c", request_id="blocked")))
    t.start()  # waiting for room, in a sync caller
    wait_until(lambda: engine.stats().admission_waiting == 1)
    loop_result: list[Any] = []

    def asyncio_waiter() -> None:
        async def go() -> None:
            loop_result.extend([m async for m in engine.generate("d", request_id="async-waiting")])
        run_async(go)

    ta = threading.Thread(target=asyncio_waiter)
    ta.start()
    wait_until(lambda: engine.stats().admission_waiting == 2)
    engine.close()
    t.join(HANG)
    ta.join(HANG)
    assert not t.is_alive() and not ta.is_alive()
    for h in (routed, queued, blocked[0]):
        msgs = list(h)
        assert len(msgs) == 1 and isinstance(msgs[0], OrchError) and msgs[0].kind == "shutdown"
    assert len(loop_result) == 1 and loop_result[0].kind == "shutdown"
    assert engine.open_requests == set()
    with pytest.raises(EngineClosed, match="closed"):
        engine.add_request("x")
    with pytest.raises(EngineClosed):
        run_async(lambda: engine.generate("x").__anext__())
    with pytest.raises(EngineClosed):
        engine.abort("routed")
    assert not engine.running
    engine.close()  # idempotent
    assert engine.stats().running is False


def test_orchestrator_crash_mid_request_drains_and_later_calls_raise() -> None:
    stages = [KillableStage(0)]
    engine = ThreadEngine(static_pipeline(stages, {0}))
    with engine:
        sync_h = engine.add_request("a", request_id="sync")
        got: list[Any] = []

        def asyncio_consumer() -> None:
            async def go() -> None:
                got.extend([m async for m in engine.generate("b", request_id="async")])
            run_async(go)

        t = threading.Thread(target=asyncio_consumer)
        t.start()
        wait_until(lambda: len(stages[0].submissions) == 2)
        engine.call_soon(stages[0].emit_nowait, "sync", "partial", False)
        assert sync_h.get(timeout=HANG).data == "partial"
        engine.call_soon(stages[0].kill)
        rest = list(sync_h)
        t.join(HANG)
        assert len(rest) == 1 and isinstance(rest[0], OrchError) and rest[0].kind == "shutdown"
        assert len(got) == 1 and isinstance(got[0], OrchError)
        wait_until(lambda: not engine.thread_alive, "engine thread exit")
        with pytest.raises(EngineClosed, match="crashed: Boom"):
            engine.add_request("later")
        assert isinstance(engine.failure, Boom)


def test_crash_drains_queued_and_backpressured_callers_too() -> None:
    stages = [KillableStage(0)]
    engine = ThreadEngine(static_pipeline(stages, {0}), request_queue_size=1)
    engine.start()
    engine.call_soon(stages[0].hold_submits)
    stuck = engine.add_request("a", request_id="stuck")  # the handler is stuck submitting it
    wait_until(lambda: engine.stats().queued_requests == 0)
    queued = engine.add_request("b", request_id="queued")  # in the channel, never handled
    results: dict[str, list[Any]] = {"sync": [], "async": []}

    def sync_waiter() -> None:
        results["sync"].extend(engine.add_request("c", request_id="sync-waiting"))

    def async_waiter() -> None:
        async def go() -> None:
            results["async"].extend([m async for m in engine.generate("d", request_id="async-waiting")])
        run_async(go)

    threads = [threading.Thread(target=sync_waiter), threading.Thread(target=async_waiter)]
    for t in threads:
        t.start()
    wait_until(lambda: engine.stats().admission_waiting == 2, "two callers waiting for room")
    engine.call_soon(stages[0].kill)
    for t in threads:
        t.join(HANG)
        assert not t.is_alive()
    for msgs in (list(stuck), list(queued), results["sync"], results["async"]):
        assert len(msgs) == 1 and isinstance(msgs[0], OrchError) and msgs[0].kind == "shutdown"
    engine.join(HANG)
    assert engine.open_requests == set()
    with pytest.raises(EngineClosed, match="crashed: Boom"):
        engine.add_request("later")
    engine.close()


def test_orchestrator_stopping_on_its_own_drains() -> None:
    engine, _ = make(1, {0})
    with engine:
        h = engine.add_request("a", request_id="r1")
        engine.call_soon(engine.orchestrator.request_shutdown)
        msgs = list(h)
        assert [type(m) for m in msgs] == [OrchError] and msgs[0].kind == "shutdown"
        wait_until(lambda: not engine.thread_alive, "engine thread exit")
        with pytest.raises(EngineClosed, match="orchestrator stopped"):
            engine.add_request("later")


def test_startup_failure_is_reraised_with_its_cause() -> None:
    @asynccontextmanager
    async def broken() -> AsyncIterator[PipelineSpec]:
        raise OSError("worker set cannot start: stage 1 exited with code 3")
        yield  # pragma: no cover

    engine = ThreadEngine(broken)
    with pytest.raises(EngineStartupError, match="stage 1 exited") as info:
        engine.start()
    assert isinstance(info.value.__cause__, OSError)
    assert not engine.thread_alive
    with pytest.raises(EngineClosed):
        engine.add_request("x")
    engine.close()


def test_startup_timeout_stops_the_thread() -> None:
    @asynccontextmanager
    async def hangs() -> AsyncIterator[PipelineSpec]:
        await trio.sleep_forever()
        yield  # pragma: no cover

    engine = ThreadEngine(hangs, startup_timeout=0.2)
    with pytest.raises(EngineStartupError, match="did not become ready"):
        engine.start()
    assert not engine.thread_alive
    with pytest.raises(EngineClosed):
        engine.add_request("x")


@pytest.mark.parametrize("started", [False, True])
def test_a_signal_inside_thread_start_still_lets_close_stop_cleanly(
        monkeypatch: pytest.MonkeyPatch, started: bool) -> None:
    """SIGTERM during ``serve``'s start-up can land inside ``Thread.start()`` (KeyboardInterrupt from
    the signal handler), before or after the thread began: close() must neither raise nor hang."""
    original = threading.Thread.start

    def interrupted(self: threading.Thread) -> None:
        if started:
            original(self)
        raise KeyboardInterrupt("SIGTERM")

    engine = ThreadEngine(static_pipeline([ScriptedStage(0)], {0}), close_timeout=HANG)
    monkeypatch.setattr(threading.Thread, "start", interrupted)
    with pytest.raises(KeyboardInterrupt):
        engine.start()
    monkeypatch.setattr(threading.Thread, "start", original)
    engine.close()  # the serve command's clean-up path
    assert not engine.thread_alive and engine.closed_reason is not None
    with pytest.raises(EngineClosed):
        engine.add_request("x")


def test_close_is_bounded_when_the_pipeline_will_not_stop() -> None:
    release = threading.Event()
    stages = [ScriptedStage(0)]

    @asynccontextmanager
    async def stubborn() -> AsyncIterator[PipelineSpec]:
        try:
            yield PipelineSpec(stages, {0})
        finally:
            release.wait(HANG)  # blocks the Trio thread itself: no cancellation can help

    engine = ThreadEngine(stubborn, close_timeout=0.2)
    engine.start()
    h = engine.add_request("x", request_id="r1")
    engine.close()  # returns after close_timeout although the thread is stuck
    assert engine.thread_alive
    msgs = list(h)
    assert msgs[-1].kind == "shutdown"
    with pytest.raises(EngineClosed):
        engine.add_request("y")
    release.set()
    engine.join(HANG)
    assert not engine.thread_alive


def test_close_before_start_and_drain_on_close() -> None:
    engine, stages = make(1, {0})
    engine.close()
    with pytest.raises(EngineClosed):
        engine.add_request("x")
    engine, stages = make(1, {0})
    engine.start()
    h = engine.add_request("x", request_id="r1")
    # finish the request from the Trio side while close() drains
    wait_until(lambda: len(stages[0].submissions) == 1, "submitted")
    threading.Timer(0.05, lambda: engine.call_soon(stages[0].emit_nowait, "r1", "done", True)).start()
    engine.close(drain=HANG)
    assert list(h) == [OrchOutput("r1", 0, "done", True)]


# ---------------------------------------------------------------- the Trio API
async def _consume(engine: Any, rid: str, into: list[Any]) -> None:
    async for m in engine.generate("p", request_id=rid):
        into.append(m)


async def test_trio_api_generate_cancel_and_close() -> None:
    stages = [ScriptedStage(0)]
    async with open_trio_engine(static_pipeline(stages, {0}), request_queue_size=2) as engine:
        got: list[Any] = []
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_consume, engine, "r1", got)
            await trio.testing.wait_all_tasks_blocked()
            await stages[0].emit("r1", "a")
            await stages[0].emit("r1", "b", finished=True)
        assert [m.data for m in got] == ["a", "b"] and got[-1].finished

        cancelled: list[Any] = []
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_consume, engine, "r2", cancelled)
            await trio.testing.wait_all_tasks_blocked()
            nursery.cancel_scope.cancel()
        await trio.testing.wait_all_tasks_blocked()
        assert cancelled == [] and stages[0].aborts == ["r2"]
        assert engine.stats().active_requests == 0

        left: list[Any] = []
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_consume, engine, "r3", left)
            await trio.testing.wait_all_tasks_blocked()
            engine.orchestrator.request_shutdown()  # the orchestrator stops under a waiting caller
    assert len(left) == 1 and left[0].kind == "shutdown"
    with pytest.raises(EngineClosed):
        await engine.generate("p").__anext__()


# ---------------------------------------------------------------- real worker processes
@pytest.mark.processes
def test_worker_set_that_cannot_start_raises_startup_error_with_cause(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    import tempfile

    from stages.config import echo_config
    from trio_orch.cluster.launcher import WorkerStartupError, open_pipeline

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the launcher's ipc dir goes here
    cfg = echo_config(2, worker_args=["--fail-at-startup", "no GPU here"], startup_timeout=20)
    engine = ThreadEngine(lambda: open_pipeline(cfg), startup_timeout=30)
    with pytest.raises(EngineStartupError, match="no GPU here") as info:
        engine.start()
    assert isinstance(info.value.__cause__, WorkerStartupError)
    assert not engine.thread_alive
    assert list(tmp_path.iterdir()) == []  # no ipc socket or log left
    with pytest.raises(EngineClosed, match=r"failed|crashed"):
        engine.add_request("x")


@pytest.mark.processes
def test_sync_and_asyncio_callers_over_real_echo_workers() -> None:
    from stages.config import echo_config
    from trio_orch.cluster.launcher import open_pipeline

    cfg = echo_config(2, final_stage_ids=[0, 1], outputs=3)
    with ThreadEngine(lambda: open_pipeline(cfg)) as engine:
        msgs = list(engine.add_request("ping", request_id="s1"))
        assert [(m.stage_id, m.data) for m in msgs] == [(0, "ping")] * 3 + [(1, "ping")] * 3
        assert msgs[-1].finished and not any(m.finished for m in msgs[:-1])

        async def many() -> list[list[Any]]:
            async def one(i: int) -> list[Any]:
                return [m async for m in engine.generate(f"p{i}", final_stage_id=0)]
            return await asyncio.gather(*(one(i) for i in range(20)))

        for i, out in enumerate(run_async(many)):
            assert [m.data for m in out] == [f"p{i}"] * 3 and out[-1].finished
        assert engine.stats().inflight_by_replica == {(0, "0"): 0, (1, "0"): 0}


def test_many_callers_with_random_cancels_and_aborts_leave_nothing_behind() -> None:
    import random

    from trio_orch.testing.toy_pipeline import toy_pipeline

    rng = random.Random(4)
    engine = ThreadEngine(toy_pipeline(token_delay=0.001, audio_delay=0.0005), request_queue_size=8)
    outcomes: dict[str, Any] = {}
    seen = 0  # messages the callers got so far, all together
    streaming = asyncio.Event()  # set once enough of them are under way to cancel some mid-stream

    async def one(i: int) -> None:
        nonlocal seen
        rid = f"r{i}"
        fate = rng.choice(["finish", "cancel", "abort", "close"])
        n = 0
        agen = engine.generate(f"request {i} " + "word " * rng.randint(1, 6), request_id=rid)
        try:
            async for m in agen:
                n += 1
                seen += 1
                if seen == 60:
                    streaming.set()
                if m.finished:
                    outcomes[rid] = m
                elif fate == "abort" and n == 2:
                    engine.abort(rid)
                elif fate == "close" and n == 2:
                    outcomes[rid] = "closed"
                    break
        finally:
            await agen.aclose()

    async def main() -> None:
        tasks = [asyncio.create_task(one(i)) for i in range(150)]
        await streaming.wait()
        for t in rng.sample(tasks, 30):
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    with engine:
        run_async(main)
        wait_until(lambda: engine.stats().active_requests == 0, "every request ended")
        stats = engine.stats()
        assert stats.queued_requests == 0 and stats.admission_waiting == 0
        assert all(v == 0 for v in stats.inflight_by_stage) and stats.open_streams == 0
        kinds = [m.kind if isinstance(m, OrchError) else "finished" for m in outcomes.values()
                 if not isinstance(m, str)]
        assert set(kinds) <= {"finished", "aborted"} and "finished" in kinds and "aborted" in kinds
        # the engine still serves after all that
        assert list(engine.generate_sync("after"))[-1].finished


async def test_trio_api_caller_waiting_for_room_gets_a_terminal_when_it_stops() -> None:
    stages = [ScriptedStage(0)]
    async with open_trio_engine(static_pipeline(stages, {0}), request_queue_size=1) as engine:
        stages[0].hold_submits()
        got: dict[str, list[Any]] = {"a": [], "b": [], "c": []}
        async with trio.open_nursery() as nursery:
            for rid in got:  # a: stuck in submit, b: queued, c: waiting for room
                nursery.start_soon(_consume, engine, rid, got[rid])
                await trio.testing.wait_all_tasks_blocked()
            engine.orchestrator.request_shutdown()
    for rid, msgs in got.items():
        assert len(msgs) == 1 and msgs[0].kind == "shutdown", rid


def test_dispatch_latency_is_measured_from_the_stage_production_stamp() -> None:
    from time import perf_counter

    from trio_orch.engine.handles import observe_latency

    seen: list[float] = []
    now = perf_counter()
    stamped = OrchOutput("r", 0, "x", False, now - 0.5)  # produced half a second ago
    unstamped = OrchError("r", 0, "aborted", "gone")  # no production time: hand-over time is used
    observe_latency(seen.append, now - 0.1, [stamped, unstamped])
    assert seen[0] == pytest.approx(0.5, abs=0.05) and seen[1] == pytest.approx(0.1, abs=0.05)
