"""The Trio orchestrator against in-process scripted stages (pytest-trio, trio_mode)."""

from __future__ import annotations

import logging
import random
from collections import defaultdict

import pytest
import trio
import trio.testing

from tests.conftest import orchestrator_tasks
from trio_orch import OrchError, Orchestrator, OrchOutput, open_orchestrator
from trio_orch.testing import ScriptedStage


def warm(k: int, p: str) -> str:
    return f"warm{k}:{len(p)}"


def three() -> list[ScriptedStage]:
    return [ScriptedStage(0), ScriptedStage(1), ScriptedStage(2)]


async def nxt(orch: Orchestrator) -> OrchOutput | OrchError:
    with trio.fail_after(5):
        return await orch.next_output()


async def drain(orch: Orchestrator) -> list[OrchOutput | OrchError]:
    """Every message left, once the orchestrator has stopped."""
    msgs = []
    with trio.fail_after(5):
        while True:
            try:
                msgs.append(await orch.next_output())
            except trio.EndOfChannel:
                return msgs


async def test_normal_mode_forward_chain() -> None:
    stages = three()
    fwd = lambda k, p, outs: f"in{k + 1}<{'|'.join(outs)}>"  # noqa: E731
    async with open_orchestrator(stages, {0, 2}, forward_fn=fwd) as orch:
        await orch.add_request("r1", "prompt")
        assert stages[0].submissions == [("r1", "prompt")]
        await stages[0].emit("r1", "t1")
        await stages[0].emit("r1", "t2", finished=True)
        assert await nxt(orch) == OrchOutput("r1", 0, "t1", False)
        assert await nxt(orch) == OrchOutput("r1", 0, "t2", False)
        await trio.testing.wait_all_tasks_blocked()
        assert stages[1].submissions == [("r1", "in1<t1|t2>")]
        await stages[1].emit("r1", "c1", finished=True)
        await trio.testing.wait_all_tasks_blocked()
        assert stages[2].submissions == [("r1", "in2<c1>")]
        await stages[2].emit("r1", "w1", finished=True)
        assert await nxt(orch) == OrchOutput("r1", 2, "w1", True)
        assert orch.active_requests == 0
    assert await drain(orch) == []


async def test_async_chunk_late_nonfinal_completion_worked_example() -> None:
    stages = three()
    async with open_orchestrator(stages, {0, 2}, async_chunk=True, prewarm_fn=warm) as orch:
        await orch.add_request("r1", "hi there")
        assert [s.submissions for s in stages] == [
            [("r1", "hi there")], [("r1", "warm1:8")], [("r1", "warm2:8")]]
        await stages[0].emit("r1", "hi")
        assert await nxt(orch) == OrchOutput("r1", 0, "hi", False)
        await stages[0].emit("r1", "there", finished=True)
        assert await nxt(orch) == OrchOutput("r1", 0, "there", False)
        await stages[2].emit("r1", "wav:HI")
        assert await nxt(orch) == OrchOutput("r1", 2, "wav:HI", False)
        await stages[2].emit("r1", "wav:THERE", finished=True)
        await trio.testing.wait_all_tasks_blocked()
        with pytest.raises(trio.WouldBlock):
            orch.next_output_nowait()  # held by the terminal gate
        await stages[1].emit("r1", None, finished=True)
        assert await nxt(orch) == OrchOutput("r1", 2, "wav:THERE", True)
        await stages[2].emit("r1", "wav:EXTRA")
        await trio.testing.wait_all_tasks_blocked()
        assert orch.dropped_outputs == 1
        assert all(s.submissions[1:] == [] for s in stages)  # each stage submitted exactly once
    assert await drain(orch) == []


async def test_async_chunk_nonfinal_stage_completes_first() -> None:
    stages = three()
    async with open_orchestrator(stages, {0, 2}, async_chunk=True, prewarm_fn=warm) as orch:
        await orch.add_request("r1", "hi there")
        await stages[0].emit("r1", "hi", finished=True)
        await stages[1].emit("r1", None, finished=True)
        await stages[2].emit("r1", "wav", finished=True)
        assert await nxt(orch) == OrchOutput("r1", 0, "hi", False)
        assert await nxt(orch) == OrchOutput("r1", 2, "wav", True)


