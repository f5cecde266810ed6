"""The asyncio twin of :mod:`trio_orch.shell.inbox`: the dispatcher's inbox, drained a batch at a time.

The ``asyncio-taskgroup`` reference gets the Trio shell's design here too: a
deque with one waiting task instead of an :class:`asyncio.Queue` (which pays
for getters' and putters' waiter lists, a bound and ``task_done``
accounting on every item).  A post is a deque append, plus resolving one
future when the dispatcher waits; the dispatcher takes everything queued in
one call.  After :meth:`close` a post raises :class:`RuntimeError`.  The
deque, post, take and close are the Trio one's (``InboxCore``); only the
waiting differs.
"""

from __future__ import annotations

import asyncio
from typing import TypeVar

from trio_orch.shell.inbox import InboxCore

__all__ = ["Inbox"]

T = TypeVar("T")


class Inbox(InboxCore[T]):
    """Many posters, one asyncio task taking (see the module docstring)."""

    __slots__ = ()

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

    def _wake(self) -> None:
        waiter = self._waiter
        if isinstance(waiter, asyncio.Future) and not waiter.done():
            waiter.set_result(None)
