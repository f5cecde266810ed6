"""Streaming-input rules: resumable requests that take more input segments while they run.

A resumable request's input comes in *segments*: the prompt given at add,
then one per ``update``.  Each submit or update to a stage opens one segment
there; an output with ``finished=True`` closes that stage's oldest open
segment.  In normal mode a stage k < final that closes a segment forwards
``forward_fn(k, prompt, outputs_of_that_segment)`` to stage k+1 -- a submit
the first time, an update afterwards, in order.  In async-chunk mode each
update goes to every stage at once (``prewarm_fn(k, segment)`` for k >= 1),
as the prompt did.  The request completes once its input is closed (an
update with ``final=True``) and every stage closed every segment; outputs of
final-output stages before that reach the user with ``finished=False`` and
``segment_done`` on the last output of each segment.
"""

from __future__ import annotations

from typing import Any

import trio_orch.core.failover as failover
from trio_orch.core.actions import Action, Emit, Submit, Update
from trio_orch.core.state import NOTHING, CoreState, RequestState
from trio_orch.types import OrchError, OrchOutput, StageOutput

__all__ = ["check_update", "forward_segment", "open_segment", "route_segment", "update"]


def check_update(state: CoreState, request_id: str, final: bool = False) -> None:
    """Raise ``ValueError`` if ``request_id`` cannot take another input segment now."""
    item = state.queued.get(request_id) or state.requests.get(request_id)
    if item is None:
        raise ValueError(f"update for unknown or ended request {request_id!r}")
    if not item.resumable:
        raise ValueError(f"request {request_id!r} was not added with resumable=True: "
                         "it takes no more input")
    if item.input_closed:
        raise ValueError(f"request {request_id!r} already had its final input segment")


def update(state: CoreState, request_id: str, segment: Any, *, final: bool = False) -> list[Action]:
    """One more input segment for a live resumable request (``final``: the last one).

    Raises ``ValueError`` and changes nothing for an unknown or ended id,
    a request not added with ``resumable=True``, or after ``final``.
    """
    check_update(state, request_id, final)
    ticket = state.queued.get(request_id)
    if ticket is not None:  # not started yet: the segments follow the prompt at start
        ticket.updates.append((segment, final))
        ticket.input_closed = final
        return NOTHING
    return open_segment(state, state.requests[request_id], segment, final)


def open_segment(state: CoreState, req: RequestState, segment: Any, final: bool) -> list[Action]:
    """Send a new input segment to stage 0 (async-chunk: to every stage up to the final one)."""
    rid = req.request_id
    targets = range(req.final_stage_id + 1) if state.async_chunk else (0,)
    payloads = [segment]
    if not state.async_chunk and req.waiting is not None and req.waiting.stage_id == 0:
        req.segments += 1  # its failover waits for a replica: the segment goes with the resend
        req.input_closed = final
        req.opened[0] = req.opened.get(0, 0) + 1
        failover.held_for_replica(state, req, Update(0, rid, segment, final, req.sampling.get(0)))
        return NOTHING
    for k in targets:
        if not state.available[k]:
            return state.end(req, OrchError(rid, k, "stage_unavailable", f"stage {k} has no live replica"))
        if k:
            try:
                payloads.append(state.prewarm_fn(k, segment))
            except Exception as exc:  # a user callback: report, never crash routing
                return state.end(req, OrchError(rid, k, "forward_failed",
                                               f"prewarm_fn({k}) raised {type(exc).__name__}: {exc}"))
    req.segments += 1
    req.input_closed = final
    for k in targets:
        req.opened[k] = req.opened.get(k, 0) + 1
    sampling = req.sampling
    updates: list[Action] = []
    for k in targets:
        update = Update(k, rid, payloads[k], final, sampling.get(k))
        state.keep_input(req, update)
        updates.append(update)
    return updates


def route_segment(state: CoreState, req: RequestState, stage_id: int, out: StageOutput) -> list[Action]:
    """Route one output of a resumable request (the segment-aware twin of ``route``)."""
    rid = req.request_id
    closed = req.closed.get(stage_id, 0)
    if req.opened.get(stage_id, 0) <= closed:  # no segment open here: late, stray or duplicate
        state.dropped_outputs += 1
        return NOTHING
    if out.error is not None:
        return failover.stage_error(state, req, stage_id, out)
    req.replay.pop(stage_id, None)  # it answered: a death there is no longer retried
    forwards = not state.async_chunk and stage_id < req.final_stage_id
    if forwards:
        req.outputs.setdefault(stage_id, []).append(out.data)
    if out.finished:
        req.closed[stage_id] = closed + 1
        if req.input_closed and closed + 1 == req.segments:
            state.stage_done(req, stage_id)
    actions: list[Action] = []
    if stage_id in req.finals:
        all_final = req.finals <= req.finished
        msg = OrchOutput(rid, stage_id, out.data, all_final, out.t_produced, closed, out.finished)
        state.keep_partial(req, stage_id, out.data)
        if all_final:
            if req.submitted <= req.finished:
                return state.complete(req, msg)
            req.pending_final = msg
            return NOTHING
        state.outputs_routed += 1
        actions.append(Emit(msg))
    elif req.pending_final is not None and req.submitted <= req.finished:
        return state.complete(req, req.pending_final)
    if forwards and out.finished:
        actions.extend(forward_segment(state, req, stage_id))
    return actions


def forward_segment(state: CoreState, req: RequestState, stage_id: int) -> list[Action]:
    """Normal mode: stage ``stage_id`` closed a segment; pass it on (submit first, then updates)."""
    nxt = stage_id + 1
    rid = req.request_id
    waits = req.waiting is not None and req.waiting.stage_id == nxt
    if not state.available[nxt] and not waits:
        return state.end(req, OrchError(rid, nxt, "stage_unavailable", f"stage {nxt} has no live replica"))
    try:
        payload = state.forward_fn(stage_id, req.prompt, req.outputs.pop(stage_id, []))
    except Exception as exc:  # a user callback: report, never crash routing
        return state.end(req, OrchError(rid, stage_id, "forward_failed",
                                       f"forward_fn({stage_id}) raised {type(exc).__name__}: {exc}"))
    last = req.input_closed and req.closed.get(stage_id, 0) == req.segments
    req.opened[nxt] = req.opened.get(nxt, 0) + 1
    params = req.sampling.get(nxt)
    action: Submit | Update
    if nxt in req.submitted:
        action = Update(nxt, rid, payload, last, params)
    else:
        req.submitted.add(nxt)
        action = Submit(nxt, rid, payload, not last, params)
    if waits and failover.held_for_replica(state, req, action):
        return NOTHING  # its failover at the next stage waits for a replica: sent with the resend
    state.keep_input(req, action)
    return [action]
