"""Admission rules: which requests are accepted, how they start, how a queued one ends.

A request's life in the core has two phases.  *Accepted* (a :class:`Ticket`):
validated and registered synchronously in the caller's context, before its
first checkpoint, so a duplicate id is refused at once and the shell can
queue the request without racing another add of the same id.  *Started* (a
:class:`RequestState`): the request handler took it and the first
submissions were decided.  A queued request can still end (abort, deadline,
shutdown) with a terminal and without any stage I/O.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Mapping
from typing import Any

import trio_orch.core.companions as companion_rules
import trio_orch.core.streaming as streaming
from trio_orch.core.actions import Action, Emit, Submit
from trio_orch.core.state import NOTHING, CoreState, RequestState, Ticket
from trio_orch.types import OrchError

__all__ = ["accept", "add", "can_start", "capacity", "check_priority", "check_timeout", "enqueue", "has_room",
           "is_current", "is_live", "is_queued", "is_started", "live_count", "next_ticket", "queued_terminal",
           "refuse", "resolve_final_stage", "resolve_sampling", "schedule", "stage_limit", "start",
           "start_key", "start_ready", "stop_accepting", "unavailable_stage", "withdraw"]


def is_queued(state: CoreState, request_id: str) -> bool:
    return request_id in state.queued


def is_live(state: CoreState, request_id: str) -> bool:
    """Accepted and without a terminal yet (queued or started)."""
    return request_id in state.queued or request_id in state.requests


def is_started(state: CoreState, request_id: str) -> bool:
    """Started and without a terminal -- a companion counts while its parent runs.

    What a shell asks before performing a submit or update decided earlier.
    """
    return request_id in state.requests or (
        request_id in state.companion_of and state.companion_of[request_id] in state.requests)


def is_current(state: CoreState, ticket: Ticket) -> bool:
    """The ticket's request is live and is this incarnation of its id."""
    rid = ticket.request_id
    if state.queued.get(rid) is ticket:
        return True
    req = state.requests.get(rid)
    return req is not None and req.ticket is ticket


def live_count(state: CoreState) -> int:
    return len(state.queued) + len(state.requests)


def resolve_final_stage(state: CoreState, request_id: object, final_stage_id: int | None) -> int:
    """Validate a new request's id and final stage; return its final stage.  Raises ValueError.

    Reads configuration only, so a serving thread may call it without
    holding the core.
    """
    if not isinstance(request_id, str) or not request_id:
        raise ValueError(f"request_id must be a non-empty str, got {request_id!r}")
    if final_stage_id is None:
        return state.default_final_stage_id
    if isinstance(final_stage_id, bool) or not isinstance(final_stage_id, int):
        raise ValueError(f"final_stage_id must be an int, got {final_stage_id!r}")
    if not 0 <= final_stage_id < state.num_stages:
        raise ValueError(
            f"final_stage_id={final_stage_id} out of range: stages are 0..{state.num_stages - 1}")
    if not state.finals_for[final_stage_id]:
        raise ValueError(
            f"final_stage_id={final_stage_id} leaves no final-output stage for request "
            f"{request_id!r}: final-output stages are {sorted(state.final_stage_ids)}")
    return final_stage_id


def check_priority(priority: object) -> int:
    """A request's priority is an int (lower values start first, as vLLM's); raises ValueError."""
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise ValueError(f"priority must be an int (lower values are served first), got {priority!r}")
    return priority


def check_timeout(timeout: float | None) -> None:
    """A per-request deadline must be a positive number of seconds (or None)."""
    if timeout is not None and not (isinstance(timeout, (int, float)) and timeout > 0):
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")


