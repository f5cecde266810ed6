"""The Trio shell's facade: :class:`Orchestrator` opens the one nursery and offers the public calls.

One nursery, opened by :meth:`Orchestrator.run`, owns every task: one reader
per stage client, the dispatcher, the performer of awaited stage I/O, the
intake and the deadline keeper (plus
short-lived tasks for stage aborts and collective calls).  Every change of
request state is decided by the core in one function,
:meth:`~trio_orch.shell.dispatch.Dispatch.decide`, whoever delivers the
event; the parts around it each hold one concern (see
:mod:`trio_orch.shell.state`).  Whatever way ``run()`` ends -- ``shutdown()``,
an outside cancel, a crash -- its ``finally`` gives every accepted request
its terminal, stops the stages and closes the output stream.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from functools import partial
from types import MappingProxyType
from typing import Any

import trio

from trio_orch.core import Abort, Expire, InputSegment, ReplicasChanged, Router, RouterStatistics, Shutdown
from trio_orch.shell.control import ControlPlane
from trio_orch.shell.dispatch import Dispatch
from trio_orch.shell.intake import Intake
from trio_orch.shell.join_gate import JoinGate
from trio_orch.shell.outputs import OutputSink, OutputStream
from trio_orch.shell.state import ShellState
from trio_orch.types import Message, RpcResult, StageClient

__all__ = ["Orchestrator", "OrchestratorStatistics", "open_orchestrator"]

log = logging.getLogger("trio_orch")


@dataclass(frozen=True, slots=True)
class OrchestratorStatistics:
    """A read-only snapshot of an orchestrator (see :meth:`Orchestrator.statistics`)."""

    state: str  #: new, running, stopping or stopped
    core: RouterStatistics  #: requests, counters and terminals, as the routing core sees them
    stage_deaths: Mapping[int, str]  #: stage -> why it died
    request_channel: trio.MemoryChannelStatistics  #: the admission channel (unbuffered: the intake takes)
    events_pending: int  #: events waiting for the dispatcher
    paused: str | None = None  #: the pause mode in effect (None: not paused)
    rpc_calls: Mapping[str, int] = field(default_factory=dict)  #: collective RPCs made, by method
    rpc_errors: Mapping[str, int] = field(default_factory=dict)  #: replicas that answered one with an error


class Orchestrator:
    """Routes requests through ``stages`` with Trio structured concurrency.

    ``final_stage_ids``: the stages whose outputs reach the user.  In normal
    mode a finished stage k forwards ``forward_fn(k, prompt, outputs_of_k)``
    to stage k+1; with ``async_chunk`` every stage is submitted at add time
    (``prewarm_fn(k, prompt)`` for k >= 1) and the terminal is gated until all
    of them finished.  ``request_queue_size`` bounds the core's start queue
    (plus the one request next in line); an add that finds it full waits in
    the request channel (0: a request that cannot start at once waits, one at
    a time, or is refused by :meth:`add_request_nowait`).  Queued requests
    start in the core's order (``priority``, lower first; deadline; arrival;
    aged by ``priority_aging`` seconds per level, see ``admission.start_key``).
    ``shutdown_grace`` bounds, in seconds, the stage aborts and ``aclose``
    calls made while stopping.  ``output_sink``, if given, receives each
    decision's messages instead of the stream read by :meth:`next_output` (the
    thread bridge uses it); ``output_backlog``, with it, says how many of
    those batches its consumer has not taken yet (events that arrive while it
    is behind are decided together, see :mod:`trio_orch.shell.dispatch`).
    ``request_timeout`` is the default per-request deadline in seconds (None:
    no deadline); a request past its deadline gets ``OrchError(kind="timeout")``
    and is aborted on every stage it is open on.  ``check_sampling(stage_id,
    params)`` validates one stage's per-request sampling parameters at
    acceptance (see :meth:`add_request`).  ``max_inflight`` bounds, per stage
    and per live replica, the started requests that still have to pass that
    stage (None: no bound); an accepted request waits until the core says
    there is room on its whole path, so under load the queue fills and
    :meth:`add_request` waits (backpressure).  ``max_running`` bounds the
    started requests, whatever their paths (vLLM's ``max_num_seqs``; None:
    no bound).  Stage clients that report their
    replicas (:class:`~trio_orch.types.ReplicatedStageClient`) keep the core's
    availability and bounds in step with the replicas that are ready.
    ``max_retries``: how many times a request is failed over -- resent to its
    stage when the replica holding it died before answering it there, once
    the stage has a live replica again if it has none (within the request's
    deadline); in async-chunk mode restarted from stage 0 while nothing
    reached the user -- before it ends with ``replica_died`` (0: never; see
    ``trio_orch/core/failover.py``).
    """

    def __init__(
        self,
        stages: Sequence[StageClient],
        final_stage_ids: Iterable[int],
        *,
        async_chunk: bool = False,
        forward_fn: Callable[..., Any] | None = None,
        prewarm_fn: Callable[[int, Any], Any] | None = None,
        request_queue_size: int = 256,
        shutdown_grace: float = 2.0,
        output_sink: OutputSink | None = None,
        output_backlog: Callable[[], int] | None = None,
        request_timeout: float | None = None,
        check_sampling: Callable[[int, Any], Any] | None = None,
        rpc_timeout: float = 5.0,
        max_inflight: Sequence[int | None] | None = None,
        max_running: int | None = None,
        max_retries: int = 1,
        priority_aging: float = 1.0,
    ) -> None:
        if request_queue_size < 0:
            raise ValueError(f"request_queue_size must be >= 0, got {request_queue_size}")
        Router.check_timeout(request_timeout)
        router = Router(len(stages), final_stage_ids, async_chunk=async_chunk, forward_fn=forward_fn,
                        prewarm_fn=prewarm_fn, check_sampling=check_sampling, max_inflight=max_inflight,
                        max_running=max_running, max_retries=max_retries, priority_aging=priority_aging)
        self._state = state = ShellState(router, stages, queue_size=request_queue_size,
                                         shutdown_grace=shutdown_grace, rpc_timeout=rpc_timeout)
        self.router = router
        self.stages = state.stages
        self.request_timeout = request_timeout
        self._outputs = OutputStream(output_sink, output_backlog)
        self._control = ControlPlane(state)
        self._dispatch = Dispatch(state, self._outputs, self._control)
        self._control.dispatch = self._dispatch
        self._intake = Intake(state, self._dispatch, request_timeout)
        self._drain_timeout: float | None = None
        self._drain_scope: trio.CancelScope | None = None
        #: replicas join (and leave) through the core; shutdown cancels joins in progress
        self.joins = JoinGate(router)

    # ------------------------------------------------------------------ state
    @property
    def shutdown_grace(self) -> float:
        return self._state.shutdown_grace

    @property
    def rpc_timeout(self) -> float:
        return self._state.rpc_timeout

    @property
    def stage_deaths(self) -> dict[int, str]:
        """Stage -> why it died."""
        return self._state.stage_deaths

    @property
    def rpc_calls(self) -> dict[str, int]:
        return self._control.rpc_calls

    @property
    def rpc_errors(self) -> dict[str, int]:
        return self._control.rpc_errors

    @property
    def dropped_outputs(self) -> int:
        """Outputs dropped because their request was unknown or already cleaned up."""
        return self.router.dropped_outputs

    @property
    def active_requests(self) -> int:
        """Accepted requests that have not had their terminal yet (queued included)."""
        return self.router.live_count

    @property
    def queued_requests(self) -> int:
        """Accepted requests not started yet."""
        return len(self.router.queued)

    @property
    def running(self) -> bool:
        return self._state.phase == "running"

    @property
    def paused(self) -> str | None:
        """The pause mode in effect (``"wait"``, ``"abort"`` or ``"keep"``), None when not paused."""
        return self.router.paused

    def statistics(self) -> OrchestratorStatistics:
        """A frozen snapshot (call it from the orchestrator's thread)."""
        state = self._state
        return OrchestratorStatistics(
            state=state.phase, core=self.router.statistics(),
            stage_deaths=MappingProxyType(dict(state.stage_deaths)),
            request_channel=self._intake.channel_statistics(),
            events_pending=len(self._dispatch.inbox),
            paused=self.router.paused,
            rpc_calls=MappingProxyType(dict(self._control.rpc_calls)),
            rpc_errors=MappingProxyType(dict(self._control.rpc_errors)),
        )

    def capacity(self) -> float:
        """At most how many accepted requests it holds at once (``math.inf``: no stage bound)."""
        return self._intake.capacity()

    def has_room(self) -> bool:
        """Whether the request queue has space now (an add would not wait); a hint for admission."""
        return self._intake.has_room()

    # ------------------------------------------------------------------ requests
    async def add_request(self, request_id: str, prompt: Any, *, final_stage_id: int | None = None,
                          timeout: float | None = None, resumable: bool = False,
                          sampling: Any = None, companions: Mapping[str, Any] | None = None,
                          wait_start: bool = True, priority: int = 0) -> None:
        """Accept a request; return once it started (its first submissions were made).

        ``timeout`` (seconds, default ``request_timeout``) bounds the request's
        whole life, from acceptance to terminal.  ``resumable``: more input
        segments may follow through :meth:`update_request`; the request ends
        only after its final segment.  ``sampling``: per-stage parameters, a
        list indexed by stage or a mapping stage -> parameters; each stage
        gets its entry with every submit and update (never interpreted here).
        ``companions``: ``{id: prompt}`` requests that run stage 0 next to this
        one (e.g. CFG's negative prompt) and condition its forward; they never
        reach the user (see :mod:`trio_orch.core.companions`).  ``priority``
        (an int, lower first; default 0): queued requests start in the core's
        order, and each stage worker batches by the same key.

        Waits while the request queue is full.  Raises ``ValueError`` for a
        duplicate active id or bad parameters and ``RuntimeError`` once the
        orchestrator stopped accepting; in both cases nothing is registered.
        If the caller is cancelled after the request was accepted, the request
        is aborted (it still gets its terminal).  ``wait_start=False`` returns
        as soon as the request is in the queue (accepted: it starts when there
        is room and gets its terminal like any other), which lets a front that
        admits many requests keep the queue full.
        """
        intake = self._intake
        ticket = intake.accept(request_id, prompt, final_stage_id, timeout, resumable, sampling, companions,
                               priority)
        done = trio.Event() if wait_start else None
        if not intake.enqueue_now(ticket, done):
            await intake.send(ticket, done)
        if done is None:
            return
        try:
            await done.wait()
        except trio.Cancelled:
            self.abort_nowait(request_id)
            raise

    def add_request_nowait(self, request_id: str, prompt: Any, *, final_stage_id: int | None = None,
                           timeout: float | None = None, resumable: bool = False,
                           sampling: Any = None, companions: Mapping[str, Any] | None = None,
                           priority: int = 0) -> None:
        """Like :meth:`add_request` without waiting; raises ``trio.WouldBlock`` when the queue is full.

        Synchronous, so a thread bridge can call it via the Trio token.  With
        no request queue (``request_queue_size=0``) a request that could not
        start at once is refused the same way.
        """
        intake = self._intake
        intake.add_nowait(intake.accept(request_id, prompt, final_stage_id, timeout, resumable, sampling,
                                        companions, priority))

    async def update_request(self, request_id: str, segment: Any, *, final: bool = False) -> None:
        """One more input segment for a live resumable request; ``final=True`` for the last one.

        Returns once the segment was handed to the stages (a request not
        started yet keeps it for its start, which sends it right after the
        prompt).  Raises ``ValueError`` (changing nothing) for an unknown or
        ended id, a request not added with ``resumable=True``, or after its
        final segment, and ``RuntimeError`` once the orchestrator stopped.
        Updates of one request reach each stage in call order, after the
        request's first submission there.
        """
        if self._state.phase == "stopped":
            raise RuntimeError("orchestrator is not accepting requests: it has shut down")
        self.router.check_update(request_id, final)  # live sessions still take input while draining
        event = InputSegment(request_id, segment, final)
        done = trio.Event()
        try:
            self._dispatch.offer(event, settle=done)
        except trio.ClosedResourceError:
            raise RuntimeError("orchestrator is not accepting requests: it has shut down") from None
        await done.wait()
        if event.error is not None:
            raise event.error

    async def abort(self, request_id: str, timeout: float | None = None) -> list[RpcResult]:
        """Abort a request; it gets ``OrchError(kind="aborted")`` at once.  Unknown id: no-op.

        The terminal carries what the request produced so far
        (``OrchError.partial``).  Returns once every stage that held the
        request confirmed it stopped there (stage clients that declare
        ``confirm_abort``; others are only told), each replica under its own
        deadline (``timeout``, default ``rpc_timeout``): one
        :class:`RpcResult` per replica asked, in ``(stage_id, replica)``
        order -- ``value`` the ids it stopped, or ``error`` when it did not
        confirm (hung, stopped, dead).  Empty when no stage held it (unknown,
        still queued, or every stage had finished).
        """
        return await self._control.abort(request_id, timeout)

    def abort_nowait(self, request_id: str) -> None:
        """Synchronous :meth:`abort` that does not wait for the stages."""
        self._control.abort_nowait(request_id)

    # ------------------------------------------------------------------ control
    async def collective_rpc(self, method: str, args: Sequence[Any] = (),
                             kwargs: Mapping[str, Any] | None = None, stage_ids: Iterable[int] | None = None,
                             timeout: float | None = None) -> list[RpcResult]:
        """Call ``method(*args, **kwargs)`` on every live replica of the chosen stages.

        Returns one :class:`RpcResult` per replica, in ``(stage_id, replica)``
        order.  Replicas are called concurrently, in tasks of the run nursery,
        each under its own deadline (``timeout``, default ``rpc_timeout``): a
        hung or dead replica yields its own error result and never blocks
        admission, routing or the other replicas.  Raises ``ValueError`` for
        invalid stage ids (nothing is called) and ``RuntimeError`` when the
        orchestrator is not running.
        """
        return await self._control.collective_rpc(method, args, kwargs, stage_ids, timeout)

    async def pause(self, mode: str = "wait") -> None:
        """Start no request from the call on; return once the pause is complete.

        ``"wait"``: requests already started finish; returns once none is left.
        ``"abort"``: they are aborted now (terminal ``aborted``); returns once
        each got its terminal and the stages that held them confirmed they
        stopped (as :meth:`abort`; a replica that does not confirm within
        ``rpc_timeout`` is logged, not waited for).  ``"keep"``: they stay where they are and every
        stage is asked to stop stepping (RPC ``pause``); returns at once.
        Meanwhile ``add_request`` accepts and queues but starts nothing (its
        caller waits: backpressure, not an error) until :meth:`resume`;
        ``shutdown()`` still gives every request its terminal.  Raises
        ``ValueError`` for an unknown mode.
        """
        await self._control.pause(mode)

    async def resume(self) -> None:
        """Start requests again (after ``pause("keep")`` the stages are asked to step again)."""
        await self._control.resume()

    # ------------------------------------------------------------------ outputs
    async def next_output(self) -> Message:
        """The next message in delivery order; ``trio.EndOfChannel`` once all is delivered.

        A message that is ready comes after a cancellation check only
        (``checkpoint_if_cancelled``): no schedule point, as asyncio's
        ``Queue.get`` of a ready item -- a consumer that keeps up pays one
        scheduler pass per wait, not one per message.  When none is ready it
        waits (a full checkpoint).
        """
        return await self._outputs.next_output()

    def next_output_nowait(self) -> Message:
        """The next message if one is ready; ``trio.WouldBlock`` if none, ``trio.EndOfChannel`` at the end."""
        return self._outputs.next_output_nowait()

    async def next_batch(self) -> list[Message]:
        """Every message ready now, in delivery order, waiting for the first; ``EndOfChannel`` at the end.

        For consumers that handle messages in batches (a front, a benchmark);
        the same checkpoint rule as :meth:`next_output`.
        """
        return await self._outputs.next_batch()

    async def outputs(self) -> AsyncIterator[Message]:
        """Iterate over messages until the orchestrator stopped and all were delivered."""
        while True:
            try:
                yield await self.next_output()
            except trio.EndOfChannel:
                return

    # ------------------------------------------------------------------ lifecycle
    def request_shutdown(self, timeout: float | None = None) -> None:
        """Stop accepting and begin shutting down (synchronous, idempotent).

        ``timeout`` lets active requests finish for up to that many seconds;
        ``None`` gives them their ``shutdown`` terminal at once -- also when a
        drain asked for earlier is still running (a second Ctrl-C).
        """
        state = self._state
        self.router.stop_accepting()  # the one flag a caller flips: accept() raises from now on
        if not state.stop_requested.is_set():
            self._drain_timeout = timeout
            state.draining = True
            state.stop_requested.set()
            state.after_decision()
        elif timeout is None:
            self._drain_timeout = None
            if self._drain_scope is not None:
                self._drain_scope.cancel()
        if state.phase == "new":
            self._finish_sync()
            self._outputs.close()
            state.phase = "stopped"
            state.stopped.set()

    async def shutdown(self, timeout: float | None = None) -> None:
        """Graceful shutdown; returns when ``run()`` has returned."""
        self.request_shutdown(timeout)
        await self._state.stopped.wait()

    async def wait_stopped(self) -> None:
        await self._state.stopped.wait()

    async def run(self, *, task_status: trio.TaskStatus[Orchestrator] = trio.TASK_STATUS_IGNORED
                  ) -> None:
        """Run until shutdown or cancellation; signal readiness via ``task_status``."""
        state = self._state
        if state.phase != "new":
            raise RuntimeError(f"Orchestrator.run() called on a {state.phase} orchestrator")
        state.phase = "running"
        dispatch = self._dispatch
        try:
            async with trio.open_nursery() as nursery:
                state.nursery = nursery
                self._watch_replicas()
                for k, stage in enumerate(self.stages):
                    nursery.start_soon(dispatch.read, k, stage, name=f"trio_orch.reader[{k}]")
                nursery.start_soon(dispatch.run, name="trio_orch.dispatcher")
                nursery.start_soon(dispatch.perform, name="trio_orch.performer")
                # started, not start_soon: it waits on the request channel before we report ready
                await nursery.start(self._intake.run, name="trio_orch.intake")
                nursery.start_soon(state.deadlines.run, self._expire, name="trio_orch.deadline_keeper")
                task_status.started(self)
                await state.stop_requested.wait()
                state.phase = "stopping"
                self.joins.stop()
                if self._drain_timeout:
                    with trio.move_on_after(self._drain_timeout) as self._drain_scope:
                        await state.drained.wait()
                    self._drain_scope = None
                nursery.cancel_scope.cancel()
        finally:
            state.nursery = None
            state.phase = "stopping"
            self.router.stop_accepting()
            self.joins.stop()
            with trio.CancelScope(shield=True):
                await self._finish()
            state.phase = "stopped"
            state.stopped.set()

    def _watch_replicas(self) -> None:
        """Stages that report their replicas keep the core's availability current; joinable ones get the
        gate their joins go through."""
        events = []
        for k, (stage, ab) in enumerate(zip(self.stages, self._state.abilities, strict=True)):
            if ab.replicated:
                events.append(ReplicasChanged(k, *stage.replica_counts()))  # type: ignore[attr-defined]
                stage.watch_replicas(partial(self.replicas_changed, k))  # type: ignore[attr-defined]
            if ab.joinable:  # replicas may join it at runtime: through this core
                stage.join_gate = self.joins  # type: ignore[attr-defined]
        if events:
            self._dispatch.decide(events)

    def replicas_changed(self, stage_id: int, live: int, total: int) -> None:
        """A stage's ready replicas changed (what a replica pool reports through ``watch_replicas``).

        The core's availability and bounds follow with the next decision, and
        the failovers that waited for a live replica of that stage go out.
        """
        if self._state.phase not in ("running", "stopping"):
            return
        try:
            self._dispatch.offer(ReplicasChanged(stage_id, live, total))
        except trio.ClosedResourceError:
            pass  # stopping: the shutdown terminals already went out

    def _expire(self, request_id: str) -> None:
        """The deadline keeper's callback: the request's current incarnation ends (terminal ``timeout``)."""
        router = self.router
        incarnation = router.queued.get(request_id) or router.requests.get(request_id)
        if incarnation is not None:
            try:
                self._dispatch.offer(Expire(request_id, incarnation))
            except trio.ClosedResourceError:
                pass

    # ------------------------------------------------------------------ shutdown
    def _finish_sync(self) -> list[Abort]:
        """Terminals for everything still accepted; close the input side; return the stage aborts left.

        Adds found waiting in the request channel were handed over and get
        their shutdown terminal from the core; adds still on their way in are
        withdrawn (their call raises).  Events the dispatcher never took are
        dropped, their waiters released: the shutdown terminal covers them.
        """
        self.router.stop_accepting()
        self._intake.close()
        dispatch = self._dispatch
        confirms, settles = dispatch.close()
        dispatch.decide([Shutdown()], confirms, settles)
        for waiting in dispatch.starting.values():
            for done in waiting:
                done.set()
        dispatch.starting.clear()
        for w in list(self._control.waiters):
            w.event.set()
        leftover, self._control.leftover = self._control.leftover, []
        return leftover

    async def _finish(self) -> None:
        aborts = self._finish_sync()
        with trio.move_on_after(self._state.shutdown_grace):
            for a in aborts:
                if self.router.available[a.stage_id]:
                    await self._control.abort_on(a.stage_id, a.request_ids)
        async with trio.open_nursery() as nursery:
            for stage in self.stages:
                nursery.start_soon(self._close_stage, stage)
        self._outputs.close()

    async def _close_stage(self, stage: StageClient) -> None:
        grace = self._state.shutdown_grace
        with trio.move_on_after(grace) as scope:
            try:
                await stage.aclose()
            except Exception as exc:
                log.warning("closing stage %r failed: %r", stage, exc)
        if scope.cancelled_caught:
            log.warning("closing stage %r took longer than %.1fs; abandoned", stage, grace)


@asynccontextmanager
async def open_orchestrator(stages: Sequence[StageClient], final_stage_ids: Iterable[int],
                            **kwargs: Any) -> AsyncIterator[Orchestrator]:
    """``async with open_orchestrator(...) as orch``: nursery + ``start(orch.run)``.

    Leaving the block shuts the orchestrator down without draining.
    """
    orch = Orchestrator(stages, final_stage_ids, **kwargs)
    async with trio.open_nursery() as nursery:
        await nursery.start(orch.run)
        try:
            yield orch
        finally:
            orch.request_shutdown()
