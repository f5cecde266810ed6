"""The routing core's facade: every rule set in one object, and its statistics."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from trio_orch.core.membership import MembershipRules
from trio_orch.core.routing import RoutingRules

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


class Router(RoutingRules, MembershipRules):
    """Request progression across stages ``0..num_stages-1``, with no I/O.

    Events come in as method calls and return the actions the shell must
    perform, in order.  See ``docs/design.md`` for the table of rules and the
    one method that implements each.
    """

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
            stage_limits=tuple(self.stage_limit(k) for k in range(self.num_stages)),
            retried_by_stage=tuple(self.retried),
            waiting_by_stage=tuple(len(w) for w in self.waiting),
        )
