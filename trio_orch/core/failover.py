"""Failover rules: a request a dead replica held is resent -- at once, or once a replica is back.

A replica pool reports a replica's death (killed, evicted as hung, gone while
leaving) as one ``replica_died`` output per request bound to it.  Where the
request had produced nothing at that stage, nothing of it reached anyone, so
the core sends the same inputs to the stage again and the pool places them on
a live replica -- invisibly to the user, at most ``max_retries`` times per
request.  When the stage has no live replica at that moment (its only replica
died, the others are restarting), the resend *waits*: it goes out as soon as
the stage reports a live replica again (:meth:`FailoverRules.resume_failovers`,
called by ``replicas_changed``), while the request's deadline, an abort, a
shutdown or the stage's death (its last slot given up) may end it first.

Async-chunk mode streams chunks from stage to stage as they are made, so one
stage's inputs cannot be replayed alone: while nothing of the request reached
the user, the whole request restarts from stage 0 (every other stage holding
it is told to drop it first); otherwise it ends with ``replica_died`` and its
partial output.
"""

from __future__ import annotations

from trio_orch.core.actions import Abort, Action, Submit, Update
from trio_orch.core.state import NOTHING, CoreState, RequestState, Waiting
from trio_orch.types import OrchError, StageOutput

__all__ = ["failover", "held_for_replica", "resend", "restart", "resume_failovers", "stage_error",
           "waiting_message"]


def stage_error(state: CoreState, req: RequestState, stage_id: int, out: StageOutput) -> list[Action]:
    """A stage reported ``req`` failed (its own error, or its replica's death): failed over where
    :func:`failover` allows, else the terminal (``out.error_kind``, ``stage_failed`` by default) --
    not aborted on that stage, which already dropped it."""
    retry = failover(state, req, stage_id, out)
    if retry is not None:
        return retry
    kind = out.error_kind or "stage_failed"
    return state.end(req, OrchError(req.request_id, stage_id, kind, out.error), skip=stage_id)


def failover(state: CoreState, req: RequestState, stage_id: int, out: StageOutput) -> list[Action] | None:
    """A replica died holding ``req`` at ``stage_id``: the actions that retry it, or None (it ends).

    Retried when the output is a pool's ``replica_died``, the request has
    retries left (``max_retries``) and, in normal mode, the stage had
    produced nothing for it: the same inputs go again, in order (the
    submit, a resumable request's segments, a parent's companions, whose
    outputs are collected afresh).  Async-chunk mode restarts the request
    instead (:meth:`restart`).  With no live replica on the stage the
    resend waits for one (:meth:`resend`).  None: the caller ends the
    request with its ``replica_died`` terminal and partial output.
    """
    if out.error_kind != "replica_died" or req.retries >= state.max_retries or req.waiting is not None:
        return None  # (one failover waits at a time: a second death meanwhile ends the request)
    if state.async_chunk:
        return restart(state, req, stage_id, out.error or "replica died")
    inputs = req.replay.get(stage_id)
    if inputs is None:
        return None
    req.retries += 1
    if stage_id == 0 and req.companions:
        # every id still bound to the dead replica brings its own replica_died: drop those
        stale = {cid for cid, comp in req.companions.items() if not comp.finished}
        stale.add(req.request_id)
        stale.discard(out.request_id)
        req.stale = stale
        for comp in req.companions.values():
            comp.finished = False
            comp.outputs.clear()
    return resend(state, req, stage_id, out.error or "replica died", inputs)


def restart(state: CoreState, req: RequestState, stage_id: int, why: str) -> list[Action] | None:
    """Async-chunk: run the request again from stage 0, or None if that would show the user twice.

    Only while nothing of it reached the user (no output of a final
    stage, none held) and for a request that takes no streamed input
    (whose later segments are not kept).  Every other stage that holds it
    is aborted first -- the shells perform an abort before a later submit
    of the same request to the same stage -- then every stage of its path
    gets its first input again, as at start.
    """
    if req.resumable or req.partial or req.pending_final is not None:
        return None
    rid, final = req.request_id, req.final_stage_id
    try:
        payloads = [req.prompt] + [state.prewarm_fn(k, req.prompt) for k in range(1, final + 1)]
    except Exception:  # a user callback failed: end as the death would (nothing is retried)
        return None
    req.retries += 1
    aborts: list[Action] = [Abort(k, [rid]) for k in sorted(req.open_stages)
                            if k != stage_id and state.available[k]]
    for k in req.finished:  # it has every stage of its path to pass again
        state.claims[k] += 1
    req.finished.clear()
    req.outputs.clear()
    req.submitted = set(range(final + 1))
    sampling = req.sampling
    inputs: list[Action] = [Submit(k, rid, payloads[k], False, sampling.get(k)) for k in range(final + 1)]
    inputs.extend(state.past_final(req))
    return aborts + resend(state, req, stage_id, why, inputs)


def resend(state: CoreState, req: RequestState, died_at: int, why: str, inputs: list[Action]) -> list[Action]:
    """Send ``inputs`` now if every stage they go to has a live replica; else wait for one.

    A waiting request sends nothing and stays started (it keeps its room
    and its deadline); :meth:`resume_failovers` sends it once its stage
    is live again.  The retry is counted when it is sent.
    """
    for a in inputs:
        if type(a) is not Abort and not state.available[a.stage_id]:
            req.waiting = Waiting(died_at, a.stage_id, why, inputs)
            state.waiting[a.stage_id][req.request_id] = req
            return NOTHING
    req.waiting = None
    state.retried[died_at] += 1
    return list(inputs)  # a copy: inputs kept for a later failover may grow meanwhile


def resume_failovers(state: CoreState, stage_id: int) -> list[Action]:
    """Stage ``stage_id`` has a live replica again: send the failovers that waited for one, in order."""
    waiting = state.waiting[stage_id]
    if not waiting or not state.available[stage_id]:
        return NOTHING
    state.waiting[stage_id] = {}
    actions: list[Action] = []
    for req in waiting.values():
        w = req.waiting
        assert w is not None
        actions.extend(resend(state, req, w.died_at, w.why, w.actions))
    return actions


def held_for_replica(state: CoreState, req: RequestState, action: Submit | Update) -> bool:
    """Keep an input for a stage the request waits at: it goes with the resend (True), not now.

    A resumable request's segment that arrives while its failover waits
    joins the inputs kept for that stage instead of failing on a stage
    with no live replica.
    """
    w = req.waiting
    if w is None or w.stage_id != action.stage_id or state.async_chunk:
        return False
    state.keep_input(req, action)
    return True


def waiting_message(state: CoreState, req: RequestState, message: str) -> str:
    """``message`` for a request that ends while its failover waits, saying what it waited for."""
    w = req.waiting
    if w is None:
        return message
    return (f"{message} while waiting for stage {w.stage_id} to have a live replica again "
            f"(its replica died holding the request: {w.why})")
