"""Scenarios about replicas that join at runtime: 17 of the comparison.

The seed registers a remote replica with an attach handshake of about five
seconds, run as a fire-and-forget task; at shutdown it waits up to ten
seconds (``wait_for``) for those tasks before sweeping.  Here a join whose
handshake takes :data:`HANDSHAKE` seconds is in progress when shutdown
starts: how long does shutdown take, does the join complete into a stopping
orchestrator, and is anything left running?  Every implementation asks the
same core whether a finished handshake makes a member (it refuses once
shutdown began); they differ in what they do with the handshake itself.
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
)

#: the attach handshake's duration: the seed's ~5 s, scaled down so a table run stays short
HANDSHAKE = 1.0


def measure_attach_at_shutdown(impl: str) -> dict[str, Any]:
    """Begin a join of stage 1, shut down while its handshake runs, see what became of it."""
    with LogCapture():
        h = start(impl, 2, {1})
        members_before = len(h.router.members)
        h.attach_replica(1, "m1", HANDSHAKE)
        h.wait_until(lambda: "m1" in h.router.joining, CUT)
        time.sleep(0.05)  # the handshake is under way
        m = stop_and_drain(h)
        outcome_at_return = h.join_outcomes().get("m1")
        time.sleep(0.1)
        m["outcome"] = h.join_outcomes().get("m1", "still running")
    m["outcome_at_return"] = outcome_at_return or "still running"
    m["members_added"] = len(h.router.members) - members_before
    m["handshake_s"] = HANDSHAKE
    m["waited_for_handshake"] = bool(not m["hung"] and m["shutdown_s"] >= HANDSHAKE * 0.8)
    return m


def judge_attach_at_shutdown(m: dict[str, Any]) -> tuple[str, str]:
    if m["hung"]:
        return "hang", f"run() had not returned after {m['cut_s']} s"
    if m["members_added"]:
        return "zombie", "the join completed into the stopped orchestrator: a member was added"
    if m["outcome_at_return"] == "still running" or (m["tasks_alive_after_run"] or 0) > 0:
        return (
            "leak",
            f"the handshake was still running when run() returned ({m['tasks_alive_after_run']} tasks)",
        )
    if m["waited_for_handshake"]:
        return "waited", (
            f"shutdown waited {m['shutdown_s']:.2f} s for the {m['handshake_s']:g} s handshake "
            f"(it ended {m['outcome']})"
        )
    return (
        "ok",
        f"the handshake was cancelled at once ({m['outcome']}); shutdown took {m['shutdown_s']:.3f} s",
    )


S17 = Scenario(
    17,
    "attach-at-shutdown",
    "a replica's attach handshake is in progress when shutdown starts",
    f"A replica begins to join stage 1 (its handshake takes {HANDSHAKE:g} s; the seed's takes ~5 s, and the "
    "seed waits up to 10 s for handshakes at shutdown); shutdown starts while it runs. Is shutdown held up, "
    "does the join complete into the stopped orchestrator, is the handshake left running?",
    "hang if shutdown hangs; zombie if a member was added; leak if the handshake outlived run(); waited if "
    "shutdown waited for the handshake; else ok",
    measure_attach_at_shutdown,
    judge_attach_at_shutdown,
    lambda m: (
        f"shutdown {m['shutdown_s']:.3f} s, join: {m['outcome']}, tasks left: {m['tasks_alive_after_run']}"
    ),
    needs=frozenset({"membership"}),
    kind="design",
    because=(
        "whether shutdown waits for a fire-and-forget handshake or cancels a task it owns is the "
        "shell's choice; TaskGroup and nursery both can"
    ),
)