async def test_async_chunk_stage0_is_last_final_stage() -> None:
    stages = three()
    async with open_orchestrator(stages, {0, 2}, async_chunk=True, prewarm_fn=warm) as orch:
        await orch.add_request("r1", "hi there")
        await stages[1].emit("r1", None, finished=True)
        await stages[2].emit("r1", "wav", finished=True)
        assert await nxt(orch) == OrchOutput("r1", 2, "wav", False)
        await stages[0].emit("r1", "text", finished=True)
        assert await nxt(orch) == OrchOutput("r1", 0, "text", True)


async def test_twenty_concurrent_requests_with_random_late_completions(
        autojump_clock: trio.testing.MockClock) -> None:
    rng = random.Random(1234)
    stages = three()
    ids = [f"r{i}" for i in range(20)]
    async with open_orchestrator(stages, {0, 2}, async_chunk=True, prewarm_fn=warm) as orch:
        for rid in ids:
            await orch.add_request(rid, "hello")

        async def stage_script(k: int, rid: str) -> None:
            n = rng.randint(1, 3) if k != 1 else 0
            for i in range(n):
                await trio.sleep(rng.uniform(0, 0.002))
                await stages[k].emit(rid, f"{k}:{i}")
            await trio.sleep(rng.uniform(0, 0.01) * (5 if k == 1 else 1))  # stage 1 often late
            await stages[k].emit(rid, f"{k}:end", finished=True)

        got: dict[str, list] = defaultdict(list)
        async with trio.open_nursery() as nursery:
            for rid in ids:
                for k in range(3):
                    nursery.start_soon(stage_script, k, rid)
            done = 0
            while done < len(ids):
                msg = await nxt(orch)
                assert not (got[msg.request_id] and got[msg.request_id][-1].finished), (
                    f"message after the terminal: {msg}")
                got[msg.request_id].append(msg)
                done += msg.finished
        await trio.testing.wait_all_tasks_blocked()
        for rid in ids:
            terminals = [m for m in got[rid] if m.finished]
            assert len(terminals) == 1 and got[rid][-1] is terminals[0]
            assert isinstance(terminals[0], OrchOutput)
        assert orch.active_requests == 0
    assert await drain(orch) == []


async def test_outputs_after_cleanup_are_dropped_and_counted() -> None:
    stages = three()
    async with open_orchestrator(stages, {0, 2}) as orch:
        await orch.add_request("r1", "p", final_stage_id=0)
        await stages[0].emit("r1", "x", finished=True)
        assert await nxt(orch) == OrchOutput("r1", 0, "x", True)
        await stages[0].emit("r1", "late")
        await stages[2].emit("r1", "late2", finished=True)
        await stages[1].emit("never-added", "zzz")
        await trio.testing.wait_all_tasks_blocked()
        assert orch.dropped_outputs == 3
        assert orch.active_requests == 0 and "r1" not in orch.router
    assert await drain(orch) == []


async def test_abort_mid_stream() -> None:
    stages = three()
    async with open_orchestrator(stages, {0, 2}, async_chunk=True) as orch:
        await orch.add_request("r1", "p")
        await stages[0].emit("r1", "a")
        assert await nxt(orch) == OrchOutput("r1", 0, "a", False)
        await stages[0].emit("r1", "b", finished=True)
        assert await nxt(orch) == OrchOutput("r1", 0, "b", False)
        await orch.abort("r1")
        msg = await nxt(orch)
        assert isinstance(msg, OrchError) and msg.kind == "aborted" and msg.request_id == "r1"
        assert stages[0].aborts == [] and stages[1].aborts == ["r1"] and stages[2].aborts == ["r1"]
        await stages[2].emit("r1", "after abort")
        await trio.testing.wait_all_tasks_blocked()
        assert orch.dropped_outputs == 1
    assert await drain(orch) == []


async def test_unknown_abort_is_a_noop() -> None:
    stages = three()
    async with open_orchestrator(stages, {0, 2}) as orch:
        await orch.abort("nobody")
        await orch.add_request("r1", "p", final_stage_id=0)
        await orch.abort("nobody")
        await stages[0].emit("r1", "x", finished=True)
        assert await nxt(orch) == OrchOutput("r1", 0, "x", True)
        await orch.abort("r1")  # already finished: also a no-op
        assert all(s.aborts == [] for s in stages)
    assert await drain(orch) == []


