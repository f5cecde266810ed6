"""Scenarios about companion requests (classifier-free guidance): 14 and 15 of the comparison.

A companion (the negative prompt's encoding) runs stage 0 next to its
parent, and the parent's forward to stage 1 needs both.  The seed forwards
the parent as soon as it can and, when a companion is late, only logs that
guidance may degrade.  These experiments ask what each implementation
delivers when a companion outlives its parent, and when the parent's
forward races its companion.
"""

from __future__ import annotations

import time
from typing import Any

from bench.compare.scenarios.base import (
    CUT,
    LogCapture,
    Scenario,
    start,
    stop_and_drain,
    terminal_stats,
    until_terminal,
)
from bench.drivers.base import Driver
from trio_orch.types import StageOutput

#: how long we watch for something that must not happen (a forward, a message) before calling it absent
QUIET = 0.2


def cfg_forward(k: int, prompt: Any, outputs: list[Any], companions: dict[str, Any] | None = None) -> Any:
    """The next stage's input: the parent's outputs and its companions' (None when none came)."""
    return {"cond": list(outputs), "uncond": companions}


def _finished_stage0(h: Driver, rid: str) -> bool:
    req = h.router.requests.get(rid)
    return req is not None and 0 in req.finished


# ---------------------------------------------------------------- 14
def measure_companion_after_abort(impl: str) -> dict[str, Any]:
    """The parent is aborted while its companion still runs stage 0; then the companion finishes."""
    with LogCapture():
        h = start(impl, 2, {1}, forward_fn=cfg_forward)
        h.add_request("r1", "a cat", companions={"r1:neg": "blurry"})
        h.emit(0, "r1", "enc", finished=True)  # the parent is encoded, its companion is not
        h.wait_until(lambda: _finished_stage0(h, "r1"), CUT)
        h.abort("r1")
        until_terminal(h, "r1")
        companion_aborted = h.wait_until(lambda: "r1:neg" in h.aborts(0), CUT)
        dropped = h.dropped_outputs
        h.emit(0, "r1:neg", "late", finished=True)  # it finishes anyway (the abort raced it)
        counted = h.wait_until(lambda: h.dropped_outputs > dropped, CUT)
        time.sleep(QUIET)
        before = list(h.received)
        forwards = len(h.submissions(1))
        m = stop_and_drain(h)
    m.update(terminal_stats(h.received, ["r1"]))
    m["terminal_kind"] = next((getattr(x, "kind", "finished") for x in before
                               if x.request_id == "r1" and x.finished), None)
    m["companion_aborted"] = companion_aborted
    m["late_output_counted"] = counted
    m["forwards"] = forwards
    m["companion_messages"] = sum(1 for x in h.received if x.request_id == "r1:neg")
    return m


def judge_companion_after_abort(m: dict[str, Any]) -> tuple[str, str]:
    if m["hung"]:
        return "hang", f"run() had not returned after {m['cut_s']} s"
    if m["forwards"]:
        return "forwarded", "the late companion started the aborted parent's forward to stage 1"
    if m["companion_messages"]:
        return "visible", f"the user got {m['companion_messages']} messages for the companion"
    if m["without_terminal"] or m["duplicate_terminals"] or m["after_terminal"] \
            or m["terminal_kind"] != "aborted":
        return "lost", (f"parent terminal {m['terminal_kind']!r}, {m['duplicate_terminals']} duplicated, "
                        f"{m['after_terminal']} after it")
    if not m["companion_aborted"]:
        return "kept", "the companion was not aborted on stage 0: it kept running for nobody"
    if not m["late_output_counted"]:
        return "uncounted", "the companion's late output vanished without being counted as dropped"
    return "ok", ("one 'aborted' terminal; the companion aborted on stage 0; its late output dropped "
                  "and counted")


S14 = Scenario(
    14, "companion-after-abort", "a companion finishes after its parent was aborted",
    "r1 has a companion (its negative prompt); r1 finishes stage 0 and is aborted while the companion "
    "still runs there; then the companion finishes anyway. Does anything reach the user or stage 1?",
    "hang if shutdown hangs; forwarded if stage 1 got r1; visible if the user saw the companion; lost if "
    "r1 did not end with exactly one 'aborted' terminal and nothing after it; kept if the companion was "
    "not aborted on stage 0; uncounted if its late output was not counted as dropped; else ok",
    measure_companion_after_abort, judge_companion_after_abort,
    lambda m: (f"terminal: {m['terminal_kind']}, companion aborted: {m['companion_aborted']}, "
               f"late output dropped: {m['late_output_counted']}, forwards: {m['forwards']}"),
    needs=frozenset({"companions"}),
    kind="design",
    because="dropping a companion's late output is the shared routing core's rule",
)


