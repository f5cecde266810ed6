"""The routing core's facade: one state, every rule reachable from it, and its statistics.

:class:`Router` *is* the core's state (:class:`~trio_orch.core.state.CoreState`)
and names each rule function as a method, so a shell holds one object; the
rules themselves are plain functions over the state, one module per concern
(``admission``, ``streaming``, ``failover``, ``routing``, ``control``,
``membership``, ``companions``), each importing only the ones below it.
Binding them here costs nothing per call: a function stored on a class is a
method.  A shell changes request state through :meth:`Router.route_many`
alone (``core/events.py``); the other methods are the queries it asks, the
caller-side acceptance, and what tests drive one rule at a time with.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

import trio_orch.core.admission as admission
import trio_orch.core.companions as companions
import trio_orch.core.control as control
import trio_orch.core.events as events
import trio_orch.core.failover as failover
import trio_orch.core.membership as membership
import trio_orch.core.routing as routing
import trio_orch.core.streaming as streaming
from trio_orch.core.state import CoreState

__all__ = ["Router", "RouterStatistics"]


@dataclass(frozen=True, slots=True)
class RouterStatistics:
    """A consistent snapshot of the core's counters and tables (read-only)."""

    queued: int  #: accepted, not started
    active: int  #: started, no terminal yet
    outputs_routed: int  #: messages delivered to users, terminals included
    dropped_outputs: int  #: outputs for unknown or ended requests, or for stages not open
    terminals_by_kind: Mapping[str, int]  #: "finished" and every OrchError kind
    inflight_by_stage: tuple[int, ...]  #: started requests open on each stage
    stage_available: tuple[bool, ...]
    accepting: bool
    replicas_live: tuple[int, ...] = ()  #: ready replicas per stage
    replicas_total: tuple[int, ...] = ()  #: replica slots per stage
    claims_by_stage: tuple[int, ...] = ()  #: started requests that still have to pass each stage
    stage_limits: tuple[int | None, ...] = ()  #: how many may (None: no bound), see ``has_room``
    retried_by_stage: tuple[int, ...] = ()  #: failovers: requests resubmitted after their replica died
    waiting_by_stage: tuple[int, ...] = ()  #: failovers waiting for a live replica at each stage

    @property
    def live(self) -> int:
        return self.queued + self.active


class Router(CoreState):
    """Request progression across stages ``0..num_stages-1``, with no I/O.

    Events come in through :meth:`route_many` and return the actions the
    shell must perform, in order.  See ``docs/design.md`` for the table of
    rules and the one function that implements each.
    """

    # ---------------------------------------------------------------- the one entry for state changes
    route_many = events.route_many

    # ---------------------------------------------------------------- acceptance (in the caller)
    accept = admission.accept
    withdraw = admission.withdraw
    resolve_final_stage = admission.resolve_final_stage
    resolve_sampling = admission.resolve_sampling
    check_priority = staticmethod(admission.check_priority)
    check_timeout = staticmethod(admission.check_timeout)
    check_update = streaming.check_update
    check_stage_ids = control.check_stage_ids
    check_pause_mode = staticmethod(control.check_pause_mode)

    # ---------------------------------------------------------------- queries
    is_queued = admission.is_queued
    is_live = admission.is_live
    is_started = admission.is_started
    is_current = admission.is_current
    live_count = property(admission.live_count)
    next_ticket = admission.next_ticket
    can_start = admission.can_start
    has_room = admission.has_room
    stage_limit = admission.stage_limit
    capacity = admission.capacity
    unavailable_stage = admission.unavailable_stage
    schedule = admission.schedule
    start_key = admission.start_key
    queued_terminal = admission.queued_terminal
    pause_complete = control.pause_complete
    companions_ready = companions.companions_ready
    waiting_message = failover.waiting_message

    # ---------------------------------------------------------------- one rule at a time (tests, tools)
    enqueue = admission.enqueue
    start = admission.start
    start_ready = admission.start_ready
    add = admission.add
    stop_accepting = admission.stop_accepting
    update = streaming.update
    route = routing.route
    abort = routing.abort
    expire = routing.expire
    submit_failed = routing.submit_failed
    submitted = routing.submitted
    stage_died = routing.stage_died
    set_available = routing.set_available
    replicas_changed = routing.replicas_changed
    shutdown = routing.shutdown
    pause = control.pause
    resume = control.resume

    # ---------------------------------------------------------------- membership (not request state)
    join = membership.join
    joined = membership.joined
    left = membership.left
    joins_to_cancel = membership.joins_to_cancel

    def __len__(self) -> int:
        return len(self.requests)

    def __contains__(self, request_id: object) -> bool:
        """Started and without a terminal (queued requests are not *in* the router yet)."""
        return request_id in self.requests

    def statistics(self) -> RouterStatistics:
        inflight = [0] * self.num_stages
        for req in self.requests.values():
            for k in req.submitted - req.finished:
                inflight[k] += 1
        return RouterStatistics(
            queued=len(self.queued), active=len(self.requests),
            outputs_routed=self.outputs_routed, dropped_outputs=self.dropped_outputs,
            terminals_by_kind=MappingProxyType(dict(self.terminals_by_kind)),
            inflight_by_stage=tuple(inflight), stage_available=tuple(self.available),
            accepting=self.accepting,
            replicas_live=tuple(self.replicas_live), replicas_total=tuple(self.replicas_total),
            claims_by_stage=tuple(self.claims),
            stage_limits=tuple(admission.stage_limit(self, k) for k in range(self.num_stages)),
            retried_by_stage=tuple(self.retried),
            waiting_by_stage=tuple(len(w) for w in self.waiting),
        )
