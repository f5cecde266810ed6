"""The dispatcher's inbox: an unbounded FIFO with one waiting task, drained a whole batch at a time.

Every event for the dispatcher (a stage's outputs, a command, a stage's
death) is posted here synchronously, from the readers' tasks, the push
path's callbacks and the abort path.  A memory channel would do the same
job, but it pays for what the dispatcher never uses -- several receivers,
a buffer bound, send-side waiters, statistics, clones -- on every item:
about 1.8 us for a ``send_nowait`` + ``receive_nowait`` pair on this
project's 2-vCPU VM, against 0.2 us for a deque's.  With one event per
output at high concurrency that was the largest single cost per output.
Here a post is a deque append, plus one ``reschedule`` when the dispatcher
is parked; the dispatcher takes everything queued in one call.

Close semantics follow Trio's channels: :meth:`close` is synchronous and
idempotent; a post after it raises :class:`trio.ClosedResourceError`; what
was queued before it can still be taken (:meth:`take`).
"""

from __future__ import annotations

from collections import deque
from typing import Generic, TypeVar

import trio

__all__ = ["Inbox", "InboxCore"]

T = TypeVar("T")


class InboxCore(Generic[T]):
    """What every event loop's inbox shares: the deque, the close flag, post and take.

    A subclass says how its one taker waits (:meth:`wait`) and is woken
    (:meth:`_wake`), and what a post after close raises.
    """

    __slots__ = ("_closed", "_items", "_waiter")

    #: raised by a post after :meth:`close`
    closed_error: type[Exception] = RuntimeError

    def __init__(self) -> None:
        self._items: deque[T] = deque()
        self._waiter: object | None = None
        self._closed = False

    def __len__(self) -> int:
        return len(self._items)

    def post(self, item: T) -> None:
        """Queue ``item`` and wake the taker if it waits; ``closed_error`` once closed."""
        if self._closed:
            raise self.closed_error("the inbox is closed")
        self._items.append(item)
        if self._waiter is not None:
            self._wake()

    def nudge(self) -> None:
        """Wake the taker if it waits, with nothing queued (it has other work: see the dispatch)."""
        if self._waiter is not None:
            self._wake()

    def take(self) -> list[T]:
        """Everything queued, oldest first (an empty list if nothing is)."""
        items = list(self._items)
        self._items.clear()
        return items

    def close(self) -> None:
        """Refuse later posts (idempotent); a waiting taker wakes up and finds what is left."""
        self._closed = True
        if self._waiter is not None:
            self._wake()

    @property
    def closed(self) -> bool:
        return self._closed

    def _wake(self) -> None:
        raise NotImplementedError


class Inbox(InboxCore[T]):
    """Many posters, one Trio task taking (see the module docstring)."""

    __slots__ = ()

    closed_error = trio.ClosedResourceError

    async def wait(self) -> None:
        """Return once something is queued or the inbox is closed: at once (no checkpoint) if so already.

        One taker only: a second task waiting at the same time is a bug, and raises.
        """
        if self._items or self._closed:
            return
        if self._waiter is not None:
            raise trio.BusyResourceError("another task already waits on this inbox")
        self._waiter = trio.lowlevel.current_task()

        def abort(_: object) -> trio.lowlevel.Abort:
            self._waiter = None
            return trio.lowlevel.Abort.SUCCEEDED

        await trio.lowlevel.wait_task_rescheduled(abort)

    def _wake(self) -> None:
        task, self._waiter = self._waiter, None
        trio.lowlevel.reschedule(task)  # type: ignore[arg-type]
