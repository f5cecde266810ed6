"""Failover in the routing core: a request stranded on a dead replica is resent, not failed.

A replica pool reports a replica's death as one ``replica_died`` output per
request bound to it; the core resends such a request's inputs to the same
stage (the pool places them on a live replica) when that stage had produced
nothing for it and it has retries left; with no live replica the resend waits
for one.  Async-chunk requests restart from stage 0 while nothing reached the
user.
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


def test_other_errors_end_the_request_as_before() -> None:
    r = Router(1, {0})
    r.add("a", "p")
    failed = StageOutput("a", None, True, error="oom", error_kind="stage_failed")
    assert [m.kind for m in emitted(r.route(0, failed))] == ["stage_failed"]
    assert r.retried == [0]


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


# ---------------------------------------------------------------- no live replica: wait for one
def test_with_no_live_replica_the_resend_waits_for_the_replacement() -> None:
    r = Router(1, {0})
    r.add("r", "p")
    assert r.replicas_changed(0, 0, 1) == []  # the pool reports its last replica gone before the outputs
    assert r.route(0, died("r")) == []  # nothing to the user, nothing sent: it waits
    assert "r" in r and r.retried == [0] and r.statistics().waiting_by_stage == (1,)
    assert r.route(0, out("r", "stray", True)) == [] and r.dropped_outputs == 1  # no replica holds it
    assert r.replicas_changed(0, 1, 1) == [Submit(0, "r", "p")]  # the replacement is ready
    assert r.retried == [1] and r.statistics().waiting_by_stage == (0,)
    assert emitted(r.route(0, out("r", "x", True))) == [OrchOutput("r", 0, "x", True)]


def test_waiting_failovers_are_resent_in_the_order_their_replicas_died() -> None:
    r = Router(2, {1}, forward_fn=lambda k, p, outs: f"fwd:{p}")
    for rid in ("a", "b", "c"):
        r.add(rid, rid)
    r.route(0, out("c", "x", True))  # c moved on to stage 1
    r.replicas_changed(0, 0, 2)
    r.replicas_changed(1, 0, 1)
    assert r.route(0, died("b")) == r.route(0, died("a")) == r.route(1, died("c")) == []
    assert r.replicas_changed(1, 1, 1) == [Submit(1, "c", "fwd:c")]
    assert r.replicas_changed(0, 1, 2) == [Submit(0, "b", "b"), Submit(0, "a", "a")]
    assert r.replicas_changed(0, 2, 2) == []  # nothing waits any more


def test_the_deadline_ends_a_waiting_request_saying_what_it_waited_for() -> None:
    r = Router(1, {0})
    r.add("r", "p")
    r.replicas_changed(0, 0, 1)
    r.route(0, died("r"))
    (err,) = emitted(r.expire("r"))
    assert (err.kind, err.stage_id) == ("timeout", 0)
    assert "waiting for stage 0 to have a live replica again" in err.message
    assert "replica 1 died" in err.message
    assert r.replicas_changed(0, 1, 1) == [] and r.retried == [0]  # forgotten: nothing is resent


def test_a_stage_that_dies_for_good_ends_its_waiting_requests() -> None:
    """Its last replica slot was given up: the pool reports the stage dead (no replica will come)."""
    r = Router(1, {0})
    r.add("r", "p")
    r.replicas_changed(0, 0, 1)
    r.route(0, died("r"))
    (err,) = emitted(r.stage_died(0, "stage0: every replica is dead"))
    assert err.kind == "replica_died" and "while waiting for stage 0" in err.message
    assert "r" not in r and r.statistics().waiting_by_stage == (0,)


@pytest.mark.parametrize("end", ["abort", "shutdown"])
def test_abort_and_shutdown_end_a_waiting_request_with_one_terminal_and_no_stage_io(end: str) -> None:
    r = Router(1, {0})
    r.add("r", "p")
    r.replicas_changed(0, 0, 1)
    r.route(0, died("r"))
    acts = r.abort("r") if end == "abort" else r.shutdown()
    assert [type(a) for a in acts] == [Emit]
    assert acts[0].message.kind == ("aborted" if end == "abort" else end)
    assert r.replicas_changed(0, 1, 1) == []


def test_out_of_retries_while_waiting_is_impossible_and_the_waiting_counts_as_the_retry() -> None:
    r = Router(1, {0}, max_retries=1)
    r.add("r", "p")
    r.replicas_changed(0, 0, 1)
    r.route(0, died("r"))
    assert r.replicas_changed(0, 1, 1) == [Submit(0, "r", "p")]
    (err,) = emitted(r.route(0, died("r")))  # the replacement died too: no retry left
    assert err.kind == "replica_died"


def test_a_segment_given_while_the_failover_waits_is_sent_with_the_resend() -> None:
    r = Router(1, {0})
    r.add("r", "s0", resumable=True)
    r.replicas_changed(0, 0, 1)
    assert r.route(0, died("r")) == []
    assert r.update("r", "s1", final=True) == []  # kept, not failed on a stage with no replica
    resent = [Submit(0, "r", "s0", resumable=True), Update(0, "r", "s1", final=True)]
    assert r.replicas_changed(0, 1, 1) == resent
    r.route(0, out("r", "o0", True))
    assert emitted(r.route(0, out("r", "o1", True)))[0].finished


def test_a_segment_forwarded_to_a_stage_whose_failover_waits_goes_with_the_resend() -> None:
    r = Router(2, {1}, forward_fn=lambda k, p, outs: f"f:{'+'.join(outs)}")
    r.add("r", "s0", resumable=True)
    r.route(0, out("r", "a", True))  # segment 0 forwarded: Submit(1, f:a)
    r.replicas_changed(1, 0, 1)
    assert r.route(1, died("r")) == []
    assert r.update("r", "s1", final=True) == [Update(0, "r", "s1", final=True)]
    assert r.route(0, out("r", "b", True)) == []  # segment 1's forward waits with the resend
    assert r.replicas_changed(1, 1, 1) == [Submit(1, "r", "f:a", resumable=True),
                                           Update(1, "r", "f:b", final=True)]


# ---------------------------------------------------------------- async-chunk: restart from stage 0
def ac_router(**kw: Any) -> Router:
    return Router(3, {2}, async_chunk=True, prewarm_fn=lambda k, p: f"warm{k}", **kw)


def test_async_chunk_restarts_from_stage_0_while_nothing_reached_the_user() -> None:
    r = ac_router()
    start = r.add("r", "p")
    assert r.route(0, out("r", "c1", True)) == []  # stage 0 finished: its chunks flowed to stage 1
    acts = r.route(1, died("r"))
    assert acts == [Abort(2, ["r"]), *start]  # stage 2 drops what it had, then every stage again
    assert r.retried == [0, 1, 0] and r.claims == [1, 1, 1]
    for k in range(3):
        acts = r.route(k, out("r", f"o{k}", True))
    assert emitted(acts) == [OrchOutput("r", 2, "o2", True)]
    assert r.terminals_by_kind == {"finished": 1}


def test_async_chunk_fails_once_something_reached_the_user() -> None:
    r = Router(3, {0, 2}, async_chunk=True)
    r.add("r", "p")
    r.route(0, out("r", "tok"))  # shown to the user
    acts = r.route(1, died("r"))
    (err,) = emitted(acts)
    assert err.kind == "replica_died" and err.partial == {0: ["tok"]} and r.retried == [0, 0, 0]
    assert Abort(0, ["r"]) in acts and Abort(2, ["r"]) in acts


def test_async_chunk_restart_waits_for_a_replica_and_is_bounded() -> None:
    r = ac_router(max_retries=1)
    start = r.add("r", "p")
    r.replicas_changed(0, 0, 1)
    assert r.route(0, died("r")) == [Abort(1, ["r"]), Abort(2, ["r"])]  # the restart waits for stage 0
    assert r.replicas_changed(0, 1, 1) == start
    (err,) = emitted(r.route(2, died("r")))
    assert err.kind == "replica_died"


def test_async_chunk_resumable_requests_are_not_restarted() -> None:
    r = ac_router()
    r.add("r", "p", resumable=True)
    assert [m.kind for m in emitted(r.route(0, died("r")))] == ["replica_died"]
