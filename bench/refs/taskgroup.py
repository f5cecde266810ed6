"""The modern asyncio reference: the same orchestrator under ``asyncio.TaskGroup`` (3.11+).

Same thread/loop boundary, janus queues, request handler, reader-per-stage and
serial dispatcher as :class:`bench.refs.omni.OmniEventDriven`, but the tasks
live in one :class:`asyncio.TaskGroup`, and it makes every design choice the
Trio shell (``trio_orch/shell/orchestrator.py``) makes, so that where its row
still differs from Trio's the difference is the concurrency model's:

- **stop bounded, however it is asked for**: ``request_shutdown`` or a
  cancellation of ``run()`` from outside cancels the group's tasks, and at
  most ``shutdown_grace`` later an ``asyncio.timeout`` cancels the group a
  second time (TaskGroup re-cancels its children when its parent is);
- **the push path**: a stage client that offers ``pump(deliver)`` hands its
  batches over synchronously, routed at once while the dispatcher is idle;
- **one dispatcher pass per batch of events**: its inbox is a deque with one
  waiter (:mod:`bench.refs.inbox`, the twin of the Trio shell's), drained
  whole; everything in it is routed, then the I/O done once;
- **the abort path**: a serving thread's abort goes straight to the loop
  (``call_soon_threadsafe``): a queued request gets its terminal at once, a
  started one through the dispatcher, in order with the outputs -- not
  behind the adds in the request queue;
- **stage I/O off the routing path**: stage aborts (an abort's, a
  deadline's) run in tasks of the group, so a stage hung in ``abort()``
  stalls nobody; collective RPCs too, and a call whose task was cancelled
  before it ran is still answered;
- **errors while stopping are reported**: once the group has ended, what
  the readers posted that the dispatcher never routed (a stage failing as
  it is cancelled) is logged;
- **the cleanup is bounded and shielded**: stage aborts and each ``aclose``
  under ``asyncio.timeout(shutdown_grace)``, the whole cleanup under
  ``asyncio.shield`` (Trio: a shielded cancel scope);
- no ``all_tasks()`` sweep (the thread runs the loop with
  :class:`asyncio.Runner`, whose close cancels what is left); readers use
  ``Task.cancelling()`` to tell a cancellation of their own task from a
  ``CancelledError`` raised by the stage client (pyzmq raises one when a
  socket is closed under a pending ``recv``); replica handshakes are cancelled
  at shutdown.

What none of this changes is the model: cancellation stays edge-triggered
(a task that catches ``CancelledError`` once and keeps awaiting is not
cancelled again until something delivers a second cancel -- here the stop
deadline), ``asyncio.shield`` protects the inner task but not the one that
awaits it, and a thread started by ``asyncio.to_thread`` runs on after its
await was cancelled.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Coroutine
from typing import Any

from bench.refs.control import RpcMsg, concurrent_rpc
from bench.refs.inbox import Inbox
from bench.refs.orchestrator import AsyncioOrchestrator
from trio_orch.core import Abort, RequestState
from trio_orch.shell.orchestrator import BURST_GAP
from trio_orch.types import StageClient, StageDied, StageOutput

__all__ = ["TaskGroupOrchestrator"]

log = logging.getLogger("bench.refs.taskgroup")


class _AbortCmd:
    """A serving thread's abort of a started request, for the dispatcher (this incarnation only)."""

    __slots__ = ("state",)

    def __init__(self, state: RequestState) -> None:
        self.state = state


class _Perform:
    """Stage I/O decided by a batch routed on the push path, for the dispatcher to do in order."""

    __slots__ = ("actions",)

    def __init__(self, actions: list[Any]) -> None:
        self.actions = actions


