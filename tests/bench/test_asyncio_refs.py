"""The routing scenario suite, run against every implementation through the thread-side driver.

The asyncio references must honour the same routing contract (every request
ends with exactly one terminal, the last message for it) as the Trio
orchestrator -- same core, different concurrency shell -- so the comparison
measures the shell alone.  Every test runs once per implementation that
supports scripted stages (Trio included).
"""

from __future__ import annotations

import os
from collections import Counter

import pytest

from bench.drivers.base import Driver, EndOfStream
from bench.implementations import make_driver, names
from stages.config import echo_config
from trio_orch.types import OrchError, OrchOutput

IMPLS = names("scripted")


@pytest.fixture(params=IMPLS)
def impl(request: pytest.FixtureRequest) -> str:
    return request.param


def start(impl: str, *args, **kwargs) -> Driver:
    return make_driver(impl, *args, **kwargs).start()


def assert_one_terminal_last(msgs: list, rids: set[str]) -> None:
    """Every request in ``rids`` has exactly one terminal and nothing after it."""
    seen_terminal: set[str] = set()
    for m in msgs:
        assert m.request_id not in seen_terminal, f"message after the terminal: {m}"
        if m.finished:
            seen_terminal.add(m.request_id)
    assert seen_terminal == rids


def forward(k, prompt, outs):
    return f"{prompt}|{k}:{'+'.join(outs)}"


def test_normal_mode_forward_chain(impl: str) -> None:
    with start(impl, 3, {0, 2}, forward_fn=forward) as h:
        h.add_request("r1", "p")
        h.emit(0, "r1", "a")
        h.emit(0, "r1", "b", finished=True)
        assert h.collect(2) == [OrchOutput("r1", 0, "a", False), OrchOutput("r1", 0, "b", False)]
        assert h.wait_until(lambda: h.submissions(1))
        assert h.submissions(1) == [("r1", "p|0:a+b")]
        h.emit(1, "r1", "t", finished=True)  # not a final stage: never shown
        assert h.wait_until(lambda: h.submissions(2))
        assert h.submissions(2) == [("r1", "p|1:t")]  # forward_fn gets the original prompt
        h.emit(2, "r1", "w", finished=True)
        assert h.next_output() == OrchOutput("r1", 2, "w", True)
        # a text-only request stops at stage 0
        h.add_request("r2", "q", final_stage_id=0)
        h.emit(0, "r2", "z", finished=True)
        assert h.next_output() == OrchOutput("r2", 0, "z", True)
        assert h.submissions(1) == [("r1", "p|0:a+b")]
        report = h.shutdown()
    assert not report.hung and report.tasks_alive_after_run == 0
    assert h.drain(1) == ([], True)


def test_async_chunk_worked_table(impl: str) -> None:
    """The routing contract's async-chunk example, row by row."""
    with start(impl, 3, {0, 2}, async_chunk=True, prewarm_fn=lambda k, p: f"warm{k}:{len(p)}") as h:
        h.add_request("r1", "hi there")
        assert h.submissions(0) == [("r1", "hi there")]
        assert h.submissions(1) == [("r1", "warm1:8")]
        assert h.submissions(2) == [("r1", "warm2:8")]
        h.emit(0, "r1", "hi")
        assert h.next_output() == OrchOutput("r1", 0, "hi", False)
        h.emit(0, "r1", "there", finished=True)
        assert h.next_output() == OrchOutput("r1", 0, "there", False)
        h.emit(2, "r1", "wav:HI")
        assert h.next_output() == OrchOutput("r1", 2, "wav:HI", False)
        h.emit(2, "r1", "wav:THERE", finished=True)
        with pytest.raises(TimeoutError):
            h.next_output(timeout=0.1)  # held: stage 1 not finished
        h.emit(1, "r1", None, finished=True)
        assert h.next_output() == OrchOutput("r1", 2, "wav:THERE", True)
        h.emit(2, "r1", "wav:EXTRA")
        assert h.wait_until(lambda: h.dropped_outputs == 1)
        with pytest.raises(TimeoutError):
            h.next_output(timeout=0.05)
        assert h.active_requests == 0


