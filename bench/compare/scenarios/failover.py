"""Scenarios about failover: a resend that waits for a replacement replica, raced against the rest.

A stage's only replica dies holding requests that had produced nothing: the
core keeps each one's inputs and resends them once the stage reports a live
replica again (the supervisor's replacement is ready).  Here that readiness
arrives in the same hand-over as an abort of one waiting request, and later
in the same hand-over as a shutdown with another one still waiting.  Every
implementation performs the same core's decisions; the row shows whether its
shell delivers them -- one terminal each, a resend only while wanted, and a
resend that lost its race followed by an abort on the stage (no replica left
holding a request nobody waits for).
"""

from __future__ import annotations

from typing import Any

from bench.compare.scenarios.base import (
    CUT,
    LogCapture,
    Scenario,
    shut_fmt,
    start,
    stop_and_drain,
    terminal_stats,
    until_terminal,
)
from bench.drivers.base import Driver, Unsupported
from trio_orch.types import StageOutput

#: the three requests: resent once ready; aborted as the replica comes back; still waiting at shutdown
READY, ABORTED, AT_SHUTDOWN = "ready", "aborted", "at-shutdown"


def _died(h: Driver, rid: str) -> None:
    """What a replica pool reports for a request its dead replica held."""
    h.emit_batch(0, [StageOutput(rid, None, True, error="stage0: replica 0 died (killed)",
                                 error_kind="replica_died")])


def _kind(msgs: list[Any], rid: str) -> str:
    ends = [m for m in msgs if m.request_id == rid and m.finished]
    if not ends:
        return "none"
    return getattr(ends[-1], "kind", "finished")


def measure_failover_races(impl: str) -> dict[str, Any]:
    """Kill the only replica twice; race its replacement's readiness against an abort and a shutdown."""
    with LogCapture():
        h = start(impl, 1, {0})
        replicas_changed = getattr(getattr(h, "orch", None), "replicas_changed", None)
        if replicas_changed is None:
            h.shutdown(wait=CUT)
            raise Unsupported(f"{impl} is told nothing of a stage's replicas")

        def waiting(n: int) -> bool:
            return h.wait_until(lambda: h.call(lambda: h.router.statistics().waiting_by_stage) == (n,), CUT)

        for rid in (READY, ABORTED):
            h.add_request(rid, rid)
        h.call(replicas_changed, 0, 0, 1)  # the only replica died (the pool says so first) ...
        _died(h, READY)
        _died(h, ABORTED)  # ... then each request it held
        waited = waiting(2)
        h.abort(ABORTED)  # the client gives up just as the replacement becomes ready
        h.call_soon(replicas_changed, 0, 1, 1)
        h.wait_until(lambda: len([r for r, _ in h.submissions(0) if r == READY]) >= 2, CUT)
        h.emit(0, READY, "done", finished=True)
        until_terminal(h, READY)
        until_terminal(h, ABORTED)
        h.add_request(AT_SHUTDOWN, AT_SHUTDOWN)
        h.call(replicas_changed, 0, 0, 1)  # it dies again; the replacement is ready as shutdown begins
        _died(h, AT_SHUTDOWN)
        waited = waiting(1) and waited
        h.call_soon(replicas_changed, 0, 1, 1)
        m = stop_and_drain(h)
    msgs = list(h.received)
    subs = [r for r, _ in h.submissions(0)]
    aborts = set(h.aborts(0))
    m.update(terminal_stats(msgs, [READY, ABORTED, AT_SHUTDOWN]))
    m["waited_for_replica"] = waited
    m["ready_resent"] = subs.count(READY) - 1
    m["ready_end"] = _kind(msgs, READY)
    for key, rid in (("aborted", ABORTED), ("shutdown", AT_SHUTDOWN)):
        m[f"{key}_end"] = _kind(msgs, rid)
        m[f"{key}_resent"] = subs.count(rid) - 1
        m[f"{key}_left_on_stage"] = bool(subs.count(rid) > 1 and rid not in aborts)
    return m


def judge_failover_races(m: dict[str, Any]) -> tuple[str, str]:
    if m["hung"]:
        return "hang", f"run() had not returned after {m['cut_s']} s"
    if m["without_terminal"]:
        return "lost", f"{m['without_terminal']} request(s) got no terminal"
    if m["duplicate_terminals"] or m["after_terminal"]:
        return "duplicate", (f"{m['duplicate_terminals']} extra terminal(s), "
                             f"{m['after_terminal']} message(s) after a terminal")
    if m["ready_resent"] != 1 or m["ready_end"] != "finished":
        return "not resent", (f"the request that waited for the replacement was resent {m['ready_resent']} "
                              f"time(s) and ended {m['ready_end']}")
    if m["aborted_end"] != "aborted" or m["shutdown_end"] != "shutdown":
        return "wrong terminal", f"abort race ended {m['aborted_end']}, shutdown race {m['shutdown_end']}"
    if m["aborted_left_on_stage"] or m["shutdown_left_on_stage"]:
        return "zombie", "a resend that lost its race was never aborted on the stage"
    waited = m["waited_for_replica"]
    how = ("the deaths were routed while the stage had no replica, and the resends waited" if waited
           else "the deaths were read only once the stage was live again (nothing read from a stage with no "
                "live replica), so nothing waited: resent at once")
    return "ok", (f"{how}; the waiting request finished; the abort (resent {m['aborted_resent']}x) and the "
                  f"shutdown (resent {m['shutdown_resent']}x) each ended theirs once, a late resend aborted "
                  "on the stage")


S23 = Scenario(
    23,
    "failover-races",
    "a failover waits for the replacement replica; readiness races an abort and a shutdown",
    "A stage's only replica dies holding requests that produced nothing; they wait for its replacement. "
    "The replacement becomes ready in the same hand-over as an abort of one of them, and later as "
    "shutdown begins with another one waiting. Is the waiting request resent once and finished, does each "
    "racing request get exactly one terminal, and is a resend that lost its race aborted on the stage?",
    "hang if shutdown hangs; lost / duplicate for missing or extra terminals; not resent if the waiting "
    "request was not resent exactly once and finished; wrong terminal if the abort or shutdown did not "
    "end its request; zombie if a resend was left on the stage unaborted; else ok",
    measure_failover_races,
    judge_failover_races,
    lambda m: (f"{'waited, ' if m['waited_for_replica'] else 'no wait, '}"
               f"resent {m['ready_resent']}x -> {m['ready_end']}; abort race: {m['aborted_end']} "
               f"(resent {m['aborted_resent']}x); shutdown race: {m['shutdown_end']} "
               f"(resent {m['shutdown_resent']}x); shutdown {shut_fmt(m)}"),
    kind="design",
    because="every shell performs the same core's failover decisions; a difference here would be how a "
            "shell orders its hand-overs and stage aborts, a choice either concurrency model can make",
)
