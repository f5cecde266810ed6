"""Benchmark output: terminal tables (:mod:`bench.tables`), markdown, JSON, PNG plots, the floors' verdict.

Every number comes from the result dictionary of one run; nothing is typed in.
Targets are judged in :mod:`bench.perf.targets`, headlines written in
:mod:`bench.perf.headlines`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

from bench.drivers.floor import PATHS
from bench.drivers.zmq_floor import PATH as ZMQ_PATH
from bench.perf.headlines import headlines
from bench.perf.stats import ratio, verdict
from bench.perf.targets import BASE, get
from bench.perf.verdict import build as build_verdict
from bench.perf.verdict import quick
from bench.tables import markdown_table

__all__ = [
    "cdf_figure",
    "closing",
    "curve_rows",
    "floor_rows",
    "floors_hold",
    "markdown_report",
    "plot",
    "publish",
    "readme_block",
    "renderables",
    "table_rows",
    "target_rows",
    "text_report",
    "throughput_figure",
    "update_between_markers",
    "write_json",
]

#: the floor rows' path column, by the path their workload runs
FLOOR_LABEL = {"thread": "floor:\nthread", "loop": "floor:\nin-loop", "zmq": "floor:\nZMQ"}
#: what each path column word means (the legend)
PATH_LEGEND = {
    "push": "the shell takes the push path: a stage hands each batch to the shell's routing "
            "synchronously, no reader task in between",
    "reader": "a reader task per stage receives each batch and hands it on (task wake-ups the push path "
              "does not have)",
    "floor: thread": "the thread hand-off floor: " + PATHS["thread"],
    "floor: in-loop": "the in-loop floor: " + PATHS["loop"],
    "floor: ZMQ": "the ZMQ floor: " + ZMQ_PATH,
}
RATIO_LEGEND = ("x trio: this row / trio's. lower / higher: this row's 95 % interval lies wholly below / "
                "above trio's (a difference); =: the intervals overlap (no difference is claimed)")
HEADLINE_NOTE = ("model: trio vs asyncio-taskgroup (the same routing core and design choices, one on Trio, "
                 "one on asyncio; their thread bridges differ as their loops do); design: omni-event vs "
                 "asyncio-taskgroup (both asyncio, vLLM-Omni's design vs the Trio shell's); above the floor: "
                 "trio vs the floor of its path. Lower / higher only where the 95 % intervals do not "
                 "overlap.")
BOUNDS_LEGEND = ("x [bounds] (the verdict): a / b and the bounds the two 95 % intervals allow (a's low end / "
                 "b's high end to a's high end / b's low end); they exclude 1 exactly where it says lower / "
                 "higher")
CI_LEGEND = ("[lo-hi]: the 95 % percentile-bootstrap interval of that percentile over this run's samples "
             "(10,000 seeded resamples)")


def _path(results: dict[str, Any], wl: str, impl: str) -> str:
    res = get(results, wl, impl) or {}
    if impl in ("floor", "zmq-floor"):
        from bench.perf.workloads import path_of

        return FLOOR_LABEL[path_of(wl)]
    if "push" not in res:
        return "-"
    return "push" if res["push"] else "reader"


def _fmt(v: float | None, digits: int = 1) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    if abs(v) >= 1_000:
        return f"{v:,.0f}"
    return f"{v:.{digits}f}"


def concurrent(wl: str) -> bool:
    """Many outputs in flight at once: latency there is queueing, the floor bounds throughput and CPU."""
    return wl.startswith("b_") or "_b_" in wl


def _ci(lat: dict[str, Any], pct: str) -> str:
    """``p [lo-hi]``: a percentile and its interval."""
    v, ci = lat.get(f"{pct}_us"), lat.get(f"{pct}_ci_us")
    if v is None or v != v:
        return "-"
    if not ci or ci[0] != ci[0]:
        return _fmt(v)
    return f"{_fmt(v)}\n[{_fmt(ci[0])}-{_fmt(ci[1])}]"


def _vs(lat: dict[str, Any], base: dict[str, Any], pct: str, is_base: bool) -> str:
    """The ratio to trio's percentile, with the interval verdict (lower / higher / =)."""
    r = ratio(lat.get(f"{pct}_us"), base.get(f"{pct}_us"))
    if r is None:
        return "-"
    if is_base:
        return f"{r:.2f}"
    return f"{r:.2f}\n{verdict(lat.get(f'{pct}_ci_us'), base.get(f'{pct}_ci_us'))}"