def test_async_chunk_no_hold_and_terminal_from_stage0(impl: str) -> None:
    with start(impl, 3, {0, 2}, async_chunk=True) as h:
        # S1 finishes before S2: no holding
        h.add_request("a", "x")
        h.emit(1, "a", None, finished=True)
        h.emit(0, "a", "t", finished=True)
        assert h.next_output() == OrchOutput("a", 0, "t", False)
        h.emit(2, "a", "w", finished=True)
        assert h.next_output() == OrchOutput("a", 2, "w", True)
        # S0 is the last final stage to finish: the terminal comes from stage 0
        h.add_request("b", "x")
        h.emit(1, "b", None, finished=True)
        h.emit(2, "b", "w", finished=True)
        assert h.next_output() == OrchOutput("b", 2, "w", False)
        h.emit(0, "b", "t", finished=True)
        assert h.next_output() == OrchOutput("b", 0, "t", True)


def test_twenty_concurrent_requests_late_completions(impl: str) -> None:
    rids = [f"r{i:02d}" for i in range(20)]
    with start(impl, 2, {0, 1}) as h:
        for r in rids:
            h.add_request(r, r)
        for r in rids:
            h.emit(0, r, "t", finished=True)
        assert h.wait_until(lambda: len(h.submissions(1)) == 20)
        for r in reversed(rids):  # completions in the opposite order, interleaved with partials
            h.emit(1, r, "p1")
        for r in rids[::2] + rids[1::2]:
            h.emit(1, r, "end", finished=True)
        msgs = h.collect(20 + 20 + 20)
        h.emit(1, rids[0], "late")  # after cleanup: dropped
        assert h.wait_until(lambda: h.dropped_outputs == 1)
        h.shutdown()
        rest, ended = h.drain(1)
    assert ended and rest == []
    assert_one_terminal_last(msgs, set(rids))
    assert all(isinstance(m, OrchOutput) for m in msgs)


def test_outputs_after_cleanup_dropped_and_counted(impl: str) -> None:
    with start(impl, 1, {0}) as h:
        h.add_request("r1", "p")
        h.emit(0, "r1", "x", finished=True)
        assert h.next_output() == OrchOutput("r1", 0, "x", True)
        h.emit(0, "r1", "y")
        h.emit(0, "nobody", "z", finished=True)
        assert h.wait_until(lambda: h.dropped_outputs == 2)
        with pytest.raises(TimeoutError):
            h.next_output(timeout=0.05)


def test_abort_mid_stream(impl: str) -> None:
    with start(impl, 2, {0, 1}, async_chunk=True) as h:
        h.add_request("r1", "p")
        h.emit(0, "r1", "a")
        assert h.next_output() == OrchOutput("r1", 0, "a", False)
        h.abort("r1")
        msg = h.next_output()
        assert isinstance(msg, OrchError) and msg.kind == "aborted"
        assert h.wait_until(lambda: h.aborts(0) == ["r1"] and h.aborts(1) == ["r1"])
        h.emit(0, "r1", "b", finished=True)
        assert h.wait_until(lambda: h.dropped_outputs == 1)
        h.abort("unknown")  # no-op
        h.add_request("r1", "again")  # the id is free again
        h.shutdown()
        rest, ended = h.drain()
    assert ended and [(m.request_id, m.kind) for m in rest] == [("r1", "shutdown")]


def test_unknown_abort_is_a_noop(impl: str) -> None:
    with start(impl, 1, {0}) as h:
        h.abort("ghost")
        h.add_request("r1", "p")
        h.emit(0, "r1", "x", finished=True)
        assert h.next_output() == OrchOutput("r1", 0, "x", True)
        assert h.aborts(0) == []


def test_per_request_stage_error(impl: str) -> None:
    with start(impl, 2, {1}, async_chunk=True) as h:
        h.add_request("r1", "p")
        h.add_request("r2", "p")
        h.emit(0, "r1", None, error="out of memory")
        msg = h.next_output()
        assert isinstance(msg, OrchError)
        assert (msg.request_id, msg.stage_id, msg.kind) == ("r1", 0, "stage_failed")
        assert "out of memory" in msg.message
        assert h.wait_until(lambda: h.aborts(1) == ["r1"])
        assert h.aborts(0) == []
        h.emit(0, "r2", None, finished=True)
        h.emit(1, "r2", "ok", finished=True)
        assert h.next_output() == OrchOutput("r2", 1, "ok", True)


