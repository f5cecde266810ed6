"""Admission into the core's start queue: at once while it has room, else in arrival order.

``add_request`` validates and registers a request in the caller, before any
checkpoint (the core's ``accept``: a duplicate id or a bad parameter raises
there, and nothing is registered).  The ticket then goes into the core's
start queue as an ``Enqueue`` event -- at once if the queue has room and no
earlier add waits for it; otherwise the caller waits in the request channel
(unbuffered: a cancelled send sent nothing) and the intake task moves it in,
in arrival order, when room appears.  What starts, and when, the core
decides (:mod:`trio_orch.core.admission`); the queue only bounds how many
accepted requests wait for it, so under load callers wait (backpressure).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import trio

from trio_orch.core import Ticket
from trio_orch.shell.dispatch import Dispatch
from trio_orch.shell.state import ShellState

__all__ = ["Intake"]

_Item = tuple[Ticket, trio.Event | None]


def _not_accepting() -> RuntimeError:
    return RuntimeError("orchestrator is not accepting requests: it has shut down")


class Intake:
    """The request channel, the intake task and the add paths (see the module docstring)."""

    def __init__(self, state: ShellState, dispatch: Dispatch, request_timeout: float | None) -> None:
        self.state = state
        self.router = state.router
        self.dispatch = dispatch
        self.request_timeout = request_timeout
        self._send, self._recv = trio.open_memory_channel[_Item](0)
        self.closed = False  #: no more adds (shutdown)
        self._scope: trio.CancelScope | None = None  # around the intake task's receive
        self._sending: set[Ticket] = set()  # accepted, their add_request waits in the channel

    # ------------------------------------------------------------------ the add paths
    def accept(self, request_id: str, prompt: Any, final_stage_id: int | None, timeout: float | None,
               resumable: bool, sampling: Any, companions: Mapping[str, Any] | None,
               priority: int) -> Ticket:
        """Validate and register a request (the core's ``accept``); arm its deadline."""
        ticket = self.router.accept(request_id, prompt, final_stage_id=final_stage_id,
                                    timeout=self.request_timeout if timeout is None else timeout,
                                    resumable=resumable, sampling=sampling, companions=companions,
                                    priority=priority)
        if ticket.timeout is not None:
            self.state.deadlines.set(request_id, ticket.timeout)
            ticket.deadline = trio.current_time() + ticket.timeout  # the start order's, from acceptance
        return ticket

    def enqueue_now(self, ticket: Ticket, done: trio.Event | None) -> bool:
        """Into the start queue at once if it has room and no earlier add waits; whether it went."""
        state = self.state
        if self.closed or state.queue_full() or self._send.statistics().tasks_waiting_send:
            return False
        self.dispatch.enqueue(ticket, trio.current_time(), done)
        if state.queue_full() and self._scope is not None:
            self._scope.cancel()  # full now: the intake stops taking from the channel
        return True

    async def send(self, ticket: Ticket, done: trio.Event | None) -> None:
        """The start queue is full: wait in the request channel, in arrival order, for the intake."""
        self._sending.add(ticket)
        try:
            await self._send.send((ticket, done))
        except BaseException as exc:
            self.withdraw(ticket)  # trio guarantees a cancelled send did not send
            if isinstance(exc, (trio.ClosedResourceError, trio.BrokenResourceError)):
                raise _not_accepting() from None
            raise
        finally:
            self._sending.discard(ticket)

    def add_nowait(self, ticket: Ticket) -> None:
        """``add_request_nowait``: ``trio.WouldBlock`` (the ticket withdrawn) when it cannot go in now.

        With no request queue (``request_queue_size=0``) a request that could
        not start at once is refused the same way.
        """
        try:
            if not self.state.queue_size and not self.router.can_start(ticket):
                raise trio.WouldBlock
            if self.closed:
                raise trio.ClosedResourceError
            if not self.enqueue_now(ticket, None):
                raise trio.WouldBlock
        except BaseException as exc:
            self.withdraw(ticket)
            if isinstance(exc, (trio.ClosedResourceError, trio.BrokenResourceError)):
                raise _not_accepting() from None
            raise

    def withdraw(self, ticket: Ticket) -> None:
        """The ticket never reached the start queue: forget it (no terminal)."""
        if self.router.queued.get(ticket.request_id) is ticket:
            self.router.withdraw(ticket)
            self.state.deadlines.discard(ticket.request_id)

    # ------------------------------------------------------------------ hints for a front
    def has_room(self) -> bool:
        """The start queue has space now and nobody waits for it: an add would not wait."""
        return not self.state.queue_full() and not self._send.statistics().tasks_waiting_send

    def capacity(self) -> float:
        """At most how many accepted requests it holds at once: started, plus a full start queue
        (``math.inf``: no stage bound).  With no request queue a request that cannot start is
        refused, so then it is what the stages hold."""
        stages = self.router.capacity()
        if stages is None:
            return math.inf
        size = self.state.queue_size
        return stages + (1 + size if size else 0)

    def channel_statistics(self) -> trio.MemoryChannelStatistics:
        return self._send.statistics()

    # ------------------------------------------------------------------ the intake task
    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Move adds from the request channel into the start queue while it has room, in order.

        Every add already waiting when it wakes is taken in the same pass, so a
        burst goes in together.
        """
        state = self.state
        task_status.started()
        while True:
            while state.queue_full():
                state.room = room = trio.Event()
                await room.wait()
            # cancelled when adds that went straight in fill the queue: a cancelled receive took nothing
            item: _Item | None = None
            with trio.CancelScope() as self._scope:
                try:
                    item = await self._recv.receive()
                except trio.EndOfChannel:
                    return
            self._scope = None
            if item is None:
                continue
            now = trio.current_time()
            while True:
                ticket, done = item
                if self.router.queued.get(ticket.request_id) is ticket:
                    self.dispatch.enqueue(ticket, now, done)
                elif done is not None:
                    done.set()  # it ended before it was queued
                if state.queue_full():
                    break
                try:
                    item = self._recv.receive_nowait()
                except (trio.WouldBlock, trio.EndOfChannel):
                    break  # the end is seen by the next receive

    def close(self) -> None:
        """Shutdown: no more adds.  Adds still waiting in the channel are handed over (their requests get
        the shutdown terminal); adds whose caller had not got in yet are withdrawn (their call raises)."""
        self.closed = True
        self._send.close()
        handed_over: set[Ticket] = set()
        while True:
            try:
                ticket, done = self._recv.receive_nowait()
            except (trio.WouldBlock, trio.EndOfChannel):
                break
            handed_over.add(ticket)
            if done is not None:
                done.set()
        for ticket in self._sending - handed_over:
            self.withdraw(ticket)
