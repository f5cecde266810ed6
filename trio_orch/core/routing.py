"""Routing rules: outputs, forwarding, the terminal gate, and every way a started request ends."""

from __future__ import annotations

import trio_orch.core.admission as admission
import trio_orch.core.companions as companions
import trio_orch.core.failover as failover
import trio_orch.core.streaming as streaming
from trio_orch.core.actions import Abort, Action, Emit, Submit
from trio_orch.core.state import NOTHING, CoreState, RequestState
from trio_orch.types import OrchError, OrchOutput, StageOutput

__all__ = ["abort", "end_by_id", "expire", "forward", "replicas_changed", "route", "route_companion",
           "set_available", "shutdown", "stage_died", "submit_failed", "submitted"]


def route(state: CoreState, stage_id: int, out: StageOutput) -> list[Action]:
    """Route one output of stage ``stage_id`` (the terminal gate lives here)."""
    rid = out.request_id
    req = state.requests.get(rid)
    if req is None:
        parent = state.companion_of.get(rid)
        if parent is not None:
            return route_companion(state, parent, stage_id, out)
    if req is not None and out.error_kind == "replica_died" and rid in req.stale:
        req.stale.discard(rid)  # the death of the replica a failover already left
        state.dropped_outputs += 1
        return NOTHING
    if (req is None or stage_id not in req.submitted or stage_id in req.finished
            or (req.waiting is not None and (req.waiting.stage_id == stage_id or state.async_chunk))):
        # Unknown, cleaned up, never submitted here, already finished here, or waiting for a
        # replica to be resent to here (no replica holds it; an async-chunk restart: none anywhere).
        state.dropped_outputs += 1
        return NOTHING
    if req.resumable:
        return streaming.route_segment(state, req, stage_id, out)
    if out.error is not None:
        return failover.stage_error(state, req, stage_id, out)
    req.replay.pop(stage_id, None)  # it answered: a death there is no longer retried
    finished = out.finished
    forwards = finished and not state.async_chunk and stage_id < req.final_stage_id
    if forwards and req.companions and stage_id == 0 and not companions.companions_ready(state, req):
        forwards = False  # the last companion to finish stage 0 forwards (route_companion)
    if finished:
        state.stage_done(req, stage_id)
    if not state.async_chunk and stage_id < req.final_stage_id:
        req.outputs.setdefault(stage_id, []).append(out.data)
    actions: list[Action] = []
    if stage_id in req.finals:
        all_final = req.finals <= req.finished
        msg = OrchOutput(rid, stage_id, out.data, all_final, out.t_produced)
        state.keep_partial(req, stage_id, out.data)
        if all_final:
            if req.submitted <= req.finished:
                return state.complete(req, msg)
            req.pending_final = msg  # the terminal gate: an upstream stage is still open
            return NOTHING
        state.outputs_routed += 1
        actions.append(Emit(msg))
    elif req.pending_final is not None and req.submitted <= req.finished:
        return state.complete(req, req.pending_final)
    if forwards:
        actions.extend(forward(state, req, stage_id))
    return actions


def route_companion(state: CoreState, parent_id: str, stage_id: int, out: StageOutput) -> list[Action]:
    """Route one output of a companion: collect it; its finish may release the parent's forward."""
    parent = state.requests.get(parent_id)
    comp = parent.companions.get(out.request_id) if parent is not None else None
    if parent is None or comp is None or stage_id != 0 or comp.finished:
        state.dropped_outputs += 1
        return NOTHING
    if out.error_kind == "replica_died" and comp.request_id in parent.stale:
        parent.stale.discard(comp.request_id)  # its old replica's death: resubmitted already
        state.dropped_outputs += 1
        return NOTHING
    if parent.waiting is not None and parent.waiting.stage_id == 0:
        state.dropped_outputs += 1  # its failover waits for a replica: no replica holds it
        return NOTHING
    if out.error is not None:
        retry = failover.failover(state, parent, 0, out)
        if retry is not None:
            return retry
        comp.finished = True  # it is gone on its stage: nothing to abort there
        kind = out.error_kind or "stage_failed"
        why = f"companion {comp.request_id!r} failed at stage 0: {out.error}"
        return state.end(parent, OrchError(parent_id, 0, kind, why))
    comp.outputs.append(out.data)
    if not out.finished:
        return NOTHING
    comp.finished = True
    if 0 in parent.finished and companions.companions_ready(state, parent):
        return forward(state, parent, 0)
    return NOTHING


def forward(state: CoreState, req: RequestState, stage_id: int) -> list[Action]:
    """Normal mode: stage ``stage_id`` finished, submit ``forward_fn(...)`` to the next stage."""
    nxt = stage_id + 1
    rid = req.request_id
    if not state.available[nxt]:
        return state.end(req, OrchError(rid, nxt, "stage_unavailable", f"stage {nxt} has no live replica"))
    try:
        outputs = req.outputs.pop(stage_id, [])
        if req.companions and stage_id == 0:
            comps = companions.companion_outputs(state, req)
            payload = state.forward_fn(stage_id, req.prompt, outputs, companions=comps)
        else:
            payload = state.forward_fn(stage_id, req.prompt, outputs)
    except Exception as exc:  # a user callback: report, never crash routing
        return state.end(req, OrchError(rid, stage_id, "forward_failed",
                                       f"forward_fn({stage_id}) raised {type(exc).__name__}: {exc}"))
    req.submitted.add(nxt)
    submit = Submit(nxt, rid, payload, False, req.sampling.get(nxt))
    state.keep_input(req, submit)
    return [submit]


