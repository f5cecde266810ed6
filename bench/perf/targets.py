"""The performance targets (docs/performance.md), each judged from one run's numbers, clause by clause.

A target is a conjunction ("p50 <= 30 us and below every asyncio
reference"); each clause is judged on its own and a missed target names the
clauses that failed, with the numbers that failed them.  "Below" another
implementation means what it means in the tables: the two 95 % intervals do
not overlap (:func:`bench.perf.stats.verdict`); overlapping intervals are no
win.
"""

from __future__ import annotations

from typing import Any

from bench.perf.stats import verdict

__all__ = ["BASE", "get", "refs", "targets"]

#: the implementation every ratio and target is judged against
BASE = "trio"


def get(results: dict[str, Any], wl: str, impl: str, *path: str) -> Any:
    """``results["workloads"][wl][impl][path...]``, or None where any part is missing."""
    node: Any = results.get("workloads", {}).get(wl, {}).get(impl)
    for key in path:
        if not isinstance(node, dict) or key not in node:
            return None
        node = node[key]
    return node


def num(results: dict[str, Any], wl: str, impl: str, *path: str) -> float | None:
    v = get(results, wl, impl, *path)
    return v if isinstance(v, (int, float)) else None


def refs(results: dict[str, Any]) -> list[str]:
    """The asyncio references (not trio-orch's own rows, not the floors)."""
    return [i for i in results.get("implementations", []) if i.startswith(("omni", "asyncio"))]


Clause = tuple[bool, str]  #: (holds, what failed, with its numbers)


def _limit(v: float | None, op: str, lim: float, what: str, unit: str = "us") -> Clause:
    ok = v is not None and (v <= lim if op == "<=" else v < lim if op == "<" else v >= lim)
    shown = "-" if v is None else f"{v:,.1f}"
    return ok, f"{what} {shown} {unit} is not {op} {lim:,g} {unit}"


def _below_refs(results: dict[str, Any], wl: str, key: str, pct: str) -> list[Clause]:
    """trio's interval wholly below each reference's (the tables' "lower")."""
    mine = get(results, wl, BASE, key, f"{pct}_ci_us")
    out: list[Clause] = []
    for r in refs(results):
        theirs = get(results, wl, r, key, f"{pct}_ci_us")
        if theirs is None:
            continue
        word = verdict(mine, theirs)
        v = num(results, wl, r, key, f"{pct}_us")
        why = "intervals overlap" if word == "=" else "trio is higher"
        out.append((word == "lower", f"not below {r}'s {pct} {v:,.1f} us ({why})"))
    return out


def _tput_above_refs(results: dict[str, Any], wl: str, strict: bool) -> list[Clause]:
    mine = num(results, wl, BASE, "throughput_per_s")
    out: list[Clause] = []
    for r in refs(results):
        o = num(results, wl, r, "throughput_per_s")
        if o is None or mine is None:
            continue
        ok = mine > o if strict else mine >= o
        out.append((ok, f"throughput {mine:,.0f}/s below {r}'s {o:,.0f}/s"))
    return out


