"""The benchmark's headlines: per path, what the model changes, what design changes, what the floor is.

Three comparisons separate the causes, each between two rows of one run:

* **model**: ``trio`` against ``asyncio-taskgroup`` -- the same routing
  core and the Trio shell's design choices (the push path where the stage
  offers it, the abort path, bounded cleanups), one on Trio, one on asyncio.
  What remains between them is the concurrency model and the thread bridge
  each loop has (Trio's token and a ``SimpleQueue`` sink; asyncio's
  ``call_soon_threadsafe`` and janus queues, as vLLM-Omni has them);
* **design**: ``omni-event`` against ``asyncio-taskgroup`` -- both asyncio;
  vLLM-Omni's design (a reader task per stage, a dispatcher fed through a
  queue, no push path) against the Trio shell's design on asyncio;
* **floor**: ``trio`` against the floor of its path -- what the shell and
  the routing cost above the hops nobody can skip.

A difference is claimed only where the 95 % intervals do not overlap.
"""

from __future__ import annotations

from typing import Any

from bench.perf.stats import ratio, verdict
from bench.perf.targets import get

__all__ = ["FLOOR", "PAIRS", "WORKLOADS", "floor_of", "headlines"]

#: the workloads a headline is written for, and what their path is called
WORKLOADS = {"a_seq": "thread hand-off", "c_chain": "thread hand-off, three stages",
             "loop_a_seq": "in the loop", "loop_c_chain": "in the loop, three stages",
             "zmq_a_seq": "over ZMQ workers"}

#: stands for the floor of the workload's path in :data:`PAIRS`
FLOOR = "<floor>"
#: the comparisons of a headline: (what it separates, the row, the row it is divided by)
PAIRS = (("model", "trio", "asyncio-taskgroup"), ("design", "omni-event", "asyncio-taskgroup"),
         ("above the floor", "trio", FLOOR))


def floor_of(results: dict[str, Any], wl: str) -> str | None:
    """The floor row this run has for ``wl`` (the thread / in-loop floor or the ZMQ floor), if any."""
    return next((f for f in ("floor", "zmq-floor") if get(results, wl, f, "latency")), None)


def _compare(results: dict[str, Any], wl: str, a: str, b: str, pct: str) -> str | None:
    """``a`` against ``b``: ratio, both values with intervals, and the verdict in words."""
    la, lb = get(results, wl, a, "latency"), get(results, wl, b, "latency")
    if not la or not lb:
        return None
    r = ratio(la.get(f"{pct}_us"), lb.get(f"{pct}_us"))
    if r is None:
        return None
    called = verdict(la.get(f"{pct}_ci_us"), lb.get(f"{pct}_ci_us"))
    word = {"lower": f"{a} lower", "higher": f"{a} higher",
            "=": "no difference (the intervals overlap)"}[called]

    def show(lat: dict[str, Any]) -> str:
        lo, hi = lat[f"{pct}_ci_us"]
        return f"{lat[f'{pct}_us']:,.1f} us [{lo:,.1f}-{hi:,.1f}]"

    return f"{a} {show(la)} vs {b} {show(lb)}: {r:.2f}x, {word}"


def headlines(results: dict[str, Any], pct: str = "p50") -> list[str]:
    """One line per headline workload this run measured (see the module docstring)."""
    out: list[str] = []
    for wl, path in WORKLOADS.items():
        parts = []
        push = {i: get(results, wl, i, "push") for i in ("trio", "asyncio-taskgroup")}
        for what, a, b in PAIRS:
            b = floor_of(results, wl) if b == FLOOR else b
            line = b and _compare(results, wl, a, b, pct)
            if not line:
                continue
            if what == "model" and push[a] != push[b]:
                what = "model and the push path (asyncio-taskgroup has none here)"
            parts.append(f"{what}: {line}")
        if parts:
            out.append(f"{wl} ({path}, {pct}) -- " + "; ".join(parts))
    return out
