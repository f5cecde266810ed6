"""The Trio shell performs failovers: a resend that waits for a replacement, a restart, their ends.

A scripted stage that reports replicas (as a replica pool does) stands in for
a pool whose only replica died: it reports zero live replicas, then the
``replica_died`` output of the request it held, then -- seconds later, on
Trio's autojump clock -- one live replica again (the supervisor's
replacement is ready).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import trio
import trio.testing

from trio_orch import Orchestrator
from trio_orch.testing import ScriptedStage
from trio_orch.types import OrchError, OrchOutput, StageOutput


class ReplicatedScriptedStage(ScriptedStage):
    """A scripted stage with replicas the test kills and brings back (``set_live``)."""

    def __init__(self, stage_id: int = 0, live: int = 1, total: int = 1, **kw: Any) -> None:
        super().__init__(stage_id, **kw)
        self.live, self.total = live, total
        self.watchers: list[Callable[[int, int], None]] = []
        self.log: list[tuple[str, str]] = []  # ("submit" | "abort", request id), in order

    def replica_counts(self) -> tuple[int, int]:
        return self.live, self.total

    def watch_replicas(self, callback: Callable[[int, int], None]) -> None:
        self.watchers.append(callback)

    def set_live(self, live: int) -> None:
        self.live = live
        for cb in self.watchers:
            cb(live, self.total)

    def replica_died(self, request_id: str) -> None:
        """The replica holding ``request_id`` died: the pool's per-request output for it."""
        self.emit_batch_nowait([StageOutput(request_id, None, True, error=f"{self.name}: replica 0 died",
                                            error_kind="replica_died")])

    async def submit(self, request_id: str, payload: Any, **kw: Any) -> None:
        self.log.append(("submit", request_id))
        await super().submit(request_id, payload, **kw)

    async def abort(self, request_ids: list[str]) -> None:
        self.log.extend(("abort", rid) for rid in request_ids)
        await super().abort(request_ids)


async def started(nursery: trio.Nursery, stages: list[ScriptedStage], finals: set[int],
                  **kw: Any) -> Orchestrator:
    orch = Orchestrator(stages, finals, **kw)
    await nursery.start(orch.run)
    return orch


async def test_a_resend_waits_for_the_replacement_and_the_request_completes(
        autojump_clock: trio.testing.MockClock) -> None:
    stage = ReplicatedScriptedStage()
    async with trio.open_nursery() as nursery:
        orch = await started(nursery, [stage], {0}, request_timeout=60)
        await orch.add_request("r", "p")
        await trio.testing.wait_all_tasks_blocked()
        stage.set_live(0)  # its only replica died; a restart is under way
        stage.replica_died("r")
        await trio.testing.wait_all_tasks_blocked()
        assert stage.submissions == [("r", "p")] and orch.router.statistics().waiting_by_stage == (1,)
        await trio.sleep(3)  # the replacement takes its time: nothing reaches the user meanwhile
        with pytest.raises(trio.WouldBlock):
            orch.next_output_nowait()
        stage.set_live(1)
        await trio.testing.wait_all_tasks_blocked()
        assert stage.submissions == [("r", "p"), ("r", "p")]  # the same input, to the replacement
        await stage.emit("r", "x", finished=True)
        assert await orch.next_output() == OrchOutput("r", 0, "x", True)
        assert orch.router.retried == [1]
        orch.request_shutdown()


async def test_the_deadline_ends_a_request_still_waiting_for_a_replica(
        autojump_clock: trio.testing.MockClock) -> None:
    stage = ReplicatedScriptedStage()
    async with trio.open_nursery() as nursery:
        orch = await started(nursery, [stage], {0})
        await orch.add_request("r", "p", timeout=5)
        await trio.testing.wait_all_tasks_blocked()
        stage.set_live(0)
        stage.replica_died("r")
        msg = await orch.next_output()  # the deadline passes while the replacement is not ready
        assert isinstance(msg, OrchError) and (msg.kind, msg.stage_id) == ("timeout", 0)
        assert "waiting for stage 0 to have a live replica again" in msg.message
        assert trio.current_time() >= 5
        stage.set_live(1)
        await trio.testing.wait_all_tasks_blocked()
        assert stage.submissions == [("r", "p")]  # nothing resent for an ended request
        orch.request_shutdown()


async def test_a_stage_given_up_ends_its_waiting_requests_with_one_terminal(
        autojump_clock: trio.testing.MockClock) -> None:
    stage = ReplicatedScriptedStage()
    async with trio.open_nursery() as nursery:
        orch = await started(nursery, [stage], {0})
        await orch.add_request("r", "p")
        await trio.testing.wait_all_tasks_blocked()
        stage.set_live(0)
        stage.replica_died("r")
        await trio.sleep(2)
        await stage.fail(RuntimeError("stage0: every replica slot was given up"))
        msg = await orch.next_output()
        assert isinstance(msg, OrchError) and msg.kind == "replica_died"
        assert "waiting for stage 0" in msg.message and "given up" in msg.message
        orch.request_shutdown()
    assert [m async for m in orch.outputs()] == []  # no second terminal


async def test_shutdown_and_abort_end_waiting_requests_once(autojump_clock: trio.testing.MockClock) -> None:
    stage = ReplicatedScriptedStage()
    async with trio.open_nursery() as nursery:
        orch = await started(nursery, [stage], {0})
        for rid in ("a", "b"):
            await orch.add_request(rid, "p")
        await trio.testing.wait_all_tasks_blocked()
        stage.set_live(0)
        stage.replica_died("a")
        stage.replica_died("b")
        await trio.testing.wait_all_tasks_blocked()
        await orch.abort("a")
        orch.request_shutdown()
    msgs = [m async for m in orch.outputs()]
    assert [(m.request_id, m.kind) for m in msgs] == [("a", "aborted"), ("b", "shutdown")]


async def test_an_async_chunk_restart_aborts_each_stage_before_submitting_again(
        autojump_clock: trio.testing.MockClock) -> None:
    stages = [ReplicatedScriptedStage(k, live=2, total=2) for k in range(3)]
    async with trio.open_nursery() as nursery:
        orch = await started(nursery, list(stages), {2}, async_chunk=True, prewarm_fn=lambda k, p: f"w{k}")
        await orch.add_request("r", "p")
        await stages[0].emit("r", "chunk")  # stage 0 streams to stage 1; nothing shown to the user
        stages[1].set_live(1)
        stages[1].replica_died("r")
        await trio.testing.wait_all_tasks_blocked()
        assert stages[0].log == [("submit", "r"), ("abort", "r"), ("submit", "r")]
        assert stages[1].log == [("submit", "r"), ("submit", "r")]  # its dead replica held it
        assert stages[2].log == [("submit", "r"), ("abort", "r"), ("submit", "r")]
        for k in range(3):
            await stages[k].emit("r", f"o{k}", finished=True)
        assert await orch.next_output() == OrchOutput("r", 2, "o2", True)
        assert orch.router.retried == [0, 1, 0]
        orch.request_shutdown()
