"""Failover across the shells: scenario 23 (a resend waiting for the replacement, raced against abort
and shutdown) and an async-chunk restart, on the Trio shell and every asyncio reference."""

from __future__ import annotations

import pytest

from bench.compare.scenarios import by_number, run_scenario
from bench.compare.scenarios.failover import judge_failover_races
from bench.implementations import make_driver
from trio_orch.types import StageOutput


@pytest.mark.parametrize("impl", ["trio", "omni-event", "omni-poll", "asyncio-taskgroup"])
def test_every_shell_resends_once_and_ends_each_racing_request_once(impl: str) -> None:
    out = run_scenario(by_number(23), impl)
    assert out.verdict == "ok", (out.reason, out.driver_error)
    m = out.metrics
    assert (m["ready_resent"], m["ready_end"]) == (1, "finished")
    assert (m["aborted_end"], m["shutdown_end"]) == ("aborted", "shutdown")
    assert m["without_terminal"] == m["duplicate_terminals"] == m["after_terminal"] == 0
    if impl != "omni-poll":  # the legacy poll loop skips a stage with no live replica: maybe no wait
        assert m["waited_for_replica"]


def test_the_verdict_follows_the_numbers() -> None:
    ok = {"hung": False, "without_terminal": 0, "duplicate_terminals": 0, "after_terminal": 0,
          "waited_for_replica": True, "ready_resent": 1, "ready_end": "finished", "aborted_end": "aborted",
          "shutdown_end": "shutdown", "aborted_resent": 1, "shutdown_resent": 0,
          "aborted_left_on_stage": False, "shutdown_left_on_stage": False}
    assert judge_failover_races(ok)[0] == "ok"
    assert judge_failover_races({**ok, "aborted_left_on_stage": True})[0] == "zombie"
    assert judge_failover_races({**ok, "ready_resent": 2})[0] == "not resent"
    assert judge_failover_races({**ok, "without_terminal": 1})[0] == "lost"
    assert judge_failover_races({**ok, "shutdown_end": "replica_died"})[0] == "wrong terminal"


@pytest.mark.parametrize("impl", ["trio", "omni-event", "omni-poll", "asyncio-taskgroup"])
def test_every_shell_restarts_an_async_chunk_request_that_showed_nothing(impl: str) -> None:
    with make_driver(impl, 3, {2}, async_chunk=True, prewarm_fn=lambda k, p: f"w{k}").start() as h:
        h.add_request("r", "p")
        h.emit(0, "r", "chunk")  # streamed on to stage 1; nothing is shown to the user
        died = StageOutput("r", None, True, error="stage1: replica 0 died", error_kind="replica_died")
        h.emit_batch(1, [died])
        assert h.wait_until(lambda: all(len(h.submissions(k)) == 2 for k in range(3)))
        assert [h.submissions(k) for k in range(3)] == [[("r", p)] * 2 for p in ("p", "w1", "w2")]
        assert h.wait_until(lambda: "r" in h.aborts(0) and "r" in h.aborts(2))  # told to drop the old run
        for k in range(3):
            h.emit(k, "r", f"o{k}", finished=True)
        msg = h.next_output()
        assert (msg.finished, getattr(msg, "data", None)) == (True, "o2")
        assert h.call(lambda: h.router.retried) == [0, 1, 0]
