"""The shell's control plane: pause and resume, collective calls, aborts the stages confirm.

None of it is on the routing path.  A collective RPC starts one task per
stage in the run nursery and never touches request state, so a hung replica
delays nobody but its caller.  ``pause``, ``resume`` and ``abort`` are events
like any other (decided by the core through
:meth:`~trio_orch.shell.dispatch.Dispatch.decide`); what this module adds is
the waiting: an abort's caller gets its terminal at once and then waits,
concurrently per stage and each under its deadline, for the replicas that
held the request to confirm they stopped it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import trio

from trio_orch.core import Abort, AbortRequest, Pause, Resume
from trio_orch.shell.state import ShellState
from trio_orch.types import RpcResult

if TYPE_CHECKING:
    from trio_orch.shell.dispatch import Dispatch

__all__ = ["AbortWait", "ControlPlane"]

log = logging.getLogger("trio_orch")

Answer = tuple[int, Any, "str | None"]


class AbortWait:
    """A caller waiting for the stages to confirm the aborts its event (``request``) caused.

    ``ids``: the request ids those aborts asked the stages to drop (the core
    fills them into ``request.aborted``); ``results``: each replica's answer.
    """

    __slots__ = ("event", "handed", "ids", "request", "results", "timeout")

    def __init__(self, request: AbortRequest | Pause, timeout: float) -> None:
        self.request = request
        self.timeout = timeout
        self.ids: set[str] = set()
        self.results: list[RpcResult] = []
        self.event = trio.Event()
        self.handed = False  # the confirmations are awaited in an abort task, which sets ``event``


class _RpcCall:
    """The answers of one collective RPC as its per-stage tasks report them."""

    __slots__ = ("answers", "args", "done", "kwargs", "method", "pending", "timeout")

    def __init__(self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any], timeout: float,
                 targets: list[int]) -> None:
        self.method = method
        self.args = args
        self.kwargs = kwargs
        self.timeout = timeout
        self.pending = set(targets)
        self.answers: dict[int, list[Answer]] = {}
        self.done = trio.Event()

    def answer(self, stage_id: int, replies: list[Answer]) -> None:
        self.answers[stage_id] = replies
        self.pending.discard(stage_id)
        if not self.pending:
            self.done.set()

    def results(self) -> list[RpcResult]:
        return sorted((RpcResult(k, r, v, e) for k, replies in self.answers.items() for r, v, e in replies),
                      key=lambda x: (x.stage_id, x.replica))


class ControlPlane:
    """Pause, resume, collective RPCs and confirmed aborts (see the module docstring)."""

    def __init__(self, state: ShellState) -> None:
        self.state = state
        self.dispatch: Dispatch | None = None  # set once the dispatch exists (it performs our events)
        self.rpc_calls: dict[str, int] = {}  #: collective RPCs by method
        self.rpc_errors: dict[str, int] = {}  #: replicas that answered one with an error, by method
        self.waiters: set[AbortWait] = set()  #: callers of abort() waiting (released at shutdown)
        #: stage aborts decided while stopping, for the shutdown path to perform
        self.leftover: list[Abort] = []

    def _offer(self, event: Any, confirm: AbortWait | None = None, settle: trio.Event | None = None) -> bool:
        """Hand an event to the dispatch; False once it takes none (stopping: terminals are on the way)."""
        assert self.dispatch is not None
        try:
            self.dispatch.offer(event, confirm, settle)
        except trio.ClosedResourceError:
            return False
        return True

    # ------------------------------------------------------------------ aborts
    async def abort(self, request_id: str, timeout: float | None) -> list[RpcResult]:
        """Abort ``request_id``; wait for the stages that held it to confirm (see ``Orchestrator.abort``)."""
        event = self._abort_event(request_id)
        if event is None:
            return []
        wait = AbortWait(event, self.state.rpc_timeout if timeout is None else timeout)
        if not self._offer(event, wait):
            return []
        self.waiters.add(wait)
        try:
            await wait.event.wait()
        finally:
            self.waiters.discard(wait)
        return sorted(wait.results, key=lambda r: (r.stage_id, r.replica))

    def abort_nowait(self, request_id: str) -> None:
        event = self._abort_event(request_id)
        if event is not None:
            self._offer(event)

    def _abort_event(self, request_id: str) -> AbortRequest | None:
        """The abort of the request's current incarnation; None for an unknown or ended id (a no-op)."""
        router = self.state.router
        incarnation = router.queued.get(request_id) or router.requests.get(request_id)
        return None if incarnation is None else AbortRequest(request_id, incarnation)

    async def abort_all(self, aborts: list[Abort], waiters: list[AbortWait]) -> None:
        """Perform the stage aborts of one decision; the ``waiters`` get their confirmations."""
        try:
            if waiters:  # a caller waits: the stages confirm concurrently, each in decision order
                by_stage: dict[int, list[Abort]] = {}
                for a in aborts:
                    by_stage.setdefault(a.stage_id, []).append(a)
                async with trio.open_nursery() as nursery:
                    for stage_aborts in by_stage.values():
                        nursery.start_soon(self._confirm_all, stage_aborts, waiters)
            else:
                for a in aborts:
                    await self.abort_on(a.stage_id, a.request_ids)
        finally:
            for w in waiters:
                w.event.set()

    async def _confirm_all(self, aborts: list[Abort], waiters: list[AbortWait]) -> None:
        for a in aborts:
            await self._confirm_on(a, waiters)

    async def _confirm_on(self, a: Abort, waiters: list[AbortWait]) -> None:
        """Abort on one stage and collect each replica's confirmation for the callers it concerns."""
        k = a.stage_id
        stage, can_confirm = self.state.stages[k], self.state.abilities[k].confirm_abort
        timeout = max(w.timeout for w in waiters)
        replies: list[Answer] = []
        try:
            with trio.move_on_after(timeout + self.state.shutdown_grace) as scope:
                if can_confirm:
                    replies = list(await stage.confirm_abort(a.request_ids, timeout))  # type: ignore[attr-defined]
                else:
                    await stage.abort(a.request_ids)
                    replies = [(-1, None, f"stage {k} ({type(stage).__name__}) cannot confirm aborts: "
                                          "told, not confirmed")]
            if scope.cancelled_caught:
                replies = [(-1, None, f"timeout: stage {k} did not confirm within {timeout:g}s")]
        except Exception as exc:  # the stage is dying; its reader reports that
            replies = [(-1, None, f"{type(exc).__name__}: {exc}")]
        for w in waiters:
            if w.ids.intersection(a.request_ids):
                w.results.extend(RpcResult(k, r, v, e) for r, v, e in replies)

    async def abort_on(self, stage_id: int, request_ids: list[str]) -> None:
        try:
            await self.state.stages[stage_id].abort(request_ids)
        except Exception as exc:  # the stage is dying; its reader reports that
            log.debug("abort %s on stage %d failed: %r", request_ids, stage_id, exc)

    # ------------------------------------------------------------------ pause
    async def pause(self, mode: str) -> None:
        """Start no request from now on; return once the pause is complete (see ``Orchestrator.pause``)."""
        state = self.state
        if state.phase in ("stopping", "stopped"):
            raise RuntimeError("orchestrator is not running: it cannot pause")
        state.router.check_pause_mode(mode)
        if state.pause_waiter is not None:  # a pause already waiting: it completes on the new terms
            state.pause_waiter.set()
            state.pause_waiter = None
        event = Pause(mode)
        stopped = AbortWait(event, state.rpc_timeout)
        if self._offer(event, stopped):
            await stopped.event.wait()  # the aborts of mode "abort", confirmed (or not, in time)
        for r in stopped.results:
            if r.error is not None:
                log.warning("pause('abort'): stage %d replica %d did not confirm: %s",
                            r.stage_id, r.replica, r.error)
        if mode == "keep":
            await self._tell_stages("pause")
        if not state.router.pause_complete():
            state.pause_waiter = waiter = trio.Event()
            await waiter.wait()

    async def resume(self) -> None:
        """Start requests again (after ``pause("keep")`` the stages are asked to step again)."""
        state = self.state
        mode = state.router.paused
        decided = trio.Event()
        if self._offer(Resume(), settle=decided):
            await decided.wait()
        if state.pause_waiter is not None:
            state.pause_waiter.set()
            state.pause_waiter = None
        if mode == "keep":
            await self._tell_stages("resume")

    async def _tell_stages(self, method: str) -> None:
        """Best effort: ``method`` on every stage that takes RPC calls; failures are logged."""
        if self.state.nursery is None:
            return
        for r in await self.collective_rpc(method):
            if r.error is not None:
                log.info("stage %d replica %d did not %s: %s", r.stage_id, r.replica, method, r.error)

    # ------------------------------------------------------------------ collective calls
    async def collective_rpc(self, method: str, args: Sequence[Any] = (),
                             kwargs: Mapping[str, Any] | None = None, stage_ids: Iterable[int] | None = None,
                             timeout: float | None = None) -> list[RpcResult]:
        """``method(*args, **kwargs)`` on every live replica of the chosen stages (``Orchestrator``'s)."""
        state = self.state
        targets = state.router.check_stage_ids(stage_ids)
        if not isinstance(method, str) or not method:
            raise ValueError(f"method must be a non-empty str, got {method!r}")
        timeout = state.rpc_timeout if timeout is None else timeout
        if not timeout > 0:
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
        nursery = state.nursery
        if nursery is None or nursery.cancel_scope.cancel_called:
            raise RuntimeError("orchestrator is not running: collective_rpc needs a running orchestrator")
        call = _RpcCall(method, tuple(args), dict(kwargs or {}), timeout, targets)
        self.rpc_calls[method] = self.rpc_calls.get(method, 0) + 1
        for k in targets:
            nursery.start_soon(self._rpc_stage, call, k, name=f"trio_orch.rpc[{k}].{method}")
        await call.done.wait()
        results = call.results()
        errors = sum(1 for r in results if r.error is not None)
        if errors:
            self.rpc_errors[method] = self.rpc_errors.get(method, 0) + errors
        return results

    async def _rpc_stage(self, call: _RpcCall, stage_id: int) -> None:
        """One stage's part of a collective RPC; always records an answer, even when cancelled."""
        answer: list[Answer] = []
        stage = self.state.stages[stage_id]
        try:
            if not self.state.abilities[stage_id].rpc:
                answer = [(-1, None, f"stage {stage_id} ({type(stage).__name__}) takes no rpc calls")]
                return
            # The client applies the deadline per replica; this bound only guards against a
            # client that ignores it.
            with trio.move_on_after(call.timeout + self.state.shutdown_grace) as scope:
                try:
                    answer = list(await stage.rpc(call.method, call.args, call.kwargs,  # type: ignore[attr-defined]
                                                  call.timeout))
                except Exception as exc:
                    answer = [(-1, None, f"{type(exc).__name__}: {exc}")]
            if scope.cancelled_caught:
                answer = [(-1, None, f"timeout: stage {stage_id} did not answer within {call.timeout}s")]
        finally:
            call.answer(stage_id, answer or [(-1, None, "orchestrator shut down during the call")])
