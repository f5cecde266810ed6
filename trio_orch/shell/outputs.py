"""Where the messages a decision emits go: the caller's sink, or a buffer read by ``next_output``.

The buffer is a deque of messages with the consumers parked on a lot: a
delivery is an ``extend`` (plus one wake-up when a consumer waits), where a
memory channel would cost a send and a receive per delivered batch.  A ready
message is taken after a cancellation check only, no schedule point (as
asyncio's ``Queue.get`` of a ready item): a consumer that keeps up pays one
scheduler pass per wait, not one per message.

:attr:`OutputStream.behind` says whether the consumer has not taken what the
last decisions delivered -- with a sink, what its ``backlog`` callable says
(a queue's size), else False.  The dispatch reads it to decide whether an
event is decided at once (nothing in flight) or waits to be decided together
with what else arrives meanwhile (see :mod:`trio_orch.shell.dispatch`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import trio

from trio_orch.types import Message

__all__ = ["OutputSink", "OutputStream"]

OutputSink = Callable[[list[Message]], None]


class OutputStream:
    """The delivered messages, for a sink or for ``next_output``/``next_batch`` (see the module docstring)."""

    __slots__ = ("_buf", "_closed", "_lot", "_waiting", "backlog", "behind", "deliver")

    def __init__(self, sink: OutputSink | None, backlog: Callable[[], int] | None = None) -> None:
        self._buf: deque[Message] = deque()
        self._closed = False
        self._lot = trio.lowlevel.ParkingLot()
        self._waiting = 0  # consumers parked on the lot
        #: the buffer holds messages no consumer took yet (always False with a sink)
        self.behind = False
        #: a sink's backlog (batches its consumer has not taken), None when unknown or no sink
        self.backlog = backlog if sink is not None else None
        #: called with each decision's messages, in delivery order
        self.deliver: OutputSink = sink if sink is not None else self._append

    def _append(self, msgs: list[Message]) -> None:
        self._buf.extend(msgs)
        self.behind = True
        if self._waiting:
            self._lot.unpark_all()

    def close(self) -> None:
        """No more messages: consumers get ``trio.EndOfChannel`` once the buffer is empty (idempotent)."""
        self._closed = True
        self._lot.unpark_all()

    async def _wait(self) -> None:
        """Park until a delivery or the close (a full checkpoint)."""
        self._waiting += 1
        try:
            await self._lot.park()
        finally:
            self._waiting -= 1

    def _take(self) -> list[Message]:
        buf = self._buf
        batch = list(buf)
        buf.clear()
        self.behind = False
        return batch

    async def next_output(self) -> Message:
        """The next message; waits for one (a full checkpoint), ``trio.EndOfChannel`` at the end."""
        buf = self._buf
        if buf:
            await trio.lowlevel.checkpoint_if_cancelled()
        while not buf:
            if self._closed:
                raise trio.EndOfChannel
            await self._wait()
        msg = buf.popleft()
        if not buf:
            self.behind = False
        return msg

    def next_output_nowait(self) -> Message:
        buf = self._buf
        if not buf:
            raise trio.EndOfChannel if self._closed else trio.WouldBlock
        msg = buf.popleft()
        if not buf:
            self.behind = False
        return msg

    async def next_batch(self) -> list[Message]:
        """Every message ready now, waiting for the first; ``trio.EndOfChannel`` at the end."""
        if self._buf:
            await trio.lowlevel.checkpoint_if_cancelled()
            return self._take()
        while not self._buf:
            if self._closed:
                raise trio.EndOfChannel
            await self._wait()
        return self._take()
