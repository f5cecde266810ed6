"""``trio-orch bench``: dispatch latency and throughput, every implementation in one run.

Implementations come from :mod:`bench.implementations`, workloads from
:mod:`bench.perf.workloads`; a workload runs on every chosen implementation
that supports what it needs.

Implementations run interleaved (round r runs each of them once, in a
shuffled order, and sequential workloads start with untimed warm-up
outputs) so machine drift and power-state carry-over hit all alike; each
run starts a fresh orchestrator, runs the workload and measures its shutdown.  Results are merged per
(workload, implementation) and every ratio is computed from this run's numbers.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import random
import sys
from pathlib import Path
from typing import Any

from bench.implementations import IMPLEMENTATIONS, SKIPPED, names
from bench.perf import report
from bench.perf.stats import COVERAGE, RESAMPLES, SEED, summarize
from bench.perf.targets import targets
from bench.perf.workloads import SWEEP_OUTPUTS_QUICK, WORKLOADS, run_workload
from bench.tables import StepProgress


def configure(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.description = (
        "Dispatch latency (a stage output handed over in the main thread -> the consumer in the main\n"
        "thread receives it through the thread bridge), forward and admission latency, throughput,\n"
        "orchestrator-thread CPU per output, idle CPU and shutdown time, for trio-orch (direct and through\n"
        "the production thread adapter), the asyncio references (vLLM-Omni event-driven and 1 ms polling,\n"
        "asyncio.TaskGroup) and the floors, interleaved in one run (worker workloads: on those that\n"
        "support worker processes). A floor takes every hop of its path and nothing else: the thread\n"
        "hand-off floor (two plain-thread wake-ups), the in-loop floor (one task wake-up), the ZMQ floor\n"
        "(the socket round trip and the two thread hops). p50 and p99 come with 95 % bootstrap intervals;\n"
        "a ratio against trio-orch says lower / higher only where the intervals do not overlap (else =).\n"
        "A full run (3 rounds) takes at least 10,000 latency samples per implementation and workload.\n"
        "Prints the tables (fitted to the terminal, with a legend) and the performance targets (a\n"
        "missed one names the clause that failed); writes results.json, results.md and PNG plots (the\n"
        "a_seq latency CDF, the throughput curve) to --out; ends with a verdict of at most ten lines:\n"
        "targets met and missed, the headline ratios with their bounds, whether the floors held.")
    parser.epilog = ("workloads:\n"
                     + "\n".join(f"  {k:16s} {w.description}" for k, w in WORKLOADS.items())
                     + "\nimplementations:\n"
                     + "\n".join(f"  {k:18s} {i.description}" for k, i in IMPLEMENTATIONS.items()))
    parser.add_argument("--quick", action="store_true",
                        help="one round of small workloads (a few hundred latency samples per row, "
                             f"{SWEEP_OUTPUTS_QUICK:,} outputs per point of the throughput curve; about a "
                             "minute or two on 2 cores): checks that every workload runs and shows the "
                             "shape of the results; its intervals are wide, so it judges no floor")
    parser.add_argument("--rounds", type=int, default=None,
                        help="interleaved rounds per workload (default 3, --quick 1)")
    parser.add_argument("--workloads", default=None,
                        help="comma-separated subset of the workloads below (default: all)")
    parser.add_argument("--impls", default=None,
                        help="comma-separated subset of the implementations (default: all); "
                             f"known: {', '.join([*IMPLEMENTATIONS, *SKIPPED])}")
    parser.add_argument("--out", type=Path, default=Path("bench_results"),
                        help="directory for results.json, results.md and the PNG plots "
                             "(default ./bench_results)")
    parser.add_argument("--json", type=Path, default=None, help="also write the JSON to this path")
    parser.add_argument("--markdown", type=Path, default=None, help="also write the markdown to this path")
    parser.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    parser.add_argument("--serving", action="store_true",
                        help="also run the serving benchmark: trio-orch serve --loop trio vs --loop asyncio, "
                             "N concurrent streaming clients over loopback (echo workers and the default "
                             "torch pipeline): time to first chunk, inter-chunk latency, requests/s, server "
                             "CPU per request")
    parser.add_argument("--serving-only", action="store_true", help="only the serving benchmark")
    parser.add_argument("--concurrency", type=int, default=64,
                        help="concurrent streaming clients of the serving benchmark (default 64)")
    parser.add_argument("--readme", type=Path, default=None,
                        help="also put the table between the '<!-- bench:begin -->' and "
                             "'<!-- bench:end -->' markers of this file (a page of yours; the run "
                             "of record lives in docs/performance.md)")


def _pick(arg: str | None, known: dict[str, Any], what: str) -> list[str]:
    if not arg:
        return list(known)
    picked = [x.strip() for x in arg.split(",") if x.strip()]
    bad = [n for n in picked if n not in known]
    if bad:
        raise SystemExit(f"unknown {what}: {', '.join(bad)} (known: {', '.join(known)})")
    return picked


def _impls_for(workload: str, impl_names: list[str]) -> list[str]:
    """The chosen implementations that can run ``workload``."""
    able = set(names(WORKLOADS[workload].needs))
    return [i for i in impl_names if i in able]


def _rounds(workload: str, rounds: int) -> int:
    """Idle CPU and the torch pipeline are measured once; the rest ``rounds`` times."""
    return 1 if WORKLOADS[workload].once else rounds


def run_benchmark(workload_names: list[str], impl_names: list[str], rounds: int, quick: bool,
                  progress: StepProgress | None = None) -> tuple[dict[str, Any], dict[str, list[float]]]:
    """Run everything; return (results, raw a_seq latencies per implementation)."""
    results: dict[str, Any] = {"implementations": impl_names, "workloads": {}}
    raw_a_seq: dict[str, list[float]] = {}
    for wl in workload_names:
        impls = _impls_for(wl, impl_names)
        runs: dict[str, list[dict[str, Any]]] = {i: [] for i in impls}
        n_rounds = _rounds(wl, rounds)
        for r in range(n_rounds):
            order = list(impls)
            random.Random(r).shuffle(order)  # a different neighbour each round (power-state carry-over)
            for impl in order:
                runs[impl].append(run_workload(wl, impl, quick))
                if progress:
                    progress.step(f"{wl} {impl} (round {r + 1}/{n_rounds})")
        results["workloads"][wl] = {i: summarize(runs[i]) for i in impls}
        if wl == "a_seq":
            raw_a_seq = {i: [x for run in runs[i] for x in run["latency"]] for i in impls}
    # the registry's order, whatever order they ran in (a run may put the riskiest first)
    results["workloads"] = {w: results["workloads"][w] for w in WORKLOADS if w in results["workloads"]}
    results["targets"] = targets(results)
    return results, raw_a_seq


def serving_pipelines(quick: bool) -> dict[str, list[str]]:
    """The serving benchmark's pipelines: serve flags by name (``{echo}``: the echo config's path)."""
    pipes = {"echo workers": ["--config", "{echo}"]}
    if not quick:
        pipes["torch pipeline"] = []
    return pipes


def _per_request(runs: list[dict[str, Any]], key: str, ok: int, scale: float = 1.0) -> float:
    """``key`` summed over the rounds, per request (NaN when a round did not measure it)."""
    if not ok or any(key not in r for r in runs):
        return float("nan")
    return sum(r[key] for r in runs) / ok * scale


def summarize_serving(raw: dict[str, Any], concurrency: int) -> dict[str, Any]:
    """Per pipeline and front: TTFC and inter-chunk percentiles (us), requests/s, server CPU ms/request,
    and the workers' steps and CPU ms per request."""
    from bench.perf.stats import percentiles_us

    out: dict[str, Any] = {"concurrency": concurrency}
    for pipe, per_front in raw.items():
        out[pipe] = {}
        for front, runs in per_front.items():
            ok = sum(r["ok"] for r in runs)
            wall = sum(r["wall_s"] for r in runs)
            cpu = sum(r["server_cpu_s"] for r in runs)
            out[pipe][front] = {
                "rounds": len(runs), "requests": ok, "failed": sum(r["failed"] for r in runs),
                "ttfc": percentiles_us([x for r in runs for x in r["ttfc"]]),
                "inter_chunk": percentiles_us([x for r in runs for x in r["gaps"]]),
                "requests_per_s": ok / wall if wall else float("nan"),
                "server_cpu_ms_per_request": cpu / ok * 1e3 if ok else float("nan"),
                "requests_per_s_rounds": [r["ok"] / r["wall_s"] for r in runs if r["wall_s"]],
            }
            if runs and all("worker_steps" in r for r in runs):  # the workers were measured
                out[pipe][front].update(worker_steps_per_request=_per_request(runs, "worker_steps", ok),
                                        worker_cpu_ms_per_request=_per_request(runs, "worker_cpu_s", ok, 1e3))
    return out


