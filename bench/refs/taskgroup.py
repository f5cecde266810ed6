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
- **one decide-and-perform path**: every change of request state happens in
  one synchronous function, :meth:`TaskGroupOrchestrator._decide`, the only
  caller of the core's ``route_many`` -- output batches, adds, aborts,
  deadlines, input segments, a stage's death, replica changes -- whoever
  delivers the event; the stage I/O it decides is awaited in decision order
  by the task that decided (the dispatcher, or the request handler), or
  handed to the dispatcher by a callback that cannot await;
- **the same rule for who decides**: at once, by whoever delivers the event,
  while nothing is in flight (the dispatcher parked with nothing queued, the
  consumer caught up with the output queue); otherwise the event waits in the
  dispatcher's inbox (a deque with one waiter, :mod:`bench.refs.inbox`, the
  twin of the Trio shell's) and everything queued there is decided together;
  no clock is read;
- **the push path**: a stage client that offers ``pump(deliver)`` hands its
  batches over synchronously, into that same path;
- **the abort path**: a serving thread's abort goes straight to the loop
  (``call_soon_threadsafe``) as an event of that path, in order with the
  outputs -- not behind the adds in the request queue;
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
from collections.abc import Coroutine
from typing import Any

from bench.refs.control import RpcMsg, concurrent_rpc
from bench.refs.inbox import Inbox
from bench.refs.orchestrator import AbortMsg, AddMsg, AsyncioOrchestrator, UpdateMsg
from trio_orch.core import (
    Abort,
    AbortRequest,
    Action,
    Emit,
    Enqueue,
    Expire,
    InputSegment,
    ReplicasChanged,
    StageLost,
    Submit,
    SubmitFailed,
    Submitted,
    Ticket,
    Update,
    stage_call,
    stage_call_failed,
    stage_call_nowait,
)
from trio_orch.types import StageAbilities, StageClient, StageDied, StageOutput

__all__ = ["TaskGroupOrchestrator"]

log = logging.getLogger("bench.refs.taskgroup")

#: posted when a decision made at once left starts for the dispatcher's next decision
_STARTS = object()


