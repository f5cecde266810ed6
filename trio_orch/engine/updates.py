"""Input updates of resumable requests: ``update_request`` from the run or any thread, in call order.

A caller's update is posted to the engine's run (:meth:`UpdateForwarder.post`)
and answered through a :class:`concurrent.futures.Future` (a Trio task waits
for it on an event, a plain thread blocks on it, an asyncio task awaits it wrapped).  An update for a request
that still waits for admission (the request channel was full) waits here
and follows the request in once it is admitted; every other update goes to
one FIFO that a single task drains with ``Orchestrator.update_request`` (which
itself waits while the request channel is full: backpressure, as for adds).
So a request's updates reach the orchestrator in the order they were made,
after the request itself.  A future cancelled before its update was taken
up withdraws it (nothing changes); once taken up, it runs to its answer.
"""

from __future__ import annotations

import math
from concurrent.futures import Future
from typing import Any

import trio

from trio_orch.engine.api import EngineClosed
from trio_orch.engine.demux import DONE, PENDING, Stream
from trio_orch.shell.orchestrator import Orchestrator

__all__ = ["UpdateForwarder"]

#: one posted update: (request id, segment, final, the caller's future)
Item = tuple[str, Any, bool, "Future[None]"]


class UpdateForwarder:
    """The engine's side of ``update_request``; every method runs in the engine's run."""

    def __init__(self) -> None:
        self._send, self._recv = trio.open_memory_channel[Item](math.inf)
        self._waiting: dict[str, list[Item]] = {}
        self.closed: str | None = None

    def post(self, stream: Stream | None, request_id: str, segment: Any, final: bool,
             fut: Future[None]) -> None:
        """Queue one update for ``stream`` (the request's registered stream, or None)."""
        item = (request_id, segment, final, fut)
        if self.closed is not None:
            self._answer(item, EngineClosed(f"the engine is closed: {self.closed}"))
        elif stream is None or stream.state == DONE:
            self._answer(item, ValueError(f"update for unknown or ended request {request_id!r}"))
        elif not stream.resumable:
            self._answer(item, ValueError(f"request {request_id!r} was not added with resumable=True: "
                                          "it takes no more input"))
        elif stream.state == PENDING:
            self._waiting.setdefault(request_id, []).append(item)
        else:
            self._send.send_nowait(item)

    def admitted(self, request_id: str) -> None:
        """The request was admitted: its waiting updates follow it, in order."""
        for item in self._waiting.pop(request_id, ()):
            self._send.send_nowait(item)

    def dropped(self, request_id: str, why: str) -> None:
        """The request ended without being admitted: its waiting updates fail."""
        for item in self._waiting.pop(request_id, ()):
            self._answer(item, ValueError(f"update for request {request_id!r}, which ended: {why}"))

    async def run(self, orch: Orchestrator) -> None:
        """Apply the queued updates one by one until cancelled; then refuse the rest."""
        try:
            async for item in self._recv:
                rid, segment, final, fut = item
                if not fut.set_running_or_notify_cancel():
                    continue  # the caller withdrew it before it was taken up
                try:
                    await orch.update_request(rid, segment, final=final)
                except (ValueError, RuntimeError) as exc:
                    fut.set_exception(exc)
                except BaseException as exc:
                    fut.set_exception(EngineClosed(f"the engine stopped before the update was applied: "
                                                   f"{type(exc).__name__}"))
                    raise
                else:
                    fut.set_result(None)
        finally:
            self.close("its orchestrator stopped")

    def close(self, reason: str) -> None:
        """Refuse every update not applied yet, and any later one."""
        if self.closed is None:
            self.closed = reason
        err = EngineClosed(f"the engine is closed: {self.closed}")
        for items in self._waiting.values():
            for item in items:
                self._answer(item, err)
        self._waiting.clear()
        while True:
            try:
                self._answer(self._recv.receive_nowait(), err)
            except (trio.WouldBlock, trio.EndOfChannel, trio.ClosedResourceError):
                return

    @staticmethod
    def _answer(item: Item, exc: BaseException) -> None:
        fut = item[3]
        if fut.set_running_or_notify_cancel():
            fut.set_exception(exc)