def test_stage_death(impl: str) -> None:
    with start(impl, 2, {0, 1}) as h:
        h.add_request("on1", "p")
        h.emit(0, "on1", "t", finished=True)
        assert h.next_output() == OrchOutput("on1", 0, "t", False)
        assert h.wait_until(lambda: h.submissions(1))
        h.add_request("on0", "p")
        h.emit(1, "on1", "partial")
        assert h.next_output() == OrchOutput("on1", 1, "partial", False)
        h.fail_stage(1, RuntimeError("gpu fell off"))
        msg = h.next_output()
        assert isinstance(msg, OrchError) and (msg.request_id, msg.kind) == ("on1", "replica_died")
        assert "gpu fell off" in msg.message
        # the orchestrator keeps running; a forward to the dead stage is refused at that moment
        h.emit(0, "on0", "t", finished=True)
        assert h.collect(2) == [
            OrchOutput("on0", 0, "t", False),
            OrchError("on0", 1, "stage_unavailable", "stage 1 has no live replica"),
        ]
        h.add_request("text", "p", final_stage_id=0)
        h.emit(0, "text", "ok", finished=True)
        assert h.next_output() == OrchOutput("text", 0, "ok", True)
        report = h.shutdown()
    assert not report.hung and report.run_error is None


def test_shutdown_with_requests_in_flight(impl: str) -> None:
    with start(impl, 2, {1}) as h:
        for i in range(5):
            h.add_request(f"r{i}", "p")
        h.emit(0, "r0", "t", finished=True)
        assert h.wait_until(lambda: h.submissions(1))
        report = h.shutdown()
        msgs, ended = h.drain()
    assert ended and not report.hung and report.run_error is None
    assert report.tasks_alive_after_run == 0
    assert Counter(m.kind for m in msgs) == {"shutdown": 5}
    assert_one_terminal_last(msgs, {f"r{i}" for i in range(5)})
    with pytest.raises(EndOfStream):
        h.next_output(timeout=0.1)
    with pytest.raises(RuntimeError):
        h.add_request("late", "p")


def test_shutdown_with_drain_lets_requests_finish(impl: str) -> None:
    with start(impl, 1, {0}) as h:
        h.add_request("r1", "p")
        h.emit(0, "r1", "x")
        assert h.next_output() == OrchOutput("r1", 0, "x", False)
        h.request_shutdown(5.0)
        h.emit(0, "r1", "y", finished=True)
        report = h.shutdown(5.0)
        msgs, ended = h.drain()
    assert not report.hung and ended
    assert msgs == [OrchOutput("r1", 0, "y", True)]


def test_duplicate_id_refused(impl: str) -> None:
    with start(impl, 2, {1}) as h:
        h.add_request("r1", "p")
        with pytest.raises(ValueError, match="duplicate"):
            h.add_request("r1", "other")
        assert h.submissions(0) == [("r1", "p")]
        h.emit(0, "r1", None, finished=True)
        assert h.wait_until(lambda: h.submissions(1))
        h.emit(1, "r1", "done", finished=True)
        assert h.next_output() == OrchOutput("r1", 1, "done", True)


@pytest.mark.parametrize(
    ("rid", "kwargs", "match"),
    [
        ("", {}, "non-empty"),
        (None, {}, "non-empty"),
        ("r", {"final_stage_id": 5}, "out of range"),
        ("r", {"final_stage_id": -1}, "out of range"),
        ("r", {"final_stage_id": "1"}, "must be an int"),
        ("r", {"final_stage_id": 0}, "no final-output stage"),
    ],
)
def test_malformed_input_raises_and_registers_nothing(impl: str, rid, kwargs, match) -> None:
    with start(impl, 2, {1}) as h:
        with pytest.raises(ValueError, match=match):
            h.add_request(rid, "p", **kwargs)
        assert h.submissions(0) == []
        assert h.active_requests == 0
        h.add_request("ok", "p")
        assert h.submissions(0) == [("ok", "p")]


