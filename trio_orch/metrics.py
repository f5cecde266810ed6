"""Counters and a histogram for the serving front, rendered as Prometheus text.

No dependency on ``prometheus_client``: the bridge records into a plain
fixed-bucket :class:`Histogram` (a bisect and an integer increment, cheap
enough for the hot path) and :func:`render_prometheus` turns an engine
snapshot into the text exposition format (version 0.0.4).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from trio_orch.engine_base import EngineStatistics

__all__ = ["DEFAULT_LATENCY_BUCKETS", "Histogram", "render_prometheus"]

#: seconds; dense below 1 ms, where a thread handover should land
DEFAULT_LATENCY_BUCKETS: tuple[float, ...] = (
    10e-6, 20e-6, 30e-6, 50e-6, 100e-6, 200e-6, 500e-6,
    1e-3, 2e-3, 5e-3, 10e-3, 50e-3, 0.1, 0.5, 1.0,
)


class Histogram:
    """Fixed buckets, observed from any thread without a lock.

    Under the GIL an increment can in rare races be lost; that is acceptable
    for monitoring and keeps the consumer's hot path lock-free.
    """

    __slots__ = ("bounds", "count", "counts", "sum")

    def __init__(self, bounds: Sequence[float] = DEFAULT_LATENCY_BUCKETS) -> None:
        self.bounds = tuple(sorted(bounds))
        self.counts = [0] * (len(self.bounds) + 1)  # last slot: +Inf
        self.count = 0
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.count += 1
        self.sum += value

    def cumulative(self) -> list[tuple[str, int]]:
        """``(le, cumulative count)`` pairs, ``+Inf`` last, as Prometheus wants them."""
        out: list[tuple[str, int]] = []
        total = 0
        for bound, n in zip((*self.bounds, None), self.counts, strict=True):
            total += n
            out.append(("+Inf" if bound is None else repr(float(bound)), total))
        return out


def _labels(labels: Mapping[str, Any]) -> str:
    if not labels:
        return ""
    parts = []
    for k, v in labels.items():
        s = str(v).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')
        parts.append(f'{k}="{s}"')
    return "{" + ",".join(parts) + "}"


class _Writer:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def family(self, name: str, kind: str, help_text: str,
               samples: Iterable[tuple[Mapping[str, Any], float]]) -> None:
        self.lines.append(f"# HELP {name} {help_text}")
        self.lines.append(f"# TYPE {name} {kind}")
        suffix = "_total" if kind == "counter" else ""
        for labels, value in samples:
            self.lines.append(f"{name}{suffix}{_labels(labels)} {float(value)!r}")

    def histogram(self, name: str, help_text: str, hist: Histogram) -> None:
        self.lines.append(f"# HELP {name} {help_text}")
        self.lines.append(f"# TYPE {name} histogram")
        for le, n in hist.cumulative():
            self.lines.append(f'{name}_bucket{{le="{le}"}} {float(n)!r}')
        self.lines.append(f"{name}_sum {float(hist.sum)!r}")
        self.lines.append(f"{name}_count {float(hist.count)!r}")


def render_prometheus(stats: EngineStatistics, latency: Histogram,
                      extra_counters: Mapping[str, tuple[str, Mapping[tuple[tuple[str, str], ...], int]]]
                      | None = None) -> str:
    """Render an engine snapshot (see ``Engine.stats``) as Prometheus text.

    ``extra_counters``: name -> (help, {label pairs: value}) for counters the
    caller keeps itself (e.g. HTTP requests by status).
    """
    w = _Writer()
    w.family("trio_orch_up", "gauge", "1 while the orchestrator thread is running",
             [({}, 1 if stats.running else 0)])
    w.family("trio_orch_request_channel_depth", "gauge",
             "requests waiting in the orchestrator's bounded request channel",
             [({}, stats.queued_requests)])
    w.family("trio_orch_admission_waiting", "gauge",
             "requests waiting in the bridge for room in the request channel (backpressure)",
             [({}, stats.admission_waiting)])
    w.family("trio_orch_active_requests", "gauge", "accepted requests without their terminal yet",
             [({}, stats.active_requests)])
    w.family("trio_orch_stage_inflight", "gauge", "requests open on each stage (submitted, not finished)",
             [({"stage": k}, v) for k, v in enumerate(stats.inflight_by_stage)])
    w.family("trio_orch_replica_inflight", "gauge",
             "requests open on each stage replica (stage clients that report replicas)",
             [({"stage": s, "replica": r}, v)
              for (s, r), v in sorted(stats.inflight_by_replica.items())])
    w.family("trio_orch_stage_available", "gauge", "1 while a stage has a live replica",
             [({"stage": k}, 1 if v else 0) for k, v in enumerate(stats.stage_available)])
    w.family("trio_orch_outputs_routed", "counter", "outputs delivered to users (terminals included)",
             [({}, stats.outputs_routed)])
    w.family("trio_orch_dropped_outputs", "counter",
             "stage outputs dropped because their request was unknown or already ended",
             [({}, stats.dropped_outputs)])
    w.family("trio_orch_terminals", "counter", "request terminals by kind (finished or an error kind)",
             [({"kind": k}, v) for k, v in sorted(stats.terminals_by_kind.items())])
    w.family("trio_orch_errors", "counter", "error terminals (OrchError) by kind",
             [({"kind": k}, v) for k, v in sorted(stats.errors_by_kind.items())])
    for name, (help_text, values) in (extra_counters or {}).items():
        w.family(name, "counter", help_text, [(dict(lbl), v) for lbl, v in sorted(values.items())])
    w.histogram("trio_orch_dispatch_latency_seconds",
                "dispatch latency: a stage produced an output -> the consumer (sync thread, asyncio "
                "task or trio task) took it; from the dispatcher's hand-over for unstamped messages",
                latency)
    return "\n".join(w.lines) + "\n"
