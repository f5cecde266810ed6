"""The routing core driven directly: no event loop, no I/O (the contract of docs/design.md)."""

from __future__ import annotations

import ast
import pathlib

import pytest

from trio_orch.core import Abort, Emit, Router, Submit
from trio_orch.types import OrchError, OrchOutput, StageOutput


def warm(k: int, p: str) -> str:
    return f"warm{k}:{len(p)}"


def emitted(actions: list) -> list:
    return [a.message for a in actions if isinstance(a, Emit)]


def out(rid: str, data: object, finished: bool = False, error: str | None = None) -> StageOutput:
    return StageOutput(rid, data, finished, error)


def test_core_package_imports_no_event_loop() -> None:
    names = set()
    files = sorted(pathlib.Path(__file__).parents[2].joinpath("trio_orch", "core").glob("*.py"))
    assert len(files) >= 4
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names.update(a.name.split(".")[0] for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module:
                names.add(node.module.split(".")[0])
    assert not names & {"trio", "asyncio", "anyio", "janus", "zmq"}


def test_normal_mode_forward_chain() -> None:
    r = Router(3, {0, 2}, forward_fn=lambda k, p, outs: f"{k}:{'+'.join(outs)}")
    assert r.add("r1", "hello") == [Submit(0, "r1", "hello")]
    assert r.route(0, out("r1", "a")) == [Emit(OrchOutput("r1", 0, "a", False))]
    acts = r.route(0, out("r1", "b", True))
    # the user's output comes first, then the forward with every output of stage 0
    assert acts == [Emit(OrchOutput("r1", 0, "b", False)), Submit(1, "r1", "0:a+b")]
    assert r.route(1, out("r1", "x")) == []  # stage 1 is not a final-output stage
    assert r.route(1, out("r1", "y", True)) == [Submit(2, "r1", "1:x+y")]
    assert r.route(2, out("r1", "w1")) == [Emit(OrchOutput("r1", 2, "w1", False))]
    assert r.route(2, out("r1", "w2", True)) == [Emit(OrchOutput("r1", 2, "w2", True))]
    assert "r1" not in r and len(r) == 0


def test_async_chunk_worked_example_late_nonfinal_completion() -> None:
    r = Router(3, {0, 2}, async_chunk=True, prewarm_fn=warm)
    assert r.add("r1", "hi there") == [
        Submit(0, "r1", "hi there"), Submit(1, "r1", "warm1:8"), Submit(2, "r1", "warm2:8")]
    assert emitted(r.route(0, out("r1", "hi"))) == [OrchOutput("r1", 0, "hi", False)]
    assert r.route(0, out("r1", "there", True)) == [Emit(OrchOutput("r1", 0, "there", False))]
    assert emitted(r.route(2, out("r1", "wav:HI"))) == [OrchOutput("r1", 2, "wav:HI", False)]
    assert r.route(2, out("r1", "wav:THERE", True)) == []  # held: stage 1 not finished
    assert r.requests["r1"].pending_final == OrchOutput("r1", 2, "wav:THERE", True)
    assert r.route(1, out("r1", None, True)) == [Emit(OrchOutput("r1", 2, "wav:THERE", True))]
    assert "r1" not in r
    assert r.route(2, out("r1", "wav:EXTRA")) == []
    assert r.dropped_outputs == 1 and "r1" not in r


def test_async_chunk_nonfinal_completes_first_needs_no_hold() -> None:
    r = Router(3, {0, 2}, async_chunk=True, prewarm_fn=warm)
    r.add("r1", "hi there")
    r.route(0, out("r1", "hi", True))
    assert r.route(1, out("r1", None, True)) == []
    assert r.route(2, out("r1", "wav", True)) == [Emit(OrchOutput("r1", 2, "wav", True))]


def test_async_chunk_stage0_is_last_final_stage() -> None:
    r = Router(3, {0, 2}, async_chunk=True, prewarm_fn=warm)
    r.add("r1", "hi there")
    r.route(1, out("r1", None, True))
    assert emitted(r.route(2, out("r1", "wav", True))) == [OrchOutput("r1", 2, "wav", False)]
    assert r.route(0, out("r1", "end", True)) == [Emit(OrchOutput("r1", 0, "end", True))]


def test_per_request_final_stage_id_text_only() -> None:
    r = Router(3, {0, 2})
    r.add("t", "p", final_stage_id=0)
    assert r.route(0, out("t", "only", True)) == [Emit(OrchOutput("t", 0, "only", True))]
    r = Router(3, {0, 2}, async_chunk=True)
    # submitted to stage 0 only; stage 1 drops whatever stage 0 streams to it for this request
    assert r.add("t", "p", final_stage_id=0) == [Submit(0, "t", "p"), Abort(1, ["t"])]
    assert r.route(0, out("t", "only", True)) == [Emit(OrchOutput("t", 0, "only", True))]


@pytest.mark.parametrize(
    ("rid", "final", "match"),
    [("r", 3, "out of range"), ("r", -1, "out of range"), ("", None, "non-empty"),
     (7, None, "non-empty str"), ("r", "2", "must be an int")],
)
def test_bad_requests_raise_and_register_nothing(rid: object, final: object, match: str) -> None:
    r = Router(3, {0, 2})
    with pytest.raises(ValueError, match=match):
        r.add(rid, "p", final_stage_id=final)  # type: ignore[arg-type]
    assert len(r) == 0


def test_empty_final_set_for_request() -> None:
    r = Router(3, {2})
    with pytest.raises(ValueError, match="no final-output stage"):
        r.add("r", "p", final_stage_id=1)
    assert len(r) == 0


def test_router_construction_errors() -> None:
    with pytest.raises(ValueError, match="empty"):
        Router(3, set())
    with pytest.raises(ValueError, match="out of range"):
        Router(3, {3})


def test_duplicate_active_id_refused_then_allowed_after_terminal() -> None:
    r = Router(1, {0})
    r.add("r", "p")
    with pytest.raises(ValueError, match="duplicate"):
        r.add("r", "q")
    r.route(0, out("r", "x", True))
    assert r.add("r", "again") == [Submit(0, "r", "again")]


def test_abort_aborts_open_stages_and_terminates() -> None:
    r = Router(3, {0, 2}, async_chunk=True)
    r.add("r", "p")
    r.route(0, out("r", "x", True))
    acts = r.abort("r")
    assert acts[0] == Emit(OrchError("r", None, "aborted", "aborted by the client"))
    assert acts[1:] == [Abort(1, ["r"]), Abort(2, ["r"])]
    assert r.abort("r") == [] and r.abort("nope") == []
    assert r.route(2, out("r", "late")) == [] and r.dropped_outputs == 1


def test_stage_error_output_terminates_and_aborts_elsewhere() -> None:
    r = Router(3, {0, 2}, async_chunk=True)
    r.add("r", "p")
    acts = r.route(1, out("r", None, error="oom"))
    assert emitted(acts) == [OrchError("r", 1, "stage_failed", "oom")]
    assert [a.stage_id for a in acts if isinstance(a, Abort)] == [0, 2]


def test_output_from_unsubmitted_or_finished_stage_is_dropped() -> None:
    r = Router(3, {0, 2})
    r.add("r", "p")
    assert r.route(2, out("r", "never submitted")) == []
    r.route(0, out("r", "x"))
    r.route(0, out("r", "y", True))
    assert r.route(0, out("r", "after finished", True)) == []
    assert r.dropped_outputs == 2 and "r" in r


def test_stage_death_terminates_bound_requests_and_blocks_new_work() -> None:
    r = Router(3, {0, 2})
    r.add("a", "p")  # open on stage 0
    r.add("b", "p")
    r.route(0, out("b", "x", True))  # b moves to stage 1
    acts = r.stage_died(1, "stage 1 died")
    assert emitted(acts) == [OrchError("b", 1, "replica_died", "stage 1 died")]
    assert "a" in r and "b" not in r
    # a later forward to the dead stage fails at that moment
    acts = r.route(0, out("a", "y", True))
    assert emitted(acts) == [OrchOutput("a", 0, "y", False),
                             OrchError("a", 1, "stage_unavailable", "stage 1 has no live replica")]
    assert "a" not in r
    # and so does a new request whose first stage is dead
    r.stage_died(0, "gone")
    assert emitted(r.add("c", "p")) == [OrchError("c", 0, "stage_unavailable", "stage 0 has no live replica")]
    assert "c" not in r
    r.set_available(0, True)
    assert r.add("c", "p") == [Submit(0, "c", "p")]


def test_submit_failure_and_forward_failure() -> None:
    r = Router(2, {1}, forward_fn=lambda k, p, o: 1 / 0)
    r.add("r", "p")
    acts = r.submit_failed(0, "r", "no replica")
    assert emitted(acts) == [OrchError("r", 0, "stage_unavailable", "no replica")]
    r.add("r", "p")
    acts = r.route(0, out("r", "x", True))
    (err,) = emitted(acts)
    assert err.kind == "forward_failed" and "ZeroDivisionError" in err.message
    assert "r" not in r


def test_shutdown_gives_every_active_request_a_terminal() -> None:
    r = Router(3, {0, 2}, async_chunk=True)
    for i in range(5):
        r.add(f"r{i}", "p")
    msgs = emitted(r.shutdown("bye"))
    assert sorted(m.request_id for m in msgs) == [f"r{i}" for i in range(5)]
    assert all(m.kind == "shutdown" for m in msgs) and len(r) == 0
    assert r.terminals_by_kind["shutdown"] == 5


def test_replica_death_reported_per_request_by_a_pool() -> None:
    r = Router(2, {1}, max_retries=0)  # failover off (tests/core/test_router_failover.py)
    r.add("r", "p")
    o = StageOutput("r", None, True, error="replica 1 died", error_kind="replica_died")
    assert emitted(r.route(0, o)) == [OrchError("r", 0, "replica_died", "replica 1 died")]


def test_production_timestamp_travels_with_the_output_but_not_into_equality() -> None:
    r = Router(1, {0})
    r.add("r", "p")
    (emit,) = r.route(0, StageOutput("r", "x", True, t_produced=12.5))
    assert emit.message.t_produced == 12.5
    assert emit.message == OrchOutput("r", 0, "x", True)


# ---------------------------------------------------------------- admission (accept -> start)
def test_accept_registers_before_start_and_refuses_duplicates_while_queued() -> None:
    r = Router(2, {1})
    t = r.accept("r", "p")
    assert r.is_queued("r") and r.is_live("r") and "r" not in r and r.live_count == 1
    with pytest.raises(ValueError, match="duplicate"):
        r.accept("r", "q")
    assert r.start(t) == [Submit(0, "r", "p")]
    assert not r.is_queued("r") and "r" in r and r.live_count == 1


def test_withdraw_forgets_a_ticket_without_a_terminal() -> None:
    r = Router(1, {0})
    t = r.accept("r", "p")
    r.withdraw(t)
    assert not r.is_live("r") and r.terminals_by_kind == {}
    assert r.start(t) == []  # a withdrawn ticket never starts
    r.accept("r", "again")  # the id is free


@pytest.mark.parametrize(("event", "kind", "text"), [
    ("abort", "aborted", "while queued"), ("expire", "timeout", "while queued"),
    ("shutdown", "shutdown", "before the request was handled")])
def test_queued_request_ends_with_one_terminal_and_never_starts(event: str, kind: str, text: str) -> None:
    r = Router(2, {1})
    t = r.accept("r", "p")
    acts = r.shutdown() if event == "shutdown" else getattr(r, event)("r")
    assert acts == [Emit(OrchError("r", None, kind, r.queued_terminal(kind)))]
    assert text in r.queued_terminal(kind)
    assert r.start(t) == [] and not r.is_live("r")
    assert r.terminals_by_kind == {kind: 1}


def test_stale_ticket_does_not_start_a_new_incarnation() -> None:
    r = Router(1, {0})
    old = r.accept("r", "first")
    r.abort("r")
    new = r.accept("r", "second")
    assert r.start(old) == []
    assert r.is_current(new) and not r.is_current(old)
    assert r.start(new) == [Submit(0, "r", "second")]


def test_prewarm_failure_is_a_forward_failed_terminal_decided_at_start() -> None:
    def prewarm(k: int, p: str) -> str:
        raise KeyError(k)

    r = Router(3, {2}, async_chunk=True, prewarm_fn=prewarm)
    acts = r.start(r.accept("r", "p"))
    (err,) = emitted(acts)
    assert (err.kind, err.stage_id) == ("forward_failed", 1)
    assert "prewarm_fn(1) raised KeyError" in err.message
    assert acts == [Emit(err)] and not r.is_live("r") and r.terminals_by_kind == {"forward_failed": 1}


def test_accept_refused_after_shutdown_and_bad_timeouts() -> None:
    r = Router(1, {0})
    for bad in (0, -1, "3", float("nan")):
        with pytest.raises(ValueError, match="timeout"):
            r.accept("r", "p", timeout=bad)  # type: ignore[arg-type]
    assert not r.is_live("r")
    r.shutdown()
    with pytest.raises(RuntimeError, match="not accepting"):
        r.accept("r", "p")


def test_submitted_asks_for_a_follow_up_abort_when_the_request_ended_meanwhile() -> None:
    r = Router(2, {1})
    r.add("r", "p")
    assert r.submitted(0, "r") == []  # still running there: nothing to undo
    r.abort("r")
    assert r.submitted(0, "r") == [Abort(0, ["r"])]


def test_every_terminal_is_counted_by_the_core() -> None:
    r = Router(2, {1}, async_chunk=True)
    r.add("done", "p")
    r.route(0, out("done", None, True))
    r.route(1, out("done", "x", True))
    r.add("aborted", "p")
    r.abort("aborted")
    r.accept("queued", "p")
    r.stage_died(0, "gone")
    r.add("unavailable", "p")
    r.set_available(0, True)
    r.add("failed", "p")
    r.route(1, out("failed", None, error="oom"))
    stats = r.statistics()
    assert dict(stats.terminals_by_kind) == {"finished": 1, "aborted": 1, "stage_unavailable": 1,
                                             "stage_failed": 1}
    assert (stats.queued, stats.active, stats.live) == (1, 0, 1)
    r.shutdown()
    assert r.statistics().terminals_by_kind["shutdown"] == 1


# ---------------------------------------------------------------- per-stage sampling parameters
def test_sampling_parameters_ride_with_every_submission_uninterpreted() -> None:
    r = Router(3, {0, 2}, forward_fn=lambda k, p, o: o[-1])
    opaque = object()
    acts = r.add("r", "p", sampling=[{"temperature": 0.0}, None, opaque])
    assert acts == [Submit(0, "r", "p", sampling={"temperature": 0.0})]
    assert r.route(0, out("r", "a", True))[1:] == [Submit(1, "r", "a")]  # stage 1: its defaults
    assert r.route(1, out("r", "b", True)) == [Submit(2, "r", "b", sampling=opaque)]
    a = Router(3, {2}, async_chunk=True)
    assert [x.sampling for x in a.add("r", "p", sampling={2: "s2"})] == [None, None, "s2"]


def test_sampling_parameters_are_checked_per_stage_at_acceptance() -> None:
    def check(stage: int, params: dict) -> dict:
        unknown = set(params) - {"temperature"}
        if unknown:
            raise ValueError(f"unknown key {sorted(unknown)[0]!r}")
        return {"temperature": 1.0, **params}

    r = Router(2, {1}, check_sampling=check)
    for bad, match in [([{}, {"tmp": 1}], "stage 1: unknown key 'tmp'"), ({5: {}}, "stage 5"),
                       ("hot", "list indexed by stage"), ([{}, {}, {}], "stage 2")]:
        with pytest.raises(ValueError, match=match):
            r.accept("r", "p", sampling=bad)
        assert not r.is_live("r")
    assert r.add("r", "p", sampling={0: {}}) == [Submit(0, "r", "p", sampling={"temperature": 1.0})]


# ---------------------------------------------------------------- pause
def test_pause_modes_decide_what_happens_to_started_requests() -> None:
    r = Router(2, {1}, async_chunk=True)
    r.add("a", "p")
    r.add("b", "p")
    assert r.pause("wait") == [] and r.paused == "wait" and not r.pause_complete()
    r.route(0, out("a", None, True))
    r.route(1, out("a", "x", True))
    r.route(0, out("b", None, True))
    r.route(1, out("b", "y", True))
    assert r.pause_complete()
    r.resume()
    assert r.paused is None and not r.pause_complete()
    r.add("c", "p")
    acts = r.pause("abort")
    assert emitted(acts) == [OrchError("c", None, "aborted", "aborted by pause(mode='abort')")]
    assert acts[1:] == [Abort(0, ["c"]), Abort(1, ["c"])] and r.pause_complete()
    r.resume()
    r.add("d", "p")
    assert r.pause("keep") == [] and r.pause_complete() and "d" in r
    with pytest.raises(ValueError, match="pause mode"):
        r.pause("sleep")


# ---------------------------------------------------------------- admission bounds and replicas
def test_a_started_request_holds_room_on_every_stage_of_its_path_until_it_passes_it() -> None:
    r = Router(3, {0, 2}, forward_fn=lambda k, p, o: o, max_inflight=[2, None, 1])
    audio = r.accept("audio", "p")  # path 0..2
    text = r.accept("text", "p", final_stage_id=0)  # path 0 only
    assert r.can_start(audio) and r.has_room(2)
    r.start(audio)
    assert r.statistics().claims_by_stage == (1, 1, 1)
    assert not r.has_room(2) and r.has_room(0)  # stage 2 admits one, and "audio" will need it
    assert r.can_start(text)
    r.start(text)
    late = r.accept("late", "p", final_stage_id=0)
    assert not r.can_start(late)  # stage 0 holds two
    r.route(0, out("text", "t", True))  # text finished: its terminal frees stage 0
    assert r.can_start(late) and r.statistics().claims_by_stage == (1, 1, 1)
    r.start(late)
    r.route(0, out("audio", "a", True))  # audio passed stage 0, still holds 1 and 2
    assert r.statistics().claims_by_stage == (1, 1, 1)
    r.route(1, out("audio", "c", True))
    assert r.statistics().claims_by_stage == (1, 0, 1)
    r.abort("audio")  # an ended request frees what it still held
    assert r.statistics().claims_by_stage == (1, 0, 0) and r.has_room(2)


def test_admission_bound_follows_the_live_replicas_and_availability() -> None:
    r = Router(2, {0, 1}, max_inflight=[2, 2])
    r.replicas_changed(0, 2, 2)
    for i in range(4):
        r.add(f"r{i}", "p")
    assert not r.has_room(1) and r.statistics().stage_limits == (4, 2)
    r.replicas_changed(1, 3, 3)
    assert not r.has_room(1) and not r.has_room(0)  # stage 1 may take 6 now; stage 0 holds 4 of 4
    r.replicas_changed(0, 3, 3)
    assert r.has_room(1)
    waiting = r.accept("w", "p")
    r.replicas_changed(0, 0, 3)  # the last replica died: nothing would start, so do not wait
    assert r.unavailable_stage(1) == 0 and r.can_start(waiting)
    assert emitted(r.start(waiting)) == [
        OrchError("w", 0, "stage_unavailable", "stage 0 has no live replica")]
    stats = r.statistics()
    assert (stats.replicas_live, stats.replicas_total, stats.stage_available) == ((0, 3), (3, 3),
                                                                                   (False, True))
    r.replicas_changed(1, 0, 2)  # a later stage down: the core still accepts, a front may refuse
    r.replicas_changed(0, 1, 3)
    assert r.unavailable_stage(0) is None and r.unavailable_stage(1) == 1
    assert r.add("x", "p", 0) == [Submit(0, "x", "p")]


def test_a_stale_ticket_may_always_start_and_bad_bounds_are_refused() -> None:
    r = Router(1, {0}, max_inflight=[1])
    r.add("a", "p")
    t = r.accept("t", "p")
    assert not r.can_start(t)
    r.abort("a")
    assert r.can_start(t)
    r.pause("wait")  # paused: a queued ticket waits even with room
    assert not r.can_start(t)
    r.resume()
    assert r.can_start(t)
    r.abort("t")  # ended while queued: start() does nothing, so the shell need not wait
    assert r.can_start(t) and r.start(t) == []
    for bad, match in [([0], "stage 0"), ([1, 1], "one entry per stage"), (["2"], "stage 0")]:
        with pytest.raises(ValueError, match=match):
            Router(1, {0}, max_inflight=bad)


def test_max_running_bounds_the_started_requests_whatever_their_paths() -> None:
    """vLLM's ``max_num_seqs``: no more than that many requests run at once; the others wait queued."""
    r = Router(2, {0, 1}, forward_fn=lambda k, p, o: o, max_running=2)
    r.add("a", "p")  # path 0..1
    r.add("b", "p", 0)  # path 0 only
    third = r.accept("c", "p", final_stage_id=0)
    assert not r.can_start(third) and not r.has_room(0) and r.capacity() == 2
    r.route(0, out("a", "x", True))  # "a" passed stage 0 but still runs on stage 1: it still counts
    assert not r.can_start(third)
    r.route(0, out("b", "y", True))  # "b" ended: one place
    assert r.can_start(third) and r.start(third) == [Submit(0, "c", "p")]
    assert r.statistics().active == 2
    both = Router(1, {0}, max_inflight=[3], max_running=2)  # the smaller bound decides the capacity
    assert both.capacity() == 2
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="max_running"):
            Router(1, {0}, max_running=bad)  # type: ignore[arg-type]


def test_resumable_and_async_chunk_requests_release_room_when_each_stage_is_done() -> None:
    r = Router(2, {1}, async_chunk=True, max_inflight=[1, 1])
    r.add("s", "p", resumable=True)
    assert r.statistics().claims_by_stage == (1, 1)
    r.route(0, out("s", None, True))  # segment 0 closed on stage 0, but more input may come
    assert r.statistics().claims_by_stage == (1, 1)
    r.update("s", "more", final=True)
    r.route(0, out("s", None, True))
    assert r.statistics().claims_by_stage == (0, 1)
    r.route(1, out("s", "x", True))
    r.route(1, out("s", "y", True))
    assert not r.is_live("s") and r.statistics().claims_by_stage == (0, 0)