def resolve_sampling(state: CoreState, sampling: Any) -> dict[int, Any]:
    """Per-stage sampling parameters -> ``{stage: params}``, each checked; raises ValueError.

    ``sampling`` is None, a sequence indexed by stage (``None`` entries:
    the stage's defaults), or a mapping ``stage -> params``.  The core
    never interprets the parameters: the pipeline's ``check_sampling``
    validates each stage's entry (naming the bad key), and the stage
    receives it with every submit and update.
    """
    if sampling is None:
        return {}
    if isinstance(sampling, Mapping):
        items = list(sampling.items())
    elif isinstance(sampling, (list, tuple)):
        items = list(enumerate(sampling))
    else:
        raise ValueError(f"sampling must be a list indexed by stage or a mapping stage -> parameters, "
                         f"got {type(sampling).__name__}")
    out: dict[int, Any] = {}
    for k, params in items:
        if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k < state.num_stages:
            raise ValueError(f"sampling parameters for stage {k!r}: stages are 0..{state.num_stages - 1}")
        if params is None:
            continue
        if state.check_sampling is not None:
            try:
                params = state.check_sampling(k, params)
            except ValueError as exc:
                raise ValueError(f"sampling parameters for stage {k}: {exc}") from None
        out[k] = params
    return out


def accept(state: CoreState, request_id: str, prompt: Any, *, final_stage_id: int | None = None,
           timeout: float | None = None, resumable: bool = False, sampling: Any = None,
           companions: Mapping[str, Any] | None = None, priority: int = 0) -> Ticket:
    """Validate and register a request; the shell queues the returned ticket.

    ``priority``: lower values start first (see :meth:`start_key`).
    ``resumable``: more input segments may follow (:meth:`update`).
    ``sampling``: per-stage parameters (see :meth:`resolve_sampling`).
    ``companions``: ``{id: stage-0 prompt}``, registered with the request
    (see :mod:`trio_orch.core.companions`).

    Raises ``ValueError`` (bad parameters, duplicate live id) or
    ``RuntimeError`` (no longer accepting); nothing is registered then.
    """
    if not state.accepting:
        raise RuntimeError("orchestrator is not accepting requests: it is shutting down")
    final = resolve_final_stage(state, request_id, final_stage_id)
    check_timeout(timeout)
    check_priority(priority)
    if request_id in state.queued or request_id in state.requests or request_id in state.companion_of:
        raise ValueError(f"duplicate request id {request_id!r}: a request with this id is active")
    params = resolve_sampling(state, sampling)
    comps = companion_rules.resolve_companions(state, request_id, companions, final, bool(resumable))
    state.accepted_total += 1
    ticket = Ticket(request_id, prompt, final, timeout, bool(resumable), params, priority,
                    state.accepted_total)
    state.queued[request_id] = ticket
    if comps:
        ticket.companions = comps
        for cid in comps:
            state.companion_of[cid] = request_id
    return ticket


def withdraw(state: CoreState, ticket: Ticket) -> None:
    """Undo :meth:`accept` for a ticket that never reached the request queue (no terminal)."""
    if state.queued.get(ticket.request_id) is ticket:
        del state.queued[ticket.request_id]
        state.unqueue(ticket)
        for cid in ticket.companions:
            state.companion_of.pop(cid, None)


def start(state: CoreState, ticket: Ticket) -> list[Action]:
    """The request handler took ``ticket``: decide the first submissions.

    Nothing if the ticket ended while queued.  Normal mode submits the
    prompt to stage 0; async-chunk mode submits every stage up to the
    final one at once (``prewarm_fn(k, prompt)`` for k >= 1).  A stage
    with no live replica, or a ``prewarm_fn`` that raises, ends the
    request here with its terminal.
    """
    rid = ticket.request_id
    if state.queued.get(rid) is not ticket:
        return NOTHING
    del state.queued[rid]
    state.unqueue(ticket)
    prompt, final = ticket.prompt, ticket.final_stage_id
    targets = range(final + 1) if state.async_chunk else (0,)
    for k in targets:
        if not state.available[k]:
            return refuse(state, ticket, OrchError(rid, k, "stage_unavailable",
                                              f"stage {k} has no live replica"))
    payloads = [prompt]
    if state.async_chunk:
        for k in range(1, final + 1):
            try:
                payloads.append(state.prewarm_fn(k, prompt))
            except Exception as exc:  # a user callback: report, never crash admission
                return refuse(state, ticket, OrchError(
                    rid, k, "forward_failed", f"prewarm_fn({k}) raised {type(exc).__name__}: {exc}"))
    req = RequestState(ticket, state.finals_for[final])
    req.submitted.update(targets)
    state.requests[rid] = req
    claims = state.claims
    for k in range(final + 1):  # released stage by stage as it finishes them, or when it ends
        claims[k] += 1
    resumable = ticket.resumable
    sampling = ticket.sampling
    actions: list[Action] = [Submit(k, rid, payloads[k], resumable, sampling.get(k)) for k in targets]
    state.keep_input(req, actions[0])
    if resumable:
        req.input_closed = False
        req.opened = dict.fromkeys(targets, 1)
        for segment, final_segment in ticket.updates:
            actions.extend(streaming.open_segment(state, req, segment, final_segment))
    for cid, cprompt in ticket.companions.items():  # after the parent: the same replica takes them
        companion = Submit(0, cid, cprompt, False, sampling.get(0), rid)
        state.keep_input(req, companion)
        actions.append(companion)
    actions.extend(state.past_final(req))
    return actions