async def test_per_request_stage_error() -> None:
    stages = three()
    async with open_orchestrator(stages, {0, 2}, async_chunk=True) as orch:
        await orch.add_request("bad", "p")
        await orch.add_request("good", "p", final_stage_id=0)
        await stages[1].emit("bad", None, error="CUDA OOM")
        msg = await nxt(orch)
        assert msg == OrchError("bad", 1, "stage_failed", "CUDA OOM")
        await trio.testing.wait_all_tasks_blocked()
        assert stages[0].aborts == ["bad"] and stages[2].aborts == ["bad"]
        assert stages[1].aborts == ["good"]  # "good" stops at stage 0: stage 1 drops its chunks
        await stages[0].emit("good", "fine", finished=True)
        assert await nxt(orch) == OrchOutput("good", 0, "fine", True)


async def test_stage_death_with_requests_then_new_work_for_that_stage() -> None:
    stages = three()
    async with open_orchestrator(stages, {0, 2}) as orch:
        await orch.add_request("on1", "p")
        await orch.add_request("on0", "p")
        await stages[0].emit("on1", "x", finished=True)
        assert await nxt(orch) == OrchOutput("on1", 0, "x", False)
        await trio.testing.wait_all_tasks_blocked()
        assert stages[1].submissions == [("on1", ["x"])]
        await stages[1].fail(RuntimeError("boom"))
        msg = await nxt(orch)
        assert isinstance(msg, OrchError) and (msg.request_id, msg.kind, msg.stage_id) == (
            "on1", "replica_died", 1)
        assert "boom" in msg.message
        # the orchestrator keeps serving; forwarding to the dead stage fails at that moment
        await stages[0].emit("on0", "y", finished=True)
        assert await nxt(orch) == OrchOutput("on0", 0, "y", False)
        msg = await nxt(orch)
        assert isinstance(msg, OrchError) and (msg.request_id, msg.kind, msg.stage_id) == (
            "on0", "stage_unavailable", 1)
        # text-only work that never touches stage 1 still runs
        await orch.add_request("text", "p", final_stage_id=0)
        await stages[0].emit("text", "t", finished=True)
        assert await nxt(orch) == OrchOutput("text", 0, "t", True)
        assert orch.running
    assert await drain(orch) == []


async def test_shutdown_with_requests_in_flight_leaves_no_task() -> None:
    stages = three()
    orch = Orchestrator(stages, {0, 2}, async_chunk=True)
    async with trio.open_nursery() as nursery:
        await nursery.start(orch.run)
        for i in range(5):
            await orch.add_request(f"r{i}", "p")
        await stages[0].emit("r0", "partial")
        assert await nxt(orch) == OrchOutput("r0", 0, "partial", False)
        # run() itself, 3 readers, the dispatcher, the performer, the intake, the deadline keeper
        assert len(orchestrator_tasks()) == 8
        await orch.shutdown()
        assert orchestrator_tasks() == []
        msgs = await drain(orch)
        assert sorted(m.request_id for m in msgs) == [f"r{i}" for i in range(5)]
        assert all(isinstance(m, OrchError) and m.kind == "shutdown" for m in msgs)
        assert all(s.closed for s in stages)
        with pytest.raises(RuntimeError, match="not accepting"):
            await orch.add_request("late", "p")
    assert orchestrator_tasks() == []


async def test_shutdown_with_timeout_lets_requests_finish(autojump_clock: trio.testing.MockClock) -> None:
    stages = three()
    orch = Orchestrator(stages, {0, 2})
    async with trio.open_nursery() as nursery:
        await nursery.start(orch.run)
        await orch.add_request("r", "p", final_stage_id=0)

        async def finish_later() -> None:
            await trio.sleep(3)  # virtual time, inside the drain's 10 s
            await stages[0].emit("r", "done", finished=True)

        t0 = trio.current_time()
        nursery.start_soon(finish_later)
        await orch.shutdown(timeout=10)
        assert 3 <= trio.current_time() - t0 < 10  # the drain ended with the request, not at its timeout
    assert await drain(orch) == [OrchOutput("r", 0, "done", True)]


async def test_nursery_cancelled_from_outside() -> None:
    stages = three()
    orch = Orchestrator(stages, {0, 2})
    with trio.CancelScope() as outer:
        async with trio.open_nursery() as nursery:
            await nursery.start(orch.run)
            await orch.add_request("r1", "p")
            await orch.add_request("r2", "p")
            outer.cancel()
    assert outer.cancelled_caught
    assert orchestrator_tasks() == []
    msgs = await drain(orch)
    assert sorted((m.request_id, m.kind) for m in msgs) == [("r1", "shutdown"), ("r2", "shutdown")]
    assert all(s.closed for s in stages)


