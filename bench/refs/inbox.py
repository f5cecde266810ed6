"""The asyncio twin of :mod:`trio_orch.shell.inbox`: the dispatcher's inbox, drained a batch at a time.

The ``asyncio-taskgroup`` reference gets the Trio shell's design here too: a
deque with one waiting task instead of an :class:`asyncio.Queue` (which pays
for getters' and putters' waiter lists, a bound and ``task_done``
accounting on every item).  A post is a deque append, plus resolving one
future when the dispatcher waits; the dispatcher takes everything queued in
one call.  After :meth:`close` a post raises :class:`RuntimeError`.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Generic, TypeVar

__all__ = ["Inbox"]

T = TypeVar("T")


class Inbox(Generic[T]):
    """Many posters, one taker (see the module docstring)."""

    __slots__ = ("_closed", "_items", "_waiter")

    def __init__(self) -> None:
        self._items: deque[T] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self._closed = False

    def __len__(self) -> int:
        return len(self._items)

    def post(self, item: T) -> None:
        """Queue ``item`` and wake the taker if it waits; :class:`RuntimeError` once closed."""
        if self._closed:
            raise RuntimeError("the inbox is closed")
        self._items.append(item)
        self._wake()

    def take(self) -> list[T]:
        """Everything queued, oldest first (an empty list if nothing is)."""
        items = list(self._items)
        self._items.clear()
        return items

    async def wait(self) -> None:
        """Return once something is queued or the inbox is closed: at once (no suspension) if so already."""
        if self._items or self._closed:
            return
        if self._waiter is not None:
            raise RuntimeError("another task already waits on this inbox")
        self._waiter = fut = asyncio.get_running_loop().create_future()
        try:
            await fut
        finally:
            self._waiter = None

    def close(self) -> None:
        """Refuse later posts (idempotent); a waiting taker wakes up and finds what is left."""
        self._closed = True
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