def targets(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Every target with its value, limit, ``met`` (None: not measured), the clauses that failed and a
    short ``key`` (the verdict names targets by it)."""
    rows: list[dict[str, Any]] = []

    def add(key: str, name: str, value: float | None, limit: str, clauses: list[Clause]) -> None:
        failed = [why for ok, why in clauses if not ok]
        rows.append({"target": name, "key": key, "value": value, "limit": limit,
                     "met": (not failed) if value is not None else None, "failed": failed})

    for pct, lim in (("p50", 30.0), ("p99", 60.0)):
        v = num(results, "a_seq", BASE, "latency", f"{pct}_us")
        add(f"a_seq {pct}", f"a_seq {pct} <= {lim:.0f} us and below every asyncio reference", v,
            f"<= {lim:.0f}", [_limit(v, "<=", lim, pct), *_below_refs(results, "a_seq", "latency", pct)])
    v = num(results, "c_chain", BASE, "forward", "p50_us")
    add("forward p50", "forward latency p50 <= 50 us", v, "<= 50", [_limit(v, "<=", 50, "forward p50")])
    v = num(results, "b_512_unbatched", BASE, "throughput_per_s")
    add("b_512_unbatched outputs/s", "b_512_unbatched >= 50,000 outputs/s and above every asyncio reference",
        v, ">= 50000",
        [_limit(v, ">=", 50_000, "throughput", "/s"), *_tput_above_refs(results, "b_512_unbatched", True)])
    v = num(results, "b_64_batched", BASE, "cpu_us_per_output")
    add("CPU per output", "orchestrator CPU <= 25 us per output in b_64_batched", v, "<= 25",
        [_limit(v, "<=", 25, "CPU per output")])
    v = num(results, "idle", BASE, "idle_cpu_pct")
    add("idle CPU", "idle CPU < 0.5 %", v, "< 0.5", [_limit(v, "<", 0.5, "idle CPU", "%")])
    v = num(results, "zmq_a_seq", BASE, "latency", "p50_us")
    add("zmq_a_seq p50", "ZMQ echo workers: a_seq p50 <= 80 us", v, "<= 80", [_limit(v, "<=", 80, "p50")])
    v = num(results, "loop_a_seq", BASE, "latency", "p50_us")
    add("loop_a_seq p50", "in-loop a_seq p50 <= 12 us and below every asyncio reference", v, "<= 12",
        [_limit(v, "<=", 12, "p50"), *_below_refs(results, "loop_a_seq", "latency", "p50")])
    v = num(results, "zmq_a_seq", BASE, "latency", "p50_us")
    floor = num(results, "zmq_a_seq", "zmq-floor", "latency", "p50_us")
    if floor is not None:
        add("zmq_a_seq vs floor", "zmq_a_seq p50 <= 1.5 x the zmq floor and below every asyncio reference",
            v, f"<= {1.5 * floor:.1f}",
            [_limit(v, "<=", round(1.5 * floor, 1), "p50"),
             *_below_refs(results, "zmq_a_seq", "latency", "p50")])
    for wl in ("b_512_unbatched", "b_64_unbatched", "zmq_b_64"):
        v = num(results, wl, BASE, "latency", "p99_us")
        mine = get(results, wl, BASE, "latency", "p99_ci_us")
        others: list[float] = []
        clauses: list[Clause] = []
        for r in refs(results):
            o = num(results, wl, r, "latency", "p99_us")
            if o is None:
                continue
            others.append(o)
            apart = verdict(mine, get(results, wl, r, "latency", "p99_ci_us")) == "higher"
            clauses.append((not apart, f"p99 above {r}'s {o:,.0f} us (intervals apart)"))
        add(f"{wl} p99", f"{wl} p99 <= every asyncio reference's (throughput not below theirs)", v,
            f"<= {min(others, default=float('nan')):,.0f}",
            [*clauses, *_tput_above_refs(results, wl, False)])
    serving = results.get("serving", {}).get("echo workers", {})
    trio_f, asy_f = serving.get("trio"), serving.get("asyncio")
    if trio_f and asy_f:
        conc = results["serving"].get("concurrency")
        for key, short, what in (("ttfc", "TTFC", "time to first chunk"),
                                 ("inter_chunk", "inter-chunk", "inter-chunk latency")):
            t, a = trio_f[key]["p50_us"], asy_f[key]["p50_us"]
            add(f"serving {short}", f"serving (echo workers, {conc} clients): --loop trio p50 {what} >= 20 % "
                "below --loop asyncio", t, f"<= {0.8 * a:.0f}",
                [(t <= 0.8 * a, f"p50 {t:,.0f} us is {100 * (1 - t / a):.0f} % below asyncio's {a:,.0f} us")])
        t, a = trio_f["requests_per_s"], asy_f["requests_per_s"]
        add("serving req/s",
            f"serving (echo workers, {conc} clients): --loop trio requests/s not below --loop asyncio", t,
            f">= {a:.1f}", [(t >= a, f"{t:,.1f} requests/s below asyncio's {a:,.1f}")])
    return [r for r in rows if r["value"] is not None or r["target"].startswith(("a_seq", "forward"))]