async def test_duplicate_request_id_is_refused() -> None:
    stages = three()
    async with open_orchestrator(stages, {0, 2}) as orch:
        await orch.add_request("r1", "first", final_stage_id=0)
        with pytest.raises(ValueError, match="duplicate request id 'r1'"):
            await orch.add_request("r1", "second")
        assert stages[0].submissions == [("r1", "first")]
        await stages[0].emit("r1", "x", finished=True)
        assert await nxt(orch) == OrchOutput("r1", 0, "x", True)
        await orch.add_request("r1", "reused after its terminal")  # fine now
        assert stages[0].submissions[-1] == ("r1", "reused after its terminal")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"final_stage_id": 3}, "out of range"), ({"final_stage_id": -1}, "out of range"),
     ({"final_stage_id": 1}, "no final-output stage")],
)
async def test_malformed_input_is_rejected_and_nothing_registered(kwargs: dict, match: str) -> None:
    stages = three()
    async with open_orchestrator(stages, {2}) as orch:
        with pytest.raises(ValueError, match=match):
            await orch.add_request("r1", "p", **kwargs)
        with pytest.raises(ValueError, match="non-empty str"):
            await orch.add_request("", "p")
        assert orch.active_requests == 0 and len(orch.router) == 0
        assert all(s.submissions == [] for s in stages)


def test_empty_final_set_is_rejected_at_construction() -> None:
    with pytest.raises(ValueError, match="final_stage_ids is empty"):
        Orchestrator(three(), set())


async def test_backpressure_on_a_full_request_channel(autojump_clock: trio.testing.MockClock) -> None:
    stages = three()
    stages[0].hold_submits()  # the request handler blocks on its first submit
    async with open_orchestrator(stages, {0, 2}, request_queue_size=2) as orch:
        accepted: list[str] = []

        async def add(rid: str) -> None:
            await orch.add_request(rid, "p", final_stage_id=0)
            accepted.append(rid)

        async with trio.open_nursery() as nursery:
            for i in range(4):
                nursery.start_soon(add, f"r{i}")
            await trio.sleep(60)
            # r0 is stuck in the handler's submit, two wait in the channel, one waits to enter it
            assert orch.queued_requests == 3 and orch.statistics().request_channel.tasks_waiting_send == 1
            assert accepted == [] and stages[0].submissions == []
            with pytest.raises(trio.WouldBlock):
                orch.add_request_nowait("extra", "p")
            stages[0].release_submits()
        assert sorted(accepted) == ["r0", "r1", "r2", "r3"]
        assert sorted(rid for rid, _ in stages[0].submissions) == sorted(accepted)


async def test_cancelled_add_request_rolls_back(autojump_clock: trio.testing.MockClock) -> None:
    stages = three()
    stages[0].hold_submits()
    async with open_orchestrator(stages, {0, 2}, request_queue_size=1) as orch:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(orch.add_request, "stuck", "p")  # taken by the handler, blocks in submit
            await trio.sleep(1)
            nursery.start_soon(orch.add_request, "queued", "p")  # fills the channel
            await trio.sleep(1)
            with trio.move_on_after(5) as scope:
                await orch.add_request("waiting", "p")  # cancelled before it got into the channel
            assert scope.cancelled_caught
            # nothing registered: not live, not in the router, the id is free again
            assert orch.active_requests == 2 and not orch.router.is_live("waiting")
            assert "waiting" not in orch.router
            stages[0].release_submits()
        assert [rid for rid, _ in stages[0].submissions] == ["stuck", "queued"]
        # a caller cancelled after its request was accepted aborts it: it still gets its terminal
        stages[0].hold_submits()
        with trio.move_on_after(5):
            await orch.add_request("waiting", "p", final_stage_id=0)
        assert "waiting" in orch.router  # registered before the submit; not leaked, see below
        msg = await nxt(orch)
        assert msg == OrchError("waiting", None, "aborted", "aborted by the client")
        stages[0].release_submits()
        await trio.testing.wait_all_tasks_blocked()
        assert "waiting" not in orch.router and orch.active_requests == 2
        assert stages[0].aborts.count("waiting") >= 1


async def test_run_twice_is_an_error() -> None:
    orch = Orchestrator(three(), {0})
    async with trio.open_nursery() as nursery:
        await nursery.start(orch.run)
        with pytest.raises(RuntimeError, match="running"):
            await orch.run()
        await orch.shutdown()