# ---------------------------------------------------------------- 14
#: how the parent's finish and its companion's arrive at stage 0's reader
ORDERS = {
    "parent-first": [["p"], ["c"]],  # two batches: the companion is late
    "companion-first": [["c"], ["p"]],
    "one-batch": [["p", "c"]],  # both in one batched step, parent first
    "one-batch-reversed": [["c", "p"]],
}


def measure_forward_race(impl: str) -> dict[str, Any]:
    """For each order: how many forwards, whether one went before the companion finished, and with what."""
    early: dict[str, int] = {}
    with LogCapture():
        h = start(impl, 2, {1}, forward_fn=cfg_forward)
        for order, batches in ORDERS.items():
            parent, comp = order, f"{order}:neg"
            h.add_request(parent, "a cat", companions={comp: "blurry"})
            early[order] = 0
            for i, batch in enumerate(batches):
                outs = [StageOutput(parent if who == "p" else comp, f"{who}-enc", True) for who in batch]
                h.emit_batch(0, outs)
                if i + 1 < len(batches):  # the companion (or the parent) is still missing: any forward now?
                    time.sleep(QUIET)
                    early[order] = sum(1 for r, _ in h.submissions(1) if r == parent)
            h.wait_until(lambda r=parent: any(s == r for s, _ in h.submissions(1)), CUT)
            time.sleep(QUIET)  # a second forward, if any, comes now
        subs = list(h.submissions(1))
        for order in ORDERS:
            h.emit(1, order, "png", finished=True)
        h.collect(len(ORDERS), timeout=CUT)
        m = stop_and_drain(h)
    m.update(terminal_stats(h.received, list(ORDERS)))
    per = {}
    for order in ORDERS:
        payloads = [p for r, p in subs if r == order]
        want = {f"{order}:neg": ["c-enc"]}
        with_comp = [p for p in payloads if isinstance(p, dict) and p.get("uncond") == want]
        per[order] = {"forwards": len(payloads), "early": early[order], "with_companion": len(with_comp)}
    m["orders"] = per
    m["forwards_without_companion"] = sum(o["forwards"] - o["with_companion"] for o in per.values())
    m["early_forwards"] = sum(o["early"] for o in per.values())
    m["extra_forwards"] = sum(max(0, o["forwards"] - 1) for o in per.values())
    m["missing_forwards"] = sum(1 for o in per.values() if o["forwards"] == 0)
    return m


def judge_forward_race(m: dict[str, Any]) -> tuple[str, str]:
    if m["hung"]:
        return "hang", f"run() had not returned after {m['cut_s']} s"
    if m["early_forwards"] or m["forwards_without_companion"]:
        return "degraded", (f"{m['early_forwards']} forwards before the companion finished, "
                            f"{m['forwards_without_companion']} without its encoding: guidance silently lost")
    if m["extra_forwards"]:
        return "dup", f"{m['extra_forwards']} extra forwards to stage 1"
    if m["missing_forwards"] or m["without_terminal"]:
        return "stalled", f"{m['missing_forwards']} parents never forwarded"
    return "ok", "in every order, exactly one forward, after both finished, with the companion's encoding"


S15 = Scenario(
    15, "forward-races-companion", "the parent's forward races its companion",
    "A parent and its companion finish stage 0 in four orders: parent first (companion late), companion "
    "first, both in one batched step (either way round). Does the forward to stage 1 wait for the "
    "companion and carry its encoding, once? (The seed forwards at once and logs that guidance may "
    "degrade.)",
    "hang if shutdown hangs; degraded if a forward went before the companion finished or without its "
    "encoding; dup if a parent was forwarded twice; stalled if one never was; else ok",
    measure_forward_race, judge_forward_race,
    lambda m: (f"forwards early: {m['early_forwards']}, without companion: "
               f"{m['forwards_without_companion']}, extra: {m['extra_forwards']}, "
               f"missing: {m['missing_forwards']}"),
    needs=frozenset({"companions"}),
    kind="design",
    because="forwarding a parent only once its companions finished is the shared routing core's rule",
)
