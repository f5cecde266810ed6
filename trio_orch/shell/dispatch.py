"""The one decide-and-perform path of the Trio shell.

Under Trio a synchronous function with no checkpoint runs atomically, so the
single-writer rule is simple to state: request state changes only inside
:meth:`Dispatch.decide`, the one function that calls the core's
:meth:`~trio_orch.core.Router.route_many`.  It decides everything first (the
core applies the events and starts what can start), then performs what it
can at once -- the messages go out, submits to stage clients that take them
synchronously are sent, stage aborts go to a task of the run nursery -- and
queues the stage I/O that must be awaited for the performer task, in
decision order (httpcore's ``_assign_requests_to_connections`` is the
model: decide under the lock, then do the I/O).

**Who decides.**  Every event enters through :meth:`Dispatch.offer` (or
:meth:`Dispatch.push` for a stage's output batch), whoever delivers it: the
dispatcher task, a reader, a stage client pushing a batch from its socket
owner, a caller of ``add_request`` or ``abort``, the deadline keeper.
When nothing is in flight -- the dispatcher is parked with no event and no
stage I/O pending, and the consumer has taken every message delivered so far
-- the deliverer decides at once: no task hop, nothing overtaken.  Otherwise
the event is queued in the inbox, and the dispatcher decides everything
queued there together on its next turn.  Nothing here reads a clock: what
arrives while earlier decisions are still in flight (a burst from one
scheduler pass, a consumer that is behind) is batched by that structure
alone, as Nagle's rule batches a socket's writes while data is unacknowledged.
The stage clients do the same for submits: what one pass sends to a busy
worker replica leaves together (``cluster/transport.py``).  And a decision
made at once starts only a request it queued into an empty start queue: room
it makes for requests already waiting is filled by the dispatcher's next
decision, which sees first whatever else the pass brought (the abort of one
of them, say).

**Stage I/O.**  Emits first, then submits and updates in decision order; a
submit the stage cannot take synchronously, every update, and everything
after them go to the performer task, which awaits them in order while
decisions go on, and reports each outcome back through
:meth:`Dispatch.decide` (``SubmitFailed``, ``Submitted``).  While such I/O
is pending no queued request starts: a stage that blocks in ``submit``
holds the start queue, and with it the callers of
``add_request``, as a bounded queue should.  Stage aborts are best-effort
cleanup in a task of the run nursery (a stage hung in ``abort`` stalls
nobody) -- except an abort followed by a submit of the same request to the
same stage (an async-chunk restart), which is awaited in order.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Sequence
from functools import partial
from typing import Any

import trio

from trio_orch.core import (
    Abort,
    Action,
    Emit,
    Enqueue,
    InputSegment,
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
from trio_orch.shell.control import AbortWait, ControlPlane
from trio_orch.shell.inbox import Inbox
from trio_orch.shell.outputs import OutputStream
from trio_orch.shell.state import ShellState
from trio_orch.types import StageClient, StageDied, StageOutput

__all__ = ["Dispatch"]

log = logging.getLogger("trio_orch")

_NO_EVENTS: list[Any] = []


class _Pending:
    """Stage I/O a decision left for the dispatcher, and what waits for it to be done."""

    __slots__ = ("actions", "release")

    def __init__(self, actions: list[Action], release: list[trio.Event]) -> None:
        self.actions = actions
        self.release = release


class Dispatch:
    """Decides every event through the core and performs the result (see the module docstring)."""

    def __init__(self, state: ShellState, outputs: OutputStream, control: ControlPlane) -> None:
        self.state = state
        self.router = state.router
        self.outputs = outputs
        self.control = control
        self.inbox: Inbox[Any] = Inbox()
        #: nothing in flight on the shell's side: the dispatcher is parked with no event queued and no
        #: stage I/O pending, and no decision is running -- a deliverer may decide at once
        self.idle = False
        self._posted = 0  # events queued so far (an inline decision checks none came in meanwhile)
        self._io: deque[_Pending] = deque()  # stage I/O to await, in decision order (``starts_held``)
        self._io_added = trio.Event()  # the performer waits on it for I/O to await
        self._parked = False  # the dispatcher waits on an empty inbox
        self._starts_due = False  # a decision made room for queued requests: the dispatcher starts them
        #: who waits on events queued in the inbox (taken with it): callers of abort()/pause() waiting
        #: for the stages' confirmations, and callers waiting until an event's stage I/O is done
        self._confirms: list[AbortWait] = []
        self._settles: list[tuple[Any, trio.Event]] = []
        #: queued tickets someone waits to see started (their add_request, an input segment kept for them)
        self.starting: dict[Ticket, list[trio.Event]] = {}

    # ------------------------------------------------------------------ events in
    def push(self, stage_id: int, outs: list[StageOutput]) -> None:
        """A stage's output batch (what a reader received, or a stage client pushed synchronously)."""
        out = self.outputs
        if self.idle and not out.behind and (out.backlog is None or not out.backlog()):
            self.decide([(stage_id, outs)])
        elif not self.inbox.closed:
            self.post((stage_id, outs))
        # else stopping: the shutdown terminals already went out

    def offer(self, event: Any, confirm: AbortWait | None = None, settle: trio.Event | None = None) -> None:
        """Any other event: decided at once when nothing is in flight, else queued for the dispatcher.

        ``confirm``: a caller waiting for the stages to confirm the aborts the
        event causes; ``settle``: set once the stage I/O it causes is done.
        Raises ``trio.ClosedResourceError`` once the shell stopped taking events.
        """
        out = self.outputs
        if self.idle and not out.behind and (out.backlog is None or not out.backlog()):
            self.decide([event], () if confirm is None else (confirm,),
                        () if settle is None else ((event, settle),))
            return
        self.post(event)
        if confirm is not None:
            self._confirms.append(confirm)
        if settle is not None:
            self._settles.append((event, settle))

    def enqueue(self, ticket: Ticket, now: float, done: trio.Event | None) -> None:
        """An accepted ticket goes into the core's start queue; ``done`` is set once it started (or ended)."""
        if done is not None:
            self.wait_start(ticket, done)
        out = self.outputs
        if self.idle and not out.behind and (out.backlog is None or not out.backlog()):
            self.decide([Enqueue(ticket, now)])
        else:
            self.post(Enqueue(ticket, now))
            self.state.enqueues_pending += 1

    def post(self, event: Any) -> None:
        """Queue an event for the dispatcher's next turn (ends the idle state)."""
        self.idle = False
        self._posted += 1
        self.inbox.post(event)

    def stage_lost(self, stage_id: int, death: StageDied) -> None:
        """A reader's stage died: logged now; its requests end when the event is decided.

        Once the run is being cancelled nothing routes any more: the failure
        is reported as one while stopping (its requests get the shutdown
        terminal).
        """
        msg = death.describe(stage_id)
        if not self.state.spawning or self.inbox.closed:
            msg = msg.replace(" died: ", " failed while stopping: ", 1)
            log.warning("%s", msg)
            self.state.stage_deaths.setdefault(stage_id, msg)
            return
        log.warning("%s", msg)
        self.state.stage_deaths[stage_id] = msg
        try:
            self.offer(StageLost(stage_id, msg))
        except trio.ClosedResourceError:
            pass

    # ------------------------------------------------------------------ the one decision
    def decide(self, events: list[Any], confirms: Sequence[AbortWait] = (),
               settles: Sequence[tuple[Any, trio.Event]] = ()) -> None:
        """Apply ``events`` through the core, then perform the result: the only writer of request state.

        Synchronous (atomic under Trio).  Outcomes of the I/O done here (a
        submit a stage refused) are decided in the same call, before it
        returns.  ``confirms`` and ``settles``: who waits on these events
        (see :meth:`offer`).
        """
        was_idle, self.idle = self.idle, False
        posted = self._posted
        router = self.router
        state = self.state
        release: list[trio.Event] = []
        # Starts: a decision made at once by a deliverer starts only what it queued itself into an empty
        # queue; room it makes for requests already waiting is filled by the dispatcher's next decision,
        # together with whatever else this scheduler pass brings (the abort of one of them, say).
        start = not state.starts_held and not (was_idle and router.start_queued)
        if not was_idle:
            self._starts_due = False
        while True:  # the outcomes of the I/O done here are decided in turn (a submit a stage refused)
            actions = router.route_many(events, start=start)
            if not actions:
                break
            events = self._perform(actions, confirms)
            if not events:
                break
        for event, done in settles:
            ticket = router.queued.get(event.request_id) if type(event) is InputSegment else None
            if ticket is not None:  # kept for its start: done once the start sends it, after the prompt
                self.wait_start(ticket, done)
            else:
                release.append(done)
        for w in confirms:
            w.ids.update(w.request.aborted)
            if not w.handed:
                w.event.set()  # its abort asked no stage: nothing to confirm
        if self.starting:
            release.extend(self._started())
        if release:
            if self._io:
                self._io[-1].release.extend(release)  # once the stage I/O decided so far is done
            else:
                for done in release:
                    done.set()
        if state.room is not None or state.pause_waiter is not None or state.draining:
            state.after_decision()
        if not start and was_idle and router.start_queued and not state.starts_held:
            self._starts_due = True  # for the dispatcher's next decision
            self.idle = False
            self.inbox.nudge()
        elif was_idle and posted == self._posted and not self._io:
            self.idle = True

    def _started(self) -> list[trio.Event]:
        """The ``add_request`` callers whose ticket is no longer queued (it started, or ended there)."""
        starting, queued = self.starting, self.router.queued
        gone = [t for t in starting if queued.get(t.request_id) is not t]
        return [done for t in gone for done in starting.pop(t)]

    def wait_start(self, ticket: Ticket, done: trio.Event) -> None:
        """Set ``done`` once ``ticket`` left the start queue (started, or ended there) and the stage I/O
        its start decided is done."""
        self.starting.setdefault(ticket, []).append(done)

    def _perform(self, actions: list[Action], confirms: Sequence[AbortWait]) -> list[Any]:
        """Emits, then the stage I/O that can be done now; what must be awaited goes to the performer.

        Returns the outcomes to decide next (submits a stage refused).
        """
        msgs = [a.message for a in actions if type(a) is Emit]
        if msgs:
            state = self.state
            if state.deadlines.current:
                discard = state.deadlines.discard
                for m in msgs:
                    if m.finished:
                        discard(m.request_id)
            self.outputs.deliver(msgs)
            if len(msgs) == len(actions):
                return _NO_EVENTS
        state = self.state
        stages, abilities = state.stages, state.abilities
        io = self._io
        later: list[Action] = []
        deferred = state.starts_held  # earlier I/O pending: everything goes behind it, in order
        aborts: list[Abort] = []
        outcomes: list[Any] = []
        now = None
        for i, a in enumerate(actions):
            t = type(a)
            if t is Submit:
                k = a.stage_id
                ab = abilities[k]
                if not deferred and ab.submit_nowait:
                    schedule = None
                    if ab.priority:
                        if now is None:
                            now = trio.current_time()
                        schedule = self.router.schedule(a.request_id, now)
                    try:
                        if stage_call_nowait(stages[k], a, schedule, ab.priority):
                            continue
                    except Exception as exc:
                        outcomes.append(SubmitFailed(k, a.request_id, stage_call_failed(a, exc)))
                        continue
                deferred = True
                later.append(a)
            elif t is Update:
                deferred = True
                later.append(a)
            elif t is Abort:
                if _resubmits(actions, i, a):  # abort first, in order: the stage takes it again
                    deferred = True
                    later.append(a)
                else:
                    aborts.append(a)
        if later:
            io.append(_Pending(later, []))
            state.starts_held = True
            self.idle = False
            self._io_added.set()
        if aborts:
            self._abort(aborts, confirms)
        return outcomes

    def _abort(self, aborts: list[Abort], confirms: Sequence[AbortWait]) -> None:
        """Stage aborts in a task of the run nursery; the callers in ``confirms`` wait for them there."""
        waiting = [w for w in confirms if not w.handed]
        for w in waiting:
            w.handed = True
        if self.state.spawning:
            self.state.nursery.start_soon(self.control.abort_all, aborts, waiting)  # type: ignore[union-attr]
        else:  # stopping: the shutdown path performs what is left
            self.control.leftover.extend(aborts)
            for w in waiting:
                w.event.set()

    def close(self) -> tuple[list[AbortWait], list[tuple[Any, trio.Event]]]:
        """Shutdown: take no more events.  What was queued and never decided is dropped (the shutdown
        terminals cover it); returns who waited on it, for the shutdown decision to release.  Stage I/O
        never performed is dropped too, and its waiters released."""
        self.inbox.close()
        self.idle = False
        for event in self.inbox.take():
            if type(event) is InputSegment:
                event.error = RuntimeError("orchestrator shut down before the update was handled")
        confirms, settles = self._confirms, self._settles
        self._confirms, self._settles = [], []
        while self._io:
            settles.extend((None, done) for done in self._io.popleft().release)
        return confirms, settles

    # ------------------------------------------------------------------ the two tasks
    async def run(self) -> None:
        """The dispatcher: decide, together, every event others queued; park when there is none."""
        inbox = self.inbox
        while True:
            if not inbox:
                if inbox.closed:
                    return
                if self._starts_due:
                    self.decide([])
                    continue
                self._parked = True
                self.idle = not self._io
                try:
                    await inbox.wait()
                finally:
                    self._parked = self.idle = False
                continue
            events = inbox.take()
            self.state.enqueues_pending = 0  # every Enqueue posted so far is in this batch
            confirms, settles = self._confirms, self._settles
            self._confirms, self._settles = [], []
            self.decide(events, confirms, settles)

    async def perform(self) -> None:
        """The performer: await the stage I/O decisions left, in decision order, while decisions go on.

        A stage that blocks in ``submit`` holds the starts (``starts_held``),
        not the routing of everything else.
        """
        io, state = self._io, self.state
        while True:
            if not io:
                self._io_added = added = trio.Event()
                await added.wait()
                continue
            pending = io[0]
            try:
                await self._perform_io(pending.actions)
            finally:
                io.popleft()
                for done in pending.release:
                    done.set()
            if not io:
                state.starts_held = False
                if self._parked and not self.inbox:
                    self.idle = True
                if self.router.start_queued:
                    self.decide([])  # the starts that waited for this I/O
                elif state.room is not None:
                    state.after_decision()  # the queue may hold one more again

    async def _perform_io(self, actions: list[Action]) -> None:
        """Await each submit, update and in-order abort; report each outcome through :meth:`decide`."""
        router = self.router
        stages, abilities = self.state.stages, self.state.abilities
        for a in actions:
            k = a.stage_id
            if type(a) is Abort:
                await self.control.abort_on(k, a.request_ids)
                continue
            if not router.is_started(a.request_id):
                continue  # ended while earlier I/O was awaited
            prio = abilities[k].priority
            schedule = router.schedule(a.request_id, trio.current_time()) if prio else None
            try:
                await stage_call(stages[k], a, schedule, prio)
            except Exception as exc:
                self.decide([SubmitFailed(k, a.request_id, stage_call_failed(a, exc))])
                continue
            if type(a) is Submit:
                self.decide([Submitted(k, a.request_id)])

    # ------------------------------------------------------------------ readers
    async def read(self, stage_id: int, stage: StageClient) -> None:
        """Move one stage's outputs in; report the stage's death as its last event.

        A stage client that pushes (``PushStageClient``) hands each batch to
        :meth:`push` synchronously from wherever it receives it -- one task
        hop less than ``receive`` -- and the reader only waits for its end.
        """
        try:
            if self.state.abilities[stage_id].push:
                await stage.pump(partial(self.push, stage_id))  # type: ignore[attr-defined]
                raise RuntimeError(f"stage {stage_id} stopped delivering outputs")
            while True:
                outs = await stage.receive()
                self.push(stage_id, outs)
        except Exception as exc:
            self.stage_lost(stage_id, StageDied.of(exc))


def _resubmits(actions: list[Action], i: int, abort: Abort) -> bool:
    """A later action submits one of the aborted ids to the same stage again (an async-chunk restart)."""
    return any(type(b) is Submit and b.stage_id == abort.stage_id and b.request_id in abort.request_ids
               for b in actions[i + 1:])
