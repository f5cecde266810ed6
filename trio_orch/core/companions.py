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

from trio_orch.core.state import CoreState, RequestState

__all__ = ["companion_outputs", "companions_ready", "resolve_companions"]


def resolve_companions(state: CoreState, request_id: str, companions: Any, final_stage_id: int,
                       resumable: bool) -> dict[str, Any]:
    """Check a parent's companions (``{id: stage-0 prompt}``); raises ValueError, registers nothing."""
    if not companions:
        return {}
    if not isinstance(companions, Mapping):
        raise ValueError(f"companions must be a mapping id -> prompt, got {type(companions).__name__}")
    if state.async_chunk:
        raise ValueError("companions need normal mode: in async-chunk mode no forward waits for them")
    if resumable:
        raise ValueError("a resumable request cannot have companions")
    if final_stage_id < 1:
        raise ValueError(f"request {request_id!r} stops at stage 0: "
                         "its companions would condition nothing")
    for cid in companions:
        if not isinstance(cid, str) or not cid:
            raise ValueError(f"companion ids must be non-empty str, got {cid!r}")
        if cid == request_id or cid in state.queued or cid in state.requests or cid in state.companion_of:
            raise ValueError(f"duplicate request id {cid!r}: companion ids share the "
                             "request-id namespace and this one is active")
    return dict(companions)


def companions_ready(state: CoreState, req: RequestState) -> bool:
    """Every companion of ``req`` finished stage 0."""
    return all(c.finished for c in req.companions.values())


def companion_outputs(state: CoreState, req: RequestState) -> dict[str, list[Any]]:
    """What ``forward_fn`` gets as ``companions=``: each companion's stage-0 data values, in order."""
    return {cid: list(c.outputs) for cid, c in req.companions.items()}
