"""Scenarios about faults while running: 3, 6 and 12 of the comparison."""

from __future__ import annotations

import time
from typing import Any

from bench.compare.scenarios.base import (
    CUT,
    LogCapture,
    Scenario,
    shut_fmt,
    start,
    stop_and_drain,
    surfaced,
    terminal_stats,
    until_terminal,
)
from trio_orch.types import OrchOutput


def _kinds(msgs: list[Any], rid: str) -> list[str]:
    return [getattr(m, "kind", "output") for m in msgs if m.request_id == rid]


#: how long we wait for a terminal that should come at once before calling it missing
SILENCE = 1.0


# ---------------------------------------------------------------- 3
def measure_reader_raises(impl: str) -> dict[str, Any]:
    """Stage 1's connection is closed under its blocked reader.

    Each framework's own way: a Trio channel/socket closed under a blocked
    receive raises ``ClosedResourceError``; pyzmq's asyncio socket closed under
    a pending ``recv`` cancels the future, so the reader gets ``CancelledError``
    although nobody cancelled its task.
    """
    with LogCapture() as logs:
        h = start(impl, 2, {0, 1})
        h.add_request("on1", "p")  # will be waiting on stage 1
        h.emit(0, "on1", "t", finished=True)
        h.collect(1, timeout=CUT)
        h.wait_until(lambda: h.submissions(1), CUT)
        h.add_request("on0", "p", final_stage_id=0)  # only needs stage 0 (the sibling)
        time.sleep(0.05)
        h.close_under_reader(1)
        until_terminal(h, "on1", SILENCE)  # the broken stage's request should end now
        running = not h.stopped
        try:
            h.emit(0, "on0", "ok", finished=True)
        except RuntimeError:  # the loop is already closed
            pass
        until_terminal(h, "on0", SILENCE)
        before = list(h.received)
        # shutdown terminals before we asked for shutdown: it stopped by itself
        running = running and not h.stopped and not any(
            getattr(x, "kind", None) == "shutdown" for x in before)
        m = stop_and_drain(h)
    m.update(terminal_stats(h.received, ["on1", "on0"]))
    m["orchestrator_running_after"] = running
    m["sibling_served"] = any(isinstance(x, OrchOutput) and x.request_id == "on0" and x.finished
                              for x in before)
    m["bound_request_terminal_before_shutdown"] = any(
        x.request_id == "on1" and x.finished for x in before[1:])
    m["error_surfaced"] = surfaced(["stage 1"], logs.records, h.run_error,
                                   [x for x in before if x.request_id == "on1"]) > 0
    return m


def judge_reader(m: dict[str, Any]) -> tuple[str, str]:
    if m["hung"]:
        return "hang", f"run() had not returned after {m['cut_s']} s"
    if not m["orchestrator_running_after"]:
        return "stopped", "the orchestrator stopped by itself: one reader took everything down"
    if not m["bound_request_terminal_before_shutdown"]:
        return "silent", "the request on the broken stage got no terminal until shutdown; error lost"
    if not m["sibling_served"]:
        return "stalled", "the sibling stage's request was not served"
    return "ok", "the broken stage's request got its error terminal, the sibling kept serving"


S3 = Scenario(
    3, "reader-raises", "one reader raises",
    "Stage 1's connection is closed under its blocked reader (Trio: ClosedResourceError; asyncio/pyzmq: "
    "CancelledError from the cancelled recv future). What happens to the sibling reader, the "
    "orchestrator, and the error?",
    "hang if shutdown hangs; stopped if the orchestrator stopped by itself; silent if the request on "
    "stage 1 got no terminal before shutdown; stalled if the stage-0 request was not served; else ok",
    measure_reader_raises, judge_reader,
    lambda m: (f"running: {m['orchestrator_running_after']}, sibling served: {m['sibling_served']}, "
               f"stage-1 request ended: {m['bound_request_terminal_before_shutdown']}"),
    kind="model",
    because=(
        "Trio's Cancelled cannot come from a library (a resource closed under a receive raises "
        "ClosedResourceError); a closed pyzmq asyncio socket raises CancelledError, which only "
        "Task.cancelling() tells from a real cancellation"
    ),
)