def start_key(state: CoreState, ticket: Ticket, queued_at: float) -> tuple[int, float, int]:
    """The order in which queued tickets start: smallest key first.

    ``(priority + aging epoch, deadline, arrival)``: the lowest priority
    value first; among equals the earliest deadline (none: last), then
    arrival order.  Aging: time is cut into epochs of ``priority_aging``
    seconds and a ticket queued one epoch earlier counts one priority level
    better, so a request of priority p is passed only by requests of
    priority q queued less than ``(p - q + 1) * priority_aging`` seconds
    after it -- a stream of more urgent requests delays it by a bounded
    time and never starves it.  The key depends on the moment it was queued
    alone, so it never changes while the ticket waits.
    """
    epoch = math.floor(queued_at / state.priority_aging)
    deadline = math.inf if ticket.deadline is None else ticket.deadline
    return (ticket.priority + epoch, deadline, ticket.seq)


def enqueue(state: CoreState, ticket: Ticket, now: float) -> None:
    """The shell queued an accepted ticket at ``now`` (its clock): it waits in the start queue.

    Its deadline (``now`` + its timeout, unless the shell set it when it
    accepted the ticket) travels with its submits.  A ticket no longer
    current (it ended meanwhile) is not queued.
    """
    if state.queued.get(ticket.request_id) is not ticket or ticket.order is not None:
        return
    if ticket.timeout is not None and ticket.deadline is None:
        ticket.deadline = now + ticket.timeout
    ticket.order = key = start_key(state, ticket, now)
    heapq.heappush(state.start_queue, (key, ticket))
    state.start_queued += 1


def next_ticket(state: CoreState) -> Ticket | None:
    """The queued ticket that starts next (the smallest :meth:`start_key`); None if none waits.

    It stays queued until :meth:`start` (the shell asks :meth:`can_start`
    first, and asks again whenever a better ticket may have arrived).
    """
    heap = state.start_queue
    while heap:
        key, ticket = heap[0]
        if ticket.order == key and state.queued.get(ticket.request_id) is ticket:
            return ticket
        heapq.heappop(heap)  # started, ended or withdrawn since it was queued
    return None


def schedule(state: CoreState, request_id: str, now: float) -> tuple[int, float | None]:
    """What a stage is told with a request's submit: its priority and the seconds left until its
    deadline (None: no deadline), so a worker picks its batch by the same order.

    A companion has its parent's.
    """
    req = state.requests.get(state.companion_of.get(request_id, request_id))
    if req is None:
        return (0, None)
    ticket = req.ticket
    left = None if ticket.deadline is None else max(0.0, ticket.deadline - now)
    return (ticket.priority, left)


def unavailable_stage(state: CoreState, final_stage_id: int) -> int | None:
    """The first stage of a request's path (0..final) with no live replica; None if none.

    A front refuses such a request at once (it could not complete) rather
    than let it queue; the core itself still accepts it and ends it with
    ``stage_unavailable`` when it reaches that stage.
    """
    available = state.available
    for k in range(final_stage_id + 1):
        if not available[k]:
            return k
    return None