def abort(state: CoreState, request_id: str, message: str = "aborted by the client") -> list[Action]:
    """Client abort, queued or started: terminal ``aborted``; unknown id is a no-op."""
    return end_by_id(state, request_id, "aborted", message)


def expire(state: CoreState, request_id: str, message: str = "request deadline exceeded") -> list[Action]:
    """Per-request deadline passed, queued or started: terminal ``timeout``; unknown id: no-op."""
    return end_by_id(state, request_id, "timeout", message)


def end_by_id(state: CoreState, request_id: str, kind: str, message: str) -> list[Action]:
    ticket = state.queued.get(request_id)
    if ticket is not None:
        return state.end_queued(ticket, kind, admission.queued_terminal(state, kind))
    req = state.requests.get(request_id)
    if req is None:
        return NOTHING
    stage = req.waiting.stage_id if req.waiting is not None and kind == "timeout" else None
    return state.end(req, OrchError(request_id, stage, kind, failover.waiting_message(state, req, message)))


def submit_failed(state: CoreState, stage_id: int, request_id: str, message: str,
                  kind: str = "stage_unavailable") -> list[Action]:
    """The shell could not deliver a Submit: terminal for that request.

    A companion's failed submit ends its parent (whose forward would wait
    for it forever), with a message naming the companion.
    """
    parent_id = state.companion_of.get(request_id)
    if parent_id is not None:
        parent = state.requests.get(parent_id)
        comp = parent.companions.get(request_id) if parent is not None else None
        if parent is None or comp is None:
            return NOTHING
        comp.finished = True  # never reached its stage: nothing to abort there
        return state.end(parent, OrchError(parent_id, stage_id, kind,
                                          f"companion {request_id!r}: {message}"))
    req = state.requests.get(request_id)
    if req is None:
        return NOTHING
    return state.end(req, OrchError(request_id, stage_id, kind, message), skip=stage_id)


def submitted(state: CoreState, stage_id: int, request_id: str) -> list[Action]:
    """A Submit completed.  If the request ended while it was in flight, abort it there.

    The request's terminal may have been decided (and its stage aborts
    sent) while the submit was still being written; the stage would then
    hold a request nobody waits for.
    """
    if admission.is_started(state, request_id):
        return NOTHING
    return [Abort(stage_id, [request_id])]


def stage_died(state: CoreState, stage_id: int, message: str) -> list[Action]:
    """A stage client died: its open requests get ``replica_died``; stage marked unavailable."""
    state.available[stage_id] = False
    state.replicas_live[stage_id] = 0
    actions: list[Action] = []
    victims = [r for r in state.requests.values()
               if (stage_id in r.submitted and stage_id not in r.finished)
               or (stage_id == 0 and r.companions and not companions.companions_ready(state, r))]
    for req in victims:
        why = failover.waiting_message(state, req, message)
        err = OrchError(req.request_id, stage_id, "replica_died", why)
        actions.extend(state.end(req, err, skip=stage_id))
    return actions


def set_available(state: CoreState, stage_id: int, available: bool) -> None:
    """Mark a stage as (un)able to take new work (e.g. a replica came back)."""
    state.available[stage_id] = available


def replicas_changed(state: CoreState, stage_id: int, live: int, total: int) -> list[Action]:
    """A stage's ready replicas changed (one died, one became ready, one left or rejoined).

    The stage is available while it has a live replica, and its admission
    bound (``max_inflight`` per live replica) follows the live count, so a
    stage that lost half its replicas admits half the work.  Requests
    bound to a dead replica are handled through their own ``replica_died``
    outputs; the returned actions are the failovers that waited for a live
    replica here, sent now (see ``resume_failovers``).
    """
    state.replicas_live[stage_id] = live
    state.replicas_total[stage_id] = total
    state.available[stage_id] = live > 0
    return failover.resume_failovers(state, stage_id)


def shutdown(state: CoreState, message: str = "orchestrator shut down") -> list[Action]:
    """Stop accepting; every queued and started request gets its ``shutdown`` terminal.

    A shell first withdraws the tickets that never reached its request
    queue (their callers get an error instead of a terminal).
    """
    admission.stop_accepting(state)
    actions: list[Action] = []
    for ticket in list(state.queued.values()):
        actions.extend(state.end_queued(ticket, "shutdown", admission.queued_terminal(state, "shutdown")))
    for req in list(state.requests.values()):
        actions.extend(state.end(req, OrchError(req.request_id, None, "shutdown", message)))
    return actions