def test_real_zmq_workers(impl: str) -> None:
    """Every implementation drives real `stages.worker` processes (asyncio: pyzmq asyncio sockets)."""
    h = start(impl, workers=echo_config(2, final_stage_ids=[0, 1], outputs=2))
    assert len(h.worker_pids) == 2 and os.path.isdir(h.worker_dir)
    rids = {f"r{i}" for i in range(3)}
    for r in sorted(rids):
        h.add_request(r, f"hello-{r}")
    msgs = []
    while sum(m.finished for m in msgs) < 3:
        msgs.append(h.next_output(timeout=10))
    assert all(isinstance(m, OrchOutput) for m in msgs)
    assert_one_terminal_last(msgs, rids)
    for r in rids:  # echo: 2 outputs at stage 0, then stage 1 echoes the forwarded list twice
        mine = [(m.stage_id, m.finished) for m in msgs if m.request_id == r]
        assert mine == [(0, False), (0, False), (1, False), (1, True)]
    report = h.shutdown(wait=10)
    assert not report.hung and report.run_error is None
    assert h.join(15)
    for pid in h.worker_pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert not os.path.exists(h.worker_dir)


def test_request_deadline_expires_running_and_queued(impl: str) -> None:
    """The orchestrator's own per-request deadline: terminal ``timeout``, stage-side abort, once."""
    with start(impl, 1, {0}) as h:
        h.add_request("slow", "p", deadline=0.2)  # the stage never answers
        h.add_request("quick", "p", deadline=5.0)
        h.emit(0, "quick", "done", finished=True)
        assert h.next_output() == OrchOutput("quick", 0, "done", True)
        msg = h.next_output()
        assert isinstance(msg, OrchError) and (msg.request_id, msg.kind) == ("slow", "timeout")
        assert h.wait_until(lambda: h.aborts(0) == ["slow"])
        h.hold_submits(0)
        h.add_request("blocker", "p", wait=False, priority=-1)  # starts first; blocks in its submit
        h.add_request("queued", "p", wait=False, deadline=0.2)  # expires while queued
        msg = h.next_output()
        assert isinstance(msg, OrchError) and (msg.request_id, msg.kind) == ("queued", "timeout")
        h.release_submits(0)
        assert h.wait_until(lambda: [r for r, _ in h.submissions(0)] == ["slow", "quick", "blocker"])
        with pytest.raises(TimeoutError):
            h.next_output(timeout=0.3)  # no second terminal for anyone
        h.shutdown()
        rest, ended = h.drain()
    assert ended and [(m.request_id, m.kind) for m in rest] == [("blocker", "shutdown")]
    assert_one_terminal_last(h.received, {"slow", "quick", "blocker", "queued"})


def test_resumable_session_sampling_and_companions(impl: str) -> None:
    """Streaming input, per-stage sampling and CFG companions run the same way in every shell."""
    fwd = lambda k, p, outs, companions=None: (outs, companions)  # noqa: E731
    with start(impl, 2, {1}, forward_fn=fwd) as h:
        h.add_request("s", "seg0", resumable=True, sampling={1: {"temperature": 0.0}})
        h.update_request("s", "seg1", final=True)
        with pytest.raises(ValueError, match="final input segment"):
            h.update_request("s", "seg2")
        assert h.updates(0) == [("s", "seg1")] and h.stage_record(0, "final_updates") == ["s"]
        h.emit(0, "s", "a", finished=True)
        h.emit(0, "s", "b", finished=True)
        assert h.wait_until(lambda: h.updates(1) == [("s", (["b"], None))])
        assert h.submissions(1) == [("s", (["a"], None))]
        assert h.stage_record(1, "sampling") == [("s", {"temperature": 0.0})] * 2
        h.emit(1, "s", "x", finished=True)
        h.emit(1, "s", "y", finished=True)
        msgs = h.collect(2)
        assert [(m.data, m.finished) for m in msgs] == [("x", False), ("y", True)]
        h.add_request("p", "cat", companions={"p:neg": "blur"})
        assert h.stage_record(0, "companions") == [("p:neg", "p")]
        h.emit(0, "p", "e", finished=True)
        h.emit(0, "p:neg", "n", finished=True)
        assert h.wait_until(lambda: h.submissions(1)[-1] == ("p", (["e"], {"p:neg": ["n"]})))
        h.emit(1, "p", "png", finished=True)
        assert h.next_output() == OrchOutput("p", 1, "png", True)
        if impl.startswith("omni"):  # the source's fallback, reproduced on purpose: a new request
            h.update_request("ghost", "x")
            assert h.wait_until(lambda: h.submissions(0)[-1] == ("ghost", "x"))
        else:
            with pytest.raises(ValueError, match="unknown or ended"):
                h.update_request("ghost", "x")
            assert ("ghost", "x") not in h.submissions(0)
