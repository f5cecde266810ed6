"""Before and after a change, in one run: the same workloads on two commits, alternating.

``python -m bench.perf.ab --base REV`` checks ``REV`` out into a temporary
git worktree and runs each (workload, implementation) on it and on the
working tree in turn, one fresh process per run, alternating ``--rounds``
times (base, head, base, head, ...) so that the machine's drift and load
hit both alike; it prints, per row, the median over rounds of throughput,
CPU per output and p50 / p99 latency for each side and the ratio head /
base.  Both sides run with this interpreter (the same dependencies); only
the project's code differs.  What ``docs/performance.md`` records as a
change's before/after comes from here.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

__all__ = ["main", "markdown", "measure"]

ROOT = Path(__file__).resolve().parents[2]

#: run in the child: one workload on one implementation, its summary as JSON on the last line
CHILD = """
import json, sys
from bench.perf.workloads import run_workload
res = run_workload(sys.argv[1], sys.argv[2], sys.argv[3] == "quick")
lat = sorted(res.get("latency") or [0.0])
print(json.dumps({"outputs_per_s": res["outputs"] / res["elapsed_s"],
                  "cpu_us_per_output": res["cpu_s"] / res["outputs"] * 1e6,
                  "p50_us": lat[len(lat) // 2] * 1e6, "p99_us": lat[int(len(lat) * 0.99)] * 1e6}))
"""

MEASURES = ("outputs_per_s", "cpu_us_per_output", "p50_us", "p99_us")


def measure(tree: Path, workload: str, impl: str, quick: bool) -> dict[str, float]:
    """One run of ``workload`` on ``impl`` with the project's code taken from ``tree``."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    out = subprocess.run([sys.executable, "-c", CHILD, workload, impl, "quick" if quick else "full"],
                         cwd=tree, env=env, capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise RuntimeError(f"{workload} on {impl} ({tree}) failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def markdown(rows: list[dict[str, Any]], base: str) -> str:
    """Medians per side and the ratio head / base (above 1 is better for outputs/s only)."""
    lines = [f"| workload | implementation | measure | base ({base}) | head | head / base |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        for m in MEASURES:
            b, h = statistics.median(x[m] for x in r["base"]), statistics.median(x[m] for x in r["head"])
            lines.append(f"| {r['workload']} | {r['impl']} | {m} | {b:,.1f} | {h:,.1f} | "
                         f"{h / b if b else float('nan'):.2f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.perf.ab", description=__doc__.split("\n\n")[0])
    p.add_argument("--base", required=True, help="the commit before the change (any git revision)")
    p.add_argument("--workloads", default="loop_b_512_unbatched,zmq_b_64",
                   help="comma-separated workloads (default loop_b_512_unbatched,zmq_b_64)")
    p.add_argument("--impls", default="trio", help="comma-separated implementations (default trio)")
    p.add_argument("--rounds", type=int, default=3, help="alternations per row (default 3)")
    p.add_argument("--full", action="store_true", help="full-size workloads (default: the --quick sizes)")
    p.add_argument("--markdown", type=Path, default=None, help="also write the table to this file")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error("--rounds must be >= 1")
    rev = subprocess.run(["git", "rev-parse", "--short", args.base], cwd=ROOT, capture_output=True, text=True)
    if rev.returncode != 0:
        p.error(f"unknown revision {args.base!r}: {rev.stderr.strip()}")
    base = rev.stdout.strip()
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="trio-orch-ab-") as tmp:
        tree = Path(tmp) / "base"
        subprocess.run(["git", "worktree", "add", "-q", "--detach", str(tree), base], cwd=ROOT, check=True)
        try:
            for w in (x for x in args.workloads.split(",") if x):
                for impl in (x for x in args.impls.split(",") if x):
                    row: dict[str, Any] = {"workload": w, "impl": impl, "base": [], "head": []}
                    for r in range(args.rounds):
                        print(f"{w} on {impl}: round {r + 1}/{args.rounds}", file=sys.stderr, flush=True)
                        row["base"].append(measure(tree, w, impl, not args.full))
                        row["head"].append(measure(ROOT, w, impl, not args.full))
                    rows.append(row)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT, check=False)
    text = markdown(rows, base)
    print(text)
    if args.markdown is not None:
        args.markdown.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