def table_rows(results: dict[str, Any]) -> list[list[str]]:
    """One row per (workload, implementation), ratios against the Trio orchestrator."""
    header = ["workload", "impl", "path", "p50 us\n[95% CI]", "p99 us\n[95% CI]", "n", "outputs/s",
              "cpu\nus/out", "p50\nx trio", "p99\nx trio", "tput\nx trio"]
    rows = [header]
    for wl, per_impl in results.get("workloads", {}).items():
        for impl, res in per_impl.items():
            if "latency" not in res and "forward" not in res:  # idle CPU, end to end, the curve
                continue
            key = "latency" if "latency" in res else "forward"
            lat = res.get(key, {})
            base = per_impl.get(BASE, {}).get(key, {})
            rows.append([
                wl, impl, _path(results, wl, impl), _ci(lat, "p50"), _ci(lat, "p99"),
                f"{lat.get('n', 0):,}", _fmt(res.get("throughput_per_s"), 0),
                _fmt(res.get("cpu_us_per_output")),
                _vs(lat, base, "p50", impl == BASE), _vs(lat, base, "p99", impl == BASE),
                _fmt(ratio(res.get("throughput_per_s"), per_impl.get(BASE, {}).get("throughput_per_s")), 2),
            ])
    return rows


def floor_rows(results: dict[str, Any]) -> list[list[str]]:
    """Per workload with a floor: the floor's number and the best other row's; beaten or not.

    One output in flight (a_seq, c_chain, ...): p50 and p99 latency, beaten
    where another row's interval lies wholly below the floor's.  Many in
    flight (b_*): latency there is time spent queued behind other outputs,
    which depends on how producer and consumer share the interpreter, not on
    the hops; the floor bounds the cost per output there -- throughput and
    loop-thread CPU per output.
    """
    rows = [["workload", "floor of path", "measure", "floor", "best other", "verdict"]]
    judged = not quick(results)  # a quick run's intervals are too wide to judge a floor by

    def said(beaten: bool) -> str:
        return ("BEATEN" if beaten else "holds") if judged else "not judged"

    for wl, per_impl in results.get("workloads", {}).items():
        floor = next((f for f in ("floor", "zmq-floor") if f in per_impl), None)
        if floor is None or "latency" not in per_impl[floor]:
            continue
        others = {i: r for i, r in per_impl.items() if i != floor and "latency" in r}
        if not others:
            continue
        mine = per_impl[floor]
        bounds = _path(results, wl, floor).replace("floor:\n", "")
        if not concurrent(wl):
            for pct in ("p50", "p99"):
                best, low = min(((i, r["latency"]) for i, r in others.items()),
                                key=lambda x: x[1].get(f"{pct}_us", math.inf))
                beaten = verdict(low.get(f"{pct}_ci_us"), mine["latency"].get(f"{pct}_ci_us")) == "lower"
                rows.append([wl, bounds, f"{pct} us", _ci(mine["latency"], pct), f"{best} {_ci(low, pct)}",
                             said(beaten)])
            continue
        best_t = max(others, key=lambda i: others[i].get("throughput_per_s", 0.0))
        t_floor, t_best = mine.get("throughput_per_s"), others[best_t].get("throughput_per_s")
        rows.append([wl, bounds, "outputs/s", _fmt(t_floor, 0), f"{best_t} {_fmt(t_best, 0)}",
                     said(bool(t_floor and t_best and t_best > t_floor))])
        best_c = min(others, key=lambda i: others[i].get("cpu_us_per_output", math.inf))
        c_floor, c_best = mine.get("cpu_us_per_output"), others[best_c].get("cpu_us_per_output")
        beaten = c_floor is not None and c_best is not None and c_best < c_floor
        rows.append([wl, bounds, "cpu us/out", _fmt(c_floor), f"{best_c} {_fmt(c_best)}", said(beaten)])
    return rows


def floors_hold(results: dict[str, Any]) -> bool | None:
    """No implementation comes in under its floor beyond the intervals (every floor row holds).

    None where no floor is judged: a quick run, or a run without a floor row.
    """
    rows = floor_rows(results)[1:]
    if quick(results) or not rows:
        return None
    return all(r[-1] == "holds" for r in rows)


