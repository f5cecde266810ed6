"""Distribution summaries for the benchmark: percentiles in µs, rates, ratios."""

from __future__ import annotations

from typing import Any

import numpy as np


def percentiles_us(samples: list[float]) -> dict[str, float]:
    """p50/p90/p99/max/mean in microseconds of samples given in seconds."""
    if not samples:
        return {"n": 0, "p50_us": float("nan"), "p90_us": float("nan"), "p99_us": float("nan"),
                "max_us": float("nan"), "mean_us": float("nan")}
    a = np.asarray(samples, dtype=np.float64) * 1e6
    p50, p90, p99 = np.percentile(a, [50, 90, 99])
    return {"n": int(a.size), "p50_us": float(p50), "p90_us": float(p90), "p99_us": float(p99),
            "max_us": float(a.max()), "mean_us": float(a.mean())}


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Merge the runs (rounds) of one implementation on one workload."""
    out: dict[str, Any] = {"rounds": len(runs)}
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
