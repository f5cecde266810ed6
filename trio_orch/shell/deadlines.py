"""Per-request deadlines kept by one task sleeping on the earliest of them.

Requests are not tasks, so a cancel scope per request is not available; one
keeper task holds a heap of ``(deadline, request_id)`` and sleeps in a cancel
scope whose deadline is moved earlier whenever an earlier request arrives.
Finished requests are forgotten lazily: a popped entry counts only if it is
still the request's current deadline.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable

import trio

__all__ = ["DeadlineKeeper"]


class DeadlineKeeper:
    def __init__(self) -> None:
        self.current: dict[str, float] = {}  #: request id -> its deadline (Trio clock), while it counts
        self._heap: list[tuple[float, str]] = []
        self._scope: trio.CancelScope | None = None

    def __len__(self) -> int:
        return len(self.current)

    def set(self, request_id: str, timeout: float) -> None:
        """Give ``request_id`` a deadline ``timeout`` seconds from now (Trio clock)."""
        deadline = trio.current_time() + timeout
        self.current[request_id] = deadline
        heapq.heappush(self._heap, (deadline, request_id))
        if self._scope is not None and deadline < self._scope.deadline:
            self._scope.deadline = deadline

    def discard(self, request_id: str) -> None:
        """The request ended: its deadline no longer applies."""
        self.current.pop(request_id, None)

    async def run(self, expire: Callable[[str], None]) -> None:
        """Call ``expire(request_id)`` for each deadline as it passes; runs until cancelled."""
        heap = self._heap
        while True:
            with trio.CancelScope(deadline=heap[0][0] if heap else math.inf) as scope:
                self._scope = scope
                await trio.sleep_forever()
            now = trio.current_time()
            while heap and heap[0][0] <= now:
                deadline, rid = heapq.heappop(heap)
                if self.current.get(rid) == deadline:
                    del self.current[rid]
                    expire(rid)
