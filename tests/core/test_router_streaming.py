"""Resumable requests in the routing core: input segments, per-segment forwarding, completion."""

from __future__ import annotations

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from trio_orch.core import Abort, Emit, Router, Submit, Update
from trio_orch.types import OrchError, OrchOutput, StageOutput


def out(rid: str, data: object, finished: bool = False, error: str | None = None) -> StageOutput:
    return StageOutput(rid, data, finished, error)


def emitted(actions: list) -> list:
    return [a.message for a in actions if isinstance(a, Emit)]


def fwd(k: int, prompt: object, outs: list) -> str:
    return f"{k}:{'+'.join(map(str, outs))}"


def test_normal_mode_forwards_each_segment_submit_first_then_updates_in_order() -> None:
    r = Router(3, {0, 2}, forward_fn=fwd)
    assert r.add("r", "s0", resumable=True) == [Submit(0, "r", "s0", resumable=True)]
    assert r.update("r", "s1") == [Update(0, "r", "s1")]
    # stage 0 answers segment 0, closes it: the user sees it (not the terminal), stage 1 gets a submit
    assert r.route(0, out("r", "a")) == [Emit(OrchOutput("r", 0, "a", False))]
    acts = r.route(0, out("r", "b", True))
    (msg,) = emitted(acts)
    assert (msg.segment, msg.segment_done, msg.finished) == (0, True, False)
    assert acts[1:] == [Submit(1, "r", "0:a+b", resumable=True)]
    # segment 1 at stage 0, then the final segment while it runs
    assert r.update("r", "s2", final=True) == [Update(0, "r", "s2", final=True)]
    acts = r.route(0, out("r", "c", True))
    assert emitted(acts)[0].segment == 1 and acts[1:] == [Update(1, "r", "0:c")]
    acts = r.route(0, out("r", "d", True))
    assert acts[1:] == [Update(1, "r", "0:d", final=True)]  # the last segment says so downstream
    # stage 1 closes its three segments, stage 2 gets them in order
    assert r.route(1, out("r", "x", True)) == [Submit(2, "r", "1:x", resumable=True)]
    assert r.route(1, out("r", "y", True)) == [Update(2, "r", "1:y")]
    assert r.route(1, out("r", "z", True)) == [Update(2, "r", "1:z", final=True)]
    assert emitted(r.route(2, out("r", "w0", True))) == [OrchOutput("r", 2, "w0", False)]
    assert emitted(r.route(2, out("r", "w1", True))) == [OrchOutput("r", 2, "w1", False)]
    (last,) = emitted(r.route(2, out("r", "w2", True)))
    assert last == OrchOutput("r", 2, "w2", True) and last.segment == 2 and last.segment_done
    assert not r.is_live("r") and r.terminals_by_kind == {"finished": 1}


def test_request_is_not_complete_before_the_input_is_closed() -> None:
    r = Router(1, {0})
    r.add("r", "s0", resumable=True)
    (msg,) = emitted(r.route(0, out("r", "a", True)))
    assert not msg.finished and msg.segment_done and "r" in r  # idle, waiting for more input
    assert r.route(0, out("r", "stray", True)) == [] and r.dropped_outputs == 1  # no segment open
    r.update("r", "s1", final=True)
    (msg,) = emitted(r.route(0, out("r", "b", True)))
    assert msg.finished and msg.segment == 1 and not r.is_live("r")


def test_async_chunk_updates_every_stage_and_gates_the_terminal() -> None:
    r = Router(3, {0, 2}, async_chunk=True, prewarm_fn=lambda k, p: f"warm{k}:{p}")
    assert r.add("r", "s0", resumable=True) == [
        Submit(0, "r", "s0", True), Submit(1, "r", "warm1:s0", True), Submit(2, "r", "warm2:s0", True)]
    assert r.update("r", "s1", final=True) == [
        Update(0, "r", "s1", True), Update(1, "r", "warm1:s1", True), Update(2, "r", "warm2:s1", True)]
    for seg in ("a", "b"):
        r.route(0, out("r", seg, True))
        r.route(2, out("r", f"wav-{seg}", True))
    assert "r" in r and r.requests["r"].pending_final is not None  # stage 1 still open: held
    assert r.route(1, out("r", None, True)) == []  # closes its first segment only
    (last,) = emitted(r.route(1, out("r", None, True)))
    assert last == OrchOutput("r", 2, "wav-b", True) and not r.is_live("r")


def test_updates_while_queued_follow_the_prompt_at_start() -> None:
    r = Router(1, {0})
    t = r.accept("r", "s0", resumable=True)
    assert r.update("r", "s1") == [] and r.update("r", "s2", final=True) == []
    with pytest.raises(ValueError, match="final"):
        r.update("r", "s3")
    assert r.start(t) == [Submit(0, "r", "s0", True), Update(0, "r", "s1"), Update(0, "r", "s2", True)]


@pytest.mark.parametrize(("setup", "match"), [
    ("unknown", "unknown or ended"), ("ended", "unknown or ended"), ("plain", "resumable=True"),
    ("closed", "final input segment")])