def chain_rows(results: dict[str, Any]) -> list[list[str]]:
    rows = [["impl", "admission\np50 us", "admission\np99 us", "fwd 0->1\np50 us", "fwd 1->2\np50 us",
             "fwd\np99 us", "final\np50 us"]]
    for impl, res in results.get("workloads", {}).get("c_chain", {}).items():
        rows.append([impl, _fmt(res.get("admission", {}).get("p50_us")),
                     _fmt(res.get("admission", {}).get("p99_us")),
                     _fmt(res.get("forward_0_1", {}).get("p50_us")),
                     _fmt(res.get("forward_1_2", {}).get("p50_us")),
                     _fmt(res.get("forward", {}).get("p99_us")),
                     _fmt(res.get("latency", {}).get("p50_us"))])
    return rows


def e2e_rows(results: dict[str, Any]) -> list[list[str]]:
    rows = [["pipeline", "requests", "first text\np50 ms", "first audio\np50 ms", "total\np50 ms"]]
    for wl in ("e2e", "e2e_async_chunk"):
        res = results.get("workloads", {}).get(wl, {}).get(BASE)
        if not res:
            continue
        keys = ("first_text", "first_audio", "total")
        ms = [(res.get(k, {}).get("p50_us") or math.nan) / 1000 for k in keys]
        rows.append(["async-chunk" if wl.endswith("chunk") else "stage by stage",
                     str(res.get("first_text", {}).get("n", 0)), *(_fmt(v) for v in ms)])
    return rows


def spread_rows(results: dict[str, Any]) -> list[list[str]]:
    """p99 of each round, for the tail-latency workloads: how much they move between rounds."""
    rows = [["workload", "impl", "p99 per round us\n(min-max)", "rounds"]]
    for wl in ("b_64_unbatched", "b_512_unbatched", "zmq_b_64", "loop_b_512_unbatched"):
        for impl, res in results.get("workloads", {}).get(wl, {}).items():
            p = res.get("p99_rounds_us")
            if p:
                rows.append([wl, impl, f"{min(p):,.0f}-{max(p):,.0f}", str(len(p))])
    return rows


def serving_rows(results: dict[str, Any]) -> list[list[str]]:
    """The serving benchmark: both fronts per pipeline (the workers' steps and CPU when the run measured
    them: a worker step sends one message, so steps per request say how many requests shared one)."""
    serving = {p: per for p, per in results.get("serving", {}).items() if isinstance(per, dict)}
    workers = any("worker_steps_per_request" in r for per in serving.values() for r in per.values())
    rows = [["pipeline", "front", "requests", "failed", "TTFC\np50 ms", "TTFC\np99 ms", "inter-chunk\np50 ms",
             "inter-chunk\np99 ms", "req/s", "server CPU\nms/req",
             *(["worker steps\n/req", "worker CPU\nms/req"] if workers else [])]]
    for pipe, per in serving.items():
        for front, r in per.items():
            rows.append([pipe, f"--loop {front}", str(r["requests"]), str(r["failed"]),
                         _fmt(r["ttfc"]["p50_us"] / 1e3, 2), _fmt(r["ttfc"]["p99_us"] / 1e3, 2),
                         _fmt(r["inter_chunk"]["p50_us"] / 1e3, 2), _fmt(r["inter_chunk"]["p99_us"] / 1e3, 2),
                         _fmt(r["requests_per_s"], 1), _fmt(r["server_cpu_ms_per_request"], 2),
                         *([_fmt(r.get("worker_steps_per_request", float("nan")), 1),
                            _fmt(r.get("worker_cpu_ms_per_request", float("nan")), 2)] if workers else [])])
    return rows


def curve_rows(results: dict[str, Any]) -> list[list[str]]:
    """The throughput curve (``b_sweep``): outputs/s per implementation at each concurrency."""
    per = results.get("workloads", {}).get("b_sweep", {})
    points = list(dict.fromkeys(n for res in per.values() for n in res.get("curve", {})))
    rows = [["impl", *(f"{n} in\nflight" for n in points)]]
    for impl, res in per.items():
        curve = res.get("curve", {})
        rows.append([impl, *(_fmt(curve.get(n, {}).get("throughput_per_s"), 0) for n in points)])
    return rows


