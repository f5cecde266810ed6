"""Where the work per output goes: counts from a profiled run, Trio and asyncio side by side.

``python -m bench.perf.passes`` runs each workload once per implementation
under :mod:`cProfile`, in the threads the implementation starts (its loop
thread, a ZMQ client's), and reports per output:

* **epoll waits** -- ``epoll.poll`` calls: how often the event loop went
  round (Trio's scheduler pass, asyncio's ``_run_once``), over the whole
  profiled run (start, warm-up outputs, measurement, stop) divided by the
  measured outputs, so a sequential workload's start-up and warm-up add a
  little to both sides;
* **task steps** -- ``Context.run`` calls: a Trio task step, an asyncio
  callback or task step;
* **calls** -- every Python function call;
* the functions with the largest share of the loop thread's own time
  (waiting in ``poll`` and in locks left out).

Counts, not times, are the point: they hardly move with the machine's load
(a profiled run is several times slower than a real one, and timings on a
busy 2-vCPU VM are noise), so a design change shows as fewer passes, steps
or calls per output in any run.  Timings belong to ``trio-orch bench``.

``--before FILES --after FILES`` reads tables this module wrote
(``--markdown``, several runs on each side) and prints the before/after
table: per (workload, implementation) the median of each count over the
runs of each side and the ratio after / before.
"""

from __future__ import annotations

import argparse
import cProfile
import glob
import pstats
import re
import statistics
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from bench.perf.workloads import WORKLOADS, run_workload

__all__ = ["Profiled", "before_after", "main", "markdown", "profile_one", "read_counts"]

#: builtins that only wait (their time is idle, not work)
WAITS = ("poll", "acquire", "get", "wait", "select", "waitpid", "read", "enable", "sleep")

DEFAULT_WORKLOADS = "loop_a_seq,loop_b_512_unbatched,b_512_unbatched,zmq_a_seq,zmq_b_64"
DEFAULT_IMPLS = "trio,asyncio-taskgroup"


class Profiled(dict[str, Any]):
    """One (workload, implementation): the counts per output and the top functions."""


@contextmanager
def _profile_threads() -> Iterator[list[cProfile.Profile]]:
    """Profile every thread started inside the block, from its start to its end."""
    profiles: list[cProfile.Profile] = []
    run = threading.Thread.run

    def profiled(self: threading.Thread) -> None:
        prof = cProfile.Profile()
        profiles.append(prof)
        prof.enable()
        try:
            run(self)
        finally:
            prof.disable()

    threading.Thread.run = profiled  # type: ignore[method-assign]
    try:
        yield profiles
    finally:
        threading.Thread.run = run  # type: ignore[method-assign]


def _is_wait(func: tuple[str, int, str]) -> bool:
    filename, _, name = func
    return (filename == "~" and any(w in name for w in WAITS)) or name == "poll"


def profile_one(workload: str, impl: str, quick: bool = True, top: int = 6) -> Profiled:
    """Run ``workload`` on ``impl`` once (after a warm-up run) with every new thread profiled."""
    run_workload(workload, impl, True)  # imports, caches, the first worker start
    with _profile_threads() as profiles:
        res = run_workload(workload, impl, quick)
    stats: pstats.Stats | None = None
    for prof in profiles:
        try:
            stats = pstats.Stats(prof) if stats is None else stats.add(prof)
        except TypeError:  # a thread that never called anything
            continue
    assert stats is not None, "no thread was profiled"
    outputs = max(1, int(res["outputs"]))
    table: dict[tuple[str, int, str], tuple[int, int, float, float, Any]] = stats.stats  # type: ignore[attr-defined]
    passes = sum(nc for f, (_, nc, _, _, _) in table.items() if f[0] == "~" and "poll" in f[2]
                 and "epoll" in f[2])
    steps = sum(nc for f, (_, nc, _, _, _) in table.items() if f[0] == "~"
                and "'run' of '_contextvars.Context'" in f[2])
    calls = sum(nc for _, (_, nc, _, _, _) in table.items())
    work = {f: tt for f, (_, _, tt, _, _) in table.items() if not _is_wait(f)}
    total = sum(work.values()) or 1.0
    best = sorted(work.items(), key=lambda kv: -kv[1])[:top]
    return Profiled(workload=workload, impl=impl, outputs=outputs, passes=passes / outputs,
                    steps=steps / outputs, calls=calls / outputs,
                    top=[(_label(f), tt / total) for f, tt in best])


