"""Routing rules: outputs, forwarding, the terminal gate, and every way a started request ends."""

from __future__ import annotations

from collections.abc import Iterable

from trio_orch.core.actions import Abort, Action, Emit, Submit
from trio_orch.core.failover import FailoverRules
from trio_orch.core.state import NOTHING, RequestState
from trio_orch.types import OrchError, OrchOutput, StageOutput

__all__ = ["RoutingRules"]


class RoutingRules(FailoverRules):
    """Outputs in, user messages and stage I/O out."""

    def route(self, stage_id: int, out: StageOutput) -> list[Action]:
        """Route one output of stage ``stage_id`` (the terminal gate lives here)."""
        rid = out.request_id
        req = self.requests.get(rid)
        if req is None:
            parent = self.companion_of.get(rid)
            if parent is not None:
                return self.route_companion(parent, stage_id, out)
        if req is not None and out.error_kind == "replica_died" and rid in req.stale:
            req.stale.discard(rid)  # the death of the replica a failover already left
            self.dropped_outputs += 1
            return NOTHING
        if (req is None or stage_id not in req.submitted or stage_id in req.finished
                or (req.waiting is not None and (req.waiting.stage_id == stage_id or self.async_chunk))):
            # Unknown, cleaned up, never submitted here, already finished here, or waiting for a
            # replica to be resent to here (no replica holds it; an async-chunk restart: none anywhere).
            self.dropped_outputs += 1
            return NOTHING
        if req.resumable:
            return self.route_segment(req, stage_id, out)
        if out.error is not None:
            retry = self.failover(req, stage_id, out)
            if retry is not None:
                return retry
            kind = out.error_kind or "stage_failed"
            return self.end(req, OrchError(rid, stage_id, kind, out.error), skip=stage_id)
        req.replay.pop(stage_id, None)  # it answered: a death there is no longer retried
        finished = out.finished
        forwards = finished and not self.async_chunk and stage_id < req.final_stage_id
        if forwards and req.companions and stage_id == 0 and not self.companions_ready(req):
            forwards = False  # the last companion to finish stage 0 forwards (route_companion)
        if finished:
            self.stage_done(req, stage_id)
        if not self.async_chunk and stage_id < req.final_stage_id:
            req.outputs.setdefault(stage_id, []).append(out.data)
        actions: list[Action] = []
        if stage_id in req.finals:
            all_final = req.finals <= req.finished
            msg = OrchOutput(rid, stage_id, out.data, all_final, out.t_produced)
            self.keep_partial(req, stage_id, out.data)
            if all_final:
                if req.submitted <= req.finished:
                    return self.complete(req, msg)
                req.pending_final = msg  # the terminal gate: an upstream stage is still open
                return NOTHING
            self.outputs_routed += 1
            actions.append(Emit(msg))
        elif req.pending_final is not None and req.submitted <= req.finished:
            return self.complete(req, req.pending_final)
        if forwards:
            actions.extend(self.forward(req, stage_id))
        return actions

    def route_many(self, stage_id: int, outs: Iterable[StageOutput]) -> list[Action]:
        """Route a batch of outputs of one stage, in order."""
        actions: list[Action] = []
        for out in outs:
            actions.extend(self.route(stage_id, out))
        return actions

    def forward(self, req: RequestState, stage_id: int) -> list[Action]:
        """Normal mode: stage ``stage_id`` finished, submit ``forward_fn(...)`` to the next stage."""
        nxt = stage_id + 1
        rid = req.request_id
        if not self.available[nxt]:
            return self.end(req, OrchError(rid, nxt, "stage_unavailable", f"stage {nxt} has no live replica"))
        try:
            outputs = req.outputs.pop(stage_id, [])
            if req.companions and stage_id == 0:
                comps = self.companion_outputs(req)
                payload = self.forward_fn(stage_id, req.prompt, outputs, companions=comps)
            else:
                payload = self.forward_fn(stage_id, req.prompt, outputs)
        except Exception as exc:  # a user callback: report, never crash routing
            return self.end(req, OrchError(rid, stage_id, "forward_failed",
                                           f"forward_fn({stage_id}) raised {type(exc).__name__}: {exc}"))
        req.submitted.add(nxt)
        submit = Submit(nxt, rid, payload, False, req.sampling.get(nxt))
        self.keep_input(req, submit)
        return [submit]

    # ------------------------------------------------------------------ ends
    def abort(self, request_id: str, message: str = "aborted by the client") -> list[Action]:
        """Client abort, queued or started: terminal ``aborted``; unknown id is a no-op."""
        return self.end_by_id(request_id, "aborted", message)

    def expire(self, request_id: str, message: str = "request deadline exceeded") -> list[Action]:
        """Per-request deadline passed, queued or started: terminal ``timeout``; unknown id: no-op."""
        return self.end_by_id(request_id, "timeout", message)

    def end_by_id(self, request_id: str, kind: str, message: str) -> list[Action]:
        ticket = self.queued.get(request_id)
        if ticket is not None:
            return self.end_queued(ticket, kind, self.queued_terminal(kind))
        req = self.requests.get(request_id)
        if req is None:
            return NOTHING
        stage = req.waiting.stage_id if req.waiting is not None and kind == "timeout" else None
        return self.end(req, OrchError(request_id, stage, kind, self.waiting_message(req, message)))

    def submit_failed(self, stage_id: int, request_id: str, message: str,
                      kind: str = "stage_unavailable") -> list[Action]:
        """The shell could not deliver a Submit: terminal for that request.

        A companion's failed submit ends its parent (whose forward would wait
        for it forever), with a message naming the companion.
        """
        parent_id = self.companion_of.get(request_id)
        if parent_id is not None:
            parent = self.requests.get(parent_id)
            comp = parent.companions.get(request_id) if parent is not None else None
            if parent is None or comp is None:
                return NOTHING
            comp.finished = True  # never reached its stage: nothing to abort there
            return self.end(parent, OrchError(parent_id, stage_id, kind,
                                              f"companion {request_id!r}: {message}"))
        req = self.requests.get(request_id)
        if req is None:
            return NOTHING
        return self.end(req, OrchError(request_id, stage_id, kind, message), skip=stage_id)

    def submitted(self, stage_id: int, request_id: str) -> list[Action]:
        """A Submit completed.  If the request ended while it was in flight, abort it there.

        The request's terminal may have been decided (and its stage aborts
        sent) while the submit was still being written; the stage would then
        hold a request nobody waits for.
        """
        if self.is_started(request_id):
            return NOTHING
        return [Abort(stage_id, [request_id])]

    def stage_died(self, stage_id: int, message: str) -> list[Action]:
        """A stage client died: its open requests get ``replica_died``; stage marked unavailable."""
        self.available[stage_id] = False
        self.replicas_live[stage_id] = 0
        actions: list[Action] = []
        victims = [r for r in self.requests.values()
                   if (stage_id in r.submitted and stage_id not in r.finished)
                   or (stage_id == 0 and r.companions and not self.companions_ready(r))]
        for req in victims:
            err = OrchError(req.request_id, stage_id, "replica_died", self.waiting_message(req, message))
            actions.extend(self.end(req, err, skip=stage_id))
        return actions

    def set_available(self, stage_id: int, available: bool) -> None:
        """Mark a stage as (un)able to take new work (e.g. a replica came back)."""
        self.available[stage_id] = available

    def replicas_changed(self, stage_id: int, live: int, total: int) -> list[Action]:
        """A stage's ready replicas changed (one died, one became ready, one left or rejoined).

        The stage is available while it has a live replica, and its admission
        bound (``max_inflight`` per live replica) follows the live count, so a
        stage that lost half its replicas admits half the work.  Requests
        bound to a dead replica are handled through their own ``replica_died``
        outputs; the returned actions are the failovers that waited for a live
        replica here, sent now (see ``resume_failovers``).
        """
        self.replicas_live[stage_id] = live
        self.replicas_total[stage_id] = total
        self.available[stage_id] = live > 0
        return self.resume_failovers(stage_id)

    def shutdown(self, message: str = "orchestrator shut down") -> list[Action]:
        """Stop accepting; every queued and started request gets its ``shutdown`` terminal.

        A shell first withdraws the tickets that never reached its request
        queue (their callers get an error instead of a terminal).
        """
        self.stop_accepting()
        actions: list[Action] = []
        for ticket in list(self.queued.values()):
            actions.extend(self.end_queued(ticket, "shutdown", self.queued_terminal("shutdown")))
        for req in list(self.requests.values()):
            actions.extend(self.end(req, OrchError(req.request_id, None, "shutdown", message)))
        return actions
