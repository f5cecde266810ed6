"""The routing core's one entry for every change of request state: :func:`route_many`.

A shell collects the events that reached it -- output batches, a stage's
death, a replica arriving or leaving, an abort, a deadline, an input
segment, a pause, a stage I/O's outcome, shutdown -- and hands them over in
one call, in the order they happened.  ``route_many`` applies each with the
rule that owns it and then starts every queued request that can start (the
shape of httpcore's ``_assign_requests_to_connections``: decide everything,
then let the caller perform the I/O).  It is synchronous, so under any event
loop the whole decision is atomic: no other task can see request state half
changed, and the single-writer rule is "only ``route_many`` writes".

An output batch is the pair ``(stage_id, outputs)`` (no wrapper: it is the
most frequent event by far); every other event is one of the small classes
below.  Events that answer their poster carry a slot the core fills in
(``aborted``: the ids the stages were told to drop, for a caller that waits
for their confirmation; ``error``: why an input segment was refused).

Acceptance (validating a new request and reserving its id, ``admission.accept``)
is not an event: the routing contract makes it happen in the caller, before
its first checkpoint, so a refusal raises there.  The accepted ticket then
enters through :class:`Enqueue`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import trio_orch.core.admission as admission
import trio_orch.core.control as control
import trio_orch.core.routing as routing
import trio_orch.core.streaming as streaming
from trio_orch.core.actions import Abort, Action
from trio_orch.core.state import CoreState, RequestState, Ticket
from trio_orch.types import StageOutput

__all__ = ["AbortRequest", "Enqueue", "Event", "Expire", "InputSegment", "Pause", "ReplicasChanged", "Resume",
           "Shutdown", "StageLost", "SubmitFailed", "Submitted", "route_many"]


class Enqueue:
    """An accepted ticket joins the start queue; ``now`` (the shell's clock) fixes its place there."""

    __slots__ = ("now", "ticket")

    def __init__(self, ticket: Ticket, now: float) -> None:
        self.ticket = ticket
        self.now = now


class AbortRequest:
    """A client's abort of ``request_id`` -- of ``incarnation`` only (an id may be reused after its
    terminal): the ticket or the started state it had when the abort was asked for."""

    __slots__ = ("aborted", "incarnation", "request_id")

    def __init__(self, request_id: str, incarnation: Ticket | RequestState | None) -> None:
        self.request_id = request_id
        self.incarnation = incarnation
        self.aborted: list[str] = []  #: filled in: the ids the stages were told to drop


class Expire:
    """The deadline of ``request_id`` (that incarnation) passed."""

    __slots__ = ("incarnation", "request_id")

    def __init__(self, request_id: str, incarnation: Ticket | RequestState | None) -> None:
        self.request_id = request_id
        self.incarnation = incarnation


class InputSegment:
    """One more input segment for a resumable request (``final``: its last)."""

    __slots__ = ("error", "final", "request_id", "segment")

    def __init__(self, request_id: str, segment: Any, final: bool) -> None:
        self.request_id = request_id
        self.segment = segment
        self.final = final
        self.error: ValueError | None = None  #: filled in when the core refuses it (it ended meanwhile)


class StageLost:
    """A stage client died (``message`` says why); its open requests end."""

    __slots__ = ("message", "stage_id")

    def __init__(self, stage_id: int, message: str) -> None:
        self.stage_id = stage_id
        self.message = message


class ReplicasChanged:
    """A stage's ready replicas changed: ``live`` of ``total`` can take requests now."""

    __slots__ = ("live", "stage_id", "total")

    def __init__(self, stage_id: int, live: int, total: int) -> None:
        self.stage_id = stage_id
        self.live = live
        self.total = total


class Pause:
    """Start nothing from now on; ``mode`` as ``control.pause`` takes it (the caller checked it)."""

    __slots__ = ("aborted", "mode")

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.aborted: list[str] = []  #: filled in (``"abort"``): the ids the stages were told to drop


class Resume:
    """Start requests again."""

    __slots__ = ()


class SubmitFailed:
    """A decided submit or update could not be delivered to stage ``stage_id``."""

    __slots__ = ("message", "request_id", "stage_id")

    def __init__(self, stage_id: int, request_id: str, message: str) -> None:
        self.stage_id = stage_id
        self.request_id = request_id
        self.message = message


class Submitted:
    """A decided submit reached stage ``stage_id`` (the request may have ended meanwhile)."""

    __slots__ = ("request_id", "stage_id")

    def __init__(self, stage_id: int, request_id: str) -> None:
        self.stage_id = stage_id
        self.request_id = request_id


class Shutdown:
    """Stop accepting; every request still queued or started gets its ``shutdown`` terminal."""

    __slots__ = ("message",)

    def __init__(self, message: str = "orchestrator shut down") -> None:
        self.message = message


Event = (tuple[int, list[StageOutput]] | Enqueue | AbortRequest | Expire | InputSegment | StageLost
         | ReplicasChanged | Pause | Resume | SubmitFailed | Submitted | Shutdown)


def _current(state: CoreState, request_id: str, incarnation: object) -> bool:
    """The request is live and is still the incarnation the event was posted for."""
    return state.queued.get(request_id) is incarnation or state.requests.get(request_id) is incarnation


def _aborted(actions: list[Action]) -> list[str]:
    """The request ids ``actions`` tell stages to drop."""
    return [i for a in actions if type(a) is Abort for i in a.request_ids]


def route_many(state: CoreState, events: Iterable[Any], start: bool = True) -> list[Action]:
    """Apply ``events`` in order, then start what can start; the actions to perform, in order.

    ``start=False``: leave the start queue as it is -- the shell still
    performs earlier stage I/O and takes no new starts until it is done (a
    stage that blocks in ``submit`` holds the queue, and the callers behind
    it).  The one function through which a shell changes request state (see
    the module docstring); a shell calls it from one place.
    """
    actions: list[Action] = []
    for ev in events:
        t = type(ev)
        if t is tuple:
            stage_id, outs = ev
            for out in outs:
                actions.extend(routing.route(state, stage_id, out))
        elif t is Enqueue:
            admission.enqueue(state, ev.ticket, ev.now)
        elif t is AbortRequest or t is Expire:
            rid = ev.request_id
            if _current(state, rid, ev.incarnation):
                acts = routing.abort(state, rid) if t is AbortRequest else routing.expire(state, rid)
                if t is AbortRequest:
                    ev.aborted.extend(_aborted(acts))
                actions.extend(acts)
        elif t is Submitted:
            actions.extend(routing.submitted(state, ev.stage_id, ev.request_id))
        elif t is SubmitFailed:
            actions.extend(routing.submit_failed(state, ev.stage_id, ev.request_id, ev.message))
        elif t is InputSegment:
            try:
                actions.extend(streaming.update(state, ev.request_id, ev.segment, final=ev.final))
            except ValueError as exc:  # it ended (or got its final segment) after the call was checked
                ev.error = exc
        elif t is StageLost:
            actions.extend(routing.stage_died(state, ev.stage_id, ev.message))
        elif t is ReplicasChanged:
            actions.extend(routing.replicas_changed(state, ev.stage_id, ev.live, ev.total))
        elif t is Pause:
            acts = control.pause(state, ev.mode)
            ev.aborted.extend(_aborted(acts))
            actions.extend(acts)
        elif t is Resume:
            control.resume(state)
        elif t is Shutdown:
            actions.extend(routing.shutdown(state, ev.message))
        else:
            raise TypeError(f"not a routing event: {ev!r}")
    if start and state.start_queued:
        actions.extend(admission.start_ready(state))
    return actions