def run(args: argparse.Namespace) -> int:
    wls = _pick(args.workloads, WORKLOADS, "workload")
    asked = [x.strip() for x in (args.impls or "").split(",") if x.strip()]
    for name in (n for n in SKIPPED if not asked or n in asked):
        print(f"{name}: skipped: {SKIPPED[name]}", file=sys.stderr)
    if asked:
        args.impls = ",".join(n for n in asked if n not in SKIPPED)
    impls = _pick(args.impls, IMPLEMENTATIONS, "implementation")
    if "trio" not in impls:
        impls.insert(0, "trio")  # ratios are against the Trio orchestrator
    rounds = args.rounds or (1 if args.quick else 3)
    if args.serving_only:
        wls = []
    serving = args.serving or args.serving_only
    pipelines = serving_pipelines(args.quick) if serving else {}
    total = sum(_rounds(w, rounds) * len(_impls_for(w, impls)) for w in wls) + 2 * rounds * len(pipelines)
    load_before = os.getloadavg()
    with StepProgress(total, "bench") as progress:
        results, raw = run_benchmark(wls, impls, rounds, args.quick, progress)
        if serving:
            import tempfile

            from bench.perf import serving as sv

            with tempfile.TemporaryDirectory() as tmp:
                flags = {name: [a.replace("{echo}", sv.echo_pipeline_file(16, tmp)) for a in f]
                         for name, f in pipelines.items()}
                raw_serving = sv.compare_fronts(flags, concurrency=args.concurrency, rounds=rounds,
                                                seconds=2.0 if args.quick else 6.0, progress=progress)
            results["serving"] = summarize_serving(raw_serving, args.concurrency)
            results["targets"] = targets(results)
    results["meta"] = {
        "mode": "quick" if args.quick else "full", "rounds": rounds,
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}",
        "load_before": " ".join(f"{x:.2f}" for x in load_before),
        "load_after": " ".join(f"{x:.2f}" for x in os.getloadavg()),
        "intervals": {"coverage": COVERAGE, "resamples": RESAMPLES, "seed": SEED,
                      "method": "percentile bootstrap over the samples of all rounds"},
        "command": " ".join(["trio-orch", "bench", *sys.argv[2:]]) if sys.argv[1:2] == ["bench"]
        else "trio-orch bench",
    }
    results["meta"]["floors_hold"] = report.floors_hold(results)  # None in a quick run: not judged
    from bench.tables import console, text

    out = console()
    for part in report.renderables(results):
        out.print(text(part) if isinstance(part, str) else part)  # brackets in a legend are not markup
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
    out.print(text("\nwrote: " + ", ".join(str(p) for p in written)))
    out.print(report.closing(results))  # the report ends with its verdict
    return 0
