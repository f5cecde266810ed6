"""The verdict that closes ``trio-orch bench``: a few lines, every word computed from the run.

What a reader of a 300-line report wants last: which targets were met and
which missed, and the headline ratios (:mod:`bench.perf.headlines`: the
model, the design, the floor, one workload per path) with the bounds the
two rows' 95 % intervals allow (:func:`bench.perf.stats.ratio_bounds`: they
exclude 1 exactly where the tables say lower / higher).  A quick run says
its intervals are wide and judges no floor.  At most :data:`MAX_LINES`
lines at 100 columns.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from bench.perf.headlines import FLOOR, PAIRS, floor_of
from bench.perf.stats import ratio, ratio_bounds, verdict
from bench.perf.targets import get

__all__ = ["MAX_LINES", "ROWS", "Verdict", "build", "quick"]

#: the verdict's length at 100 columns, at most
MAX_LINES = 10
#: the longest targets line that names the missed ones (two lines at 100 columns)
TARGETS_CHARS = 190
#: the headline workloads the verdict shows: one per path (thread hand-off, in the loop, over ZMQ
#: workers; the three-stage ones are in the headlines of results.md)
ROWS = ("a_seq", "loop_a_seq", "zmq_a_seq")


def quick(results: dict[str, Any]) -> bool:
    """Whether this is a ``--quick`` run (its intervals are too wide to judge a floor)."""
    return results.get("meta", {}).get("mode") == "quick"


@dataclass(frozen=True, slots=True)
class Verdict:
    """The closing block: which run, the floors, the targets, the ratio table (header first), serving."""

    run: str
    floors: str
    targets: str
    ratios: list[list[str]]
    serving: str

    def renderable(self) -> Any:
        """The block for a rich console."""
        from rich.console import Group
        from rich.padding import Padding
        from rich.text import Text

        from bench.tables import table

        parts: list[Any] = [Text(f"Verdict, {self.run}: {self.floors}", style="bold"),
                            Text(f"  {self.targets}")]
        if len(self.ratios) > 1:
            parts.append(Padding(table(self.ratios[0], self.ratios[1:], names={0},
                                       numbers=set(range(1, len(self.ratios[0]))), rule=False),
                                 (0, 0, 0, 2), expand=False))
        if self.serving:
            parts.append(Text(f"  {self.serving}"))
        return Group(*parts)

    def markdown(self) -> str:
        """The block for results.md: the section that closes it."""
        from bench.tables import markdown_table

        out = ["## Verdict", "", f"{self.run[:1].upper()}{self.run[1:]}: {self.floors}.", "",
               f"- {self.targets}"]
        if self.serving:
            out.append(f"- {self.serving}")
        if len(self.ratios) > 1:
            out += ["", markdown_table(self.ratios)]
        return "\n".join(out) + "\n"


def _run(results: dict[str, Any]) -> str:
    """Which run: its mode, its rounds, the fewest latency samples a row of the main table has."""
    meta = results.get("meta", {})
    rounds = meta.get("rounds")
    ns = [lat["n"] for per in results.get("workloads", {}).values() for res in per.values()
          if (lat := res.get("latency") or res.get("forward") or {}).get("n")]
    said = []
    if rounds:
        said.append(f"{rounds} round{'s' if rounds != 1 else ''}")
    if ns:
        said.append(f">= {min(ns):,} samples per row")
    mode = "quick" if quick(results) else meta.get("mode", "full")
    return f"{mode} run" + (f" ({', '.join(said)})" if said else "")


def _floors(results: dict[str, Any], floors: bool | None) -> str:
    if quick(results):
        return "intervals are wide, no floor is judged"
    return {True: "every floor holds", False: "a floor is BEATEN (see Floors)",
            None: "no floor measured"}[floors]


def _targets(results: dict[str, Any]) -> str:
    """How many targets were met, and which were missed (where that list is long: which were met)."""
    judged = [t for t in results.get("targets", []) if t["met"] is not None]
    if not judged:
        return "targets: none measured"
    met = [t.get("key") or t["target"] for t in judged if t["met"]]
    missed = [t.get("key") or t["target"] for t in judged if not t["met"]]
    head = f"targets: {len(met)} of {len(judged)} met"
    if not missed:
        return head
    line = f"{head}; missed: {', '.join(missed)}"
    if len(line) <= TARGETS_CHARS:
        return line
    return f"{head} ({', '.join(met) or 'none'}); missed the other {len(missed)} (see Targets)"


def _cell(results: dict[str, Any], wl: str, a: str, b: str, pct: str) -> str:
    """``a / b`` at ``pct``: the ratio, its bounds and the verdict word (lower / higher / =)."""
    la, lb = get(results, wl, a, "latency"), get(results, wl, b, "latency")
    if not la or not lb:
        return "-"
    r = ratio(la.get(f"{pct}_us"), lb.get(f"{pct}_us"))
    if r is None:
        return "-"
    return f"{r:.2f}{_bounds(la, lb, pct)} {verdict(la.get(f'{pct}_ci_us'), lb.get(f'{pct}_ci_us'))}"


def _bounds(a: dict[str, Any], b: dict[str, Any], pct: str) -> str:
    """`` [lo-hi]``: the bounds of a / b at ``pct`` (:func:`ratio_bounds`); "" where there are none."""
    bounds = ratio_bounds(a.get(f"{pct}_ci_us"), b.get(f"{pct}_ci_us"))
    return f" [{bounds[0]:.2f}-{bounds[1]:.2f}]" if bounds else ""


def _ratios(results: dict[str, Any], pct: str = "p50") -> list[list[str]]:
    rows = [[f"{pct}:\nx [bounds]",
             *(f"{what}: {a} /\n{'its floor' if b == FLOOR else b}" for what, a, b in PAIRS)]]
    for wl in ROWS:
        if not get(results, wl, "trio", "latency"):
            continue
        cells = [_cell(results, wl, a, floor_of(results, wl) or "" if b == FLOOR else b, pct)
                 for _, a, b in PAIRS]
        if any(c != "-" for c in cells):
            rows.append([wl, *cells])
    return rows


def _serving(results: dict[str, Any]) -> str:
    """--loop trio / --loop asyncio with echo workers: TTFC p50 with its bounds, requests/s."""
    serving = results.get("serving", {})
    trio, asy = serving.get("echo workers", {}).get("trio"), serving.get("echo workers", {}).get("asyncio")
    if not trio or not asy:
        return ""
    t, a = trio["ttfc"], asy["ttfc"]
    r = ratio(t.get("p50_us"), a.get("p50_us"))
    ttfc = "-" if r is None else f"{r:.2f}{_bounds(t, a, 'p50')}"
    rps = ratio(trio.get("requests_per_s"), asy.get("requests_per_s"))
    return (f"serving, --loop trio / asyncio (echo workers, {serving.get('concurrency')} clients): "
            f"TTFC p50 {ttfc}, req/s {'-' if rps is None else f'{rps:.2f}'}")


def build(results: dict[str, Any], floors: bool | None) -> Verdict:
    """The verdict of a run; ``floors``: whether every floor held (None: not judged or not measured)."""
    return Verdict(_run(results), _floors(results, floors), _targets(results), _ratios(results),
                   _serving(results))
