"""Scenarios about the control plane: 16 of the comparison.

An operator calls ``collective_rpc("stats")`` on every stage while one
stage's replica hangs (a stopped process, a worker stuck in a step).  The
seed awaits the replicas one by one inside its request handler, so the call
holds the handler -- and every ``add_request`` queued behind it -- until the
hung replica's timeout.  The experiment asks: is admission still served
while the call waits, how long until the call returns, and what does each
implementation report for each stage.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from bench.compare.scenarios.base import (
    CUT,
    LogCapture,
    Scenario,
    start,
    stop_and_drain,
    terminal_stats,
)
from bench.drivers.base import EndOfStream

#: the RPC's per-replica deadline; the watchdog (CUT) is above it
RPC_TIMEOUT = 1.0
#: the hung stage
HUNG = 1


def measure_rpc_while_a_replica_hangs(impl: str) -> dict[str, Any]:
    """Stage 1 never answers ``stats``; meanwhile a text-only request is added and served."""
    answer: list[Any] = []
    with LogCapture():
        h = start(impl, 3, {0, 2})
        for k in range(3):
            h.on_rpc(k, "stats", {"stage": k}, hang=k == HUNG)
        t0 = time.perf_counter()

        def call() -> None:
            try:
                answer.append(h.collective_rpc("stats", timeout=RPC_TIMEOUT))
            except Exception as exc:  # reported, never raised through the thread
                answer.append(exc)
            answer.append(time.perf_counter() - t0)

        caller = threading.Thread(target=call, name="rpc-caller", daemon=True)
        caller.start()
        h.wait_until(lambda: bool(h.stage_record(0, "rpc_calls")), CUT)  # the call is under way
        t_add = time.perf_counter()
        try:
            h.add_request("r1", "hi", final_stage_id=0, timeout=CUT)
            admitted_s: float | None = time.perf_counter() - t_add
        except TimeoutError:
            admitted_s = None
        # causal, not timed: was the hung stage's call still hanging when the request got in / out?
        admitted_during_rpc = admitted_s is not None and not h.rpc_hangs_ended
        served_during_rpc = False
        if admitted_s is not None:
            h.emit(0, "r1", "hello", finished=True)
            try:
                while not any(m.request_id == "r1" and m.finished for m in h.received):
                    h.next_output(timeout=CUT)
                served_during_rpc = admitted_during_rpc and not h.rpc_hangs_ended
            except (TimeoutError, EndOfStream):
                pass
        caller.join(CUT + RPC_TIMEOUT)
        m = stop_and_drain(h)
    m.update(terminal_stats(h.received, ["r1"]))
    results = answer[0] if answer and isinstance(answer[0], list) else []
    m["rpc_error"] = repr(answer[0]) if answer and not isinstance(answer[0], list) else None
    m["rpc_s"] = answer[1] if len(answer) > 1 else None
    m["admission_s"] = admitted_s
    m["admitted_during_rpc"] = admitted_during_rpc
    m["served_during_rpc"] = served_during_rpc
    m["answers"] = {r.stage_id: ("timeout" if r.error and "timeout" in r.error else r.error or "ok")
                    for r in results}
    return m


def judge_rpc_while_a_replica_hangs(m: dict[str, Any]) -> tuple[str, str]:
    if m["hung"]:
        return "hang", f"run() had not returned after {m['cut_s']} s"
    if m["rpc_s"] is None:
        return "hang", f"the call did not return within {CUT + RPC_TIMEOUT:.1f} s"
    if m["rpc_error"] is not None or set(m["answers"]) != {0, 1, 2}:
        return "lost", f"the call raised {m['rpc_error']} or missed stages: {m['answers']}"
    if m["answers"][HUNG] != "timeout" or any(m["answers"][k] != "ok" for k in (0, 2)):
        return "misreported", f"answers {m['answers']}: the hung stage must time out, the others answer"
    if m["admission_s"] is None or not m["served_during_rpc"]:
        waited = "never admitted" if m["admission_s"] is None else f"admitted after {m['admission_s']:.3f} s"
        return "blocked", f"the request waited for the hung stage's timeout ({waited})"
    if m["without_terminal"] or m["duplicate_terminals"] or m["after_terminal"]:
        return "lost", "the request served meanwhile did not end with exactly one terminal"
    return "ok", ("the request was admitted and served while the call waited; the hung stage got its own "
                  "timeout, the others answered")


S16 = Scenario(
    16, "rpc-hung-replica", "collective RPC while one replica hangs",
    f"collective_rpc('stats', timeout={RPC_TIMEOUT:g}) on 3 stages whose stage {HUNG} never answers; while "
    "it waits, a text-only request is added and its output emitted. Is admission still served, how long "
    "until the call returns, and what does it report per stage?",
    "hang if shutdown or the call hangs; lost if the call raised or missed a stage; misreported unless "
    "the hung stage got a timeout and the others their value; blocked if the request was not admitted "
    "and served while the hung stage's call was still pending; else ok",
    measure_rpc_while_a_replica_hangs, judge_rpc_while_a_replica_hangs,
    lambda m: (f"call returned after {m['rpc_s']:.2f} s" if m["rpc_s"] is not None else "call hung")
    + (f", request admitted after {m['admission_s'] * 1000:.1f} ms" if m["admission_s"] is not None
       else ", request never admitted")
    + f", answers {m['answers']}",
    needs=frozenset({"rpc"}),
    kind="design",
    because=(
        "whether a control call waits in the request handler or in a task of its own is the shell's "
        "choice"
    ),
)
