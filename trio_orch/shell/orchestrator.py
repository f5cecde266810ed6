"""The Trio shell around the routing core.

One nursery, opened by :meth:`Orchestrator.run`, owns every task: one reader
per stage client, the dispatcher, the request handler and the deadline
keeper.  Readers only move outputs into the dispatcher's channel (their own
failure becomes a message too); the dispatcher routes them through
:class:`~trio_orch.core.Router` and performs the resulting I/O; the request
handler starts accepted requests from the core's start queue (fed by the
intake from the request channel) in the core's order.  Every
decision -- acceptance, routing, every terminal -- is made by the core,
synchronously between checkpoints; this module only moves events in and
performs actions out.  Whatever way ``run()`` ends -- ``shutdown()``, an
outside cancel, a crash -- its ``finally`` gives every accepted request its
terminal, stops the stages and closes the output channel.

The module is longer than most on purpose: the tasks and the shutdown path
share the channels whose single-writer discipline they maintain, and keeping
them side by side keeps that discipline checkable in one read.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from functools import partial
from time import perf_counter
from types import MappingProxyType
from typing import Any

import trio

from trio_orch.core import (
    Abort,
    Action,
    Emit,
    RequestState,
    Router,
    RouterStatistics,
    Submit,
    Ticket,
    Update,
    stage_call,
    stage_call_failed,
    stage_call_nowait,
)
from trio_orch.shell.deadlines import DeadlineKeeper
from trio_orch.shell.inbox import Inbox
from trio_orch.shell.join_gate import JoinGate
from trio_orch.types import Message, ReplicatedStageClient, RpcResult, StageClient, StageDied, StageOutput

__all__ = ["Orchestrator", "OrchestratorStatistics", "open_orchestrator"]

log = logging.getLogger("trio_orch")

OutputSink = Callable[[list[Message]], None]

#: pushed batches closer together than this (seconds) are a burst: queued for one dispatcher pass
BURST_GAP = 10e-6


@dataclass(frozen=True, slots=True)
class OrchestratorStatistics:
    """A read-only snapshot of an orchestrator (see :meth:`Orchestrator.statistics`)."""

    state: str  #: new, running, stopping or stopped
    core: RouterStatistics  #: requests, counters and terminals, as the routing core sees them
    stage_deaths: Mapping[int, str]  #: stage -> why it died
    request_channel: trio.MemoryChannelStatistics  #: the admission channel (unbuffered: the intake takes)
    events_pending: int  #: outputs and commands waiting for the dispatcher
    paused: str | None = None  #: the pause mode in effect (None: not paused)
    rpc_calls: Mapping[str, int] = field(default_factory=dict)  #: collective RPCs made, by method
    rpc_errors: Mapping[str, int] = field(default_factory=dict)  #: replicas that answered with an error


class _Update:
    """An ``update_request`` call queued behind the adds before it (same channel, in order)."""

    __slots__ = ("done", "error", "final", "request_id", "segment")

    def __init__(self, request_id: str, segment: Any, final: bool) -> None:
        self.request_id = request_id
        self.segment = segment
        self.final = final
        self.done = trio.Event()
        self.error: Exception | None = None


class _Perform:
    """Stage I/O decided by a batch routed outside the dispatcher (see ``_route_now``), for it to do."""

    __slots__ = ("actions",)

    def __init__(self, actions: list[Action]) -> None:
        self.actions = actions


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
        self.answers: dict[int, list[tuple[int, Any, str | None]]] = {}
        self.done = trio.Event()

    def answer(self, stage_id: int, replies: list[tuple[int, Any, str | None]]) -> None:
        self.answers[stage_id] = replies
        self.pending.discard(stage_id)
        if not self.pending:
            self.done.set()

    def results(self) -> list[RpcResult]:
        return sorted((RpcResult(k, r, v, e) for k, replies in self.answers.items() for r, v, e in replies),
                      key=lambda x: (x.stage_id, x.replica))


class _AbortWait:
    """A caller of :meth:`Orchestrator.abort` waiting for the stages that held its request.

    ``ids`` are the request ids its abort asked the stages to drop (the
    request and its companions); ``results`` collects each replica's answer.
    """

    __slots__ = ("event", "ids", "request_id", "results", "timeout")

    def __init__(self, request_id: str, timeout: float) -> None:
        self.request_id = request_id
        self.timeout = timeout
        self.ids: set[str] = set()
        self.results: list[RpcResult] = []
        self.event = trio.Event()

    def set(self) -> None:
        self.event.set()


class _Command:
    """A client call routed through the dispatcher so it is ordered with outputs.

    ``state`` is the request's state when the call was made: the command
    applies to that incarnation only (an id may be reused after its terminal).
    """

    __slots__ = ("done", "kind", "state")

    def __init__(self, kind: str, state: RequestState, done: _AbortWait | None) -> None:
        self.kind = kind
        self.state = state
        self.done = done


class Orchestrator:
    """Routes requests through ``stages`` with Trio structured concurrency.

    ``final_stage_ids``: the stages whose outputs reach the user.  In normal
    mode a finished stage k forwards ``forward_fn(k, prompt, outputs_of_k)``
    to stage k+1; with ``async_chunk`` every stage is submitted at add time
    (``prewarm_fn(k, prompt)`` for k >= 1) and the terminal is gated until all
    of them finished.  ``request_queue_size`` bounds the admission channel
    (``add_request`` waits when it is full; 0: a request is only taken when
    the request handler is free to take it, so at most one waits for room); the queued requests
    start in the core's order (``priority``, lower first; deadline; arrival; aged by
    ``priority_aging`` seconds per level, see ``AdmissionRules.start_key``).  ``shutdown_grace`` bounds, in
    seconds, the stage aborts and ``aclose`` calls made while stopping.
    ``output_sink``, if given, receives each batch of messages instead of the
    channel read by :meth:`next_output` (the thread bridge uses it).
    ``request_timeout`` is the default per-request deadline in seconds (None:
    no deadline); a request past its deadline gets ``OrchError(kind="timeout")``
    and is aborted on every stage it is open on.  ``check_sampling(stage_id,
    params)`` validates one stage's per-request sampling parameters at
    acceptance (see :meth:`add_request`).  ``max_inflight`` bounds, per stage
    and per live replica, the started requests that still have to pass that
    stage (None: no bound); an accepted request waits in the request channel
    until the core says there is room on its whole path, so under load the
    channel fills and :meth:`add_request` waits (backpressure).  Stage clients
    that report their replicas (:class:`~trio_orch.types.ReplicatedStageClient`)
    keep the core's availability and bounds in step with the replicas that are
    ready.  ``max_retries``: how many times a request is failed over -- resent
    to its stage when the replica holding it died before answering it there,
    once the stage has a live replica again if it has none (within the
    request's deadline); in async-chunk mode restarted from stage 0 while
    nothing reached the user -- before it ends with ``replica_died`` (0:
    never; see ``FailoverRules`` in ``trio_orch/core/failover.py``).
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
        request_timeout: float | None = None,
        check_sampling: Callable[[int, Any], Any] | None = None,
        rpc_timeout: float = 5.0,
        max_inflight: Sequence[int | None] | None = None,
        max_retries: int = 1,
        priority_aging: float = 1.0,
    ) -> None:
        if request_queue_size < 0:
            raise ValueError(f"request_queue_size must be >= 0, got {request_queue_size}")
        Router.check_timeout(request_timeout)
        self.stages = list(stages)
        self.router = Router(len(self.stages), final_stage_ids, async_chunk=async_chunk,
                             forward_fn=forward_fn, prewarm_fn=prewarm_fn, check_sampling=check_sampling,
                             max_inflight=max_inflight, max_retries=max_retries,
                             priority_aging=priority_aging)
        self.shutdown_grace = shutdown_grace
        self.request_timeout = request_timeout
        self.rpc_timeout = rpc_timeout
        self._queue_size = request_queue_size
        # Unbuffered: tickets go into the core's start queue (see _queue_full), so the core orders
        # every queued request; the channel only holds the adds that wait for room there.
        self._req_send, self._req_recv = trio.open_memory_channel[
            tuple[Ticket, trio.Event | None] | _Update](0)
        self._queue_room: trio.Event | None = None  # set when the start queue may have room again
        self._intake_closed = False
        self._intake_scope: trio.CancelScope | None = None  # around the intake's receive
        self._updates: deque[_Update] = deque()  # taken by the intake, applied by the handler in order
        self._dones: dict[Ticket, trio.Event] = {}  # queued tickets whose add_request waits for the start
        self._inbox: Inbox[tuple[int | None, Any]] = Inbox()  # every event for the dispatcher
        #: the dispatcher waits on an empty inbox and nothing was posted since: a pushed batch
        #: may be routed at once by whoever delivers it (see _reader)
        self._idle = False
        self._last_inline = 0.0  # perf_counter of the last pushed batch that found the dispatcher idle
        self._last_add = 0.0  # perf_counter of the last add_request_nowait (see _start_inline)
        # one item per delivered batch (not per message): next_output() takes from _out_buf first
        self._out_send, self._out_recv = trio.open_memory_channel[list[Message]](math.inf)
        self._out_buf: deque[Message] = deque()
        self._sink: OutputSink = output_sink or self._send_to_channel
        self._deadlines = DeadlineKeeper()
        self._sending: set[Ticket] = set()  # accepted, their add_request waits for room in the channel
        self._waiters: set[_AbortWait] = set()  # callers of abort() waiting for the stages
        self._state = "new"  # new -> running -> stopping -> stopped
        self._drain_timeout: float | None = None
        self._drain_scope: trio.CancelScope | None = None
        self._room: trio.Event | None = None  # set when the request handler waits for room
        self._busy = False  #: the request handler is doing stage I/O (a start or an update)
        self._pause_waiter: trio.Event | None = None  # set once a pause asked for is complete
        self._stop_requested = trio.Event()
        self._drained = trio.Event()
        self._stopped = trio.Event()
        self.stage_deaths: dict[int, str] = {}
        self._nursery: trio.Nursery | None = None
        #: replicas join (and leave) through the core; shutdown cancels joins in progress
        self.joins = JoinGate(self.router)
        self.rpc_calls: dict[str, int] = {}  # collective RPCs by method
        self.rpc_errors: dict[str, int] = {}  # replicas that answered one with an error, by method

    # ------------------------------------------------------------------ public API
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
        """Accepted requests the request handler has not started yet."""
        return len(self.router.queued)

    @property
    def running(self) -> bool:
        return self._state == "running"

    def statistics(self) -> OrchestratorStatistics:
        """A frozen snapshot (call it from the orchestrator's thread)."""
        return OrchestratorStatistics(
            state=self._state, core=self.router.statistics(),
            stage_deaths=MappingProxyType(dict(self.stage_deaths)),
            request_channel=self._req_send.statistics(),
            events_pending=len(self._inbox),
            paused=self.router.paused,
            rpc_calls=MappingProxyType(dict(self.rpc_calls)),
            rpc_errors=MappingProxyType(dict(self.rpc_errors)),
        )

    async def add_request(self, request_id: str, prompt: Any, *, final_stage_id: int | None = None,
                          timeout: float | None = None, resumable: bool = False,
                          sampling: Any = None, companions: Mapping[str, Any] | None = None,
                          wait_start: bool = True, priority: int = 0) -> None:
        """Accept a request; return once it is registered and submitted.

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
        as soon as the request is in the request channel (accepted: it starts
        when there is room and gets its terminal like any other), which lets a
        front that admits many requests keep the channel full.
        """
        ticket = self._accept(request_id, prompt, final_stage_id, timeout, resumable, sampling, companions,
                              priority)
        done = trio.Event()
        if self._enqueue_now(ticket, done):
            pass
        else:
            await self._send_ticket(ticket, done)
        if not wait_start:
            return
        try:
            await done.wait()
        except trio.Cancelled:
            self.abort_nowait(request_id)
            raise

    def _enqueue_now(self, ticket: Ticket, done: trio.Event | None) -> bool:
        """Into the core's start queue at once if it has room and nobody waits to enter it."""
        if (self._queue_full()
                or self._req_send.statistics().tasks_waiting_send or self._intake_closed):
            return False
        self.router.enqueue(ticket, trio.current_time())
        if done is not None:
            self._dones[ticket] = done
        elif self._start_inline(ticket):
            return True
        if self._queue_full() and self._intake_scope is not None:
            self._intake_scope.cancel()  # full: the intake stops taking from the channel
        self._room_may_have_changed()
        return True

    def _start_inline(self, ticket: Ticket) -> bool:
        """Start a just-queued ``ticket`` here, in the caller, if the request handler would start it next
        and has nothing else to do; whether it did.

        The request handler is parked (waiting for room), no input update
        waits, ``ticket`` is the core's next and can start, and every stage
        takes submits synchronously: the start is decided and its submits
        sent between the same two checkpoints -- one request-handler wake-up
        fewer per request, and a burst of adds posted together still goes out
        back to back.  Only for an add that comes alone: one within
        ``BURST_GAP`` of the previous add is part of a burst, queued for the
        handler, which then starts the whole burst in one pass (started one by
        one as they arrive, a burst reached a worker spread out, and its steps
        batched fewer requests).  Single-writer as the handler's own start: it runs
        between checkpoints, in the orchestrator's thread.  Stage I/O that
        cannot be done synchronously goes to the dispatcher, in order.
        """
        router = self.router
        now = perf_counter()
        alone, self._last_add = now - self._last_add >= BURST_GAP, now
        if (not alone or self._room is None or self._busy or self._updates or self._state != "running"
                or router.next_ticket() is not ticket or not router.can_start(ticket)
                or not all(hasattr(stage, "submit_nowait") for stage in self.stages)):
            return False
        self._perform_now(router.start(ticket))
        self._last_add = perf_counter()  # from the end of this start: an add queued behind it is a burst
        self._queue_may_have_room()
        return True

    def _perform_now(self, actions: list[Action]) -> None:
        """Actions done synchronously (an inline start, a pushed batch): emits delivered, submits sent
        where the stage takes them so; from the first that cannot be, the rest go to the dispatcher in
        order."""
        self._deliver_now(actions)
        router = self.router
        later: list[Action] = []
        for a in actions:
            if type(a) is Emit:
                continue
            if later or type(a) is not Submit:
                later.append(a)
                continue
            if not router.is_started(a.request_id):
                continue  # ended by an earlier action's failure
            schedule = router.schedule(a.request_id, trio.current_time())
            try:
                sent = stage_call_nowait(self.stages[a.stage_id], a, schedule)
            except Exception as exc:
                failed = router.submit_failed(a.stage_id, a.request_id, stage_call_failed(a, exc))
                self._deliver_now(failed)
                later.extend(x for x in failed if type(x) is not Emit)
                continue
            if not sent:
                later.append(a)
                continue
            later.extend(x for x in router.submitted(a.stage_id, a.request_id) if type(x) is Abort)
        if later:
            self._post_event(None, _Perform(later))

    async def _send_ticket(self, ticket: Ticket, done: trio.Event) -> None:
        """The start queue is full: wait in the request channel (in arrival order) for the intake."""
        self._sending.add(ticket)
        try:
            await self._req_send.send((ticket, done))
        except BaseException as exc:
            self._withdraw(ticket)  # trio guarantees a cancelled send did not send
            if isinstance(exc, (trio.ClosedResourceError, trio.BrokenResourceError)):
                raise RuntimeError("orchestrator is not accepting requests: it has shut down") from None
            raise
        finally:
            self._sending.discard(ticket)

    def capacity(self) -> float:
        """At most how many accepted requests it holds at once: started, the one the request handler
        holds until there is room, and a full request channel (``math.inf``: no stage bound).

        With no request channel nothing waits for room -- a request that cannot start is refused,
        and the handler's *next* is one that can -- so then it is what the stages hold.
        """
        stages = self.router.capacity()
        if stages is None:
            return math.inf
        return stages + (1 + self._queue_size if self._queue_size else 0)

    def has_room(self) -> bool:
        """Whether the request queue has space now (an add would not wait); a hint for admission."""
        waiting = self._req_send.statistics().tasks_waiting_send
        return not self._queue_full() and not waiting

    def _queue_full(self) -> bool:
        """The start queue holds ``request_queue_size`` requests, plus the one the handler holds
        while it waits for room (not while it does a start's stage I/O) -- with no queue, the one
        startable request that is the busy handler's next."""
        size = self._queue_size
        return self.router.start_queued >= size + (0 if self._busy and size else 1)

    def add_request_nowait(self, request_id: str, prompt: Any, *, final_stage_id: int | None = None,
                           timeout: float | None = None, resumable: bool = False,
                           sampling: Any = None, companions: Mapping[str, Any] | None = None,
                           priority: int = 0) -> None:
        """Like :meth:`add_request` without waiting; raises ``trio.WouldBlock`` when full.

        Synchronous, so a thread bridge can call it via the Trio token.  With
        no request queue (``request_queue_size=0``) nothing waits for room: a
        request that could not start at once is refused the same way.  One
        that could start while the handler is busy with stage I/O (starting
        another, or an input update) is the handler's next (the start queue's
        one place): it is not refused for want of a taker, and it still
        precedes any later input update of its own.
        """
        ticket = self._accept(request_id, prompt, final_stage_id, timeout, resumable, sampling, companions,
                              priority)
        try:
            if not self._queue_size and not self.router.can_start(ticket):
                raise trio.WouldBlock
            if self._intake_closed:
                raise trio.ClosedResourceError
            if not self._enqueue_now(ticket, None):
                raise trio.WouldBlock
        except BaseException as exc:
            self._withdraw(ticket)
            if isinstance(exc, (trio.ClosedResourceError, trio.BrokenResourceError)):
                raise RuntimeError("orchestrator is not accepting requests: it has shut down") from None
            raise

    async def update_request(self, request_id: str, segment: Any, *, final: bool = False) -> None:
        """One more input segment for a live resumable request; ``final=True`` for the last one.

        Returns once the segment was handed to the stages.  Raises
        ``ValueError`` (changing nothing) for an unknown or ended id, a request
        not added with ``resumable=True``, or after its final segment, and
        ``RuntimeError`` once the orchestrator stopped.  The update travels
        through the request channel behind the adds before it, so it reaches
        each stage after the request's first submission there; it waits while
        that channel is full, and a caller cancelled while waiting changes
        nothing.
        """
        if self._state == "stopped":
            raise RuntimeError("orchestrator is not accepting requests: it has shut down")
        self.router.check_update(request_id, final)  # live sessions still take input while draining
        cmd = _Update(request_id, segment, final)
        try:
            await self._req_send.send(cmd)
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            raise RuntimeError("orchestrator is not accepting requests: it has shut down") from None
        await cmd.done.wait()
        if cmd.error is not None:
            raise cmd.error

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
        targets = self.router.check_stage_ids(stage_ids)
        if not isinstance(method, str) or not method:
            raise ValueError(f"method must be a non-empty str, got {method!r}")
        timeout = self.rpc_timeout if timeout is None else timeout
        if not timeout > 0:
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
        nursery = self._nursery
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

    @property
    def paused(self) -> str | None:
        """The pause mode in effect (``"wait"``, ``"abort"`` or ``"keep"``), None when not paused."""
        return self.router.paused

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
        if self._state in ("stopping", "stopped"):
            raise RuntimeError("orchestrator is not running: it cannot pause")
        actions = self.router.pause(mode)
        if self._pause_waiter is not None:  # a pause already waiting: it completes on the new terms
            self._pause_waiter.set()
            self._pause_waiter = None
        stopped = _AbortWait("", self.rpc_timeout)
        stopped.ids.update(i for a in actions if type(a) is Abort for i in a.request_ids)
        handed = [stopped]
        await self._perform(actions, handed)
        if not handed:  # the stage aborts run in a task: wait for their confirmations
            await stopped.event.wait()
            for r in stopped.results:
                if r.error is not None:
                    log.warning("pause('abort'): stage %d replica %d did not confirm: %s",
                                r.stage_id, r.replica, r.error)
        if mode == "keep":
            await self._tell_stages("pause")
        if not self.router.pause_complete():
            self._pause_waiter = waiter = trio.Event()
            await waiter.wait()

    async def resume(self) -> None:
        """Start requests again (after ``pause("keep")`` the stages are asked to step again)."""
        mode = self.router.paused
        self.router.resume()
        if self._pause_waiter is not None:
            self._pause_waiter.set()
            self._pause_waiter = None
        if mode == "keep":
            await self._tell_stages("resume")
        self._room_may_have_changed()

    async def _tell_stages(self, method: str) -> None:
        """Best effort: ``method`` on every stage that takes RPC calls; failures are logged."""
        if self._nursery is None:
            return
        for r in await self.collective_rpc(method):
            if r.error is not None:
                log.info("stage %d replica %d did not %s: %s", r.stage_id, r.replica, method, r.error)

    async def abort(self, request_id: str, timeout: float | None = None) -> list[RpcResult]:
        """Abort a request; it gets ``OrchError(kind="aborted")`` at once.  Unknown id: no-op.

        The terminal carries what the request produced so far
        (``OrchError.partial``).  Returns once every stage that held the
        request confirmed it stopped there (stage clients with
        ``confirm_abort``; others are only told), each replica under its own
        deadline (``timeout``, default ``rpc_timeout``): one
        :class:`RpcResult` per replica asked, in ``(stage_id, replica)``
        order -- ``value`` the ids it stopped, or ``error`` when it did not
        confirm (hung, stopped, dead).  Empty when no stage held it (unknown,
        still queued, or every stage had finished).
        """
        wait = _AbortWait(request_id, self.rpc_timeout if timeout is None else timeout)
        if self._abort(request_id, wait):
            self._waiters.add(wait)
            try:
                await wait.event.wait()
            finally:
                self._waiters.discard(wait)
        return sorted(wait.results, key=lambda r: (r.stage_id, r.replica))

    def abort_nowait(self, request_id: str) -> None:
        """Synchronous :meth:`abort` that does not wait for the stages."""
        self._abort(request_id, None)

    async def next_output(self) -> Message:
        """The next message in delivery order; ``trio.EndOfChannel`` once all is delivered.

        A message that is ready comes after a cancellation check only
        (``checkpoint_if_cancelled``): no schedule point, as asyncio's
        ``Queue.get`` of a ready item -- a consumer that keeps up pays one
        scheduler pass per wait, not one per message.  When none is ready it
        waits (a full checkpoint).
        """
        buf = self._out_buf
        if not buf:
            try:
                buf.extend(self._out_recv.receive_nowait())
            except trio.WouldBlock:
                buf.extend(await self._out_recv.receive())
                return buf.popleft()
        await trio.lowlevel.checkpoint_if_cancelled()
        return buf.popleft()

    def next_output_nowait(self) -> Message:
        """The next message if one is ready; ``trio.WouldBlock`` if none, ``trio.EndOfChannel`` at the end."""
        buf = self._out_buf
        if not buf:
            buf.extend(self._out_recv.receive_nowait())
        return buf.popleft()

    async def next_batch(self) -> list[Message]:
        """Every message ready now, in delivery order, waiting for the first; ``EndOfChannel`` at the end.

        For consumers that handle messages in batches (a front, a benchmark):
        one call per batch the dispatcher delivered; the same checkpoint rule
        as :meth:`next_output`.
        """
        buf = self._out_buf
        recv = self._out_recv.receive_nowait
        batch = list(buf)
        buf.clear()
        while True:
            try:
                batch.extend(recv())
            except trio.WouldBlock:
                break
            except trio.EndOfChannel:
                if batch:
                    break
                raise
        if batch:
            await trio.lowlevel.checkpoint_if_cancelled()
            return batch
        return list(await self._out_recv.receive())

    async def outputs(self) -> AsyncIterator[Message]:
        """Iterate over messages until the orchestrator stopped and all were delivered."""
        while True:
            try:
                yield await self.next_output()
            except trio.EndOfChannel:
                return

    def request_shutdown(self, timeout: float | None = None) -> None:
        """Stop accepting and begin shutting down (synchronous, idempotent).

        ``timeout`` lets active requests finish for up to that many seconds;
        ``None`` gives them their ``shutdown`` terminal at once -- also when a
        drain asked for earlier is still running (a second Ctrl-C).
        """
        self.router.stop_accepting()
        if not self._stop_requested.is_set():
            self._drain_timeout = timeout
            self._stop_requested.set()
            self._check_drained()
        elif timeout is None:
            self._drain_timeout = None
            if self._drain_scope is not None:
                self._drain_scope.cancel()
        if self._state == "new":
            self._finish_sync()
            self._out_send.close()
            self._state = "stopped"
            self._stopped.set()

    async def shutdown(self, timeout: float | None = None) -> None:
        """Graceful shutdown; returns when ``run()`` has returned."""
        self.request_shutdown(timeout)
        await self._stopped.wait()

    async def wait_stopped(self) -> None:
        await self._stopped.wait()

    # ------------------------------------------------------------------ the nursery
    async def run(self, *, task_status: trio.TaskStatus[Orchestrator] = trio.TASK_STATUS_IGNORED
                  ) -> None:
        """Run until shutdown or cancellation; signal readiness via ``task_status``."""
        if self._state != "new":
            raise RuntimeError(f"Orchestrator.run() called on a {self._state} orchestrator")
        self._state = "running"
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                for k, stage in enumerate(self.stages):
                    nursery.start_soon(self._reader, k, stage, name=f"trio_orch.reader[{k}]")
                nursery.start_soon(self._dispatcher, name="trio_orch.dispatcher")
                # started, not start_soon: it waits on the request channel before we report ready,
                # so that with no request queue the first request is not refused for want of a taker
                await nursery.start(self._request_handler, name="trio_orch.request_handler")
                await nursery.start(self._intake, name="trio_orch.intake")
                nursery.start_soon(self._deadlines.run, self._expire, name="trio_orch.deadline_keeper")
                self._watch_replicas()
                task_status.started(self)
                await self._stop_requested.wait()
                self._state = "stopping"
                self.router.stop_accepting()
                self.joins.stop()
                if self._drain_timeout:
                    with trio.move_on_after(self._drain_timeout) as self._drain_scope:
                        await self._drained.wait()
                    self._drain_scope = None
                nursery.cancel_scope.cancel()
        finally:
            self._nursery = None
            self._state = "stopping"
            self.router.stop_accepting()
            self.joins.stop()
            with trio.CancelScope(shield=True):
                await self._finish()
            self._state = "stopped"
            self._stopped.set()

    # ------------------------------------------------------------------ tasks
    async def _reader(self, stage_id: int, stage: StageClient) -> None:
        """Move a stage's outputs to the dispatcher; report the stage's death.

        A stage client that offers ``pump(deliver)`` (see :class:`PushStageClient`)
        hands each batch to ``deliver`` synchronously from wherever it
        receives it (its socket owner task, a thread-bridge callback), which
        saves one scheduler pass per batch over ``receive()``; the reader
        then only waits for the stage's end.
        """
        post = self._post_event
        try:
            pump = getattr(stage, "pump", None)
            if pump is not None:
                route_now = self._route_now

                def deliver(outs: list[StageOutput]) -> None:
                    # Nothing queued before it and no burst under way: route here, no dispatcher
                    # wake-up.  In a burst (another batch routed moments ago) queue it instead: the
                    # dispatcher then routes the whole burst in one pass and the sink gets one batch.
                    if self._idle:
                        if perf_counter() - self._last_inline >= BURST_GAP:
                            route_now(stage_id, outs)
                            # measured from the end of that routing: a batch that was waiting
                            # behind it (the next thread-bridge callback) is part of the burst
                            self._last_inline = perf_counter()
                            return
                        self._last_inline = perf_counter()
                    try:
                        post(stage_id, outs)
                    except trio.ClosedResourceError:
                        pass  # stopping: the shutdown terminals already went out

                await pump(deliver)
                raise RuntimeError(f"stage {stage_id} stopped delivering outputs")
            while True:
                outs = await stage.receive()
                post(stage_id, outs)
        except Exception as exc:
            post(stage_id, StageDied.of(exc))

    def _post_event(self, stage_id: int | None, item: Any) -> None:
        """Queue an event for the dispatcher (every event goes through here: it ends ``_idle``)."""
        self._idle = False
        self._inbox.post((stage_id, item))

    def _route_now(self, stage_id: int, outs: list[StageOutput]) -> None:
        """Route a pushed batch synchronously while the dispatcher is idle (the push fast path).

        Routing stays single-writer: this runs between checkpoints, like the
        dispatcher's own pass, and only when the dispatcher is blocked on an
        empty inbox, so no earlier event can be overtaken.  Emits are
        delivered here, and so are submits (forwards) to stage clients that
        take them synchronously; other stage I/O (updates, aborts, awaited
        submits) is handed to the dispatcher in decision order, which also
        ends the idle state so later batches queue behind it.
        """
        router = self.router
        actions: list[Action] = []
        for out in outs:
            actions.extend(router.route(stage_id, out))
        self._room_may_have_changed()
        if actions:
            self._perform_now(actions)  # a forward to a stage that takes submits synchronously: sent here

    async def _dispatcher(self) -> None:
        """Single router of outputs and commands; drains what is ready, then does I/O."""
        inbox = self._inbox
        router = self.router
        while True:
            if not inbox:
                self._idle = True
                try:
                    await inbox.wait()
                finally:
                    self._idle = False
            batch = inbox.take()
            if not batch:  # closed: the orchestrator is stopping
                return
            actions: list[Action] = []
            commands: list[_Command] = []
            for stage_id, item in batch:
                if type(item) is list:
                    for out in item:
                        actions.extend(router.route(stage_id, out))
                elif type(item) is _Command:
                    commands.append(item)
                    rid = item.state.request_id
                    if router.requests.get(rid) is item.state:
                        acts = router.abort(rid) if item.kind == "abort" else router.expire(rid)
                        if item.done is not None:  # the stages it asks must confirm to this caller
                            item.done.ids.update(i for a in acts if type(a) is Abort for i in a.request_ids)
                        actions.extend(acts)
                elif type(item) is _Perform:
                    actions.extend(item.actions)
                elif type(item) is StageDied:
                    actions.extend(self._on_stage_died(stage_id, item))
            self._room_may_have_changed()  # stages finished, requests ended
            waiters = [c.done for c in commands if c.done is not None]
            try:
                await self._perform(actions, waiters)
            finally:
                for ev in waiters:  # no abort I/O was needed (or we are being cancelled)
                    ev.set()

    async def _intake(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Move tickets from the request channel into the core's start queue while it has room.

        Input updates go to the request handler, in the order they came.  It
        takes while the handler does stage I/O, so the queue fills as it did
        when the channel itself buffered, and the core orders what waits.
        Every add waiting when it wakes is taken in the same pass, so a burst
        is queued whole and the handler starts it in one go.
        """
        router = self.router
        task_status.started()
        while True:
            while self._queue_full():
                self._queue_room = room = trio.Event()
                await room.wait()
            # cancelled when adds that went straight in fill the queue: a cancelled receive took nothing
            item: tuple[Ticket, trio.Event | None] | _Update | None = None
            with trio.CancelScope() as self._intake_scope:
                try:
                    item = await self._req_recv.receive()
                except trio.EndOfChannel:
                    self._intake_closed = True
                    self._room_may_have_changed()
                    return
            self._intake_scope = None
            if item is None:
                continue
            now = trio.current_time()
            while True:  # and every other add already waiting to be taken: one pass for a burst
                if type(item) is _Update:
                    self._updates.append(item)
                else:
                    ticket, done = item
                    router.enqueue(ticket, now)
                    if done is not None:
                        if ticket.order is not None:
                            self._dones[ticket] = done
                        else:
                            done.set()  # it ended before it was queued
                if self._queue_full():
                    break
                try:
                    item = self._req_recv.receive_nowait()
                except (trio.WouldBlock, trio.EndOfChannel):
                    break  # the end is seen by the next receive
            self._room_may_have_changed()

    async def _request_handler(self, *,
                               task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Apply input updates in order and start queued requests in the core's order: the core decides."""
        router = self.router
        task_status.started()  # no checkpoint until the loop below parks
        while True:
            if self._updates:
                await self._apply_update(self._updates.popleft())
                continue
            ticket = router.next_ticket()
            if ticket is not None and router.can_start(ticket):
                await self._start_burst(ticket)
                continue
            if ticket is None and self._intake_closed:
                return
            # wait for room on the stages, a new arrival (maybe the better pick) or an update
            self._room = room = trio.Event()
            await room.wait()

    async def _apply_update(self, item: _Update) -> None:
        try:
            actions = self.router.update(item.request_id, item.segment, final=item.final)
        except ValueError as exc:  # it ended (or got its final segment) after the call
            item.error = exc
            actions = []
        self._busy = True
        try:
            await self._perform(actions)
        finally:
            self._busy = False
            item.done.set()

    async def _start_burst(self, ticket: Ticket) -> None:
        """Start ``ticket``, then every queued ticket that can start after it, one after the other.

        Each start is decided and its stage I/O done before the next ticket
        leaves the queue (a submit that blocks holds the rest queued, as the
        request channel's bound expects); but where the stage clients take a
        submit synchronously there is no checkpoint between them, only one
        after the burst.  The whole burst then reaches the stages back to
        back and a worker's next step batches all of it.
        """
        router = self.router
        synced = False
        while ticket is not None and router.can_start(ticket):
            done = self._dones.pop(ticket, None)
            self._busy = True
            try:
                synced = await self._perform(router.start(ticket), checkpoint=False) or synced
            finally:
                self._busy = False
                if done is not None:
                    done.set()
                self._room_may_have_changed()  # the start queue has room for one more
            ticket = router.next_ticket()
        if synced:
            await trio.lowlevel.checkpoint()

    def _expire(self, request_id: str) -> None:
        """The deadline keeper's callback: a queued request ends now, a started one via the dispatcher."""
        if self.router.is_queued(request_id):
            self._end_queued(request_id, self.router.expire)
            return
        state = self.router.requests.get(request_id)
        if state is not None:
            self._post_event(None, _Command("expire", state, None))

    # ------------------------------------------------------------------ helpers
    def _end_queued(self, request_id: str, rule: Callable[[str], list[Action]]) -> None:
        """A queued request ends (abort, deadline): its terminal, and its add_request stops waiting."""
        ticket = self.router.queued[request_id]
        self._deliver_now(rule(request_id))
        done = self._dones.pop(ticket, None)
        if done is not None:
            done.set()

    def _accept(self, request_id: str, prompt: Any, final_stage_id: int | None, timeout: float | None,
                resumable: bool, sampling: Any, companions: Mapping[str, Any] | None,
                priority: int = 0) -> Ticket:
        ticket = self.router.accept(request_id, prompt, final_stage_id=final_stage_id,
                                    timeout=self.request_timeout if timeout is None else timeout,
                                    resumable=resumable, sampling=sampling, companions=companions,
                                    priority=priority)
        if ticket.timeout is not None:
            self._deadlines.set(request_id, ticket.timeout)
            ticket.deadline = trio.current_time() + ticket.timeout  # the start order's, from acceptance
        return ticket

    def _withdraw(self, ticket: Ticket) -> None:
        """The ticket never reached the request channel: forget it (no terminal)."""
        if self.router.queued.get(ticket.request_id) is ticket:
            self.router.withdraw(ticket)
            self._deadlines.discard(ticket.request_id)

    def _abort(self, request_id: str, done: _AbortWait | None) -> bool:
        """Start an abort; return True if the caller should wait on ``done``."""
        if self.router.is_queued(request_id):
            self._end_queued(request_id, self.router.abort)
            return False
        state = self.router.requests.get(request_id)
        if state is None:
            return False
        try:
            self._post_event(None, _Command("abort", state, done))
        except trio.ClosedResourceError:
            return False  # stopping: the shutdown terminal is on its way
        return True

    async def _rpc_stage(self, call: _RpcCall, stage_id: int) -> None:
        """One stage's part of a collective RPC; always records an answer, even when cancelled."""
        answer: list[tuple[int, Any, str | None]] = []
        try:
            rpc = getattr(self.stages[stage_id], "rpc", None)
            if rpc is None:
                answer = [(-1, None, f"stage {stage_id} ({type(self.stages[stage_id]).__name__}) "
                                     "takes no rpc calls")]
                return
            # The client applies the deadline per replica; this bound only guards against a
            # client that ignores it.
            with trio.move_on_after(call.timeout + self.shutdown_grace) as scope:
                try:
                    answer = list(await rpc(call.method, call.args, call.kwargs, call.timeout))
                except Exception as exc:
                    answer = [(-1, None, f"{type(exc).__name__}: {exc}")]
            if scope.cancelled_caught:
                answer = [(-1, None, f"timeout: stage {stage_id} did not answer within {call.timeout}s")]
        finally:
            call.answer(stage_id, answer or [(-1, None, "orchestrator shut down during the call")])

    def _watch_replicas(self) -> None:
        """Keep the core's view of each stage's ready replicas current (stage clients that report it)."""
        for k, stage in enumerate(self.stages):
            if isinstance(stage, ReplicatedStageClient):
                self.router.replicas_changed(k, *stage.replica_counts())  # nothing waits yet
                stage.watch_replicas(partial(self.replicas_changed, k))
            if hasattr(stage, "join_gate"):  # replicas may join it at runtime: through this core
                stage.join_gate = self.joins

    def replicas_changed(self, stage_id: int, live: int, total: int) -> None:
        """A stage's ready replicas changed (what a replica pool reports through ``watch_replicas``).

        The core's availability and bounds follow at once; the failovers
        that waited for a live replica of that stage are handed to the
        dispatcher, which sends them in order with everything else.
        """
        if self._state not in ("running", "stopping"):
            return
        actions = self.router.replicas_changed(stage_id, live, total)
        self._room_may_have_changed()
        if actions:
            try:
                self._post_event(None, _Perform(actions))
            except trio.ClosedResourceError:
                pass  # stopping: the shutdown terminals already went out

    def _room_may_have_changed(self) -> None:
        """Wake the request handler if it waits and has something to look at again, and the intake.

        Nothing queued, no input update and the intake open: there is nothing
        for it to start, so it sleeps on (an arrival wakes it) -- routing an
        output must not cost a handler wake-up and a scheduler pass.
        """
        room = self._room
        if room is not None and (self.router.start_queued or self._updates or self._intake_closed):
            self._room = None
            room.set()
        self._queue_may_have_room()

    def _queue_may_have_room(self) -> None:
        """Wake the intake if it waits for room in the start queue and there is some."""
        queue_room = self._queue_room
        if queue_room is not None and not self._queue_full():
            self._queue_room = None
            queue_room.set()

    def _on_stage_died(self, stage_id: int, death: StageDied) -> list[Action]:
        msg = death.describe(stage_id)
        log.warning("%s", msg)
        self.stage_deaths[stage_id] = msg
        return self.router.stage_died(stage_id, msg)

    def _send_to_channel(self, msgs: list[Message]) -> None:
        self._out_send.send_nowait(msgs)  # the batch is the channel's item (see next_output)

    def _deliver(self, msgs: list[Message]) -> None:
        deadlines = self._deadlines
        if deadlines:
            for m in msgs:
                if m.finished:
                    deadlines.discard(m.request_id)
        self._sink(msgs)
        self._room_may_have_changed()
        self._check_drained()
        self._check_paused()

    def _deliver_now(self, actions: list[Action]) -> None:
        """Deliver the messages of actions that need no stage I/O (a queued request's terminal)."""
        msgs = [a.message for a in actions if type(a) is Emit]
        if msgs:
            self._deliver(msgs)

    def _check_paused(self) -> None:
        waiter = self._pause_waiter
        if waiter is not None and self.router.pause_complete():
            self._pause_waiter = None
            waiter.set()

    def _check_drained(self) -> None:
        if not self.router.live_count and self._stop_requested.is_set():
            self._drained.set()

    async def _perform(self, actions: list[Action], waiters: list[_AbortWait] | None = None, *,
                       checkpoint: bool = True) -> bool:
        """Deliver the emits at once, submit in decision order, abort in the background.

        A submit the stage client takes synchronously (``submit_nowait``) has
        no checkpoint of its own: one follows the batch, unless
        ``checkpoint=False`` (the caller does it after more I/O).  Returns
        whether such a submit was made.

        Stage aborts are best-effort cleanup: they run in a task of the run
        nursery so a stage that hangs in ``abort`` never stalls routing for
        everybody else -- except an abort followed by a submit of the same
        request to the same stage (an async-chunk restart), done in order.
        ``waiters`` (callers of :meth:`abort`) are released once the stages
        confirmed those aborts (or did not, in time).
        """
        if not actions:
            return False
        self._deliver_now(actions)
        router = self.router
        aborts: list[Abort] = []
        synced = False  # a submit was done synchronously: one checkpoint at the end, for all of them
        for i, a in enumerate(actions):
            if type(a) is Submit or type(a) is Update:
                if not router.is_started(a.request_id):
                    continue  # ended while an earlier action awaited
                stage = self.stages[a.stage_id]
                schedule = router.schedule(a.request_id, trio.current_time()) if type(a) is Submit else None
                try:
                    if stage_call_nowait(stage, a, schedule):
                        synced = True
                    else:
                        await stage_call(stage, a, schedule)
                except Exception as exc:
                    why = stage_call_failed(a, exc)
                    await self._perform(router.submit_failed(a.stage_id, a.request_id, why))
                    continue
                aborts.extend(x for x in router.submitted(a.stage_id, a.request_id) if type(x) is Abort)
            elif type(a) is Abort:
                if self._resubmits(actions, i, a):
                    await self._abort_on(a.stage_id, a.request_ids)  # first: the stage takes it again
                else:
                    aborts.append(a)
        if aborts:
            nursery = self._nursery
            if nursery is not None and not nursery.cancel_scope.cancel_called:  # running or draining
                nursery.start_soon(self._abort_all, aborts, list(waiters or ()))
                if waiters:
                    waiters.clear()  # the abort task releases them
            else:
                await self._abort_all(aborts, [])
        if synced and checkpoint:
            await trio.lowlevel.checkpoint()
        return synced

    @staticmethod
    def _resubmits(actions: list[Action], i: int, abort: Abort) -> bool:
        """A later action submits one of the aborted ids to the same stage again (a restart)."""
        return any(type(b) is Submit and b.stage_id == abort.stage_id and b.request_id in abort.request_ids
                   for b in actions[i + 1:])

    async def _abort_all(self, aborts: list[Abort], waiters: list[_AbortWait]) -> None:
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
                    await self._abort_on(a.stage_id, a.request_ids)
        finally:
            for ev in waiters:
                ev.set()

    async def _confirm_all(self, aborts: list[Abort], waiters: list[_AbortWait]) -> None:
        for a in aborts:
            await self._confirm_on(a, waiters)

    async def _confirm_on(self, a: Abort, waiters: list[_AbortWait]) -> None:
        """Abort on one stage and collect each replica's confirmation for the callers it concerns."""
        k, stage = a.stage_id, self.stages[a.stage_id]
        timeout = max(w.timeout for w in waiters)
        confirm = getattr(stage, "confirm_abort", None)
        replies: list[tuple[int, Any, str | None]] = []
        try:
            with trio.move_on_after(timeout + self.shutdown_grace) as scope:
                if confirm is None:
                    await stage.abort(a.request_ids)
                    replies = [(-1, None, f"stage {k} ({type(stage).__name__}) cannot confirm aborts: "
                                          "told, not confirmed")]
                else:
                    replies = list(await confirm(a.request_ids, timeout))
            if scope.cancelled_caught:
                replies = [(-1, None, f"timeout: stage {k} did not confirm within {timeout:g}s")]
        except Exception as exc:  # the stage is dying; its reader reports that
            replies = [(-1, None, f"{type(exc).__name__}: {exc}")]
        for w in waiters:
            if w.ids.intersection(a.request_ids):
                w.results.extend(RpcResult(k, r, v, e) for r, v, e in replies)

    async def _abort_on(self, stage_id: int, request_ids: list[str]) -> None:
        try:
            await self.stages[stage_id].abort(request_ids)
        except Exception as exc:  # the stage is dying; its reader reports that
            log.debug("abort %s on stage %d failed: %r", request_ids, stage_id, exc)

    def _finish_sync(self) -> list[Action]:
        """Terminals for everything still accepted; close the input side; return the stage I/O left.

        Tickets found in the request channel were handed over and get their
        shutdown terminal from the core; tickets whose ``add_request`` was
        still waiting for room never got in (closing the channel makes those
        calls raise) and are withdrawn first.
        """
        self.router.stop_accepting()
        self._req_send.close()
        self._intake_closed = True
        handed_over: set[Ticket] = set()
        while True:
            try:
                item = self._req_recv.receive_nowait()
            except (trio.WouldBlock, trio.EndOfChannel):
                break
            if type(item) is _Update:
                item.error = RuntimeError("orchestrator shut down before the update was handled")
                item.done.set()
                continue
            ticket, done = item
            handed_over.add(ticket)
            if done is not None:
                done.set()
        for ticket in self._sending - handed_over:
            self._withdraw(ticket)
        while self._updates:
            upd = self._updates.popleft()
            upd.error = RuntimeError("orchestrator shut down before the update was handled")
            upd.done.set()
        for done in self._dones.values():  # queued: their shutdown terminal follows
            done.set()
        self._dones.clear()
        actions = self.router.shutdown()
        self._deliver_now(actions)
        for ev in list(self._waiters):
            ev.set()
        self._inbox.close()
        self._report_unrouted_events()
        return [a for a in actions if type(a) is not Emit]

    def _report_unrouted_events(self) -> None:
        """Events the dispatcher never saw (it was cancelled first): log stage failures."""
        for stage_id, item in self._inbox.take():
            if type(item) is StageDied:
                msg = item.describe(stage_id).replace(" died: ", " failed while stopping: ", 1)
                log.warning("%s", msg)
                self.stage_deaths.setdefault(stage_id, msg)
            elif type(item) is _Command and item.done is not None:
                item.done.set()

    async def _finish(self) -> None:
        io = self._finish_sync()
        with trio.move_on_after(self.shutdown_grace):
            for a in io:
                if type(a) is Abort and self.router.available[a.stage_id]:
                    await self._abort_on(a.stage_id, a.request_ids)
        async with trio.open_nursery() as nursery:
            for stage in self.stages:
                nursery.start_soon(self._close_stage, stage)
        self._out_send.close()

    async def _close_stage(self, stage: StageClient) -> None:
        with trio.move_on_after(self.shutdown_grace) as scope:
            try:
                await stage.aclose()
            except Exception as exc:
                log.warning("closing stage %r failed: %r", stage, exc)
        if scope.cancelled_caught:
            log.warning("closing stage %r took longer than %.1fs; abandoned", stage, self.shutdown_grace)


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


