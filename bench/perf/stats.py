"""Distribution summaries for the benchmark: percentiles in µs with bootstrap intervals, rates, ratios.

A p99 from a few hundred samples moves between runs; every p50 and p99 here
comes with a 95 % percentile-bootstrap interval over the samples, so a
reader (and :func:`verdict`) can tell a difference from noise.  The
bootstrap is drawn exactly and cheaply: a resample's k-th smallest value is
``x[floor(n U)]`` of the sorted samples, where ``U`` is the k-th smallest of
n uniforms, ``Beta(k, n-k+1)`` -- so 10,000 seeded resamples cost as much as
drawing 20,000 beta variates, whatever n is, and give what sorting 10,000
resamples of n values would (tests/project/test_bench_stats.py checks it
against a brute-force bootstrap).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

#: bootstrap resamples per interval, the interval's coverage and the seed (intervals are reproducible)
RESAMPLES = 10_000
COVERAGE = 0.95
SEED = 0


def bootstrap_ci(sorted_samples: np.ndarray, q: float, *, resamples: int = RESAMPLES,
                 coverage: float = COVERAGE, seed: int = SEED) -> tuple[float, float]:
    """The percentile-bootstrap interval of the ``q``-quantile (0..1, numpy's linear method).

    ``sorted_samples`` must be sorted ascending.  Each resample's quantile is
    interpolated between its k-th and (k+1)-th smallest values, drawn as
    order statistics of uniforms (see the module docstring).  The interval
    always contains the sample's own quantile (with very few samples the
    percentile interval may not; it is widened to it).
    """
    x = sorted_samples
    n = int(x.size)
    if n == 0:
        return (math.nan, math.nan)
    point = float(np.quantile(x, q))
    if n == 1:
        return (point, point)
    h = (n - 1) * q
    k = math.floor(h)  # 0-based rank of the lower neighbour
    frac = h - k
    rng = np.random.default_rng(seed)
    u1 = rng.beta(k + 1, n - k, size=resamples)  # the (k+1)-th smallest of n uniforms
    lo_idx = np.minimum((u1 * n).astype(np.int64), n - 1)
    values = x[lo_idx]
    if frac > 0 and k + 1 < n:  # the next order statistic: the smallest of the n-k-1 uniforms above u1
        u2 = u1 + (1.0 - u1) * rng.beta(1, n - k - 1, size=resamples)
        hi_idx = np.minimum((u2 * n).astype(np.int64), n - 1)
        values = values + frac * (x[hi_idx] - values)
    tail = (1.0 - coverage) / 2 * 100
    lo, hi = np.percentile(values, [tail, 100 - tail])
    return (min(float(lo), point), max(float(hi), point))


def percentiles_us(samples: list[float]) -> dict[str, Any]:
    """p50/p90/p99/max/mean in microseconds of samples given in seconds, p50 and p99 with intervals."""
    if not samples:
        nan = float("nan")
        return {"n": 0, "p50_us": nan, "p90_us": nan, "p99_us": nan, "max_us": nan, "mean_us": nan,
                "p50_ci_us": [nan, nan], "p99_ci_us": [nan, nan]}
    a = np.sort(np.asarray(samples, dtype=np.float64) * 1e6)
    p50, p90, p99 = np.percentile(a, [50, 90, 99])
    return {"n": int(a.size), "p50_us": float(p50), "p90_us": float(p90), "p99_us": float(p99),
            "max_us": float(a[-1]), "mean_us": float(a.mean()),
            "p50_ci_us": list(bootstrap_ci(a, 0.50)), "p99_ci_us": list(bootstrap_ci(a, 0.99))}


def verdict(ci: list[float] | None, base_ci: list[float] | None) -> str:
    """``"lower"`` / ``"higher"`` where the interval lies wholly below / above ``base_ci``; else ``"="``.

    A latency ratio is called a win or a loss only where the two intervals do
    not overlap; overlapping intervals (or a missing one) read ``"="``.
    """
    if not ci or not base_ci or any(v != v for v in (*ci, *base_ci)):
        return "="
    if ci[1] < base_ci[0]:
        return "lower"
    if ci[0] > base_ci[1]:
        return "higher"
    return "="


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Merge the runs (rounds) of one implementation on one workload."""
    out: dict[str, Any] = {"rounds": len(runs)}
    if any("push" in r for r in runs):
        out["push"] = all(r.get("push", False) for r in runs)
    for key in ("latency", "admission", "forward", "forward_0_1", "forward_1_2",
                "first_text", "first_audio", "total"):
        if any(key in r for r in runs):
            merged = [x for r in runs for x in r.get(key, [])]
            out[key] = percentiles_us(merged)
    lat_runs = [r["latency"] for r in runs if r.get("latency")]
    if len(lat_runs) > 1:  # the spread between rounds (tail latency varies with the machine)
        out["p99_rounds_us"] = [float(np.percentile(np.asarray(x) * 1e6, 99)) for x in lat_runs]
    outputs = sum(r.get("outputs", 0) for r in runs)
    elapsed = sum(r.get("elapsed_s", 0.0) for r in runs)
    cpu = sum(r.get("cpu_s", 0.0) for r in runs)
    if outputs:
        out["outputs"] = outputs
        out["throughput_per_s"] = outputs / elapsed if elapsed else float("nan")
        out["cpu_us_per_output"] = cpu / outputs * 1e6
    if any("curve" in r for r in runs):  # the throughput curve: per concurrency, over all rounds
        points = dict.fromkeys(n for r in runs for n in r.get("curve", {}))
        out["curve"] = {}
        for n in points:
            mine = [r["curve"][n] for r in runs if n in r.get("curve", {})]
            done, took = sum(p["outputs"] for p in mine), sum(p["elapsed_s"] for p in mine)
            out["curve"][n] = {"outputs": done, "throughput_per_s": done / took if took else float("nan"),
                               "cpu_us_per_output": sum(p["cpu_s"] for p in mine) / done * 1e6 if done
                               else float("nan")}
    if any("idle_cpu_s" in r for r in runs):
        idle_cpu = sum(r.get("idle_cpu_s", 0.0) for r in runs)
        idle_wall = sum(r.get("idle_wall_s", 0.0) for r in runs)
        out["idle_cpu_pct"] = 100.0 * idle_cpu / idle_wall if idle_wall else float("nan")
    shut = [r["shutdown_s"] for r in runs if "shutdown_s" in r]
    if shut:
        out["shutdown_ms"] = {"median": float(np.median(shut)) * 1e3, "max": float(max(shut)) * 1e3}
    return out


def ratio(value: float | None, base: float | None) -> float | None:
    """value / base, or None when either is missing or base is zero."""
    if value is None or base is None or base == 0 or value != value or base != base:
        return None
    return value / base


def ratio_bounds(ci: list[float] | None, base_ci: list[float] | None) -> tuple[float, float] | None:
    """The bounds of value / base that the two intervals allow: ``(lo / base_hi, hi / base_lo)``.

    They exclude 1 exactly where the intervals do not overlap -- where
    :func:`verdict` calls a difference -- so a ratio shown with them reads the
    same as the verdict.  None where an interval is missing or touches zero.
    """
    if not ci or not base_ci or any(v != v for v in (*ci, *base_ci)) or base_ci[0] <= 0:
        return None
    return ci[0] / base_ci[1], ci[1] / base_ci[0]
