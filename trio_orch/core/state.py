"""Per-request state of the routing core, and the terminal primitives every rule ends with.

:class:`CoreState` holds what the rules share (configuration, accepted and
active requests, counters) and the two functions through which *every*
request ends -- :meth:`CoreState.end` (an error terminal, plus stage aborts)
and :meth:`CoreState.complete` (the ``finished=True`` output).  They are the
only places request state is deleted, which is what makes "exactly one
terminal, and it is the last message" checkable in one read.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from trio_orch.core.actions import Abort, Action, Emit, Submit, Update
from trio_orch.types import OrchError, OrchOutput

__all__ = ["NOTHING", "Companion", "CoreState", "ForwardFn", "PrewarmFn", "RequestState", "Ticket", "Waiting"]

ForwardFn = Callable[..., Any]  # (stage_id, prompt, outputs) -> next input
PrewarmFn = Callable[[int, Any], Any]

#: shared empty result; callers must not mutate it
NOTHING: list[Action] = []


class Ticket:
    """A request accepted (validated and registered) but not yet started by the request handler.

    The shell carries the ticket through its request queue and hands it back
    to :meth:`~trio_orch.core.Router.start`; identity, not the id, decides
    whether it is still current (an id may be reused after its terminal).
    ``timeout`` is the request's deadline in seconds (None: none), for the
    shell's timer.  ``priority`` (lower first), ``seq`` (arrival order) and,
    once the shell queued it, ``deadline`` (absolute, the shell's clock) and
    ``order`` (its key in the start queue, see ``AdmissionRules.start_key``)
    decide when it starts.
    """

    __slots__ = ("companions", "deadline", "final_stage_id", "input_closed", "order", "priority", "prompt",
                 "request_id", "resumable", "sampling", "seq", "timeout", "updates")

    def __init__(self, request_id: str, prompt: Any, final_stage_id: int, timeout: float | None,
                 resumable: bool = False, sampling: dict[int, Any] | None = None, priority: int = 0,
                 seq: int = 0) -> None:
        self.request_id = request_id
        self.priority = priority
        self.seq = seq
        self.deadline: float | None = None
        self.order: tuple[int, float, int] | None = None  # set while in the start queue
        self.prompt = prompt
        self.final_stage_id = final_stage_id
        self.timeout = timeout
        self.resumable = resumable
        self.input_closed = not resumable
        self.updates: list[tuple[Any, bool]] = []  # input segments added while queued
        self.sampling: dict[int, Any] = sampling or {}  # stage -> its parameters (validated)
        self.companions: dict[str, Any] = {}  # companion id -> its stage-0 prompt

    def __repr__(self) -> str:
        return f"<Ticket {self.request_id!r}>"


class Companion:
    """A companion request (e.g. CFG's unconditional prompt): runs stage 0 next to its parent.

    It never reaches the user; its outputs condition the parent's forward from
    stage 0, which waits until the parent and every companion finished there.
    """

    __slots__ = ("finished", "outputs", "parent", "request_id")

    def __init__(self, request_id: str, parent: str) -> None:
        self.request_id = request_id
        self.parent = parent
        self.finished = False
        self.outputs: list[Any] = []


class Waiting:
    """A failover that found no live replica: what to resend once ``stage_id`` has one again.

    ``died_at``: the stage whose replica died (where the retry is counted);
    ``why``: that death, for the terminal if the request ends while waiting;
    ``actions``: the inputs to resend, in order (for a normal-mode failover the
    request's own replay list, so an input segment that arrives meanwhile is
    kept and sent with them).
    """

    __slots__ = ("actions", "died_at", "stage_id", "why")

    def __init__(self, died_at: int, stage_id: int, why: str, actions: list[Action]) -> None:
        self.died_at = died_at
        self.stage_id = stage_id
        self.why = why
        self.actions = actions


class RequestState:
    """A started request: S (submitted), D (finished), F (final-output stages), held terminal.

    A resumable request also counts input segments: ``segments`` given so
    far, and per stage how many were ``opened`` there (a submit or update)
    and ``closed`` (an output with ``finished=True``).  A stage is *done* --
    it joins D -- once the input is closed and it closed every segment.
    """

    __slots__ = (
        "closed",
        "companions",
        "final_stage_id",
        "finals",
        "finished",
        "input_closed",
        "opened",
        "outputs",
        "partial",
        "pending_final",
        "prompt",
        "replay",
        "request_id",
        "resumable",
        "retries",
        "sampling",
        "segments",
        "stale",
        "submitted",
        "ticket",
        "waiting",
    )

    def __init__(self, ticket: Ticket, finals: frozenset[int]):
        self.ticket = ticket  # the incarnation this state belongs to
        request_id, prompt, final_stage_id = ticket.request_id, ticket.prompt, ticket.final_stage_id
        self.request_id = request_id
        self.prompt = prompt
        self.final_stage_id = final_stage_id
        self.finals = finals
        self.submitted: set[int] = set()
        self.finished: set[int] = set()
        # stage -> data of every output, kept only for stages that forward.
        self.outputs: dict[int, list[Any]] = {}
        self.pending_final: OrchOutput | None = None
        #: final stage -> the data of every user-visible output it produced so far (an error
        #: terminal carries them: the caller of an abort keeps what was generated)
        self.partial: dict[int, list[Any]] = {}
        self.resumable = ticket.resumable
        self.sampling = ticket.sampling
        self.input_closed = True
        self.segments = 1
        self.opened: dict[int, int] = {}
        self.closed: dict[int, int] = {}
        self.companions: dict[str, Companion] = {
            cid: Companion(cid, request_id) for cid in ticket.companions}
        #: stage -> the inputs it was sent (submit, updates; stage 0: the companions' too) while it
        #: has answered nothing: what a failover resends (see ``keep_input``)
        self.replay: dict[int, list[Action]] = {}
        self.retries = 0  #: failovers so far (at most ``max_retries``)
        #: ids whose ``replica_died`` from the replica a failover left is still to come (dropped)
        self.stale: set[str] = set()
        #: a failover waiting for a live replica (see ``FailoverRules.resend``), else None
        self.waiting: Waiting | None = None

    @property
    def open_stages(self) -> set[int]:
        """S minus D: stages that still hold work for this request."""
        return self.submitted - self.finished


def default_forward(stage_id: int, prompt: Any, outputs: list[Any]) -> Any:
    return outputs


def default_prewarm(stage_id: int, prompt: Any) -> Any:
    return prompt


class CoreState:
    """Configuration, request tables and counters shared by the rule sets."""

    def __init__(
        self,
        num_stages: int,
        final_stage_ids: Iterable[int],
        *,
        async_chunk: bool = False,
        forward_fn: ForwardFn | None = None,
        prewarm_fn: PrewarmFn | None = None,
        check_sampling: Callable[[int, Any], Any] | None = None,
        max_inflight: Sequence[int | None] | None = None,
        max_running: int | None = None,
        max_retries: int = 1,
        priority_aging: float = 1.0,
    ) -> None:
        if num_stages < 1:
            raise ValueError(f"need at least one stage, got num_stages={num_stages}")
        finals = frozenset(final_stage_ids)
        if not finals:
            raise ValueError("final_stage_ids is empty: at least one stage must produce user output")
        bad = sorted(k for k in finals if not (isinstance(k, int) and 0 <= k < num_stages))
        if bad:
            raise ValueError(f"final_stage_ids {bad} out of range: stages are 0..{num_stages - 1}")
        if max_running is not None and (isinstance(max_running, bool) or not isinstance(max_running, int)
                                        or max_running < 1):
            raise ValueError(f"max_running must be None or an int >= 1, got {max_running!r}")
        if isinstance(max_retries, bool) or not isinstance(max_retries, int) or max_retries < 0:
            raise ValueError(f"max_retries must be an int >= 0, got {max_retries!r}")
        if isinstance(priority_aging, bool) or not isinstance(priority_aging, (int, float)) \
                or not priority_aging > 0:
            raise ValueError(f"priority_aging must be a positive number of seconds, got {priority_aging!r}")
        self.num_stages = num_stages
        #: seconds of earlier queueing worth one priority level (see ``AdmissionRules.start_key``)
        self.priority_aging = float(priority_aging)
        #: the start queue: a heap of (key, ticket) for tickets the shell queued, stale ones popped lazily
        self.start_queue: list[tuple[tuple[int, float, int], Ticket]] = []
        self.start_queued = 0  #: tickets in the start queue that are still current
        self.accepted_total = 0  #: acceptance counter: every ticket's ``seq``
        #: failovers per request at most (0: a replica's death ends its requests, see ``failover``)
        self.max_retries = max_retries
        self.final_stage_ids = finals
        self.async_chunk = async_chunk
        self.forward_fn: ForwardFn = forward_fn or default_forward
        self.prewarm_fn: PrewarmFn = prewarm_fn or default_prewarm
        #: (stage_id, params) -> params: validates (ValueError naming the key) and normalises one
        #: stage's sampling parameters at acceptance; None: passed through as given
        self.check_sampling = check_sampling
        self.default_final_stage_id = max(finals)
        self.available = [True] * num_stages
        #: live (ready, placeable) and total replicas per stage; a plain stage client counts as one
        self.replicas_live = [1] * num_stages
        self.replicas_total = [1] * num_stages
        #: admission bound per stage, per live replica (None: no bound); see ``has_room``
        self.max_inflight: list[int | None] = self.check_max_inflight(max_inflight, num_stages)
        #: the most started requests at once, whatever their path (None: no bound); see ``has_room``
        self.max_running = max_running
        #: per stage, the started requests that still have to pass it (submitted or not yet)
        self.claims = [0] * num_stages
        self.accepting = True
        self.paused: str | None = None  # a pause mode while paused (see ControlRules)
        self.queued: dict[str, Ticket] = {}  # accepted, not started
        self.requests: dict[str, RequestState] = {}  # started, no terminal yet
        self.companion_of: dict[str, str] = {}  # companion id -> its parent's id (queued or started)
        self.finals_for: dict[int, frozenset[int]] = {
            k: frozenset(f for f in finals if f <= k) for k in range(num_stages)
        }
        #: membership (see MembershipRules): identities joining (-> stage), members (-> stage), spent ones
        self.joining: dict[str, int] = {}
        self.members: dict[str, int] = {}
        self.spent_members: OrderedDict[str, None] = OrderedDict()
        # counters (read through statistics())
        self.dropped_outputs = 0
        self.outputs_routed = 0
        self.terminals_by_kind: dict[str, int] = {}
        self.retried = [0] * num_stages  #: failovers per stage (resubmits after a replica died)
        #: per stage, the started requests whose failover waits for a live replica there (in order)
        self.waiting: list[dict[str, RequestState]] = [{} for _ in range(num_stages)]

    @staticmethod
    def check_max_inflight(max_inflight: Sequence[int | None] | None, num_stages: int) -> list[int | None]:
        """One bound per stage, each None or an int >= 1; raises ValueError naming the stage."""
        if max_inflight is None:
            return [None] * num_stages
        limits = list(max_inflight)
        if len(limits) != num_stages:
            raise ValueError(f"max_inflight needs one entry per stage ({num_stages}), got {len(limits)}")
        for k, n in enumerate(limits):
            if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
                raise ValueError(f"max_inflight for stage {k} must be None or an int >= 1, got {n!r}")
        return limits

    # ------------------------------------------------------------------ terminals
    def release_claims(self, req: RequestState) -> None:
        """A request ended: it no longer holds room on the stages of its path it did not finish.

        A stage it finished released its claim then (see ``stage_done``).
        """
        claims = self.claims
        finished = req.finished
        for k in range(req.final_stage_id + 1):
            if k not in finished:
                claims[k] -= 1

    def keep_input(self, req: RequestState, action: Submit | Update) -> None:
        """Keep an input sent to a stage that has not answered the request yet (a failover resends it).

        Kept only while failover may need it: with ``max_retries``, in normal
        mode, from the stage's first input until its first output (then a
        death there is no longer retried, see ``failover``).  Async-chunk mode
        keeps nothing: a failover there restarts the request from its ticket.
        """
        if not self.max_retries or self.async_chunk:
            return
        k = action.stage_id
        if type(action) is Submit and action.companion_of is None:
            req.replay[k] = [action]
        else:
            inputs = req.replay.get(k)
            if inputs is not None:
                inputs.append(action)

    def stage_done(self, req: RequestState, stage_id: int) -> None:
        """Stage ``stage_id`` finished every input of ``req``: it joins D and frees its room there."""
        req.finished.add(stage_id)
        self.claims[stage_id] -= 1

    def complete(self, req: RequestState, msg: OrchOutput) -> list[Action]:
        """The request finished: its ``finished=True`` output is the terminal."""
        del self.requests[req.request_id]
        self.release_claims(req)
        self.outputs_routed += 1
        self.count_terminal("finished")
        actions: list[Action] = [Emit(msg)]
        if req.companions:
            actions.extend(self.release_companions(req))
        return actions

    def keep_partial(self, req: RequestState, stage_id: int, data: Any) -> None:
        """Keep a user-visible output (held terminals included) until the request ends.

        An error terminal carries them as ``OrchError.partial``: whoever waits
        only for the terminal (an abort's caller, a non-streaming front) still
        gets what was produced.  A finished request drops them.
        """
        req.partial.setdefault(stage_id, []).append(data)

    def end(self, req: RequestState, err: OrchError, skip: int | None = None) -> list[Action]:
        """The request failed: ``err`` is the terminal (with the partial output); abort it on open stages.

        ``skip`` is a stage that already dropped it (its own error, a failed submit).
        """
        err.partial = req.partial
        del self.requests[req.request_id]
        if req.waiting is not None:
            self.waiting[req.waiting.stage_id].pop(req.request_id, None)
        self.release_claims(req)
        self.count_terminal(err.kind)
        actions: list[Action] = [Emit(err)]
        for k in sorted(req.submitted - req.finished):
            if k != skip and self.available[k]:
                actions.append(Abort(k, [req.request_id]))
        if req.companions:
            actions.extend(self.release_companions(req))
        return actions

    def release_companions(self, req: RequestState) -> list[Action]:
        """The parent ended: forget its companions; abort on stage 0 those still running there."""
        running = [c.request_id for c in req.companions.values() if not c.finished]
        for cid in req.companions:
            self.companion_of.pop(cid, None)
        return [Abort(0, running)] if running and self.available[0] else []

    def unqueue(self, ticket: Ticket) -> None:
        """The ticket leaves the start queue (started, ended or withdrawn); its heap entry goes stale."""
        if ticket.order is not None:
            ticket.order = None
            self.start_queued -= 1

    def end_queued(self, ticket: Ticket, kind: str, message: str) -> list[Action]:
        """A request ended before it started: only its terminal, no stage holds it."""
        del self.queued[ticket.request_id]
        self.unqueue(ticket)
        for cid in ticket.companions:
            self.companion_of.pop(cid, None)
        self.count_terminal(kind)
        return [Emit(OrchError(ticket.request_id, None, kind, message))]

    def past_final(self, req: RequestState) -> list[Action]:
        """Async-chunk: the stage after a request's final stage drops what its final stage streams.

        In async-chunk mode every stage streams its chunks to the next one as
        it goes; a request that stops early (a text-only request stopping at
        the thinker) is never submitted to the next stage, which would
        otherwise hold those chunks until they expire.  An abort there is
        stage-side cleanup for a request it never had.  (Here, not with the
        admission rules: a start and an async-chunk restart both need it.)
        """
        nxt = req.final_stage_id + 1
        if not self.async_chunk or nxt >= self.num_stages or not self.available[nxt]:
            return NOTHING
        return [Abort(nxt, [req.request_id])]

    def count_terminal(self, kind: str) -> None:
        k = self.terminals_by_kind
        k[kind] = k.get(kind, 0) + 1