class TaskGroupOrchestrator(AsyncioOrchestrator):
    """Event-driven asyncio orchestrator with structured task supervision and the Trio shell's design."""

    variant = "asyncio-taskgroup"
    description = ("modern asyncio with the Trio shell's design: TaskGroup, asyncio.timeout and shield, "
                   "aborts via the dispatcher, stage I/O in tasks, unrouted errors reported, no sweep")
    use_runner = True
    bounded_cleanup = True
    push_path = True
    #: the dispatcher waits on an empty queue and nothing was posted since: a pushed batch may be
    #: routed at once by whoever delivers it (the Trio shell's fast path)
    _idle = False
    _last_inline = 0.0
    _tg: asyncio.TaskGroup | None = None
    #: what the readers (and aborts) post for the dispatcher: (stage id or None, outputs, death or command)
    ready_q: Inbox[tuple[int | None, Any]]

    async def run(self) -> None:
        self.ready_q = Inbox()
        self._side: set[asyncio.Task[None]] = set()
        cancelled_from_outside = False
        stop_deadline: asyncio.Timeout | None = None
        try:
            # The stop is bounded: if the group's tasks have not finished ``shutdown_grace``
            # after being cancelled, the deadline cancels this task, and TaskGroup answers
            # that by cancelling its children once more.
            async with asyncio.timeout(None) as stop_deadline:
                async with asyncio.TaskGroup() as tg:
                    self._tg = tg
                    tasks = [tg.create_task(self.request_handler(), name="orchestrator-request-handler"),
                             tg.create_task(self._dispatcher(), name="orchestrator-dispatcher")]
                    tasks += [tg.create_task(self.reader(k, s), name=f"orchestrator-reader-{k}")
                              for k, s in enumerate(self.stages)]
                    try:
                        await self.wait_stop_requested()
                    except asyncio.CancelledError:  # cancelled from outside: stop the same way, then say so
                        cancelled_from_outside = True
                    self.stopping.set()
                    stop_deadline.reschedule(asyncio.get_running_loop().time() + self.shutdown_grace)
                    for t in (*tasks, *self._side):
                        t.cancel()
        except TimeoutError:
            pass  # the stop deadline's own cancellation (an outside one propagates as CancelledError)
        finally:
            if stop_deadline is not None and stop_deadline.expired():
                log.warning("orchestrator tasks still running %.1fs after cancel; cancelled them again",
                            self.shutdown_grace)
            self._tg = None
            self.stopping.set()
            self._report_unrouted_events()
            # Shielded, as the Trio shell's cleanup is: a cancellation of run() now does not cut it.
            # (asyncio.shield protects the cleanup task, not this one: run() itself still ends at once.)
            await asyncio.shield(self.finish())
        if cancelled_from_outside:
            raise asyncio.CancelledError

    # ------------------------------------------------------------------ the abort path
    def abort(self, request_id: str) -> None:
        """(Serving thread.)  Straight to the loop, not behind the adds in the request queue."""
        try:
            self.loop.call_soon_threadsafe(self._abort_now, request_id)
        except RuntimeError:
            pass  # the loop is closed: every request already had its terminal

    def _abort_now(self, request_id: str) -> None:
        """A queued request ends at once; a started one through the dispatcher (ordered with outputs)."""
        if self.stopping.is_set():
            return  # the shutdown terminals are on their way
        if self.router.is_queued(request_id):
            io = self.deliver_emits(self.router.abort(request_id))
            if io:
                self.spawn(self.perform(io), f"orchestrator-abort-{request_id}")
            return
        state = self.router.requests.get(request_id)
        if state is not None:
            self._post(None, _AbortCmd(state))

    def _post(self, stage_id: int | None, item: Any) -> None:
        """Queue an event for the dispatcher (every event goes through here: it ends ``_idle``)."""
        self._idle = False
        self.ready_q.post((stage_id, item))

    async def stage_abort(self, a: Abort) -> None:
        """In a task of the group while running (a hung stage stalls nobody); inline while stopping."""
        if self._tg is not None and not self.stopping.is_set():
            self.spawn(self._abort_on_stage(a), f"orchestrator-abort-{a.stage_id}")
        else:
            await super().stage_abort(a)

    async def _abort_on_stage(self, a: Abort) -> None:
        await super().stage_abort(a)

    def spawn(self, coro: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
        """Side work belongs to the group while it runs (cancelled with it); else a tracked task."""
        tg = self._tg
        if tg is None or self.stopping.is_set():
            return super().spawn(coro, name)
        task = tg.create_task(coro, name=name)
        self._side.add(task)
        task.add_done_callback(self._side.discard)
        return task

    # ------------------------------------------------------------------ the tasks
    async def stop_joins(self) -> None:
        """Structured: the core's rule, every handshake in progress is cancelled at once."""
        tasks = list(self.join_tasks.values())
        self.cancel_joins()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)

    async def handle_rpc(self, msg: RpcMsg) -> None:
        """A task of the group asks every stage at once; the request handler moves on.

        A task cancelled before its first step never runs its body (its
        ``finally`` included): the done callback answers the caller then.
        """
        task = self.spawn(concurrent_rpc(self.stages, msg), f"orchestrator-rpc-{msg.method}")
        task.add_done_callback(lambda t: msg.refuse("orchestrator stopped before the call ran"))

    async def _dispatcher(self) -> None:
        """Drain what is ready, route it all, then do the I/O (the Trio shell's dispatcher)."""
        ready = self.ready_q
        router = self.router
        while True:
            if not ready:
                self._idle = True
                try:
                    await ready.wait()
                finally:
                    self._idle = False
            actions: list[Any] = []
            for stage_id, item in ready.take():
                if type(item) is _Perform:
                    actions.extend(item.actions)
                elif type(item) is _AbortCmd:
                    rid = item.state.request_id
                    if router.requests.get(rid) is item.state:
                        actions.extend(router.abort(rid))
                else:
                    assert stage_id is not None
                    actions.extend(self.route(stage_id, item))
            await self.perform(actions)

    async def reader(self, stage_id: int, stage: StageClient) -> None:
        """Move a stage's outputs to the dispatcher; report the stage's death.

        A stage client that offers ``pump(deliver)`` hands each batch to
        ``deliver`` from wherever it receives it, as on the Trio side: while the
        dispatcher is idle and no burst is under way the batch is routed right
        there (its stage I/O still goes to the dispatcher, in order); otherwise
        it is queued.
        """
        post = self._post
        try:
            pump = getattr(stage, "pump", None)
            if pump is not None:
                def deliver(outs: list[StageOutput]) -> None:
                    if self._idle:
                        if time.perf_counter() - self._last_inline >= BURST_GAP:
                            io = self.deliver_emits(self.router.route_many(stage_id, outs))
                            if io:
                                post(None, _Perform(io))
                            self._last_inline = time.perf_counter()
                            return
                        self._last_inline = time.perf_counter()
                    post(stage_id, outs)

                await pump(deliver)
                raise RuntimeError(f"stage {stage_id} stopped delivering outputs")
            while True:
                outs = await stage.receive()
                post(stage_id, outs)
        except asyncio.CancelledError as exc:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise  # our own cancellation
            post(stage_id, StageDied.of(exc))
        except Exception as exc:
            post(stage_id, StageDied.of(exc))

    def _report_unrouted_events(self) -> None:
        """Events the dispatcher never saw (it was cancelled first): log the stage failures."""
        for stage_id, item in self.ready_q.take():
            if type(item) is StageDied and stage_id is not None:
                msg = item.describe(stage_id).replace(" died: ", " failed while stopping: ", 1)
                log.warning("%s", msg)
                self.stage_deaths.setdefault(stage_id, msg)