# ---------------------------------------------------------------- 6
def measure_register_submit(impl: str) -> dict[str, Any]:
    rids = ["r1", "r2", "r3"]
    with LogCapture():
        h = start(impl, 2, {1})
        h.hold_submits(0)  # stage 0 does not take the submit: the request handler blocks in it
        for r in rids:
            h.add_request(r, "p", wait=False)
        registered = h.wait_until(lambda: "r1" in h.router.requests, CUT)
        m = stop_and_drain(h)  # cancels the handler between "registered" and "submitted"
        router_left = len(h.router.requests)
        h.release_submits(0) if not h.stopped else None
    subs = {r for r, _ in h.submissions(0)}
    aborted = set(h.aborts(0))
    m.update(terminal_stats(h.received, rids))
    m["registered_before_cancel"] = registered
    m["router_state_left"] = router_left
    m["stage_state_left"] = len(subs - aborted)
    return m


def judge_leak(m: dict[str, Any]) -> tuple[str, str]:
    if m["hung"]:
        return "hang", f"run() had not returned after {m['cut_s']} s"
    if m["router_state_left"] or m["stage_state_left"]:
        return "leak", (f"{m['router_state_left']} requests left in the router, "
                        f"{m['stage_state_left']} on the stage")
    if m["without_terminal"] or m["duplicate_terminals"]:
        return "lost", f"{m['without_terminal']} without terminal, {m['duplicate_terminals']} duplicated"
    return "ok", "no state left, every request (queued ones too) had one terminal"


S6 = Scenario(
    6, "register-then-submit", "cancelled between register and submit",
    "Stage 0 blocks in submit(); r1 is registered and being submitted, r2 and r3 wait in the request "
    "queue; shutdown cancels the handler mid-submit. Is any state leaked, does every request end?",
    "hang if shutdown hangs; leak if request state is left in the router or on the stage; lost if a "
    "request lacks its terminal; else ok",
    measure_register_submit, judge_leak,
    lambda m: f"{shut_fmt(m)}, no terminal: {m['without_terminal']}, state left: "
              f"{m['router_state_left'] + m['stage_state_left']}",
    kind="design",
    because=(
        "the core registers and decides between checkpoints, so a cancellation between register and "
        "submit leaves nothing behind in either model"
    ),
)


# ---------------------------------------------------------------- 12
def measure_stage_death(impl: str) -> dict[str, Any]:
    groups = {0: ["a0", "b0"], 1: ["a1", "b1"], 2: ["a2", "b2"]}
    rids = [r for g in groups.values() for r in g]
    with LogCapture():
        h = start(impl, 3, {2})
        for r in rids:
            h.add_request(r, "p")
        for k in (1, 2):  # move each group to its stage
            for stage in range(k):
                for r in groups[k]:
                    h.emit(stage, r, None, finished=True)
                h.wait_until(lambda s=stage, g=groups[k]: sum(r in g for r, _ in h.submissions(s + 1)) == 2,
                             CUT)
        for r in groups[2]:
            h.emit(2, r, "chunk")  # mid-stream on stage 2
        h.collect(2, timeout=CUT)
        h.fail_stage(1, RuntimeError("stage 1 process exited"))
        time.sleep(0.1)
        for r in groups[0]:
            h.emit(0, r, None, finished=True)  # forward to the dead stage
        for r in groups[2]:
            h.emit(2, r, "end", finished=True)
        try:
            h.collect(6, timeout=CUT)
        except TimeoutError:
            pass
        before = list(h.received)
        m = stop_and_drain(h)
    m.update(terminal_stats(h.received, rids))
    m["without_terminal_before_shutdown"] = terminal_stats(before, rids)["without_terminal"]
    m["kinds"] = {r: [k for k in _kinds(before, r) if k != "output"] for r in rids}
    return m


def judge_death(m: dict[str, Any]) -> tuple[str, str]:
    if m["hung"]:
        return "hang", f"run() had not returned after {m['cut_s']} s"
    if m["without_terminal_before_shutdown"]:
        return "lost", f"{m['without_terminal_before_shutdown']} requests had no terminal until shutdown"
    if m["duplicate_terminals"] or m["after_terminal"]:
        return "dup", f"{m['duplicate_terminals']} duplicate terminals, {m['after_terminal']} after one"
    return "ok", "every request ended once: replica_died / stage_unavailable / finished"


S12 = Scenario(
    12, "stage-dies", "stage dies mid-stream",
    "Six requests, two on each of three stages, streaming; stage 1 dies; then stage 0 finishes its two "
    "(forward to the dead stage) and stage 2 finishes its two. Which requests are left without terminal?",
    "hang if shutdown hangs; lost if any request had no terminal before shutdown; dup if one had two or a "
    "message after its terminal; else ok",
    measure_stage_death, judge_death,
    lambda m: f"no terminal before shutdown: {m['without_terminal_before_shutdown']}",
    kind="design",
    because="a dead stage's requests get their terminals from the shared routing core's rule",
)
