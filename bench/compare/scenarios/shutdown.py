"""Scenarios about stopping: 1, 2, 4, 5 and 8 of the comparison."""

from __future__ import annotations

import time
from typing import Any

from bench.compare.scenarios.base import (
    CUT,
    GRACE,
    LogCapture,
    Scenario,
    shut_fmt,
    start,
    stop_and_drain,
    surfaced,
    terminal_stats,
)
from trio_orch.testing import Misbehaviour


def _in_flight(h: Any, rids: list[str], stage: int = 0) -> list[Any]:
    """Add ``rids`` and stream one partial each from ``stage``; return what was delivered."""
    for r in rids:
        h.add_request(r, "p")
    time.sleep(0.05)  # every reader (or poll) is now waiting in receive()
    try:
        for r in rids:
            h.emit(stage, r, f"{r}-partial")
    except RuntimeError:  # the orchestrator already stopped (its loop is gone): measured by the caller
        return []
    got: list[Any] = []
    try:
        got = h.collect(len(rids), timeout=CUT)
    except TimeoutError:
        pass
    return got


# ---------------------------------------------------------------- 1
def measure_swallow(impl: str) -> dict[str, Any]:
    rids = [f"r{i}" for i in range(3)]
    with LogCapture():
        h = start(impl, 2, {0, 1}, misbehaviour={0: Misbehaviour(swallow_cancel_once=True)})
        delivered = _in_flight(h, rids)
        swallowed_before = h.stages[0].swallowed_cancels
        m = stop_and_drain(h)
    m.update(terminal_stats(h.received, rids))
    m["sent"], m["delivered_before_shutdown"] = len(rids), len(delivered)
    m["cancellations_swallowed"] = h.stages[0].swallowed_cancels
    m["swallowed_before_shutdown"] = swallowed_before
    return m


def judge_no_hang_no_leak(m: dict[str, Any]) -> tuple[str, str]:
    if m["hung"]:
        return "hang", f"run() had not returned after {m['cut_s']} s"
    if m["without_terminal"] or m["duplicate_terminals"]:
        return "lost", f"{m['without_terminal']} without terminal, {m['duplicate_terminals']} duplicated"
    if m.get("tasks_alive_after_run"):
        return "leak", f"{m['tasks_alive_after_run']} tasks alive after run() returned"
    return "ok", "returned, every request had one terminal, no task left"


def judge_swallow(m: dict[str, Any]) -> tuple[str, str]:
    v = judge_no_hang_no_leak(m)
    if v[0] == "ok" and m["shutdown_s"] > GRACE / 2:
        return "slow", f"run() returned after {m['shutdown_s']:.2f} s: it had to cancel a second time"
    return v


S1 = Scenario(
    1, "swallowed-cancel", "stage receive() swallows one cancellation",
    "A stage client's receive() catches the cancellation once and waits again. Does shutdown finish?",
    "hang if run() has not returned within the watchdog; lost if a request lacks its terminal or got two; "
    f"leak if tasks outlive run(); slow if run() took more than {GRACE / 2} s; else ok",
    measure_swallow, judge_swallow,
    lambda m: f"{shut_fmt(m)}, swallowed {m['cancellations_swallowed']}"
              + (" (by a poll, before shutdown)" if m["swallowed_before_shutdown"] else ""),
    kind="model",
    because=(
        "Trio's cancellation is level-triggered (every checkpoint in a cancelled scope raises again);"
        " asyncio's Task.cancel() throws CancelledError once, so a cancellation swallowed is gone"
    ),
)


# ---------------------------------------------------------------- 2
def measure_hung_cleanup(impl: str) -> dict[str, Any]:
    rids = ["r1", "r2", "r3"]
    with LogCapture():
        h = start(impl, 2, {1}, async_chunk=True, misbehaviour={1: Misbehaviour(hang_abort=True)})
        for r in rids:
            h.add_request(r, "p")
        h.abort("r1")  # the abort of r1 on stage 1 never returns: cleanup is stuck in it
        first: list[Any] = []
        try:
            first = h.collect(1, timeout=CUT)
        except TimeoutError:
            pass
        h.emit(1, "r2", "r2-partial")  # does routing go on while cleanup is stuck?
        time.sleep(0.2)
        during: list[Any] = []
        try:
            during = h.collect(1, timeout=0.3)
        except TimeoutError:
            pass
        m = stop_and_drain(h)
    m.update(terminal_stats(h.received, rids))
    m["abort_terminal_delivered"] = any(getattr(x, "kind", "") == "aborted" for x in first)
    m["routed_while_cleanup_stuck"] = len(during)
    m["grace_s"] = GRACE
    return m