class TaskGroupOrchestrator(AsyncioOrchestrator):
    """Event-driven asyncio orchestrator with structured task supervision and the Trio shell's design."""

    variant = "asyncio-taskgroup"
    description = ("modern asyncio with the Trio shell's design: one decide-and-perform path, TaskGroup, "
                   "asyncio.timeout and shield, stage I/O in tasks, unrouted errors reported, no sweep")
    use_runner = True
    bounded_cleanup = True
    push_path = True
    _tg: asyncio.TaskGroup | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        #: what others queued for the dispatcher: events, and stage I/O a callback decided (a list)
        self.ready_q: Inbox[Any] = Inbox()
        self._side: set[asyncio.Task[None]] = set()
        #: nothing in flight: the dispatcher parked with nothing queued and no stage I/O pending
        self._idle = False
        self._posted = 0
        self._io_pending = 0  # decisions whose stage I/O is not performed yet (no start meanwhile)
        self._parked = False  # the dispatcher waits on an empty inbox
        self._starting: dict[Ticket, Any] = {}  # queued tickets whose add waits for the start
        self._started: list[Any] = []  # ... whose ticket started: released once the I/O decided is done
        self._abilities = [StageAbilities.of(s) for s in self.stages]  # what each stage declared

    async def run(self) -> None:
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

    # ------------------------------------------------------------------ events in
    def _push(self, stage_id: int, outs: list[StageOutput]) -> None:
        """A stage's output batch (a reader's, or pushed synchronously by the stage client)."""
        if self._idle and not self.output_queue.async_q.qsize():
            self._perform_later(self._decide([(stage_id, outs)]))
        else:
            self._post((stage_id, outs))

    def _offer(self, event: Any) -> None:
        """Any other event from a callback: decided at once when nothing is in flight, else queued."""
        if self._idle and not self.output_queue.async_q.qsize():
            self._perform_later(self._decide([event]))
        else:
            self._post(event)

    def _post(self, item: Any) -> None:
        """Queue an event (or stage I/O to perform) for the dispatcher (ends the idle state)."""
        self._idle = False
        self._posted += 1
        self.ready_q.post(item)

    def _perform_later(self, io: list[Action]) -> None:
        """Stage I/O decided where nothing can await it: the dispatcher performs it, in order."""
        if io:
            self._io_pending += 1
            self._post(io)

    # ------------------------------------------------------------------ the one decision
    def _decide(self, events: list[Any]) -> list[Action]:
        """Apply ``events`` through the core: the only writer of request state.  Emits are delivered
        here; the stage I/O is returned, for the caller to await in order (or hand on)."""
        was_idle, self._idle = self._idle, False
        posted = self._posted
        # as the Trio shell: a decision made at once starts only what it queued into an empty queue
        start = not self._io_pending and not (was_idle and self.router.start_queued)
        io: list[Action] = []
        while True:  # the outcomes of the sends done here are decided in turn (a submit a stage refused)
            actions = self.router.route_many(events, start=start)
            msgs = [a.message for a in actions if type(a) is Emit]
            if msgs:
                self._deliver(msgs)
                if len(msgs) == len(actions):
                    break
            events = self._send_nowait(actions, io)
            if not events:
                break
        if self._starting:  # their adds return once the start's stage I/O is done (see _perform)
            queued = self.router.queued
            for t in [t for t in self._starting if queued.get(t.request_id) is not t]:
                done = self._starting.pop(t)
                if done is not None:
                    self._started.append(done)
        if not io and not self._io_pending and self._started:  # nothing to perform: they started already
            started, self._started = self._started, []
            for done in started:
                done.set()
        if not start and was_idle and self.router.start_queued and not self._io_pending:
            self._post(_STARTS)  # room for requests already waiting: the dispatcher starts them
        elif was_idle and posted == self._posted and not io:
            self._idle = True
        return io

    def _send_nowait(self, actions: list[Action], io: list[Action]) -> list[Any]:
        """Submits to stage clients that take them synchronously go out now (the Trio shell's
        ``submit_nowait`` path); the rest joins ``io``, in order.  Returns the refusals to decide."""
        refused: list[Any] = []
        deferred = bool(io) or bool(self._io_pending)
        for a in actions:
            t = type(a)
            if t is Emit:
                continue
            if t is Submit and not deferred and self._abilities[a.stage_id].submit_nowait:
                k = a.stage_id
                prio = self._abilities[k].priority
                schedule = self.router.schedule(a.request_id, self.loop.time()) if prio else None
                try:
                    if stage_call_nowait(self.stages[k], a, schedule, prio):
                        continue
                except Exception as exc:
                    refused.append(SubmitFailed(k, a.request_id, stage_call_failed(a, exc)))
                    continue
            if t is not Abort:
                deferred = True
            io.append(a)
        return refused

    async def _perform(self, io: list[Action]) -> None:
        """The stage I/O of one decision, in order; the outcomes go through :meth:`_decide`."""
        self._io_pending += 1
        try:
            loop_time = self.loop.time
            for i, a in enumerate(io):
                t = type(a)
                if t is Submit or t is Update:
                    if not self.router.is_started(a.request_id):
                        continue
                    k = a.stage_id
                    prio = self._abilities[k].priority and t is Submit
                    schedule = self.router.schedule(a.request_id, loop_time()) if prio else None
                    try:
                        await stage_call(self.stages[k], a, schedule, prio)
                    except Exception as exc:
                        await self._perform(self._decide([SubmitFailed(k, a.request_id,
                                                                       stage_call_failed(a, exc))]))
                        continue
                    if t is Submit:
                        await self._perform(self._decide([Submitted(k, a.request_id)]))
                elif t is Abort:
                    if any(type(b) is Submit and b.stage_id == a.stage_id and b.request_id in a.request_ids
                           for b in io[i + 1:]):
                        await self._abort_on(a.stage_id, a.request_ids)  # inline: it is submitted there again
                    else:
                        await self.stage_abort(a)
        finally:
            self._io_pending -= 1
        if self._io_pending:
            return
        if self._parked and not self.ready_q:
            self._idle = True  # nothing in flight again
        started, self._started = self._started, []
        for done in started:
            done.set()
        if self.router.start_queued and not self.stopping.is_set():
            await self._perform(self._decide([]))  # the starts that waited for this I/O

    # ------------------------------------------------------------------ the tasks
    async def request_handler(self) -> None:
        """Adds, input segments, aborts and calls from the serving thread, in order, as events.

        Every add already queued when it wakes goes in with the first (one
        decision for a burst); it decides at once while nothing is in flight
        and awaits the stage I/O itself, else the dispatcher decides.
        """
        q = self.request_queue.async_q
        loop_time = self.loop.time
        while True:
            msg = await q.get()
            events: list[Any] = []
            while True:
                t = type(msg)
                if t is AddMsg:
                    self._starting[msg.ticket] = msg.done
                    events.append(Enqueue(msg.ticket, loop_time()))
                elif t is UpdateMsg:
                    await self._submit_events(events)
                    events = []
                    await self._update(msg)
                elif t is RpcMsg:
                    await self.handle_rpc(msg)
                elif t is AbortMsg:
                    events.append(self._abort_event(msg.request_id))
                try:
                    msg = q.get_nowait()
                except asyncio.QueueEmpty:
                    break
            await self._submit_events(events)

    async def _submit_events(self, events: list[Any]) -> None:
        events = [e for e in events if e is not None]
        if not events:
            return
        if self._idle and not self.output_queue.async_q.qsize():
            await self._perform(self._decide(events))
        else:
            for e in events:
                self._post(e)

    async def _update(self, msg: UpdateMsg) -> None:
        """An input segment: checked by the core first (a refusal is the caller's error), then decided."""
        try:
            try:
                self.router.check_update(msg.request_id, msg.final)
            except ValueError as exc:
                msg.error = exc
                return
            event = InputSegment(msg.request_id, msg.segment, msg.final)
            await self._perform(self._decide([event]))
            msg.error = event.error
        finally:
            if msg.done is not None:
                msg.done.set()

    async def _dispatcher(self) -> None:
        """Decide everything queued together, then perform the I/O (the Trio shell's dispatcher)."""
        ready = self.ready_q
        while True:
            if not ready:
                self._parked = True
                self._idle = not self._io_pending
                try:
                    await ready.wait()
                finally:
                    self._parked = self._idle = False
            events: list[Any] = []
            for item in ready.take():
                if type(item) is list:  # stage I/O a callback decided: in order, after what came before
                    io = self._decide(events)
                    if io:
                        await self._perform(io)
                    events = []
                    self._io_pending -= 1
                    await self._perform(item)
                elif item is not _STARTS:
                    events.append(item)
            io = self._decide(events)
            if io or self._started:
                await self._perform(io)

    async def reader(self, stage_id: int, stage: StageClient) -> None:
        """Move a stage's outputs in; report the stage's death.

        A stage client that pushes hands each batch to :meth:`_push` from
        wherever it receives it, as on the Trio side.
        """
        try:
            if self._abilities[stage_id].push:
                await stage.pump(lambda outs: self._push(stage_id, outs))  # type: ignore[attr-defined]
                raise RuntimeError(f"stage {stage_id} stopped delivering outputs")
            while True:
                outs = await stage.receive()
                self._push(stage_id, outs)
        except asyncio.CancelledError as exc:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise  # our own cancellation
            self._lost(stage_id, StageDied.of(exc))
        except Exception as exc:
            self._lost(stage_id, StageDied.of(exc))

    def _lost(self, stage_id: int, death: StageDied) -> None:
        msg = death.describe(stage_id)
        if self.stopping.is_set():
            msg = msg.replace(" died: ", " failed while stopping: ", 1)
            log.warning("%s", msg)
            self.stage_deaths.setdefault(stage_id, msg)
            return
        log.warning("%s", msg)
        self.stage_deaths[stage_id] = msg
        self._post(StageLost(stage_id, msg))

    # ------------------------------------------------------------------ the abort path, deadlines, replicas
    def abort(self, request_id: str) -> None:
        """(Serving thread.)  Straight to the loop, not behind the adds in the request queue."""
        try:
            self.loop.call_soon_threadsafe(self._abort_now, request_id)
        except RuntimeError:
            pass  # the loop is closed: every request already had its terminal

    def _abort_now(self, request_id: str) -> None:
        if self.stopping.is_set():
            return  # the shutdown terminals are on their way
        event = self._abort_event(request_id)
        if event is not None:
            self._offer(event)

    def _abort_event(self, request_id: str) -> AbortRequest | None:
        incarnation = self.router.queued.get(request_id) or self.router.requests.get(request_id)
        return None if incarnation is None else AbortRequest(request_id, incarnation)

    def _expire(self, request_id: str) -> None:
        self._timers.pop(request_id, None)
        incarnation = self.router.queued.get(request_id) or self.router.requests.get(request_id)
        if incarnation is not None and not self.stopping.is_set():
            self._offer(Expire(request_id, incarnation))

    def replicas_changed(self, stage_id: int, live: int, total: int) -> None:
        """(Loop thread.)  A stage's ready replicas changed: an event of the one path."""
        if not self.stopping.is_set():
            self._offer(ReplicasChanged(stage_id, live, total))

    # ------------------------------------------------------------------ side work
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

    def _report_unrouted_events(self) -> None:
        """Events the dispatcher never saw (it was cancelled first): release what waits on them."""
        self.ready_q.take()
        for done in [*self._starting.values(), *self._started]:
            if done is not None:
                done.set()
        self._starting.clear()
        self._started.clear()
