"""Benchmark output: terminal table, markdown, JSON, PNG plots, target verdicts.

Every number comes from the result dictionary of one run; nothing is typed in.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from bench.perf.stats import ratio

#: the implementation every ratio and target is judged against
BASE = "trio"


def _get(results: dict[str, Any], wl: str, impl: str, *path: str) -> float | None:
    node: Any = results.get("workloads", {}).get(wl, {}).get(impl)
    for key in path:
        if not isinstance(node, dict) or key not in node:
            return None
        node = node[key]
    return node if isinstance(node, (int, float)) else None


def _refs(results: dict[str, Any]) -> list[str]:
    """The asyncio references (not trio-orch's own rows, not the floor)."""
    return [i for i in results.get("implementations", []) if i.startswith(("omni", "asyncio"))]


def targets(results: dict[str, Any]) -> list[dict[str, Any]]:
    """The performance targets (docs/performance.md), each judged from this run's numbers."""
    rows: list[dict[str, Any]] = []

    def add(name: str, value: float | None, limit: str, ok: bool | None) -> None:
        rows.append({"target": name, "value": value, "limit": limit,
                     "met": ok if value is not None else None})

    refs = _refs(results)
    for pct, lim in (("p50_us", 30.0), ("p99_us", 60.0)):
        v = _get(results, "a_seq", BASE, "latency", pct)
        others = [_get(results, "a_seq", r, "latency", pct) for r in refs]
        others_ok = all(o is None or (v is not None and v < o) for o in others)
        add(f"a_seq {pct[:3]} <= {lim:.0f} us and below every asyncio reference", v,
            f"<= {lim:.0f}", v is not None and v <= lim and others_ok)
    v = _get(results, "c_chain", BASE, "forward", "p50_us")
    add("forward latency p50 <= 50 us", v, "<= 50", v is not None and v <= 50)
    v = _get(results, "b_512_unbatched", BASE, "throughput_per_s")
    others = [_get(results, "b_512_unbatched", r, "throughput_per_s") for r in refs]
    add("b_512_unbatched >= 50,000 outputs/s and above every asyncio reference", v, ">= 50000",
        v is not None and v >= 50_000 and all(o is None or v > o for o in others))
    v = _get(results, "b_64_batched", BASE, "cpu_us_per_output")
    add("orchestrator CPU <= 25 us per output in b_64_batched", v, "<= 25", v is not None and v <= 25)
    v = _get(results, "idle", BASE, "idle_cpu_pct")
    add("idle CPU < 0.5 %", v, "< 0.5", v is not None and v < 0.5)
    v = _get(results, "zmq_a_seq", BASE, "latency", "p50_us")
    add("ZMQ echo workers: a_seq p50 <= 80 us", v, "<= 80", v is not None and v <= 80)
    v = _get(results, "loop_a_seq", BASE, "latency", "p50_us")
    others = [_get(results, "loop_a_seq", r, "latency", "p50_us") for r in refs]
    add("in-loop a_seq p50 <= 12 us and below every asyncio reference", v, "<= 12",
        v is not None and v <= 12 and all(o is None or v < o for o in others))
    v = _get(results, "zmq_a_seq", BASE, "latency", "p50_us")
    floor = _get(results, "zmq_a_seq", "zmq-floor", "latency", "p50_us")
    others = [_get(results, "zmq_a_seq", r, "latency", "p50_us") for r in refs]
    if floor is not None:
        add("zmq_a_seq p50 <= 1.5 x the zmq floor and below every asyncio reference", v,
            f"<= {1.5 * floor:.1f}",
            v is not None and v <= 1.5 * floor and all(o is None or v < o for o in others))
    for wl in ("b_512_unbatched", "b_64_unbatched", "zmq_b_64"):
        v = _get(results, wl, BASE, "latency", "p99_us")
        others = [_get(results, wl, r, "latency", "p99_us") for r in refs]
        tput = _get(results, wl, BASE, "throughput_per_s")
        best = max((o for o in (_get(results, wl, r, "throughput_per_s") for r in refs) if o is not None),
                   default=None)
        add(f"{wl} p99 <= every asyncio reference's (throughput not below theirs)", v,
            f"<= {min((o for o in others if o is not None), default=float('nan')):.0f}",
            v is not None and all(o is None or v <= o for o in others)
            and (best is None or tput is None or tput >= best))
    serving = results.get("serving", {}).get("echo workers", {})
    trio_f, asy_f = serving.get("trio"), serving.get("asyncio")
    if trio_f and asy_f:
        conc = results["serving"].get("concurrency")
        for key, what in (("ttfc", "time to first chunk"), ("inter_chunk", "inter-chunk latency")):
            t, a = trio_f[key]["p50_us"], asy_f[key]["p50_us"]
            add(f"serving (echo workers, {conc} clients): --loop trio p50 {what} >= 20 % below "
                "--loop asyncio", t, f"<= {0.8 * a:.0f}", t <= 0.8 * a)
        t, a = trio_f["requests_per_s"], asy_f["requests_per_s"]
        add(f"serving (echo workers, {conc} clients): --loop trio requests/s not below --loop asyncio", t,
            f">= {a:.1f}", t >= a)
    return [r for r in rows if r["value"] is not None or r["target"].startswith(("a_seq", "forward"))]


def _fmt(v: float | None, digits: int = 1) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    if abs(v) >= 10_000:
        return f"{v:,.0f}"
    return f"{v:.{digits}f}"


def table_rows(results: dict[str, Any]) -> list[list[str]]:
    """One row per (workload, implementation), ratios against the Trio orchestrator."""
    header = ["workload", "impl", "p50 us", "p90 us", "p99 us", "max us", "outputs/s", "cpu us/out",
              "p50 x trio", "p99 x trio", "tput x trio"]
    rows = [header]
    for wl, per_impl in results.get("workloads", {}).items():
        for impl, res in per_impl.items():
            if wl == "idle" or wl.startswith("e2e"):
                continue
            key = "latency" if "latency" in res else "forward"
            lat = res.get(key, {})
            base = per_impl.get(BASE, {}).get(key, {})
            rows.append([
                wl, impl, _fmt(lat.get("p50_us")), _fmt(lat.get("p90_us")), _fmt(lat.get("p99_us")),
                _fmt(lat.get("max_us")), _fmt(res.get("throughput_per_s"), 0),
                _fmt(res.get("cpu_us_per_output")),
                _fmt(ratio(lat.get("p50_us"), base.get("p50_us")), 2),
                _fmt(ratio(lat.get("p99_us"), base.get("p99_us")), 2),
                _fmt(ratio(res.get("throughput_per_s"), per_impl.get(BASE, {}).get("throughput_per_s")), 2),
            ])
    return rows


def chain_rows(results: dict[str, Any]) -> list[list[str]]:
    rows = [["impl", "admission p50 us", "admission p99 us", "fwd 0->1 p50 us", "fwd 1->2 p50 us",
             "fwd p99 us", "final p50 us"]]
    for impl, res in results.get("workloads", {}).get("c_chain", {}).items():
        rows.append([impl, _fmt(res.get("admission", {}).get("p50_us")),
                     _fmt(res.get("admission", {}).get("p99_us")),
                     _fmt(res.get("forward_0_1", {}).get("p50_us")),
                     _fmt(res.get("forward_1_2", {}).get("p50_us")),
                     _fmt(res.get("forward", {}).get("p99_us")),
                     _fmt(res.get("latency", {}).get("p50_us"))])
    return rows


def e2e_rows(results: dict[str, Any]) -> list[list[str]]:
    rows = [["pipeline", "requests", "first text p50 ms", "first audio p50 ms", "total p50 ms"]]
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
    rows = [["workload", "impl", "p99 per round us (min-max)", "rounds"]]
    for wl in ("b_64_unbatched", "b_512_unbatched", "zmq_b_64", "loop_b_512_unbatched"):
        for impl, res in results.get("workloads", {}).get(wl, {}).items():
            p = res.get("p99_rounds_us")
            if p:
                rows.append([wl, impl, f"{min(p):,.0f}-{max(p):,.0f}", str(len(p))])
    return rows


def serving_rows(results: dict[str, Any]) -> list[list[str]]:
    """The serving benchmark: both fronts per pipeline."""
    rows = [["pipeline", "front", "requests", "failed", "TTFC p50 ms", "TTFC p99 ms", "inter-chunk p50 ms",
             "inter-chunk p99 ms", "req/s", "server CPU ms/req"]]
    for pipe, per in results.get("serving", {}).items():
        if not isinstance(per, dict):
            continue
        for front, r in per.items():
            rows.append([pipe, f"--loop {front}", str(r["requests"]), str(r["failed"]),
                         _fmt(r["ttfc"]["p50_us"] / 1e3, 2), _fmt(r["ttfc"]["p99_us"] / 1e3, 2),
                         _fmt(r["inter_chunk"]["p50_us"] / 1e3, 2), _fmt(r["inter_chunk"]["p99_us"] / 1e3, 2),
                         _fmt(r["requests_per_s"], 1), _fmt(r["server_cpu_ms_per_request"], 2)])
    return rows


def misc_rows(results: dict[str, Any]) -> list[list[str]]:
    rows = [["impl", "idle CPU %", "shutdown ms (median, in-process)", "shutdown ms (max, in-process)"]]
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
    rows = [["target", "trio value", "limit", "met"]]
    for t in results.get("targets", []):
        met = {True: "yes", False: "MISSED", None: "not measured"}[t["met"]]
        rows.append([t["target"], _fmt(t["value"], 1), t["limit"], met])
    return rows


def render_text(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = []
    for n, r in enumerate(rows):
        cells = enumerate(zip(r, widths, strict=True))
        lines.append("  ".join(c.rjust(w) if j >= 2 else c.ljust(w) for j, (c, w) in cells))
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def render_markdown(rows: list[list[str]]) -> str:
    out = ["| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0])]
    out += ["| " + " | ".join(r) + " |" for r in rows[1:]]
    return "\n".join(out)


def text_report(results: dict[str, Any]) -> str:
    parts = ["Dispatch latency and throughput (ratios: this implementation / trio)",
             render_text(table_rows(results))]
    if "c_chain" in results.get("workloads", {}):
        parts += ["", "c_chain: admission and forward latency", render_text(chain_rows(results))]
    if len(e2e_rows(results)) > 1:
        parts += ["", "End to end, default torch pipeline (trio-orch)", render_text(e2e_rows(results))]
    if len(spread_rows(results)) > 1:
        parts += ["", "Tail latency: p99 of each round", render_text(spread_rows(results))]
    if len(serving_rows(results)) > 1:
        conc = results["serving"].get("concurrency")
        parts += ["", f"Serving: trio-orch serve --loop trio vs --loop asyncio, {conc} streaming clients",
                  render_text(serving_rows(results))]
    parts += ["", "Idle CPU and shutdown", render_text(misc_rows(results)),
              "", "Targets (trio-orch, this run)", render_text(target_rows(results))]
    note = missed_note(results)
    if note:
        parts += ["", note]
    return "\n".join(parts)


def missed_note(results: dict[str, Any]) -> str:
    """For missed targets: the same run's floor, and where the profile is."""
    if not any(t["met"] is False for t in results.get("targets", [])):
        return ""
    floor = _get(results, "a_seq", "floor", "latency", "p50_us")
    where = ("; " + f"the floor (thread hand-off + one channel hop, no routing) measured a_seq p50 "
             f"{floor:.1f} us in this run") if floor is not None else ""
    return f"Missed targets are explained, with profiles, in docs/performance.md{where}."


def markdown_report(results: dict[str, Any]) -> str:
    meta = results.get("meta", {})
    parts = [f"# Benchmark results ({meta.get('mode', '?')} run, {meta.get('date', '?')})", "",
             f"Machine: {meta.get('machine', '?')}. Command: `{meta.get('command', 'trio-orch bench')}`. "
             f"Load (`uptime`) before / after: {meta.get('load_before', '?')} / "
             f"{meta.get('load_after', '?')}.", "",
             "## Dispatch latency and throughput", "", render_markdown(table_rows(results))]
    if "c_chain" in results.get("workloads", {}):
        parts += ["", "## c_chain: admission and forward latency", "", render_markdown(chain_rows(results))]
    if len(e2e_rows(results)) > 1:
        parts += ["", "## End to end, default torch pipeline (trio-orch)", "",
                  render_markdown(e2e_rows(results))]
    if len(spread_rows(results)) > 1:
        parts += ["", "## Tail latency: p99 of each round", "", render_markdown(spread_rows(results))]
    if len(serving_rows(results)) > 1:
        conc = results["serving"].get("concurrency")
        parts += ["", f"## Serving: `serve --loop trio` vs `--loop asyncio`, {conc} streaming clients", "",
                  render_markdown(serving_rows(results))]
    parts += ["", "## Idle CPU and shutdown", "", render_markdown(misc_rows(results)),
              "", "## Targets", "", render_markdown(target_rows(results)), "", missed_note(results), ""]
    return "\n".join(parts)


def write_json(results: dict[str, Any], path: Path) -> None:
    path.write_text(json.dumps(results, indent=2, sort_keys=False, default=float))


def plot(results: dict[str, Any], raw_latency: dict[str, list[float]], out_dir: Path) -> list[Path]:
    """Latency CDF for a_seq per implementation; throughput vs concurrency."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    written: list[Path] = []
    if raw_latency:
        fig, ax = plt.subplots(figsize=(7, 4.2))
        for impl, samples in raw_latency.items():
            if not samples:
                continue
            a = np.sort(np.asarray(samples) * 1e6)
            ax.plot(a, np.arange(1, a.size + 1) / a.size, label=impl)
        ax.set_xscale("log")
        ax.set_xlabel("dispatch latency (µs, log scale)")
        ax.set_ylabel("fraction of outputs")
        ax.set_title("a_seq: dispatch latency CDF")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
        p = out_dir / "a_seq_latency_cdf.png"
        fig.tight_layout()
        fig.savefig(p, dpi=110)
        plt.close(fig)
        written.append(p)
    wls = results.get("workloads", {})
    series: dict[str, dict[str, list[tuple[int, float]]]] = {}
    for wl, per in wls.items():
        if not wl.startswith("b_") or wl.startswith("b_zmq"):
            continue
        _, n, mode = wl.split("_")
        for impl, res in per.items():
            if "throughput_per_s" in res:
                series.setdefault(mode, {}).setdefault(impl, []).append((int(n), res["throughput_per_s"]))
    if series:
        fig, axes = plt.subplots(1, len(series), figsize=(6 * len(series), 4.2), squeeze=False)
        for ax, (mode, per_impl) in zip(axes[0], sorted(series.items()), strict=True):
            for impl, pts in per_impl.items():
                pts.sort()
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=impl)
            ax.set_xscale("log", base=2)
            ax.set_xlabel("concurrent requests")
            ax.set_ylabel("outputs / s")
            ax.set_title(f"throughput vs concurrency ({mode})")
            ax.grid(True, alpha=0.3)
            ax.legend()
        p = out_dir / "throughput_vs_concurrency.png"
        fig.tight_layout()
        fig.savefig(p, dpi=110)
        plt.close(fig)
        written.append(p)
    return written


BEGIN, END = "<!-- bench:begin -->", "<!-- bench:end -->"


def readme_block(results: dict[str, Any], out_dir: Path) -> str:
    """The table and one plot, for the README."""
    meta = results.get("meta", {})
    rows = [r for r in table_rows(results)
            if r[0] in ("workload", "a_seq", "loop_a_seq", "b_512_unbatched", "zmq_a_seq")]
    parts = [f"Latest run: {meta.get('mode', '?')}, {meta.get('date', '?')}, {meta.get('machine', '?')} "
             f"(`{meta.get('command', 'trio-orch bench')}`; all workloads in "
             f"[{out_dir}/results.md]({out_dir}/results.md)).", "", render_markdown(rows), "",
             *([render_markdown(serving_rows(results)), ""] if len(serving_rows(results)) > 1 else []),
             render_markdown(target_rows(results)), "", missed_note(results), "",
             f"![a_seq dispatch latency CDF]({out_dir}/a_seq_latency_cdf.png)"]
    return "\n".join(parts)


def update_between_markers(path: Path, block: str) -> None:
    """Replace what stands between the bench markers of ``path`` (which must have them)."""
    text = path.read_text()
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{path}: no '{BEGIN}' ... '{END}' markers to put the table between")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    path.write_text(f"{head}{BEGIN}\n{block}\n{END}{tail}")
