"""Companion requests (CFG) in the routing core."""

from __future__ import annotations

from typing import Any

import pytest

from trio_orch.core import Abort, Emit, Router, Submit
from trio_orch.types import OrchError, OrchOutput, StageOutput


def out(rid: str, data: object, finished: bool = False, error: str | None = None,
        kind: str = "stage_failed") -> StageOutput:
    return StageOutput(rid, data, finished, error, kind)


def emitted(actions: list) -> list:
    return [a.message for a in actions if isinstance(a, Emit)]


def cfg_forward(k: int, prompt: Any, outputs: list, companions: dict | None = None) -> Any:
    return {"cond": outputs, "uncond": companions}


def test_companions_run_stage_zero_with_the_parent_and_gate_its_forward() -> None:
    r = Router(2, {1}, forward_fn=cfg_forward)
    acts = r.add("r1", "a cat", companions={"r1:neg": "blurry"})
    assert acts == [Submit(0, "r1", "a cat"), Submit(0, "r1:neg", "blurry", companion_of="r1")]
    assert r.route(0, out("r1", "e1", True)) == []  # the parent finished stage 0: waits for its companion
    assert r.route(0, out("r1:neg", "n1")) == []  # never shown to the user
    acts = r.route(0, out("r1:neg", "n2", True))
    assert acts == [Submit(1, "r1", {"cond": ["e1"], "uncond": {"r1:neg": ["n1", "n2"]}})]
    assert r.route(1, out("r1", "png", True)) == [Emit(OrchOutput("r1", 1, "png", True))]
    assert r.terminals_by_kind == {"finished": 1} and not r.companion_of
    assert r.route(0, out("r1:neg", "late")) == [] and r.dropped_outputs == 1


def test_companion_finishing_first_lets_the_parent_forward_at_once() -> None:
    r = Router(2, {1}, forward_fn=cfg_forward)
    r.add("r1", "p", companions={"c1": "n", "c2": "m"})
    r.route(0, out("c1", "x", True))
    r.route(0, out("c2", "y", True))
    assert r.route(0, out("r1", "e", True)) == [
        Submit(1, "r1", {"cond": ["e"], "uncond": {"c1": ["x"], "c2": ["y"]}})]


@pytest.mark.parametrize("how", ["abort", "expire", "shutdown"])
def test_ending_the_parent_aborts_companions_still_running(how: str) -> None:
    r = Router(2, {1}, forward_fn=cfg_forward)
    r.add("r1", "p", companions={"c1": "n", "c2": "m"})
    r.route(0, out("c1", "x", True))  # c1 is done, c2 still runs
    acts = r.shutdown() if how == "shutdown" else getattr(r, how)("r1")
    assert len(emitted(acts)) == 1 and emitted(acts)[0].request_id == "r1"
    assert [a for a in acts if isinstance(a, Abort)] == [Abort(0, ["r1"]), Abort(0, ["c2"])]
    assert r.route(0, out("c2", "late", True)) == [] and r.dropped_outputs == 1
    assert not r.companion_of  # the ids are free again


@pytest.mark.parametrize("kind", ["stage_failed", "replica_died"])
def test_a_failing_companion_fails_its_parent_and_names_itself(kind: str) -> None:
    r = Router(2, {1}, forward_fn=cfg_forward, max_retries=0)
    r.add("r1", "p", companions={"c1": "n", "c2": "m"})
    acts = r.route(0, out("c1", None, True, error="oom", kind=kind))
    (err,) = emitted(acts)
    assert (err.request_id, err.kind) == ("r1", kind) and "companion 'c1'" in err.message
    assert [a for a in acts if isinstance(a, Abort)] == [Abort(0, ["r1"]), Abort(0, ["c2"])]
    assert not r.companion_of and not r.is_live("r1")


def test_stage_zero_death_ends_a_parent_waiting_for_its_companions() -> None:
    r = Router(2, {1}, forward_fn=cfg_forward)
    r.add("r1", "p", companions={"c1": "n"})
    r.route(0, out("r1", "e", True))
    assert emitted(r.stage_died(0, "gone")) == [OrchError("r1", 0, "replica_died", "gone")]


@pytest.mark.parametrize(("companions", "kw", "match"), [
    ({"r1": "x"}, {}, "duplicate"), ({"busy": "x"}, {}, "duplicate"), ({"": "x"}, {}, "non-empty"),
    (["x"], {}, "mapping"), ({"c": "x"}, {"final_stage_id": 0}, "stops at stage 0"),
    ({"c": "x"}, {"resumable": True}, "resumable")])
def test_bad_companions_raise_and_register_nothing(companions: Any, kw: dict, match: str) -> None:
    r = Router(2, {0, 1})
    r.add("busy", "p")
    with pytest.raises(ValueError, match=match):
        r.accept("r1", "p", companions=companions, **kw)
    assert not r.is_live("r1") and not r.companion_of


def test_companion_ids_share_the_namespace_while_queued_and_are_freed_by_withdraw() -> None:
    r = Router(2, {1})
    t = r.accept("r1", "p", companions={"c1": "n"})
    with pytest.raises(ValueError, match="duplicate"):
        r.accept("c1", "p")
    r.withdraw(t)
    r.accept("c1", "p")
    with pytest.raises(ValueError, match="normal mode"):
        Router(2, {1}, async_chunk=True).accept("r", "p", companions={"c": "n"})


def test_a_companion_whose_submit_failed_ends_its_parent_naming_it() -> None:
    r = Router(2, {1}, forward_fn=cfg_forward)
    r.add("r1", "p", companions={"c1": "n", "c2": "m"})
    acts = r.submit_failed(0, "c2", "submit to stage 0 failed: the parent's replica is gone")
    [err] = emitted(acts)
    assert err.request_id == "r1" and err.kind == "stage_unavailable" and "companion 'c2'" in err.message
    assert [a for a in acts if isinstance(a, Abort)] == [Abort(0, ["r1"]), Abort(0, ["c1"])]
    assert not r.requests and not r.companion_of
    assert r.submit_failed(0, "c1", "late") == []  # the parent already ended
