"""The routing core: DESIGN §3 as a plain state machine, with no I/O.

Events come in as method calls (``add``, ``route``, ``abort``, ``stage_died``,
``submit_failed``, ``shutdown``); each returns the list of actions the caller
must perform, in order: :class:`Emit` a message to the user, :class:`Submit`
a payload to a stage, :class:`Abort` request ids on a stage.  Every decision
and every state change happens synchronously inside the call, before any I/O
(the httpcore pattern), so any concurrency shell -- the Trio orchestrator or
the asyncio references in ``bench/`` -- drives the same semantics and a
comparison between shells measures the shell alone.

Where each rule of DESIGN §3 lives:

=============================  ==============================================
Add (register, then submit)    :meth:`Router.add`
Output, terminal gate          :meth:`Router.route` (``pending_final``)
Forward on finish              :meth:`Router._forward` (called by ``route``)
Drop-and-count                 :meth:`Router.route` (``dropped_outputs``)
Abort / deadline               :meth:`Router.abort` / :meth:`Router.expire`
Stage error output             :meth:`Router.route` (``out.error``)
Replica death                  :meth:`Router.stage_died`, or per request via
                               ``StageOutput(error_kind="replica_died")``
Stage with no live replica     :meth:`Router.submit_failed`, ``available``
Shutdown terminals             :meth:`Router.shutdown`
Exactly one terminal, last     :meth:`Router._terminate` / ``_complete``
                               (the only places state is deleted)
=============================  ==============================================

This module must never import trio or asyncio.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from trio_orch.types import OrchError, OrchOutput, StageOutput

__all__ = ["Abort", "Action", "Emit", "RequestState", "Router", "Submit"]

ForwardFn = Callable[[int, Any, list[Any]], Any]
PrewarmFn = Callable[[int, Any], Any]


class Submit:
    """Send ``payload`` for ``request_id`` to stage ``stage_id``."""

    __slots__ = ("payload", "request_id", "stage_id")

    def __init__(self, stage_id: int, request_id: str, payload: Any) -> None:
        self.stage_id = stage_id
        self.request_id = request_id
        self.payload = payload

    def __repr__(self) -> str:
        return f"Submit({self.stage_id}, {self.request_id!r}, {self.payload!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Submit) and (self.stage_id, self.request_id, self.payload) == (
            other.stage_id,
            other.request_id,
            other.payload,
        )


class Abort:
    """Abort ``request_ids`` on stage ``stage_id`` (best effort, stage-side cleanup)."""

    __slots__ = ("request_ids", "stage_id")

    def __init__(self, stage_id: int, request_ids: list[str]) -> None:
        self.stage_id = stage_id
        self.request_ids = request_ids

    def __repr__(self) -> str:
        return f"Abort({self.stage_id}, {self.request_ids!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Abort) and (self.stage_id, self.request_ids) == (
            other.stage_id,
            other.request_ids,
        )


class Emit:
    """Deliver ``message`` (an :class:`OrchOutput` or :class:`OrchError`) to the user."""

    __slots__ = ("message",)

    def __init__(self, message: OrchOutput | OrchError) -> None:
        self.message = message

    def __repr__(self) -> str:
        return f"Emit({self.message!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Emit) and self.message == other.message


Action = Submit | Abort | Emit


class RequestState:
    """Per-request bookkeeping: S (submitted), D (finished), F (finals), held terminal."""

    __slots__ = (
        "final_stage_id",
        "finals",
        "finished",
        "outputs",
        "pending_final",
        "prompt",
        "request_id",
        "submitted",
    )

    def __init__(self, request_id: str, prompt: Any, final_stage_id: int, finals: frozenset[int]):
        self.request_id = request_id
        self.prompt = prompt
        self.final_stage_id = final_stage_id
        self.finals = finals
        self.submitted: set[int] = set()
        self.finished: set[int] = set()
        # stage -> data of every output, kept only for stages that forward.
        self.outputs: dict[int, list[Any]] = {}
        self.pending_final: OrchOutput | None = None

    @property
    def open_stages(self) -> set[int]:
        """S minus D: stages that still hold work for this request."""
        return self.submitted - self.finished


def _default_forward(stage_id: int, prompt: Any, outputs: list[Any]) -> Any:
    return outputs


def _default_prewarm(stage_id: int, prompt: Any) -> Any:
    return prompt


_NOTHING: list[Action] = []  # shared empty result; callers must not mutate it


class Router:
    """Request progression across stages ``0..num_stages-1`` (DESIGN §3)."""

    def __init__(
        self,
        num_stages: int,
        final_stage_ids: Iterable[int],
        *,
        async_chunk: bool = False,
        forward_fn: ForwardFn | None = None,
        prewarm_fn: PrewarmFn | None = None,
    ) -> None:
        if num_stages < 1:
            raise ValueError(f"need at least one stage, got num_stages={num_stages}")
        finals = frozenset(final_stage_ids)
        if not finals:
            raise ValueError("final_stage_ids is empty: at least one stage must produce user output")
        bad = sorted(k for k in finals if not (isinstance(k, int) and 0 <= k < num_stages))
        if bad:
            raise ValueError(
                f"final_stage_ids {bad} out of range: stages are 0..{num_stages - 1}"
            )
        self.num_stages = num_stages
        self.final_stage_ids = finals
        self.async_chunk = async_chunk
        self.forward_fn: ForwardFn = forward_fn or _default_forward
        self.prewarm_fn: PrewarmFn = prewarm_fn or _default_prewarm
        self.default_final_stage_id = max(finals)
        self.available = [True] * num_stages
        self.requests: dict[str, RequestState] = {}
        self._finals_for: dict[int, frozenset[int]] = {
            k: frozenset(f for f in finals if f <= k) for k in range(num_stages)
        }
        # counters (read by metrics and tests)
        self.dropped_outputs = 0
        self.outputs_routed = 0
        self.terminals_by_kind: dict[str, int] = {}

    # ------------------------------------------------------------------ queries
    def __len__(self) -> int:
        return len(self.requests)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self.requests

    def resolve_final_stage(self, request_id: object, final_stage_id: int | None) -> int:
        """Validate a new request's parameters; return its final stage.  Raises ValueError."""
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty str, got {request_id!r}")
        if final_stage_id is None:
            return self.default_final_stage_id
        if isinstance(final_stage_id, bool) or not isinstance(final_stage_id, int):
            raise ValueError(f"final_stage_id must be an int, got {final_stage_id!r}")
        if not 0 <= final_stage_id < self.num_stages:
            raise ValueError(
                f"final_stage_id={final_stage_id} out of range: stages are 0..{self.num_stages - 1}"
            )
        if not self._finals_for[final_stage_id]:
            raise ValueError(
                f"final_stage_id={final_stage_id} leaves no final-output stage for request "
                f"{request_id!r}: final-output stages are {sorted(self.final_stage_ids)}"
            )
        return final_stage_id

    # ------------------------------------------------------------------ events
    def add(self, request_id: str, prompt: Any, final_stage_id: int | None = None) -> list[Action]:
        """Register a request and decide its first submissions.

        Raises ValueError (nothing registered) for a duplicate active id or bad
        parameters.  A stage with no live replica yields an immediate
        ``stage_unavailable`` terminal instead of submissions.
        """
        final = self.resolve_final_stage(request_id, final_stage_id)
        if request_id in self.requests:
            raise ValueError(f"duplicate request id {request_id!r}: a request with this id is active")
        targets = range(final + 1) if self.async_chunk else (0,)
        for k in targets:
            if not self.available[k]:
                return [self._count(OrchError(request_id, k, "stage_unavailable",
                                              f"stage {k} has no live replica"))]
        payloads = [prompt]
        if self.async_chunk:
            # May raise: nothing is registered yet.
            payloads.extend(self.prewarm_fn(k, prompt) for k in range(1, final + 1))
        req = RequestState(request_id, prompt, final, self._finals_for[final])
        req.submitted.update(targets)
        self.requests[request_id] = req
        return [Submit(k, request_id, payloads[k]) for k in targets]

    def route(self, stage_id: int, out: StageOutput) -> list[Action]:
        """Route one output of stage ``stage_id``."""
        rid = out.request_id
        req = self.requests.get(rid)
        if req is None or stage_id not in req.submitted or stage_id in req.finished:
            # Unknown, cleaned up, never submitted here, or already finished here.
            self.dropped_outputs += 1
            return _NOTHING
        if out.error is not None:
            kind = out.error_kind or "stage_failed"
            return self._terminate(req, OrchError(rid, stage_id, kind, out.error), skip=stage_id)
        finished = out.finished
        forwards = finished and not self.async_chunk and stage_id < req.final_stage_id
        if finished:
            req.finished.add(stage_id)
        if not self.async_chunk and stage_id < req.final_stage_id:
            req.outputs.setdefault(stage_id, []).append(out.data)
        actions: list[Action] = []
        if stage_id in req.finals:
            all_final = req.finals <= req.finished
            msg = OrchOutput(rid, stage_id, out.data, all_final, out.t_produced)
            if all_final:
                if req.submitted <= req.finished:
                    return self._complete(req, msg)
                req.pending_final = msg  # the terminal gate: an upstream stage is still open
                return _NOTHING
            self.outputs_routed += 1
            actions.append(Emit(msg))
        elif req.pending_final is not None and req.submitted <= req.finished:
            return self._complete(req, req.pending_final)
        if forwards:
            actions.extend(self._forward(req, stage_id))
        return actions

    def route_many(self, stage_id: int, outs: Iterable[StageOutput]) -> list[Action]:
        """Route a batch of outputs of one stage, in order."""
        actions: list[Action] = []
        for out in outs:
            actions.extend(self.route(stage_id, out))
        return actions

    def abort(self, request_id: str, message: str = "aborted by the client") -> list[Action]:
        """Client abort: terminal ``aborted``; unknown id is a no-op."""
        req = self.requests.get(request_id)
        if req is None:
            return _NOTHING
        return self._terminate(req, OrchError(request_id, None, "aborted", message))

    def expire(self, request_id: str, message: str = "request deadline exceeded") -> list[Action]:
        """Per-request deadline passed: terminal ``timeout``; unknown id is a no-op."""
        req = self.requests.get(request_id)
        if req is None:
            return _NOTHING
        return self._terminate(req, OrchError(request_id, None, "timeout", message))

    def submit_failed(
        self, stage_id: int, request_id: str, message: str, kind: str = "stage_unavailable"
    ) -> list[Action]:
        """The shell could not deliver a Submit: terminal for that request."""
        req = self.requests.get(request_id)
        if req is None:
            return _NOTHING
        return self._terminate(req, OrchError(request_id, stage_id, kind, message), skip=stage_id)

    def stage_died(self, stage_id: int, message: str) -> list[Action]:
        """A stage client died: its open requests get ``replica_died``; stage marked unavailable."""
        self.available[stage_id] = False
        actions: list[Action] = []
        victims = [r for r in self.requests.values()
                   if stage_id in r.submitted and stage_id not in r.finished]
        for req in victims:
            err = OrchError(req.request_id, stage_id, "replica_died", message)
            actions.extend(self._terminate(req, err, skip=stage_id))
        return actions

    def set_available(self, stage_id: int, available: bool) -> None:
        """Mark a stage as (un)able to take new work (e.g. a replica came back)."""
        self.available[stage_id] = available

    def shutdown(self, message: str = "orchestrator shut down") -> list[Action]:
        """Every active request gets its ``shutdown`` terminal."""
        actions: list[Action] = []
        for req in list(self.requests.values()):
            actions.extend(self._terminate(req, OrchError(req.request_id, None, "shutdown", message)))
        return actions

    # ------------------------------------------------------------------ internals
    def _forward(self, req: RequestState, stage_id: int) -> list[Action]:
        nxt = stage_id + 1
        rid = req.request_id
        if not self.available[nxt]:
            err = OrchError(rid, nxt, "stage_unavailable", f"stage {nxt} has no live replica")
            return self._terminate(req, err)
        try:
            payload = self.forward_fn(stage_id, req.prompt, req.outputs.pop(stage_id, []))
        except Exception as exc:  # a user callback: report, never crash routing
            err = OrchError(rid, stage_id, "forward_failed",
                            f"forward_fn({stage_id}) raised {type(exc).__name__}: {exc}")
            return self._terminate(req, err)
        req.submitted.add(nxt)
        return [Submit(nxt, rid, payload)]

    def _complete(self, req: RequestState, msg: OrchOutput) -> list[Action]:
        del self.requests[req.request_id]
        self.outputs_routed += 1
        k = self.terminals_by_kind
        k["finished"] = k.get("finished", 0) + 1
        return [Emit(msg)]

    def _count(self, err: OrchError) -> Emit:
        k = self.terminals_by_kind
        k[err.kind] = k.get(err.kind, 0) + 1
        return Emit(err)

    def _terminate(self, req: RequestState, err: OrchError, skip: int | None = None) -> list[Action]:
        del self.requests[req.request_id]
        actions: list[Action] = [self._count(err)]
        for k in sorted(req.submitted - req.finished):
            if k != skip and self.available[k]:
                actions.append(Abort(k, [req.request_id]))
        return actions
