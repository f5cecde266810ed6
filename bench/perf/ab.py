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

``--serving`` does the same for ``trio-orch serve`` on a three-stage echo
pipeline (16 outputs a stage), both fronts, 64 streaming clients for
``--seconds`` each: per side, the workers' steps per request (a worker step
sends the orchestrator one message, so this is the worker messages per
request: how many requests shared a step), the serving process's CPU per
request and requests/s.  With ``--profiled`` the serving process runs
under ``cProfile`` (every thread) instead, for 200 and then 1,000 streamed
requests at 64 connections, and the difference divided by 800 gives, with
start-up and shutdown cancelling out, the Python calls and the worker
messages received (``WireCodec.decode`` calls) per streamed request: counts,
which move far less with the machine's load than timings do.
"""

from __future__ import annotations

import argparse
import asyncio
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
SERVING_MEASURES = ("worker_steps_per_request", "server_cpu_ms_per_request", "requests_per_s")
PROFILED_MEASURES = ("worker_messages_per_request", "calls_per_request")

#: the serving process under cProfile, every thread; the merged stats go to argv[1] at exit
PROFILED_CHILD = """
import atexit, cProfile, pstats, runpy, sys, threading
out, sys.argv = sys.argv[1], ["trio-orch", *sys.argv[2:]]
profiles = [cProfile.Profile()]
run = threading.Thread.run
def profiled(self):
    p = cProfile.Profile()
    profiles.append(p)
    p.enable()
    try:
        run(self)
    finally:
        p.disable()
threading.Thread.run = profiled
def dump():
    profiles[0].disable()
    stats = None
    for p in profiles:
        try:
            stats = pstats.Stats(p) if stats is None else stats.add(p)
        except TypeError:
            pass
    stats.dump_stats(out)
atexit.register(dump)
profiles[0].enable()
runpy.run_module("trio_orch.cli", run_name="__main__")
"""


def measure(tree: Path, workload: str, impl: str, quick: bool) -> dict[str, float]:
    """One run of ``workload`` on ``impl`` with the project's code taken from ``tree``."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    out = subprocess.run([sys.executable, "-c", CHILD, workload, impl, "quick" if quick else "full"],
                         cwd=tree, env=env, capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise RuntimeError(f"{workload} on {impl} ({tree}) failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def measure_serving(tree: Path, front: str, seconds: float, concurrency: int, config: str,
                    token: str) -> dict[str, float]:
    """One ``serve --loop front`` run on ``tree``'s code: worker steps, server CPU ms and requests/s."""
    from bench.perf import serving as sv

    flags = ["--config", config]
    proc, url = sv.start_server([*flags, "--loop", front, "--max-inflight", "0", "--request-queue-size",
                                 str(4 * concurrency)], admin_token=token, code=tree)
    try:
        body = sv.echo_body(flags)
        asyncio.run(sv.post(*sv.split_url(url), "/v1/chat/completions", body))  # warm-up
        m = sv.measure_front(url, proc.pid, concurrency, seconds, 2, body, admin_token=token)
    finally:
        sv.stop_server(proc)
    ok = max(1, m["ok"])
    return {"worker_steps_per_request": m["worker_steps"] / ok,
            "server_cpu_ms_per_request": m["server_cpu_s"] / ok * 1e3,
            "requests_per_s": m["ok"] / m["wall_s"], "failed": m["failed"]}