def judge_hung_cleanup(m: dict[str, Any]) -> tuple[str, str]:
    v = judge_no_hang_no_leak(m)
    if v[0] != "ok":
        return v
    if m["shutdown_s"] > m["grace_s"] + 0.5:
        return "slow", f"shutdown took {m['shutdown_s']:.2f} s, more than grace {m['grace_s']} s + 0.5 s"
    return "ok", f"cleanup cut at the grace period; {v[1]}"


S2 = Scenario(
    2, "hung-cleanup", "shutdown while cleanup awaits a hung stage",
    "An abort to stage 1 never returns (hung stage) while requests are active; then shutdown.",
    "hang if run() has not returned within the watchdog; lost/leak as in 1; slow if it took more than "
    "grace + 0.5 s; else ok",
    measure_hung_cleanup, judge_hung_cleanup,
    lambda m: f"{shut_fmt(m)}, routed while stuck: {m['routed_while_cleanup_stuck']}",
    needs=frozenset({"async_chunk"}),
    kind="design",
    because=(
        "either model can bound a cleanup with a deadline (a shielded move_on_after, "
        "asyncio.timeout); the vLLM-Omni shape awaits its stage aborts without one"
    ),
)


# ---------------------------------------------------------------- 4
MARKERS4 = ["E-recv-0", "E-recv-1", "E-close-0", "E-close-1"]


def measure_errors_at_shutdown(impl: str) -> dict[str, Any]:
    rids = ["r1", "r2"]
    mb = {k: Misbehaviour(cancel_error=RuntimeError(f"E-recv-{k}"),
                          aclose_error=ValueError(f"E-close-{k}")) for k in (0, 1)}
    with LogCapture() as logs:
        h = start(impl, 2, {0, 1}, misbehaviour=mb)
        _in_flight(h, rids)
        died_early = sum(getattr(x, "kind", "") == "replica_died" for x in h.received)
        m = stop_and_drain(h)
        h.join(CUT)
    m.update(terminal_stats(h.received, rids))
    m["stage_deaths_before_shutdown"] = died_early
    m["errors_injected"] = len(MARKERS4)
    m["errors_surfaced"] = surfaced(MARKERS4, logs.records, h.run_error, h.received)
    m["surfaced_which"] = [x for x in MARKERS4 if surfaced([x], logs.records, h.run_error, h.received)]
    return m


def judge_errors(m: dict[str, Any]) -> tuple[str, str]:
    if m["hung"]:
        return "hang", f"run() had not returned after {m['cut_s']} s"
    n, k = m["errors_injected"], m["errors_surfaced"]
    if m["stage_deaths_before_shutdown"]:
        return "early", ("the faults fired before shutdown (every poll cancels receive()): "
                         f"{m['stage_deaths_before_shutdown']} requests got replica_died; "
                         f"{k} of {n} reported")
    if k == n:
        return "ok", f"all {n} errors reported"
    if k == 0:
        return "lost", f"none of the {n} errors reported"
    return "partial", f"{k} of {n} errors reported, {n - k} swallowed"


S4 = Scenario(
    4, "errors-at-shutdown", "several errors during shutdown",
    "Both stages' receive() raise instead of being cancelled, and both aclose() raise. How many of the "
    "4 errors reach the caller (raised from run(), WARNING+ log, or a terminal's text)?",
    "hang if run() has not returned; early if the stages already died before shutdown; ok if all 4 "
    "reported; partial if some; lost if none",
    measure_errors_at_shutdown, judge_errors,
    lambda m: f"{m['errors_surfaced']}/{m['errors_injected']} reported" + (
        f" (stages died before shutdown: {m['stage_deaths_before_shutdown']} requests)"
        if m["stage_deaths_before_shutdown"] else ""),
    kind="design",
    because=(
        "reporting the stage errors nobody routed is a choice of the shutdown path: once every task "
        "has ended, drain the event queue and log what is left"
    ),
)