def test_bad_updates_raise_and_change_nothing(setup: str, match: str) -> None:
    r = Router(2, {1})
    if setup != "unknown":
        r.add("r", "p", resumable=setup != "plain")
    if setup == "ended":
        r.abort("r")
    if setup == "closed":
        r.update("r", "last", final=True)
    def snapshot() -> object:
        req = r.requests.get("r")
        return None if req is None else (dict(req.opened), req.segments, req.input_closed)

    before = snapshot()
    with pytest.raises(ValueError, match=match):
        r.update("r", "more")
    assert snapshot() == before


def test_abort_reaches_stages_that_hold_an_idle_resumable_request() -> None:
    r = Router(3, {2}, forward_fn=fwd)
    r.add("r", "s0", resumable=True)
    r.route(0, out("r", "a", True))  # stage 0 idle now, stage 1 has segment 0
    acts = r.abort("r")
    assert emitted(acts) == [OrchError("r", None, "aborted", "aborted by the client")]
    assert acts[1:] == [Abort(0, ["r"]), Abort(1, ["r"])]  # stage 0 still holds its context


def test_stage_error_mid_session_ends_the_request_once() -> None:
    r = Router(2, {1}, forward_fn=fwd)
    r.add("r", "s0", resumable=True)
    r.route(0, out("r", "a", True))
    r.update("r", "s1")
    acts = r.route(1, out("r", None, error="oom"))
    assert emitted(acts) == [OrchError("r", 1, "stage_failed", "oom")] and acts[1:] == [Abort(0, ["r"])]
    with pytest.raises(ValueError):
        r.update("r", "s2")


#: weighted: mostly progress (finish, update), sometimes a stray output, rarely an ending event;
#: the integer is the stage (for update: final when it is 0)
KINDS = ["finish"] * 30 + ["update"] * 12 + ["output"] * 6 + ["abort", "error", "died"]
OPS = st.lists(st.tuples(st.sampled_from(KINDS), st.sampled_from([0, 1, 2])), min_size=4, max_size=60)


@pytest.mark.parametrize("async_chunk", [False, True])
@settings(max_examples=400, deadline=None)
@given(ops=OPS)
@example(ops=[("update", 0), ("finish", 0), ("finish", 0), ("finish", 2), ("finish", 2), ("finish", 1),
              ("finish", 1)])  # async-chunk: the terminal is held until stage 1 closes its last segment
@example(ops=[("finish", 0), ("update", 1), ("finish", 0), ("update", 0), ("finish", 1), ("finish", 0),
              ("finish", 1), ("finish", 1), ("finish", 2), ("finish", 2), ("finish", 2)])
def test_one_session_every_segment_reaches_every_stage_once_in_order(async_chunk: bool, ops: list) -> None:
    """A single resumable request under any sequence of events: segments flow in order, one terminal."""
    r = Router(3, {0, 2}, async_chunk=async_chunk, prewarm_fn=lambda k, p: f"w{k}:{p}",
               forward_fn=lambda k, p, o: f"f{k}:{o[-1]}")
    segments, closed_input = 1, False
    got: dict[int, list[object]] = {}  # stage -> payloads received (submit, then updates)
    finals: dict[int, list[bool]] = {}
    closed: dict[int, int] = {}
    terminals: list[object] = []

    def apply(actions: list) -> None:
        for a in actions:
            if isinstance(a, (Submit, Update)):
                assert not terminals, f"stage I/O after the terminal: {a}"
                assert isinstance(a, Submit) == (a.stage_id not in got)
                got.setdefault(a.stage_id, []).append(a.payload)
                finals.setdefault(a.stage_id, []).append(
                    a.final if isinstance(a, Update) else not a.resumable)
            elif isinstance(a, Emit):
                assert not terminals, f"message after the terminal: {a.message}"
                if a.message.finished:
                    terminals.append(a.message)

    apply(r.add("r", "s0", resumable=True))
    for op, arg in ops:
        if terminals:
            break
        if op == "update":
            if closed_input:
                with pytest.raises(ValueError):
                    r.update("r", "late")
                continue
            apply(r.update("r", f"s{segments}", final=arg == 0))
            segments, closed_input = segments + 1, arg == 0
        elif op in ("finish", "output"):
            is_open = len(got.get(arg, [])) > closed.get(arg, 0)
            if op == "finish" and is_open:
                closed[arg] = closed.get(arg, 0) + 1
            apply(r.route(arg, StageOutput("r", f"d{arg}", op == "finish")))
        elif op == "abort":
            apply(r.abort("r"))
        elif op == "error":
            apply(r.route(arg, StageOutput("r", None, True, "boom")))
        else:
            apply(r.stage_died(arg, "died"))
    if closed_input and all(closed.get(k, 0) == segments for k in range(3)):
        assert terminals, "every segment closed everywhere, yet no terminal"
    apply(r.shutdown())
    assert len(terminals) == 1 and not r.is_live("r")
    for k, payloads in got.items():
        if k == 0:
            assert payloads == [f"s{i}" for i in range(len(payloads))], "stage 0 input out of order"
        elif async_chunk:
            assert payloads == [f"w{k}:s{i}" for i in range(len(payloads))], f"stage {k} out of order"
        assert len(payloads) <= segments and finals[k] == [
            closed_input and i == segments - 1 for i in range(len(payloads))], f"stage {k} final flags"
    if isinstance(terminals[0], OrchOutput):
        assert closed_input and all(len(got.get(k, [])) == segments for k in range(3)), "ended early"
        assert all(closed.get(k, 0) == segments for k in range(3)), "finished before every segment closed"