def _label(func: tuple[str, int, str]) -> str:
    filename, line, name = func
    if filename == "~":
        return name.strip("<>{}").replace("built-in method ", "").replace("method ", "")
    for root in ("site-packages/", "/lib/python3", "/work/main/", "/"):
        if root in filename:
            filename = filename.split(root, 1)[1]
            break
    return f"{filename}:{line}({name})"


def markdown(rows: list[Profiled]) -> str:
    """The counts table and, per row, where the loop thread's own time went."""
    lines = ["| workload | implementation | epoll waits / output | task steps / output | calls / output |",
             "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['workload']} | {r['impl']} | {r['passes']:.3f} | {r['steps']:.2f} | "
                     f"{r['calls']:.1f} |")
    lines.append("")
    for r in rows:
        shares = "; ".join(f"`{name}` {share:.0%}" for name, share in r["top"])
        lines.append(f"- **{r['workload']}, {r['impl']}**: {shares}")
    return "\n".join(lines) + "\n"


COUNTS = ("epoll waits", "task steps", "calls")
_ROW = re.compile(r"^\| ([\w-]+) \| ([\w-]+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \|$", re.M)


def read_counts(path: Path) -> dict[tuple[str, str], tuple[float, float, float]]:
    """(workload, implementation) -> (epoll waits, task steps, calls) per output, from a written table."""
    return {(m[1], m[2]): (float(m[3]), float(m[4]), float(m[5])) for m in _ROW.finditer(path.read_text())}


def before_after(before: list[Path], after: list[Path]) -> str:
    """For every row both sides have: the median of each count over that side's runs (the tables that
    have the row), and after / before."""
    sides: list[dict[tuple[str, str], list[tuple[float, float, float]]]] = []
    for paths in (before, after):
        rows: dict[tuple[str, str], list[tuple[float, float, float]]] = {}
        for path in paths:
            for k, v in read_counts(path).items():
                rows.setdefault(k, []).append(v)
        sides.append(rows)
    head = " | ".join(f"{c} / output: before, after (ratio)" for c in COUNTS)
    lines = [f"| workload | implementation | {head} |", "|---|---|" + "---|" * len(COUNTS)]
    for k in (k for k in sides[1] if k in sides[0]):
        cells = []
        for i, fmt in enumerate((".3f", ".2f", ".1f")):
            b, a = (statistics.median(v[i] for v in side[k]) for side in sides)
            ratio = f"{a / b:.2f}" if b else "-"
            cells.append(f"{b:{fmt}}, {a:{fmt}} ({ratio})")
        lines.append(f"| {k[0]} | {k[1]} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.perf.passes", description=__doc__.split("\n\n")[0],
                                epilog="Counts hardly move with the machine's load; timings do (see "
                                       "trio-orch bench).")
    p.add_argument("--workloads", default=DEFAULT_WORKLOADS,
                   help=f"comma-separated workloads (default {DEFAULT_WORKLOADS})")
    p.add_argument("--impls", default=DEFAULT_IMPLS, help=f"comma-separated implementations (default "
                                                          f"{DEFAULT_IMPLS})")
    p.add_argument("--full", action="store_true", help="the full-size workloads (default: the --quick sizes)")
    p.add_argument("--markdown", type=Path, default=None, help="also write the tables to this file")
    p.add_argument("--before", nargs="+", default=None, metavar="FILE",
                   help="tables written by --markdown before a change (globs too): with --after, print the "
                        "before/after medians instead of profiling")
    p.add_argument("--after", nargs="+", default=None, metavar="FILE", help="the same after the change")
    args = p.parse_args(argv)
    if (args.before is None) != (args.after is None):
        p.error("--before and --after go together")
    if args.before is not None:
        sides = [[Path(f) for pat in pats for f in sorted(glob.glob(pat))]
                 for pats in (args.before, args.after)]
        if not all(sides):
            p.error("--before/--after: no such file")
        text = before_after(*sides)
        print(text)
        if args.markdown is not None:
            args.markdown.write_text(text)
        return 0
    workloads = [w for w in args.workloads.split(",") if w]
    unknown = [w for w in workloads if w not in WORKLOADS]
    if unknown:
        p.error(f"unknown workload(s) {', '.join(unknown)}: choose from {', '.join(WORKLOADS)}")
    rows: list[Profiled] = []
    for w in workloads:
        for impl in (i for i in args.impls.split(",") if i):
            print(f"profiling {w} on {impl} ...", file=sys.stderr, flush=True)
            rows.append(profile_one(w, impl, quick=not args.full))
    text = markdown(rows)
    print(text)
    if args.markdown is not None:
        args.markdown.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
