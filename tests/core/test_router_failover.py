"""Failover in the routing core: a request stranded on a dead replica is resent, not failed.

A replica pool reports a replica's death as one ``replica_died`` output per
request bound to it; the core resends such a request's inputs to the same
stage (the pool places them on a live replica) when that stage had produced
nothing for it, it has retries left and the stage still has a live replica.
"""

from __future__ import annotations

from typing import Any

import pytest

from trio_orch.core import Abort, Emit, Router, Submit, Update
from trio_orch.types import OrchError, OrchOutput, StageOutput


def died(rid: str) -> StageOutput:
    return StageOutput(rid, None, True, error="stage0: replica 1 died", error_kind="replica_died")


def out(rid: str, data: object, finished: bool = False) -> StageOutput:
    return StageOutput(rid, data, finished)


def emitted(actions: list) -> list:
    return [a.message for a in actions if isinstance(a, Emit)]


def test_a_request_that_got_nothing_is_resubmitted_with_the_same_input_and_completes() -> None:
    r = Router(1, {0})
    assert r.add("r", "prompt") == [Submit(0, "r", "prompt")]
    assert r.route(0, died("r")) == [Submit(0, "r", "prompt")]  # no terminal: invisible to the user
    assert "r" in r and r.retried == [1] and r.statistics().retried_by_stage == (1,)
    assert r.route(0, out("r", "x", True)) == [Emit(OrchOutput("r", 0, "x", True))]
    assert r.terminals_by_kind == {"finished": 1}


def test_retries_are_bounded_per_request() -> None:
    r = Router(1, {0}, max_retries=2)
    r.add("r", "p")
    assert r.route(0, died("r")) == [Submit(0, "r", "p")]
    assert r.route(0, died("r")) == [Submit(0, "r", "p")]
    (err,) = emitted(r.route(0, died("r")))
    assert (err.kind, err.stage_id) == ("replica_died", 0) and "r" not in r
    assert r.retried == [2]


def test_max_retries_zero_turns_failover_off() -> None:
    r = Router(1, {0}, max_retries=0)
    r.add("r", "p")
    assert emitted(r.route(0, died("r"))) == [OrchError("r", 0, "replica_died", "stage0: replica 1 died")]
    assert r.retried == [0]


@pytest.mark.parametrize("bad", [-1, 1.5, True, "1"])
def test_max_retries_must_be_a_non_negative_int(bad: Any) -> None:
    with pytest.raises(ValueError, match="max_retries"):
        Router(1, {0}, max_retries=bad)


def test_a_request_that_already_produced_output_there_ends_with_its_partial_output() -> None:
    r = Router(1, {0})
    r.add("r", "p")
    r.route(0, out("r", "tok1"))
    (err,) = emitted(r.route(0, died("r")))
    assert err.kind == "replica_died" and err.partial == {0: ["tok1"]}
    assert r.retried == [0]


def test_only_other_errors_and_no_live_replica_end_the_request_as_before() -> None:
    r = Router(1, {0})
    r.add("a", "p")
    failed = StageOutput("a", None, True, error="oom", error_kind="stage_failed")
    assert [m.kind for m in emitted(r.route(0, failed))] == ["stage_failed"]
    r.add("b", "p")
    r.replicas_changed(0, 0, 2)  # the pool reports its last replica gone before the outputs
    assert [m.kind for m in emitted(r.route(0, died("b")))] == ["replica_died"]


def test_a_later_stage_is_resent_its_forwarded_input_and_earlier_output_stays_shown() -> None:
    r = Router(2, {0, 1}, forward_fn=lambda k, p, outs: f"fwd:{'+'.join(outs)}")
    r.add("r", "p")
    assert emitted(r.route(0, out("r", "a", True))) == [OrchOutput("r", 0, "a", False)]
    assert r.route(1, died("r")) == [Submit(1, "r", "fwd:a")]
    assert r.retried == [0, 1]
    assert emitted(r.route(1, out("r", "w", True))) == [OrchOutput("r", 1, "w", True)]


def test_a_resumable_request_gets_its_segments_again_in_order() -> None:
    r = Router(1, {0})
    r.add("r", "s0", resumable=True)
    assert r.update("r", "s1") == [Update(0, "r", "s1")]
    assert r.route(0, died("r")) == [Submit(0, "r", "s0", resumable=True), Update(0, "r", "s1")]
    assert r.update("r", "s2", final=True) == [Update(0, "r", "s2", final=True)]
    for seg in range(3):
        r.route(0, out("r", f"o{seg}", True))
    assert "r" not in r and r.terminals_by_kind == {"finished": 1}


def test_a_parent_is_resent_with_its_companions_and_their_old_deaths_are_dropped() -> None:
    def cfg(k: int, p: Any, outs: list, companions: dict | None = None) -> Any:
        return {"cond": outs, "uncond": companions}

    r = Router(2, {1}, forward_fn=cfg)
    first = r.add("r", "cat", companions={"c1": "blur", "c2": "dark"})
    r.route(0, out("c2", "u2", True))  # a companion finished on the replica before it died
    assert r.route(0, died("r")) == first
    assert r.route(0, died("c1")) == [] and r.dropped_outputs == 1  # the same death, already handled
    r.route(0, out("c1", "v1", True))
    r.route(0, out("c2", "v2", True))
    acts = r.route(0, out("r", "e", True))
    assert acts == [Submit(1, "r", {"cond": ["e"], "uncond": {"c1": ["v1"], "c2": ["v2"]}})]
    assert r.route(1, out("r", "img", True)) == [Emit(OrchOutput("r", 1, "img", True))]


def test_a_companion_reporting_the_death_first_resends_its_parent_too() -> None:
    r = Router(2, {1})
    first = r.add("r", "cat", companions={"c1": "blur"})
    assert r.route(0, died("c1")) == first
    assert r.route(0, died("r")) == [] and "r" in r


def test_async_chunk_requests_are_not_retried() -> None:
    r = Router(2, {1}, async_chunk=True)
    r.add("r", "p")
    acts = r.route(0, died("r"))
    assert [m.kind for m in emitted(acts)] == ["replica_died"] and Abort(1, ["r"]) in acts