def stage_limit(state: CoreState, stage_id: int) -> int | None:
    """How many started requests may hold stage ``stage_id`` now (None: no bound).

    ``max_inflight`` per live replica: a stage that lost replicas admits less.
    """
    per_replica = state.max_inflight[stage_id]
    if per_replica is None:
        return None
    return per_replica * max(1, state.replicas_live[stage_id])


def capacity(state: CoreState) -> int | None:
    """At most how many started requests the stages can hold at once (None: no bound).

    Every started request holds room on at least one stage -- the first of
    its path it has not finished -- so the sum of the bounds caps them.  A
    front uses it (with the shell's queue) to refuse cheaply what could
    only be shed.
    """
    total = 0
    for k in range(state.num_stages):
        limit = stage_limit(state, k)
        if limit is None:
            return state.max_running
        total += limit
    return total if state.max_running is None else min(total, state.max_running)


def has_room(state: CoreState, final_stage_id: int) -> bool:
    """May one more request with this path start now?

    A started request holds room on every stage of its path (0..final)
    until it finishes that stage or ends, so what a stage has admitted
    includes work still upstream of it: nothing starts that a later stage
    would have to queue beyond its bound.  And no more than ``max_running``
    requests are started at once, whatever their paths (vLLM's
    ``max_num_seqs``).
    """
    if state.max_running is not None and len(state.requests) >= state.max_running:
        return False
    claims = state.claims
    for k in range(final_stage_id + 1):
        limit = stage_limit(state, k)
        if limit is not None and claims[k] >= limit:
            return False
    return True


def can_start(state: CoreState, ticket: Ticket) -> bool:
    """Should the shell call :meth:`start` for this queued ticket now rather than wait?

    Yes when there is room on its path, and also when ``start`` would not
    submit anything anyway (the ticket ended while queued, or a stage it
    starts on has no live replica: it ends at once).  No while paused.
    Otherwise the shell waits, and asks again after a request ended, a
    stage finished one, a stage's replicas changed or a pause ended.
    """
    if state.queued.get(ticket.request_id) is not ticket:
        return True
    if state.paused is not None:
        return False
    final = ticket.final_stage_id
    first = range(final + 1) if state.async_chunk else (0,)
    if any(not state.available[k] for k in first):
        return True
    return has_room(state, final)


def start_ready(state: CoreState) -> list[Action]:
    """Start every queued ticket that can start now, in the start order; their first submissions.

    The starts of one decision go out together (a worker's next step
    batches them); the first ticket that must wait for room holds the ones
    behind it, which keeps the start order (a better ticket is never passed
    by a worse one because the worse one fits).
    """
    actions: list[Action] = []
    while state.start_queued:
        ticket = next_ticket(state)
        if ticket is None or not can_start(state, ticket):
            break
        actions.extend(start(state, ticket))
    return actions


def add(state: CoreState, request_id: str, prompt: Any, final_stage_id: int | None = None, *,
        timeout: float | None = None, resumable: bool = False, sampling: Any = None,
        companions: Mapping[str, Any] | None = None, priority: int = 0) -> list[Action]:
    """:meth:`accept` and :meth:`start` in one step (no queue between them)."""
    return start(state, accept(state, request_id, prompt, final_stage_id=final_stage_id, timeout=timeout,
                                  resumable=resumable, sampling=sampling, companions=companions,
                                  priority=priority))


def refuse(state: CoreState, ticket: Ticket, err: OrchError) -> list[Action]:
    """A request that could not start: its terminal; nothing was submitted, its companions go."""
    for cid in ticket.companions:
        state.companion_of.pop(cid, None)
    state.count_terminal(err.kind)
    return [Emit(err)]


def queued_terminal(state: CoreState, kind: str) -> str:
    """The message of a queued request's terminal of ``kind``."""
    return {
        "aborted": "aborted by the client while queued",
        "timeout": "its deadline passed while queued",
        "shutdown": "orchestrator shut down before the request was handled",
    }.get(kind, kind)


def stop_accepting(state: CoreState) -> None:
    """From now on :meth:`accept` raises ``RuntimeError`` (shutdown began)."""
    state.accepting = False
