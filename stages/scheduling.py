"""Which waiting request joins a worker's batch next: the head's order, kept past admission.

The orchestrator starts queued requests by priority (lower first), then
deadline, then arrival, with aging (its core); a worker that holds
more requests than its batch takes picks the ones that join the batch by the
same key, so a high-priority request does not wait behind a backlog of
low-priority ones a replica already holds.  The priority and the seconds left
until the deadline travel with the submit (``stages.wire.Submit``); an older
head sends neither, which reads as priority 0 and no deadline -- arrival
order, as before.  Running requests are never preempted.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterator
from typing import Generic, TypeVar

__all__ = ["AGING", "WaitingQueue", "batch_key"]

#: seconds of earlier arrival worth one priority level (the head's default ``priority_aging``)
AGING = 1.0

T = TypeVar("T")


def batch_key(priority: int, deadline: float | None, arrived: float, seq: int,
              aging: float = AGING) -> tuple[int, float, int]:
    """The order in which waiting requests join the batch: smallest first.

    ``(priority + aging epoch of arrival, deadline, arrival)``: a request
    that arrived one ``aging`` epoch earlier counts one level better, so a
    stream of more urgent ones delays a request by a bounded time, never
    forever.  ``deadline`` is absolute on the worker's clock (None: none,
    last among equals).
    """
    return (priority + math.floor(arrived / aging), math.inf if deadline is None else deadline, seq)


class WaitingQueue(Generic[T]):
    """The worker's waiting requests, taken smallest :func:`batch_key` first.

    Iteration and ``len`` see every waiting request; :meth:`remove` (an
    abort, a failure) is rare and linear.
    """

    def __init__(self, aging: float = AGING) -> None:
        self.aging = aging
        self._heap: list[tuple[tuple[int, float, int], T]] = []
        self._seq = 0

    def push(self, item: T, *, priority: int = 0, deadline: float | None = None, now: float = 0.0) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (batch_key(priority, deadline, now, self._seq, self.aging), item))

    def pop(self) -> T:
        """The waiting request that joins the batch next (IndexError when none waits)."""
        return heapq.heappop(self._heap)[1]

    def remove(self, item: T) -> None:
        for i, (_, it) in enumerate(self._heap):
            if it is item:
                self._heap[i] = self._heap[-1]
                self._heap.pop()
                heapq.heapify(self._heap)
                return
        raise ValueError("not waiting")

    def __len__(self) -> int:
        return len(self._heap)

    def __bool__(self) -> bool:
        return bool(self._heap)

    def __iter__(self) -> Iterator[T]:
        return (it for _, it in self._heap)
