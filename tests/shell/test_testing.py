"""The test doubles and checks of trio_orch.testing, which the suite and bench/ rely on."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

import pytest
import trio
import trio.testing

from trio_orch import OrchError, OrchOutput, open_orchestrator
from trio_orch.testing import LeakProbe, Misbehaviour, PushScriptedStage, ScriptedStage, TerminalLedger
from trio_orch.types import StageOutput


async def test_a_batch_comes_out_of_one_receive_and_a_death_after_it() -> None:
    stage = ScriptedStage(0)
    stage.emit_batch_nowait([StageOutput("a", 1, False), StageOutput("b", 2, False)])
    stage.emit_nowait("a", 3, True)
    stage.fail_nowait(RuntimeError("gone"))
    assert [(o.request_id, o.data) for o in await stage.receive()] == [("a", 1), ("b", 2), ("a", 3)]
    with pytest.raises(RuntimeError, match="gone"):
        await stage.receive()
    with pytest.raises(RuntimeError, match="closed or dead"):
        stage.emit_nowait("a", 4)


async def test_on_submit_sees_every_accepted_submit() -> None:
    seen: list[tuple[int, str]] = []
    stage = ScriptedStage(3, on_submit=lambda k, rid: seen.append((k, rid)))
    await stage.submit("r1", "p")
    stage.fail_nowait()
    with pytest.raises(RuntimeError):
        await stage.submit("r2", "p")  # refused: not seen
    assert seen == [(3, "r1")] and stage.submissions == [("r1", "p")]


async def test_a_swallowed_cancellation_is_delivered_again(autojump_clock: trio.testing.MockClock) -> None:
    """The stage swallows one cancellation; Trio's is level-triggered: the next wait ends it."""
    stage = ScriptedStage(0, misbehaviour=Misbehaviour(swallow_cancel_once=True))
    with trio.move_on_after(0.01) as scope:
        await stage.receive()
    assert scope.cancelled_caught and stage.swallowed_cancels == 1


async def test_misbehaving_abort_and_close(autojump_clock: trio.testing.MockClock) -> None:
    stage = ScriptedStage(0, misbehaviour=Misbehaviour(hang_abort=True, aclose_error=ValueError("E")))
    with trio.move_on_after(0.05) as scope:
        await stage.abort(["r"])
    assert scope.cancelled_caught and stage.aborts == []
    with pytest.raises(ValueError, match="E"):
        await stage.aclose()


async def test_push_stage_delivers_before_and_after_the_pump_starts() -> None:
    stages = [PushScriptedStage(0), PushScriptedStage(1)]
    stages[0].emit_nowait("early", "x", True)  # before the orchestrator pumps: queued, delivered first
    async with open_orchestrator(stages, final_stage_ids={0, 1}) as orch:
        await orch.add_request("r1", "p")
        stages[0].emit_batch_nowait([StageOutput("r1", "a", False), StageOutput("r1", "b", True)])
        assert [await orch.next_output() for _ in range(2)] == [OrchOutput("r1", 0, "a", False),
                                                               OrchOutput("r1", 0, "b", False)]
        await trio.testing.wait_all_tasks_blocked()
        await stages[1].fail(RuntimeError("stage 1 fell over"))
        msg = await orch.next_output()
        assert isinstance(msg, OrchError) and (msg.request_id, msg.kind) == ("r1", "replica_died")
        assert orch.dropped_outputs == 1  # "early" was delivered (to no request) and counted


def test_terminal_ledger_counts_what_breaks_the_contract() -> None:
    ledger = TerminalLedger()
    ledger.accepted |= {"a", "b", "c"}
    for msg in (OrchOutput("a", 0, "x", False), OrchOutput("a", 0, "y", True), OrchOutput("a", 0, "z", False),
                OrchError("b", 1, "aborted", "by the client"), OrchError("b", 1, "shutdown", "bye")):
        ledger.record(msg)
    assert ledger.without_terminal() == 1  # c
    assert (ledger.duplicates, ledger.after_terminal, ledger.messages) == (1, 1, 5)
    assert ledger.by_kind() == {"aborted": 1, "ok": 1}


@pytest.mark.processes
def test_leak_probe_sees_a_child_process_and_a_directory_left_behind() -> None:
    probe = LeakProbe()
    tmpdir = tempfile.mkdtemp(prefix="trio-orch-leak-")
    probe.saw_dir(tmpdir)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        leaks = probe.leaks()
        assert leaks["processes"] == 1 and leaks["ipc_files"] == 1
    finally:
        child.kill()
        child.wait()
        os.rmdir(tmpdir)
    assert probe.leaks() == {"processes": 0, "fds": 0, "ipc_files": 0}
