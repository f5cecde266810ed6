"""Companion rules: requests registered with a parent that condition its next stage (CFG).

Classifier-free guidance needs a second, unconditional encoding of a
negative prompt next to the conditional one.  A *companion* is registered
atomically with its parent (its id shares the request-id namespace), runs
stage 0 only -- on the parent's stage-0 replica -- and never reaches the
user: the parent's terminal is the only one.  The parent's forward from
stage 0 waits until the parent **and every companion** finished there, and
``forward_fn`` then gets ``companions={id: [data values of that companion]}``.
A companion that fails fails its parent (the message names it); ending the
parent aborts companions still running; their later outputs are dropped and
counted.  Companions need normal mode and a parent whose final stage is past
stage 0 (there is nothing to condition otherwise).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from trio_orch.core.actions import Action
from trio_orch.core.state import NOTHING, CoreState, RequestState
from trio_orch.types import OrchError, StageOutput

__all__ = ["CompanionRules"]


class CompanionRules(CoreState):
    """Validation and routing of companion requests."""

    def resolve_companions(self, request_id: str, companions: Any, final_stage_id: int,
                           resumable: bool) -> dict[str, Any]:
        """Check a parent's companions (``{id: stage-0 prompt}``); raises ValueError, registers nothing."""
        if not companions:
            return {}
        if not isinstance(companions, Mapping):
            raise ValueError(f"companions must be a mapping id -> prompt, got {type(companions).__name__}")
        if self.async_chunk:
            raise ValueError("companions need normal mode: in async-chunk mode no forward waits for them")
        if resumable:
            raise ValueError("a resumable request cannot have companions")
        if final_stage_id < 1:
            raise ValueError(f"request {request_id!r} stops at stage 0: "
                             "its companions would condition nothing")
        for cid in companions:
            if not isinstance(cid, str) or not cid:
                raise ValueError(f"companion ids must be non-empty str, got {cid!r}")
            if cid == request_id or cid in self.queued or cid in self.requests or cid in self.companion_of:
                raise ValueError(f"duplicate request id {cid!r}: companion ids share the "
                                 "request-id namespace and this one is active")
        return dict(companions)

    def companions_ready(self, req: RequestState) -> bool:
        """Every companion of ``req`` finished stage 0."""
        return all(c.finished for c in req.companions.values())

    def companion_outputs(self, req: RequestState) -> dict[str, list[Any]]:
        """What ``forward_fn`` gets as ``companions=``: each companion's stage-0 data values, in order."""
        return {cid: list(c.outputs) for cid, c in req.companions.items()}

    def route_companion(self, parent_id: str, stage_id: int, out: StageOutput) -> list[Action]:
        """Route one output of a companion: collect it; its finish may release the parent's forward."""
        parent = self.requests.get(parent_id)
        comp = parent.companions.get(out.request_id) if parent is not None else None
        if parent is None or comp is None or stage_id != 0 or comp.finished:
            self.dropped_outputs += 1
            return NOTHING
        if out.error_kind == "replica_died" and comp.request_id in parent.stale:
            parent.stale.discard(comp.request_id)  # its old replica's death: resubmitted already
            self.dropped_outputs += 1
            return NOTHING
        if parent.waiting is not None and parent.waiting.stage_id == 0:
            self.dropped_outputs += 1  # its failover waits for a replica: no replica holds it
            return NOTHING
        if out.error is not None:
            retry = self.failover(parent, 0, out)
            if retry is not None:
                return retry
            comp.finished = True  # it is gone on its stage: nothing to abort there
            kind = out.error_kind or "stage_failed"
            why = f"companion {comp.request_id!r} failed at stage 0: {out.error}"
            return self.end(parent, OrchError(parent_id, 0, kind, why))
        comp.outputs.append(out.data)
        if not out.finished:
            return NOTHING
        comp.finished = True
        if 0 in parent.finished and self.companions_ready(parent):
            return self.forward(parent, 0)
        return NOTHING

    def forward(self, req: RequestState, stage_id: int) -> list[Action]:  # pragma: no cover
        """Declared for the rule above; :meth:`RoutingRules.forward` implements it."""
        raise NotImplementedError
