"""A fixed-bucket histogram cheap enough for the hot path, and the bucket sets trio-orch uses.

Observations happen where the event is (the orchestrator's dispatcher, a
consumer thread, the HTTP front) without a lock; :meth:`Histogram.snapshot`
copies the counts once per scrape, and :mod:`trio_orch.http.metrics` exposes the
snapshots through ``prometheus_client``.  No ``prometheus_client`` import
here: the stage pools and the engine record into these without it.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["DEFAULT_LATENCY_BUCKETS", "REQUEST_TIME_BUCKETS", "RTF_BUCKETS", "STAGE_TIME_BUCKETS",
           "Histogram", "HistogramSnapshot"]

#: seconds; dense below 1 ms, where a thread handover should land
DEFAULT_LATENCY_BUCKETS: tuple[float, ...] = (
    10e-6, 20e-6, 30e-6, 50e-6, 100e-6, 200e-6, 500e-6,
    1e-3, 2e-3, 5e-3, 10e-3, 50e-3, 0.1, 0.5, 1.0,
)

#: seconds a request takes end to end, or until its first output of a stage
REQUEST_TIME_BUCKETS: tuple[float, ...] = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 30.0, 60.0,
    120.0, 300.0,
)

#: seconds a request waits for, or spends in, one stage worker's batch
STAGE_TIME_BUCKETS: tuple[float, ...] = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
)

#: real-time factor: seconds of generation per second of audio (< 1: faster than real time)
RTF_BUCKETS: tuple[float, ...] = (0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0)


@dataclass(frozen=True, slots=True)
class HistogramSnapshot:
    """The counts of a :class:`Histogram` at one moment: ``buckets`` are ``(le, cumulative)``, +Inf last."""

    buckets: tuple[tuple[float, int], ...]
    sum: float
    count: int


class Histogram:
    """Fixed buckets, observed from any thread without a lock.

    Under the GIL an increment can in rare races be lost; that is acceptable
    for monitoring and keeps the observer's hot path lock-free.
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

    def add(self, snap: HistogramSnapshot) -> None:
        """Add the observations of ``snap`` (another histogram's, with the same buckets) to this one."""
        if len(snap.buckets) != len(self.counts):
            raise ValueError(f"cannot add {len(snap.buckets)} buckets to a histogram of {len(self.counts)}")
        previous = 0
        for i, (_bound, cumulative) in enumerate(snap.buckets):
            self.counts[i] += cumulative - previous
            previous = cumulative
        self.count += snap.count
        self.sum += snap.sum

    def snapshot(self) -> HistogramSnapshot:
        counts = list(self.counts)  # one C-level copy; the totals are recomputed from it
        out: list[tuple[float, int]] = []
        total = 0
        for bound, n in zip((*self.bounds, float("inf")), counts, strict=True):
            total += n
            out.append((float(bound), total))
        return HistogramSnapshot(tuple(out), float(self.sum), total)
