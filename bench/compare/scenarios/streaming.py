"""Scenarios about streaming input (resumable requests): 13 of the comparison."""

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
)
from bench.drivers.base import Driver
from trio_orch.types import Message

# ---------------------------------------------------------------- 13
LISTEN13 = 0.3  # how long we listen for messages nobody asked for (a zombie's answer comes at once)


def _until_terminal(h: Driver, rid: str, msgs: list[Message]) -> bool:
    """Collect messages until ``rid``'s terminal (True) or the watchdog (False)."""
    end = time.perf_counter() + CUT
    while (left := end - time.perf_counter()) > 0:
        try:
            m = h.next_output(timeout=left)
        except Exception:
            return False
        msgs.append(m)
        if m.request_id == rid and m.finished:
            return True
    return False


def _listen(h: Driver, msgs: list[Message], seconds: float) -> None:
    end = time.perf_counter() + seconds
    while (left := end - time.perf_counter()) > 0:
        try:
            msgs.append(h.next_output(timeout=left))
        except Exception:
            return


def _late_update(h: Driver, rid: str) -> str | None:
    """Send an update nobody should take; the error it raised (None: none)."""
    try:
        h.update_request(rid, f"late input for {rid}", timeout=CUT)
    except ValueError as exc:
        return str(exc)
    return None


def measure_late_update(impl: str) -> dict[str, Any]:
    """A session is aborted; its client's next input arrives after the abort; so does one for an id
    never added.  Does the caller learn it, and does anything start?"""
    with LogCapture() as logs:
        h = start(impl, 1, {0})
        msgs: list[Message] = []
        h.add_request("s1", "hello", resumable=True)
        h.update_request("s1", "and more")  # a live update: taken everywhere
        h.abort("s1")  # the client hangs up ...
        aborted = _until_terminal(h, "s1", msgs)
        after_abort = _late_update(h, "s1")  # ... while its next input is in flight
        unknown = _late_update(h, "ghost")
        subs = [rid for rid, _ in h.submissions(0)]
        for rid in ("s1", "ghost"):  # the stage answers whatever it was given
            h.emit(0, rid, f"answer for {rid}", finished=True)
        _listen(h, msgs, LISTEN13)
        m = stop_and_drain(h)
    m.update(terminal_stats(msgs, ["s1"]))
    m["aborted_terminal_seen"] = aborted
    m["update_after_abort_error"] = after_abort
    m["unknown_update_error"] = unknown
    m["requests_started_by_updates"] = subs.count("s1") - 1 + subs.count("ghost")
    m["messages_for_unknown_id"] = sum(1 for x in msgs if x.request_id == "ghost")
    m["updates_delivered"] = len(h.updates(0))
    m["fallback_warnings"] = sum(1 for r in logs.records if "falling back" in r)
    return m


def judge_late_update(m: dict[str, Any]) -> tuple[str, str]:
    started = m["requests_started_by_updates"]
    if started or m["messages_for_unknown_id"] or m["after_terminal"]:
        return "zombie", (f"{started} request(s) started by late updates; {m['after_terminal']} message(s) "
                          f"after s1's terminal, {m['messages_for_unknown_id']} for an id never added; "
                          f"the caller saw {'no error' if not m['update_after_abort_error'] else 'an error'}")
    if m["update_after_abort_error"] is None or m["unknown_update_error"] is None:
        return "silent", "a late update was neither refused nor applied"
    if not m["aborted_terminal_seen"] or m["without_terminal"]:
        return "lost", "the aborted session got no terminal"
    return "ok", "both late updates raised ValueError to their caller; nothing started"


S13 = Scenario(
    13, "late-update", "input update after an abort, and for an unknown id",
    "A resumable session is aborted while its next input segment is in flight (the update arrives "
    "after the abort), and an update arrives for an id never added. Does the caller get an error, "
    "and does anything start?",
    "zombie if a late update started a request nobody added (stage work, messages after the "
    "session's terminal or for an id never added); silent if a late update was neither refused nor "
    "applied; lost if the aborted session got no terminal; else ok",
    measure_late_update, judge_late_update,
    lambda m: (f"after abort: {'error' if m['update_after_abort_error'] else 'no error'}, unknown id: "
               f"{'error' if m['unknown_update_error'] else 'no error'}, started: "
               f"{m['requests_started_by_updates']}, after terminal: {m['after_terminal']}"),
    needs=frozenset({"resumable"}),
    kind="design",
    because=(
        "whether a late input update is refused or starts a new request is a decision, the core's "
        "(refuse) or the seed's (fall back to add_request)"
    ),
)