def misc_rows(results: dict[str, Any]) -> list[list[str]]:
    rows = [["impl", "idle CPU %", "shutdown ms\n(median, in-process)", "shutdown ms\n(max, in-process)"]]
    wls = results.get("workloads", {})
    for impl in results.get("implementations", []):
        idle = wls.get("idle", {}).get(impl, {}).get("idle_cpu_pct")
        shut = [r["shutdown_ms"] for wl, per in wls.items() for i, r in per.items()
                if i == impl and "shutdown_ms" in r and not wl.startswith(("zmq", "e2e"))]
        med = sorted(s["median"] for s in shut)[len(shut) // 2] if shut else None
        mx = max((s["max"] for s in shut), default=None)
        rows.append([impl, _fmt(idle, 3), _fmt(med, 2), _fmt(mx, 2)])
    return rows


def target_rows(results: dict[str, Any]) -> list[list[str]]:
    """One row per target: its value, limit, whether met -- and for a missed one, the clauses that failed."""
    rows = [["target", "trio value", "limit", "met"]]
    for t in results.get("targets", []):
        met = {True: "yes", False: "MISSED", None: "not measured"}[t["met"]]
        if t["met"] is False and t.get("failed"):
            met = "MISSED: " + "; ".join(t["failed"])
        rows.append([t["target"], _fmt(t["value"], 1), t["limit"], met])
    return rows


def legend(results: dict[str, Any]) -> list[str]:
    """What the tables' words mean: the path column (only the words used), intervals, ratios."""
    used = {r[2].replace("\n", " ") for r in table_rows(results)[1:]}
    lines = [f"{k}: {v}" for k, v in PATH_LEGEND.items() if k in used]
    floors = ("floor not judged: a quick run's intervals are too wide to judge a floor by (a full run "
              "does)" if quick(results) else
              "floor holds / BEATEN: BEATEN where another row's interval lies wholly below the floor's")
    return [*lines, CI_LEGEND, RATIO_LEGEND, floors, BOUNDS_LEGEND]


class Section(NamedTuple):
    """One table of the report: its title, its rows (the header first) and which columns hold what."""

    title: str
    rows: list[list[str]]
    numbers: set[int]  #: columns of numbers (right-aligned, never wrapped)
    names: set[int]  #: columns of names (an implementation, a workload: never wrapped)


def _sections(results: dict[str, Any]) -> list[Section]:
    """Every table this run has, in order."""
    def section(title: str, rows: list[list[str]], first_number: int, names: int) -> Section:
        return Section(title, rows, set(range(first_number, len(rows[0]))), set(range(names)))

    out = [section("Dispatch latency and throughput (ratios: this implementation / trio)",
                   table_rows(results), 3, 3)]
    if len(floor_rows(results)) > 1:
        out.append(section("Floors: each bounds the path beside it, hop for hop", floor_rows(results), 3, 1))
    if len(curve_rows(results)) > 1:
        out.append(section("Throughput (b_sweep): outputs/s by requests in flight",
                           curve_rows(results), 1, 1))
    if "c_chain" in results.get("workloads", {}):
        out.append(section("c_chain: admission and forward latency", chain_rows(results), 1, 1))
    if len(e2e_rows(results)) > 1:
        out.append(section("End to end, default torch pipeline (trio-orch)", e2e_rows(results), 1, 0))
    if len(spread_rows(results)) > 1:
        out.append(section("Tail latency: p99 of each round", spread_rows(results), 2, 2))
    if len(serving_rows(results)) > 1:
        conc = results["serving"].get("concurrency")
        out.append(section(f"Serving: serve --loop trio vs --loop asyncio, {conc} streaming clients",
                           serving_rows(results), 2, 0))
    out += [section("Idle CPU and shutdown", misc_rows(results), 1, 1),
            Section("Targets (trio-orch, this run)", target_rows(results), {1, 2}, set())]
    return out


def renderables(results: dict[str, Any]) -> list[Any]:
    """The rich tables of this run and the legend, for a console."""
    from bench.perf.workloads import WORKLOADS
    from bench.tables import table

    parts: list[Any] = []
    for n, (title, rows, numbers, names) in enumerate(_sections(results)):
        if n == 0:  # the main table, one per workload (the workload in the title): it fits 100 columns
            parts.append(title)
            for wl in dict.fromkeys(r[0] for r in rows[1:]):
                what = WORKLOADS[wl].description if wl in WORKLOADS else ""
                mine = [r for r in rows[1:] if r[0] == wl]
                ns = {r[5] for r in mine}
                drop = {0}  # the workload: in the title
                if len(ns) == 1:  # the sample count too: the table fits 100 columns
                    what += f" ({ns.pop()} samples each)"
                    drop.add(5)
                keep = [j for j in range(len(rows[0])) if j not in drop]
                parts.append(table([rows[0][j] for j in keep], [[r[j] for j in keep] for r in mine],
                                   title=f"{wl}: {what}",
                                   numbers={k for k, j in enumerate(keep) if j in numbers},
                                   names={k for k, j in enumerate(keep) if j in names}))
            continue
        parts.append(table(rows[0], rows[1:], title=title, numbers=numbers, names=names,
                           flex={0: 2, 3: 3} if title.startswith("Targets") else None))
    parts.append("Legend\n" + "\n".join(f"  {line}" for line in legend(results)))
    note = missed_note(results)
    if note:
        parts.append(note)
    return parts


def closing(results: dict[str, Any]) -> Any:
    """The verdict that closes the report (:mod:`bench.perf.verdict`), for a console."""
    return build_verdict(results, floors_hold(results)).renderable()


def text_report(results: dict[str, Any], columns: int | None = None) -> str:
    """Every table of the run and its verdict as plain text, ``columns`` wide (default: the terminal's)."""
    from bench.tables import render

    return render([*renderables(results), closing(results)], columns)


def missed_note(results: dict[str, Any]) -> str:
    """For missed targets: the same run's floor, and where the profile is."""
    if not any(t["met"] is False for t in results.get("targets", [])):
        return ""
    floor = get(results, "a_seq", "floor", "latency", "p50_us")
    where = ("; " + f"the thread hand-off floor (two plain-thread wake-ups, no loop, no routing) measured "
             f"a_seq p50 {floor:.1f} us in this run") if isinstance(floor, float) else ""
    return f"Missed targets are explained, with profiles, in docs/performance.md{where}."


def markdown_report(results: dict[str, Any]) -> str:
    meta = results.get("meta", {})
    parts = [f"# Benchmark results ({meta.get('mode', '?')} run, {meta.get('date', '?')})", "",
             f"Machine: {meta.get('machine', '?')}. Command: `{meta.get('command', 'trio-orch bench')}`. "
             f"Load (`uptime`) before / after: {meta.get('load_before', '?')} / "
             f"{meta.get('load_after', '?')}.", ""]
    for title, rows, *_ in _sections(results):
        parts += [f"## {title}", "", markdown_table(rows), ""]
    parts += ["Legend:", "", *(f"- {line}" for line in legend(results)), "", missed_note(results), ""]
    lines = headlines(results) + headlines(results, "p99")
    if lines:
        parts[4:4] = ["## Headlines: model, design, floor", "", HEADLINE_NOTE, "",
                      *(f"- {h}" for h in lines), ""]
    return "\n".join(parts) + "\n" + build_verdict(results, floors_hold(results)).markdown()


def write_json(results: dict[str, Any], path: Path) -> None:
    path.write_text(json.dumps(results, indent=2, sort_keys=False, default=float))


def _lines_figure(lines: dict[str, tuple[Any, Any]], title: str, xlabel: str, ylabel: str,
                  **style: Any) -> tuple[Any, Any]:
    """(figure, axes): one line per label, a grid, and the legend beside the axes (it hides no data)."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8.5, 4.2), layout="constrained")
    ax = fig.add_subplot()
    for label, (xs, ys) in lines.items():
        ax.plot(xs, ys, label=label, **style)
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, which="both", alpha=0.3)
    fig.legend(loc="outside right upper")
    return fig, ax


def cdf_figure(raw_latency: dict[str, list[float]]) -> Any:
    """The a_seq dispatch-latency CDF, one line per implementation."""
    import numpy as np

    lines = {}
    for impl, samples in raw_latency.items():
        if samples:
            a = np.sort(np.asarray(samples) * 1e6)
            lines[impl] = (a, np.arange(1, a.size + 1) / a.size)
    fig, ax = _lines_figure(lines, "a_seq: dispatch latency CDF", "dispatch latency (µs, log scale)",
                            "fraction of outputs")
    ax.set_xscale("log")
    return fig


def throughput_figure(results: dict[str, Any]) -> Any:
    """The throughput curve (``b_sweep``): outputs/s against requests in flight; None without a curve."""
    lines = {}
    for impl, res in results.get("workloads", {}).get("b_sweep", {}).items():
        pts = sorted((int(n), p["throughput_per_s"]) for n, p in res.get("curve", {}).items())
        if pts:
            lines[impl] = ([n for n, _ in pts], [t for _, t in pts])
    if not lines:
        return None
    fig, ax = _lines_figure(lines, "b_sweep: throughput vs concurrency",
                            "requests in flight (each output handed over on its own; log scale)",
                            "outputs / s (log scale)", marker="o")
    points = sorted({n for xs, _ in lines.values() for n in xs})
    ax.set_xscale("log", base=2)
    ax.set_xticks(points, labels=[str(n) for n in points])
    ax.set_yscale("log")
    return fig


def plot(results: dict[str, Any], raw_latency: dict[str, list[float]], out_dir: Path) -> list[Path]:
    """Write the plots this run has: the a_seq latency CDF, the throughput curve; their paths."""
    figures = {"a_seq_latency_cdf.png": cdf_figure(raw_latency) if raw_latency else None,
               "throughput_vs_concurrency.png": throughput_figure(results)}
    written: list[Path] = []
    for name, fig in figures.items():
        if fig is not None:
            fig.savefig(out_dir / name, dpi=110)
            written.append(out_dir / name)
    return written


BEGIN, END = "<!-- bench:begin -->", "<!-- bench:end -->"


def readme_block(results: dict[str, Any], out_dir: Path) -> str:
    """The table and one plot, for the README."""
    meta = results.get("meta", {})
    rows = [r for r in table_rows(results)
            if r[0] in ("workload", "a_seq", "loop_a_seq", "b_512_unbatched", "zmq_a_seq")]
    rows = [[c for j, c in enumerate(r) if j not in (5, 7)] for r in rows]  # n and cpu: in results.md
    parts = [f"Latest run: {meta.get('mode', '?')}, {meta.get('date', '?')}, {meta.get('machine', '?')} "
             f"(`{meta.get('command', 'trio-orch bench')}`; all workloads in "
             f"[{out_dir}/results.md]({out_dir}/results.md)).", "", markdown_table(rows), "",
             *(["Headlines (p50). " + HEADLINE_NOTE, "", *(f"- {h}" for h in headlines(results)), ""]
               if headlines(results) else []),
             *([markdown_table(serving_rows(results)), ""] if len(serving_rows(results)) > 1 else []),
             markdown_table(target_rows(results)), "", missed_note(results), "",
             "Intervals: 95 % bootstrap; a ratio says lower / higher only where the intervals do not "
             "overlap (else =); the path column and the floors: "
             "[docs/performance.md](docs/performance.md).", "",
             f"![a_seq dispatch latency CDF]({out_dir}/a_seq_latency_cdf.png)"]
    return "\n".join(parts)


def publish(out: dict[str, Any], json_path: str | None, markdown_path: str | None,
            render: Callable[[dict[str, Any]], str], begin: str, end: str) -> None:
    """A benchmark's results: printed as JSON, written to ``json_path``, rendered into ``markdown_path``."""
    text = json.dumps(out, indent=2)
    print(text)
    if json_path:
        Path(json_path).write_text(text + "\n")
    if markdown_path:
        update_between_markers(Path(markdown_path), render(out), begin, end)


def update_between_markers(path: Path, block: str, begin: str = BEGIN, end: str = END) -> None:
    """Replace what stands between the markers ``begin`` / ``end`` of ``path`` (which must have them).

    ``block`` goes in on its own lines; every benchmark that renders into a
    document writes through here.
    """
    text = path.read_text()
    if begin not in text or end not in text:
        raise SystemExit(f"{path}: no '{begin}' ... '{end}' markers to put the table between")
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    path.write_text(f"{head}{begin}\n{block.rstrip(chr(10))}\n{end}{tail}")