# ---------------------------------------------------------------- 5
def measure_blocked_readers(impl: str) -> dict[str, Any]:
    rids = [f"r{i}" for i in range(4)]
    with LogCapture():
        h = start(impl, 3, {2}, async_chunk=True)
        for r in rids:
            h.add_request(r, "p")
        time.sleep(0.05)  # every reader is now blocked in receive()
        m = stop_and_drain(h)
    m.update(terminal_stats(h.received, rids))
    return m


S5 = Scenario(
    5, "blocked-readers", "shutdown while every reader is blocked in receive()",
    "Three stages, four active requests, no output anywhere; shutdown.",
    "hang if run() has not returned within the watchdog; lost if a request lacks its terminal; leak if "
    "tasks outlive run(); else ok",
    measure_blocked_readers, judge_no_hang_no_leak,
    lambda m: f"{shut_fmt(m)}, no terminal: {m['without_terminal']}",
    needs=frozenset({"async_chunk"}),
    kind="design",
    because=(
        "the terminals at shutdown come from the shared routing core; any shell that calls it gives "
        "them"
    ),
)


# ---------------------------------------------------------------- 8
def measure_tasks_alive(impl: str) -> dict[str, Any]:
    rids = [f"r{i}" for i in range(5)]
    mb = {k: Misbehaviour(helper_per_submit=True) for k in (0, 1)}
    with LogCapture() as logs:
        h = start(impl, 2, {1}, misbehaviour=mb)
        for r in rids:
            h.add_request(r, "p")
        for r in rids[:3]:
            h.emit(0, r, None, finished=True)
        h.wait_until(lambda: len(h.submissions(1)) == 3, CUT)
        h.emit(1, "r0", "done", finished=True)
        h.collect(1, timeout=CUT)
        helpers_started = len(h.submissions(0)) + len(h.submissions(1))
        m = stop_and_drain(h)
        helpers_after_run = sum(".heartbeat[" in n for n in h.alive_after_run_names)
        thread_ended = h.join(CUT)
    m.update(terminal_stats(h.received, rids))
    m["helpers_started"] = helpers_started
    m["helpers_alive_after_run"] = helpers_after_run
    m["tasks_pending_at_loop_end"] = h.tasks_pending_at_loop_end
    m["destroyed_pending_logged"] = sum("destroyed but it is pending" in r for r in logs.records)
    m["thread_ended"] = thread_ended
    return m


def judge_tasks(m: dict[str, Any]) -> tuple[str, str]:
    if m["hung"]:
        return "hang", f"run() had not returned after {m['cut_s']} s"
    if not m["thread_ended"]:
        return "hang", "the loop thread did not end"
    leaked = (m["tasks_pending_at_loop_end"] or 0) + m["destroyed_pending_logged"]
    if leaked:
        return "leak", f"{leaked} tasks still pending when the loop ended"
    orch = (m["tasks_alive_after_run"] or 0) - m["helpers_alive_after_run"]
    if orch > 0:
        return "leak", f"{orch} orchestrator tasks alive after run() returned"
    return "ok", (f"nothing pending at the end; {m['helpers_alive_after_run']} stage helpers were left to "
                  f"their owner when run() returned")


S8 = Scenario(
    8, "tasks-alive", "tasks alive after shutdown",
    "Stage clients start a background helper per submit; 5 requests, one completes; shutdown. What is "
    "still alive when run() returns, and when the loop ends?",
    "hang if run() or the thread does not end; leak if tasks are pending at the loop's end or orchestrator "
    "tasks outlive run(); else ok (helpers alive after run() are reported, owned by the application)",
    measure_tasks_alive, judge_tasks,
    lambda m: (f"after run: {m['tasks_alive_after_run']} ({m['helpers_alive_after_run']} helpers), "
               f"at loop end: {m['tasks_pending_at_loop_end']}"),
    kind="model",
    because=(
        "a Trio task lives in a nursery, so none outlives the block that owns it; an asyncio task "
        "outlives its creator unless a TaskGroup, a sweep or the loop's end cancels it"
    ),
)
