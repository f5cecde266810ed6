"""``trio-orch bench``: dispatch latency and throughput, every implementation in one run.

Implementations run interleaved (round r runs each of them once, in a
shuffled order, and sequential workloads start with untimed warm-up
outputs) so machine drift and power-state carry-over hit all alike; each run starts a fresh orchestrator,
runs the workload and measures its shutdown.  Results are merged per
(workload, implementation) and every ratio is computed from this run's numbers.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.perf import report, workloads
from bench.perf.asyncio_drivers import ASYNCIO_DRIVERS
from bench.perf.drivers import BenchDriver, FloorDriver, TrioDriver
from bench.perf.engine_driver import EngineDriver
from bench.perf.stats import summarize
from bench.perf.zmq_workloads import ZMQ_IMPLEMENTATIONS, run_zmq_workload

Workload = Callable[[BenchDriver, bool], dict[str, Any]]

#: name -> (function(driver, quick), one-line description)
WORKLOADS: dict[str, tuple[Workload, str]] = {
    "a_seq": (lambda d, q: workloads.seq(d, 300 if q else 1000, paced=False),
              "one request, 1,000 outputs on a final stage, each handed over when the previous arrived"),
    "a_paced": (lambda d, q: workloads.seq(d, 100 if q else 1000, paced=True),
                "a_seq with a uniform random 0.2-3 ms gap before each output"),
    "c_chain": (lambda d, q: workloads.chain(d, 50 if q else 200),
                "200 requests one after another, one output per stage: admission, forward, final"),
    "b_64_batched": (lambda d, q: workloads.concurrent(d, 64, 20 if q else 50, batched=True),
                     "64 concurrent requests x 50 outputs, one batch per step"),
    "b_64_unbatched": (lambda d, q: workloads.concurrent(d, 64, 20 if q else 50, batched=False),
                       "64 concurrent requests x 50 outputs, each output on its own"),
    "b_512_batched": (lambda d, q: workloads.concurrent(d, 512, 10 if q else 50, batched=True),
                      "512 concurrent requests x 50 outputs, one batch per step"),
    "b_512_unbatched": (lambda d, q: workloads.concurrent(d, 512, 10 if q else 50, batched=False),
                        "512 concurrent requests x 50 outputs, each output on its own"),
    "idle": (lambda d, q: workloads.idle(d, 1.0 if q else 5.0),
             "orchestrator-thread CPU with no requests (5 s)"),
}

#: worker-process workloads (echo ones for trio-orch and the asyncio references; e2e trio-orch only)
ZMQ_WORKLOADS: dict[str, str] = {
    "zmq_a_seq": "a_seq over ZMQ echo workers: 1,000 requests one after another, one output each",
    "zmq_b_64": "64 concurrent requests x 50 outputs from ZMQ echo workers (worker batches per step)",
    "e2e": "default torch pipeline, stage by stage: time to first text and to first audio",
    "e2e_async_chunk": "default torch pipeline with async-chunk: time to first text and to first audio",
}

#: name -> driver factory
IMPLEMENTATIONS: dict[str, Callable[[], BenchDriver]] = {
    "floor": FloorDriver,
    "trio": TrioDriver,
    "trio-engine": EngineDriver,
    **ASYNCIO_DRIVERS,
}


def configure(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.description = (
        "Dispatch latency (a stage output handed over in the main thread -> the consumer in the main\n"
        "thread receives it through the thread bridge), forward and admission latency, throughput,\n"
        "orchestrator-thread CPU per output, idle CPU and shutdown time, for trio-orch, the asyncio\n"
        "references (vLLM-Omni event-driven and 1 ms polling, asyncio.TaskGroup) and the floor (a bare\n"
        "thread hand-off + one channel hop), interleaved in one run. Prints a table with ratios against\n"
        "trio-orch and the issue-6 targets; writes results.json, results.md and PNG plots to --out.")
    parser.epilog = ("workloads:\n" + "\n".join(f"  {k:16s} {v[1]}" for k, v in WORKLOADS.items())
                     + "\n" + "\n".join(f"  {k:16s} {v}" for k, v in ZMQ_WORKLOADS.items()))
    parser.add_argument("--quick", action="store_true",
                        help="smaller workloads and fewer rounds (under a minute)")
    parser.add_argument("--rounds", type=int, default=None,
                        help="interleaved rounds per workload (default 3, --quick 1)")
    parser.add_argument("--workloads", default=None,
                        help="comma-separated subset of the workloads below (default: all)")
    parser.add_argument("--impls", default=None,
                        help="comma-separated subset of the implementations (default: all); "
                             f"known: {', '.join(IMPLEMENTATIONS)}")
    parser.add_argument("--out", type=Path, default=Path("bench_results"),
                        help="directory for results.json, results.md and the PNG plots "
                             "(default ./bench_results)")
    parser.add_argument("--json", type=Path, default=None, help="also write the JSON to this path")
    parser.add_argument("--markdown", type=Path, default=None, help="also write the markdown to this path")
    parser.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    parser.add_argument("--readme", type=Path, default=None,
                        help="also put the table between the '<!-- bench:begin -->' and "
                             "'<!-- bench:end -->' markers of this file (e.g. README.md)")


def _pick(arg: str | None, known: dict[str, Any], what: str) -> list[str]:
    if not arg:
        return list(known)
    names = [x.strip() for x in arg.split(",") if x.strip()]
    bad = [n for n in names if n not in known]
    if bad:
        raise SystemExit(f"unknown {what}: {', '.join(bad)} (known: {', '.join(known)})")
    return names


class Progress:
    """A one-line progress bar on stderr."""

    def __init__(self, total: int) -> None:
        self.total, self.done, self.t0 = total, 0, time.perf_counter()
        self.tty = sys.stderr.isatty()

    def step(self, label: str) -> None:
        self.done += 1
        width = 30
        filled = int(width * self.done / self.total)
        line = (f"[{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} "
                f"{time.perf_counter() - self.t0:5.1f}s {label}")
        if self.tty:
            sys.stderr.write("\r" + line.ljust(100))
            if self.done == self.total:
                sys.stderr.write("\n")
        else:
            sys.stderr.write(line + "\n")
        sys.stderr.flush()


def _zmq_impls(workload: str, impl_names: list[str]) -> list[str]:
    """Who runs a worker-process workload: trio-orch, plus the asyncio references for echo ones."""
    if workload.startswith("e2e"):
        return ["trio"]
    return [i for i in impl_names if i in ZMQ_IMPLEMENTATIONS]


def _rounds(workload: str, rounds: int) -> int:
    """Idle CPU and the torch pipeline are measured once; the rest ``rounds`` times."""
    return 1 if workload == "idle" or workload.startswith("e2e") else rounds


def run_benchmark(workload_names: list[str], impl_names: list[str], rounds: int, quick: bool,
                  progress: Progress | None = None) -> tuple[dict[str, Any], dict[str, list[float]]]:
    """Run everything; return (results, raw a_seq latencies per implementation)."""
    results: dict[str, Any] = {"implementations": impl_names, "workloads": {}}
    raw_a_seq: dict[str, list[float]] = {}
    for wl in workload_names:
        if wl in ZMQ_WORKLOADS:
            zimpls = _zmq_impls(wl, impl_names)
            zruns: dict[str, list[dict[str, Any]]] = {i: [] for i in zimpls}
            for r in range(_rounds(wl, rounds)):
                order = list(zimpls)
                random.Random(r).shuffle(order)
                for impl in order:
                    zruns[impl].append(run_zmq_workload(wl, quick, impl))
                    if progress:
                        progress.step(f"{wl} {impl} (round {r + 1})")
            results["workloads"][wl] = {i: summarize(zruns[i]) for i in zimpls}
            continue
        fn = WORKLOADS[wl][0]
        runs: dict[str, list[dict[str, Any]]] = {i: [] for i in impl_names}
        for r in range(_rounds(wl, rounds)):
            order = list(impl_names)
            random.Random(r).shuffle(order)  # a different neighbour each round (power-state carry-over)
            for impl in order:
                driver = IMPLEMENTATIONS[impl]()
                driver.start(3, {0, 2})
                try:
                    res = fn(driver, quick)
                finally:
                    t = time.perf_counter()
                    driver.shutdown()
                    shutdown_s = time.perf_counter() - t
                res["shutdown_s"] = shutdown_s
                runs[impl].append(res)
                if progress:
                    progress.step(f"{wl} {impl} (round {r + 1}/{_rounds(wl, rounds)})")
        results["workloads"][wl] = {i: summarize(runs[i]) for i in impl_names}
        if wl == "a_seq":
            raw_a_seq = {i: [x for run in runs[i] for x in run["latency"]] for i in impl_names}
    results["targets"] = report.targets(results)
    return results, raw_a_seq


def run(args: argparse.Namespace) -> int:
    wls = _pick(args.workloads, {**WORKLOADS, **ZMQ_WORKLOADS}, "workload")
    impls = _pick(args.impls, IMPLEMENTATIONS, "implementation")
    if "trio" not in impls:
        impls.insert(0, "trio")  # ratios are against the Trio orchestrator
    rounds = args.rounds or (1 if args.quick else 3)
    progress = Progress(sum(_rounds(w, rounds) * len(_zmq_impls(w, impls) if w in ZMQ_WORKLOADS else impls)
                            for w in wls))
    results, raw = run_benchmark(wls, impls, rounds, args.quick, progress)
    results["meta"] = {
        "mode": "quick" if args.quick else "full", "rounds": rounds,
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}",
        "command": " ".join(["trio-orch", "bench", *sys.argv[2:]]) if sys.argv[1:2] == ["bench"]
        else "trio-orch bench",
    }
    print(report.text_report(results))
    args.out.mkdir(parents=True, exist_ok=True)
    report.write_json(results, args.out / "results.json")
    (args.out / "results.md").write_text(report.markdown_report(results))
    written = [args.out / "results.json", args.out / "results.md"]
    if args.json:
        report.write_json(results, args.json)
        written.append(args.json)
    if args.markdown:
        args.markdown.write_text(report.markdown_report(results))
        written.append(args.markdown)
    if not args.no_plots:
        written += report.plot(results, raw, args.out)
    if args.readme:
        report.update_between_markers(args.readme, report.readme_block(results, args.out))
        written.append(args.readme)
    print("\nwrote: " + ", ".join(str(p) for p in written))
    return 0