async def test_per_request_deadline_on_a_stage_that_never_answers(
    autojump_clock: trio.testing.MockClock,
) -> None:
    stages = three()
    async with open_orchestrator(stages, {0, 2}, async_chunk=True, request_timeout=30) as orch:
        t0 = trio.current_time()
        await orch.add_request("slow", "p", timeout=5)
        await orch.add_request("default", "p")  # the orchestrator's 30 s default
        await orch.add_request("quick", "p", final_stage_id=0, timeout=1)
        await stages[0].emit("quick", "x", finished=True)
        assert await nxt(orch) == OrchOutput("quick", 0, "x", True)
        msg = await orch.next_output()
        assert (msg.request_id, msg.kind) == ("slow", "timeout")
        assert trio.current_time() - t0 == pytest.approx(5, abs=0.1)
        await trio.testing.wait_all_tasks_blocked()
        assert [s.aborts for s in stages] == [["slow"], ["quick", "slow"], ["slow"]]  # every open stage
        # (stage 1 first dropped the chunks of "quick", which stops at stage 0)
        msg = await orch.next_output()
        assert (msg.request_id, msg.kind) == ("default", "timeout")
        assert trio.current_time() - t0 == pytest.approx(30, abs=0.1)
        assert orch.active_requests == 0
        # the finished request's deadline never fires later
        await trio.sleep(100)
        with pytest.raises(trio.WouldBlock):
            orch.next_output_nowait()


async def test_deadline_of_a_request_still_queued(autojump_clock: trio.testing.MockClock) -> None:
    stages = three()
    stages[0].hold_submits()
    async with open_orchestrator(stages, {0, 2}) as orch:
        orch.add_request_nowait("stuck", "p", priority=-1)  # starts first, despite the other's deadline
        orch.add_request_nowait("queued", "p", timeout=2)
        msg = await nxt(orch)
        assert msg == OrchError("queued", None, "timeout", "its deadline passed while queued")
        stages[0].release_submits()
        await trio.testing.wait_all_tasks_blocked()
        assert [rid for rid, _ in stages[0].submissions] == ["stuck"]  # never submitted
        with pytest.raises(ValueError, match="timeout must be a positive"):
            await orch.add_request("bad", "p", timeout=0)


class PushStage(ScriptedStage):
    """A ScriptedStage that also offers the push fast path (``pump``)."""

    def __init__(self, stage_id: int) -> None:
        super().__init__(stage_id)
        self.deliver = None
        self._dead_event = trio.Event()
        self._exc: BaseException | None = None

    async def pump(self, deliver) -> None:  # type: ignore[no-untyped-def]
        self.deliver = deliver
        await self._dead_event.wait()
        raise self._exc or RuntimeError("gone")

    def push(self, rid: str, data: object, finished: bool = False) -> None:
        from trio_orch import StageOutput

        assert self.deliver is not None, "the reader did not pump this stage"
        self.deliver([StageOutput(rid, data, finished)])

    def kill(self, exc: BaseException) -> None:
        self._exc = exc
        self._dead_event.set()


async def test_push_stage_clients_are_pumped_not_polled() -> None:
    stages = [PushStage(0), ScriptedStage(1), PushStage(2)]
    async with open_orchestrator(stages, {0, 2}) as orch:
        await orch.add_request("r", "p")
        await trio.testing.wait_all_tasks_blocked()
        stages[0].push("r", "a")
        stages[0].push("r", "b", finished=True)
        assert await nxt(orch) == OrchOutput("r", 0, "a", False)
        assert await nxt(orch) == OrchOutput("r", 0, "b", False)
        await trio.testing.wait_all_tasks_blocked()
        await stages[1].emit("r", "x", finished=True)  # a pull stage in the same pipeline
        await trio.testing.wait_all_tasks_blocked()
        assert stages[2].submissions == [("r", ["x"])]
        stages[2].kill(RuntimeError("pushed stage died"))
        msg = await nxt(orch)
        assert (msg.request_id, msg.kind, msg.stage_id) == ("r", "replica_died", 2)
        assert "pushed stage died" in msg.message
    # a deliver after shutdown is dropped quietly, never raised into the pusher
    stages[0].push("r", "late")
    assert await drain(orch) == []