def profiled_counts(tree: Path, front: str, config: str, requests: int, tmp: Path) -> tuple[int, int]:
    """(Python calls, worker messages received) in the serving process for ``requests`` streamed requests."""
    import pstats
    import re
    import signal
    import threading

    from bench.perf import serving as sv

    out = tmp / f"serve-{front}-{requests}.prof"
    flags = ["--config", config]
    proc = subprocess.Popen([sys.executable, "-c", PROFILED_CHILD, str(out), "serve", "--port", "0", *flags,
                             "--loop", front, "--max-inflight", "0", "--request-queue-size", "256"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tree,
                            env={**os.environ, "PYTHONPATH": str(tree)})
    assert proc.stdout is not None
    url = None
    for line in proc.stdout:
        m = re.search(r"serving on (http://\S+)", line)
        if m:
            url = m.group(1)
            break
    if url is None:
        raise RuntimeError(f"serve on {tree} exited before serving")
    threading.Thread(target=proc.stdout.read, daemon=True).start()
    try:
        asyncio.run(sv.stream_requests(url, sv.echo_body(flags), requests, 64))
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(120)
    table: dict[Any, Any] = pstats.Stats(str(out)).stats  # type: ignore[attr-defined]
    calls = sum(nc for _, nc, _, _, _ in table.values())
    decoded = sum(nc for f, (_, nc, _, _, _) in table.items()
                  if f[2] == "decode" and f[0].endswith("wire.py"))
    return calls, decoded


def serving_markdown(rows: list[dict[str, Any]], base: str) -> str:
    """Medians per side of the serving runs, and head / base."""
    lines = [f"| front | measure | base ({base}) | head | head / base |", "|---|---|---|---|---|"]
    for r in rows:
        for m in (PROFILED_MEASURES if "calls_per_request" in r["base"][0] else SERVING_MEASURES):
            b, h = statistics.median(x[m] for x in r["base"]), statistics.median(x[m] for x in r["head"])
            lines.append(f"| --loop {r['front']} | {m} | {b:,.2f} | {h:,.2f} | "
                         f"{h / b if b else float('nan'):.2f} |")
    return "\n".join(lines) + "\n"


def _spread(xs: list[float]) -> str:
    return f"{statistics.median(xs):,.1f} [{min(xs):,.1f}-{max(xs):,.1f}]"


def compared(m: str, base: list[float], head: list[float]) -> str:
    """``worse`` / ``better`` when every head round lies beyond every base round on that side (outputs/s:
    higher is better, the rest lower), with three rounds a side at least; else ``=``: no difference is
    claimed (the rounds overlap, or there are too few of them to tell)."""
    if min(len(base), len(head)) < 3:
        return "="
    higher_better = m == "outputs_per_s"
    if min(head) > max(base):
        return "better" if higher_better else "worse"
    if max(head) < min(base):
        return "worse" if higher_better else "better"
    return "="


def markdown(rows: list[dict[str, Any]], base: str) -> str:
    """Medians per side with the range of the rounds, head / base, and whether the rounds overlap."""
    lines = [f"| workload | implementation | measure | base ({base}): median [range] | "
             "head: median [range] | head / base | rounds |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        for m in MEASURES:
            bs, hs = [x[m] for x in r["base"]], [x[m] for x in r["head"]]
            b, h = statistics.median(bs), statistics.median(hs)
            lines.append(f"| {r['workload']} | {r['impl']} | {m} | {_spread(bs)} | {_spread(hs)} | "
                         f"{h / b if b else float('nan'):.2f} | {compared(m, bs, hs)} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.perf.ab", description=__doc__.split("\n\n")[0])
    p.add_argument("--base", required=True, help="the commit before the change (any git revision)")
    p.add_argument("--workloads", default="loop_b_512_unbatched,zmq_b_64",
                   help="comma-separated workloads (default loop_b_512_unbatched,zmq_b_64)")
    p.add_argument("--impls", default="trio", help="comma-separated implementations (default trio)")
    p.add_argument("--rounds", type=int, default=3, help="alternations per row (default 3)")
    p.add_argument("--full", action="store_true", help="full-size workloads (default: the --quick sizes)")
    p.add_argument("--serving", action="store_true",
                   help="instead of the workloads: serve on echo workers, both fronts, 64 streaming clients")
    p.add_argument("--seconds", type=float, default=5.0,
                   help="--serving: seconds of load per run (default 5)")
    p.add_argument("--profiled", action="store_true",
                   help="--serving: count calls and worker messages per request under cProfile instead")
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
            if args.serving:
                rows = _serving_rounds(tree, Path(tmp), args.rounds, args.seconds, args.profiled)
            for w in (x for x in args.workloads.split(",") if x and not args.serving):
                for impl in (x for x in args.impls.split(",") if x):
                    row: dict[str, Any] = {"workload": w, "impl": impl, "base": [], "head": []}
                    for r in range(args.rounds):
                        print(f"{w} on {impl}: round {r + 1}/{args.rounds}", file=sys.stderr, flush=True)
                        row["base"].append(measure(tree, w, impl, not args.full))
                        row["head"].append(measure(ROOT, w, impl, not args.full))
                    rows.append(row)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT, check=False)
    text = serving_markdown(rows, base) if args.serving else markdown(rows, base)
    print(text)
    if args.markdown is not None:
        args.markdown.write_text(text)
    return 0


def _serving_rounds(tree: Path, tmp: Path, rounds: int, seconds: float,
                    profiled: bool = False) -> list[dict[str, Any]]:
    """Both fronts on both sides, ``rounds`` times, alternating base and head."""
    import secrets

    from bench.perf.serving import echo_pipeline_file

    config, token = echo_pipeline_file(16, str(tmp)), secrets.token_urlsafe(16)
    rows = {front: {"front": front, "base": [], "head": []} for front in ("trio", "asyncio")}
    for r in range(rounds):
        for side, code in (("base", tree), ("head", ROOT)):
            for front in ("trio", "asyncio"):
                print(f"serving --loop {front} on {side}: round {r + 1}/{rounds}", file=sys.stderr,
                      flush=True)
                if profiled:
                    (c1, d1), (c2, d2) = (profiled_counts(code, front, config, n, tmp) for n in (200, 1000))
                    res = {"worker_messages_per_request": (d2 - d1) / 800,
                           "calls_per_request": (c2 - c1) / 800}
                else:
                    res = measure_serving(code, front, seconds, 64, config, token)
                print(f"  {res}", file=sys.stderr, flush=True)
                rows[front][side].append(res)
    return list(rows.values())


if __name__ == "__main__":
    sys.exit(main())
