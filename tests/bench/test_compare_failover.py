"""Comparison scenario 23: a failover waiting for the replacement, raced against abort and shutdown."""

from __future__ import annotations

import pytest

from bench.compare.scenarios import by_number, run_scenario
from bench.compare.scenarios.failover import judge_failover_races


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