async def test_scripted_emit_returns_once_routed_so_a_chain_can_be_scripted_back_to_back() -> None:
    stages = three()
    async with open_orchestrator(stages, {0, 2}) as orch:
        await orch.add_request("r", "p")
        await stages[0].emit("r", "a", finished=True)  # forwarded to stage 1 before emit returns
        await stages[1].emit("r", "b", finished=True)  # so stage 1 knows the request already
        await stages[2].emit("r", "c", finished=True)
        assert orch.dropped_outputs == 0
        assert [await nxt(orch), await nxt(orch)] == [OrchOutput("r", 0, "a", False),
                                                       OrchOutput("r", 2, "c", True)]


async def test_a_stage_hung_in_abort_does_not_stall_routing_for_others() -> None:
    class HangingAbort(ScriptedStage):
        async def abort(self, request_ids: list[str]) -> None:
            await trio.sleep_forever()

    stages = [ScriptedStage(0), HangingAbort(1), ScriptedStage(2)]
    async with open_orchestrator(stages, {0, 2}, async_chunk=True, shutdown_grace=0.5) as orch:
        await orch.add_request("victim", "p")
        await orch.add_request("other", "p", final_stage_id=0)
        orch.abort_nowait("victim")  # its abort on stage 1 hangs forever
        msg = await nxt(orch)
        assert (msg.request_id, msg.kind) == ("victim", "aborted")
        await stages[0].emit("other", "still routed", finished=True)
        assert await nxt(orch) == OrchOutput("other", 0, "still routed", True)
    assert orchestrator_tasks() == []  # the hung abort task was cancelled with the nursery


async def test_reader_errors_during_shutdown_are_reported_not_lost(caplog: pytest.LogCaptureFixture) -> None:
    class RaisesOnCancel(ScriptedStage):
        async def receive(self):  # type: ignore[no-untyped-def]
            try:
                return await super().receive()
            except trio.Cancelled:
                raise RuntimeError(f"{self.name}: receive broke while being cancelled") from None

    caplog.set_level(logging.WARNING, logger="trio_orch")
    stages = [RaisesOnCancel(0), RaisesOnCancel(1)]
    async with open_orchestrator(stages, {1}) as orch:
        await orch.add_request("r", "p")
    assert sorted(orch.stage_deaths) == [0, 1]
    assert sum("receive broke while being cancelled" in r.getMessage() for r in caplog.records) == 2
    msgs = await drain(orch)
    assert [(m.request_id, m.kind) for m in msgs] == [("r", "shutdown")]


async def test_a_hung_abort_does_not_stall_the_drain_of_a_graceful_shutdown() -> None:
    class HangingAbort(ScriptedStage):
        async def abort(self, request_ids: list[str]) -> None:
            await trio.sleep_forever()

    stages = [HangingAbort(0), ScriptedStage(1)]
    orch = Orchestrator(stages, {0, 1}, async_chunk=True, shutdown_grace=0.2)
    async with trio.open_nursery() as nursery:
        await nursery.start(orch.run)
        await orch.add_request("bad", "p")
        await orch.add_request("good", "p", final_stage_id=0)

        async def during_drain() -> None:
            await stages[1].emit("bad", None, error="oom")  # aborts "bad" on stage 0: hangs
            await stages[0].emit("good", "done", finished=True)  # must still be routed

        nursery.start_soon(during_drain)
        with trio.fail_after(5):
            await orch.shutdown(timeout=5)
    msgs = await drain(orch)
    assert [(m.request_id, getattr(m, "kind", "ok")) for m in msgs] == [("bad", "stage_failed"),
                                                                        ("good", "ok")]
    assert orchestrator_tasks() == []


async def test_sampling_parameters_reach_each_stage_with_its_submission() -> None:
    stages = three()
    async with open_orchestrator(stages, {2}, forward_fn=lambda k, p, o: o[-1]) as orch:
        with pytest.raises(ValueError, match="stage 7"):
            await orch.add_request("bad", "p", sampling={7: {}})
        await orch.add_request("r", "p", sampling={0: {"seed": 7}, 2: {"voice": "b"}})
        await stages[0].emit("r", "a", finished=True)
        await stages[1].emit("r", "b", finished=True)
        assert (stages[0].sampling, stages[1].sampling, stages[2].sampling) == (
            [("r", {"seed": 7})], [], [("r", {"voice": "b"})])
        assert stages[1].submissions == [("r", "a")] and stages[0].submissions == [("r", "p")]
