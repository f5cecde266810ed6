"""THE engine: the orchestrator with admission, per-request streams and the control plane, in a Trio run.

:class:`TrioEngine` runs as a task of the caller's Trio run
(``await nursery.start(engine.run)``, or ``async with open_trio_engine(factory)``):
it hosts the pipeline (stage clients, possibly worker processes) and the
:class:`Orchestrator`.  A request is admitted by the one
:class:`~trio_orch.engine.admitter.Admitter` (at once, after a bounded wait,
or shed with :class:`Overloaded`); the orchestrator's ``output_sink`` feeds
a :class:`~trio_orch.engine.demux.Demux` that wakes each waiting task once
per dispatcher batch (one :class:`trio.Event`, no thread, no hop).
Resumable requests take more input through the
:class:`~trio_orch.engine.updates.UpdateForwarder`, in call order, after
their own admission.  The control plane is
:class:`~trio_orch.engine.control.ControlPlane`.  It satisfies the engine's
seam, :class:`~trio_orch.engine.api.EngineClient`; ``serve --loop trio``
serves the HTTP app over it this way (:mod:`trio_orch.serve.trio_front`).

Calls from another thread are posted through the run's Trio token, so the
thread adapter (:class:`~trio_orch.engine.bridge.ThreadEngine`: a Trio run in a
thread that hosts this engine) adds only the blocking and asyncio forms.

Fatal drain: whatever ends the run (``request_stop``, a crash, a
cancellation), every registered request -- queued, waiting for admission
or in flight -- gets a terminal ``OrchError(kind="shutdown")`` and every
later call raises :class:`EngineClosed` at once.
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import threading
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping, Sequence
from concurrent.futures import Future
from contextlib import asynccontextmanager
from functools import partial
from time import monotonic
from typing import Any, TypeVar

import trio

from stages.sampling_params import StageParams
from trio_orch.engine.admitter import Admitter
from trio_orch.engine.api import EngineClosed, EngineStartupError, EngineStatistics, ReportsReady
from trio_orch.engine.base import PipelineFactory, as_spec, collect_stats, stage_timings, unwrap
from trio_orch.engine.control import ControlPlane
from trio_orch.engine.demux import DONE, PENDING, Demux, Stream, TrioStream
from trio_orch.engine.handles import AsyncRequestHandle, messages, open_accepted, stream_batches
from trio_orch.engine.updates import UpdateForwarder
from trio_orch.shell.orchestrator import Orchestrator
from trio_orch.types import Message, RpcResult, StageClient

__all__ = ["TrioEngine", "open_trio_engine"]

log = logging.getLogger("trio_orch.engine")
S = TypeVar("S", bound=Stream)


class TrioEngine(ControlPlane):
    """The engine; see the module docstring.

    ``pipeline`` is a :data:`~trio_orch.engine.base.PipelineFactory`.
    ``request_queue_size``, ``shutdown_grace``, ``request_timeout``,
    ``max_inflight`` and ``max_running`` go to the :class:`Orchestrator` (the
    pipeline's own options come on top).  ``admission_timeout`` and ``max_waiting`` bound how
    long and how many requests wait for room in the request channel; past
    them a request is shed with :class:`Overloaded` (None: no bound, callers
    wait -- backpressure).  See :mod:`trio_orch.engine.admitter`.

    Lifecycle: ``await nursery.start(engine.run)`` returns once the
    orchestrator accepts requests (``EngineStartupError`` if the pipeline
    could not start); :meth:`request_stop` (any thread) begins the shutdown,
    with a drain if asked; ``run`` returns once the pipeline is stopped (a
    crash after the start is not raised: it is :attr:`failure`, and the
    reason every later call gives).  Cancelling ``run`` is the hard stop.
    """

    def __init__(self, pipeline: PipelineFactory, *, request_queue_size: int = 256,
                 shutdown_grace: float = 2.0, request_timeout: float | None = None,
                 admission_timeout: float | None = None, max_waiting: int | None = None,
                 max_inflight: Sequence[int | None] | None = None, max_running: int | None = None) -> None:
        self._pipeline = pipeline
        self._orch_options: dict[str, Any] = {"request_queue_size": request_queue_size,
                                              "shutdown_grace": shutdown_grace}
        if request_timeout is not None:
            self._orch_options["request_timeout"] = request_timeout
        self._max_inflight = max_inflight  # the engine's bound wins over the pipeline's
        if max_running is not None:
            self._orch_options["max_running"] = max_running
        self._demux = Demux()
        self._demux.timings_of = self._timings_of
        self._admitter = Admitter(self._demux, timeout=admission_timeout, max_waiting=max_waiting)
        self._updates = UpdateForwarder()  # update_request's Trio side
        self._admitter.on_admitted = self._updates.admitted
        self._admitter.on_dropped = self._updates.dropped
        self._ids = itertools.count()
        self._id_prefix = f"{os.getpid():x}-{id(self) & 0xFFFFFF:x}"
        self._run_thread: int | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self._main_scope: trio.CancelScope | None = None
        self._orch: Orchestrator | None = None
        self._ready = False
        self._stage_params: Sequence[StageParams] | None = None
        self._failure: BaseException | None = None
        self._stop_flag = False
        self._drain: float | None = None
        self._closing: str | None = None  # set: new requests are refused with this reason
        self._dead: str | None = None  # set: the run is over (or abandoned)

    # ------------------------------------------------------------------ lifecycle
    async def run(self, *, task_status: trio.TaskStatus[TrioEngine] = trio.TASK_STATUS_IGNORED) -> None:
        """Run the pipeline and the orchestrator until stopped; see the class docstring."""
        if self._run_thread is not None:
            raise RuntimeError("TrioEngine.run() called twice")
        self._run_thread = threading.get_ident()
        self._token = trio.lowlevel.current_trio_token()
        reason = None
        try:
            await self._serve(task_status)
        except BaseException as exc:
            inner = unwrap(exc)
            if isinstance(inner, (trio.Cancelled, KeyboardInterrupt)):
                raise
            self._failure = inner
            what = f"{type(inner).__name__}: {inner}"
            if not self._ready:
                reason = f"it failed to start: {what}"
                raise EngineStartupError(f"engine failed to start: {what}") from inner
            reason = f"its orchestrator crashed: {what}"
            log.error("engine crashed", exc_info=inner)
        finally:
            stopped = "the engine was closed" if self._stop_flag else "its orchestrator stopped"
            self.mark_dead(reason or stopped)
            self._updates.close(self._dead or "its orchestrator stopped")
            if not self._ready and self._failure is None:  # stopped before it was ready: not a failure
                self._ready = True
                task_status.started(self)

    async def _serve(self, task_status: trio.TaskStatus[TrioEngine]) -> None:
        with trio.CancelScope() as scope:
            self._main_scope = scope
            if self._stop_flag:
                return
            async with self._pipeline() as raw:
                spec = as_spec(raw)
                self._stage_params = spec.stage_params
                opts = {**self._orch_options, **spec.options}
                if self._max_inflight is not None:
                    opts["max_inflight"] = self._max_inflight
                orch = Orchestrator(spec.stages, spec.final_stage_ids, output_sink=self._demux.sink, **opts)
                self._admitter.orch = orch
                async with trio.open_nursery() as nursery:
                    await nursery.start(orch.run)
                    nursery.start_soon(self._admitter.run, orch, name="trio_orch.engine.admitter")
                    nursery.start_soon(self._updates.run, orch, name="trio_orch.engine.updates")
                    self._orch = orch
                    self._ready = True
                    task_status.started(self)
                    if self._stop_flag:
                        orch.request_shutdown(self._drain)
                    await orch.wait_stopped()
                    # No more terminals can come from the orchestrator: refuse and drain now,
                    # before the pipeline's own shutdown (which may take a while).
                    if self._closing is None:
                        self._closing = "its orchestrator stopped"
                    self._demux.sweep("shutdown", f"the engine stopped: {self._closing}")
                    nursery.cancel_scope.cancel()

    def request_stop(self, drain: float | None = None) -> None:
        """Stop accepting; let in-flight requests finish for up to ``drain`` s; then stop (any thread)."""
        if self._closing is None:
            self._closing = "the engine was closed"
        self._stop_flag = True
        self._drain = drain
        self._post_quiet(self._stop_cb)

    close = request_stop  #: ``run`` returns once the pipeline stopped: await that, not this

    def end_drain(self) -> None:
        """Cut a drain begun by :meth:`request_stop` short: what is still in flight ends now (any thread)."""
        self._drain = None
        self._post_quiet(self._stop_cb)

    def _stop_cb(self) -> None:
        if self._orch is not None:
            self._orch.request_shutdown(self._drain)
        elif self._main_scope is not None:
            self._main_scope.cancel()

    def mark_dead(self, reason: str) -> None:
        """Refuse everything from now on and give every open request its ``shutdown`` terminal.

        Called when the run ends; a host that gives up on the run (its thread
        will not stop) calls it from outside.  The first reason given stays.
        """
        if self._dead is None:
            self._dead = reason
        if self._closing is None:
            self._closing = reason
        self._demux.sweep("shutdown", f"the engine stopped: {self._dead}")

    # ------------------------------------------------------------------ state (any thread)
    @property
    def running(self) -> bool:
        return self._ready and self.closed_reason is None

    @property
    def orchestrator(self) -> Orchestrator | None:
        """The orchestrator (lives in the engine's run: read it there, see :meth:`call_soon`)."""
        return self._orch

    @property
    def stages(self) -> list[StageClient]:
        return list(self._orch.stages) if self._orch is not None else []

    @property
    def stage_params(self) -> Sequence[StageParams] | None:
        """Each stage's name and sampling parameters, as the pipeline declared them (None: none)."""
        return self._stage_params

    @property
    def final_stage_ids(self) -> frozenset[int]:
        """The pipeline's final-output stages (empty before start)."""
        return self._orch.router.final_stage_ids if self._orch is not None else frozenset()

    @property
    def stage_kinds(self) -> list[str] | None:
        """Each stage's kind, as the pipeline declared them (None: it declares none)."""
        params = self._stage_params
        return [p.name for p in params] if params is not None else None

    def stage_info(self, stage: int) -> Mapping[str, Any]:
        """What ``stage``'s first ready worker reported in its handshake (any thread).

        Empty for stage clients with no workers (in-process ones) and before
        any worker of the stage is ready.
        """
        orch = self._orch
        if orch is None:
            return {}
        client = orch.stages[stage]
        return client.ready_info() if isinstance(client, ReportsReady) else {}

    @property
    def failure(self) -> BaseException | None:
        """What ended the run, if it crashed or could not start (None otherwise)."""
        return self._failure

    @property
    def demux(self) -> Demux:
        """The per-request streams the orchestrator's batches are routed to (introspection)."""
        return self._demux

    @property
    def latency(self) -> Any:
        """The handover-latency histogram (dispatcher batch -> consumer)."""
        return self._demux.latency

    @property
    def open_requests(self) -> set[str]:
        """Ids of the requests whose consumer has not had the terminal yet (a snapshot)."""
        return set(self._demux.streams)

    @property
    def shedding(self) -> bool:
        """The engine shed a request and has had no room since: a new one now would be shed too.

        A hint for a front that wants to refuse cheaply under a flood; the
        admission decision itself stays with the core and the admitter.
        """
        return monotonic() < self._admitter.shedding_until

    @property
    def capacity(self) -> float:
        """At most how many requests it can hold now without shedding (``math.inf``: no bound).

        The orchestrator's capacity plus the requests that may wait for room;
        it follows the live replicas.  Read without a lock: an estimate for a
        front (:class:`~trio_orch.http.limits.Shedder`), which refuses a new
        request once as many are already on their way.
        """
        orch = self._orch
        if orch is None:
            return math.inf
        return orch.capacity() + self._admitter.waiting_bound

    @property
    def retry_after(self) -> float:
        """Seconds a shed caller is told to wait."""
        return self._admitter.retry_after

    @property
    def admission_waiting(self) -> int:
        """Requests waiting for room in the request channel."""
        return self._admitter.waiting

    @property
    def closed_reason(self) -> str | None:
        """Why the engine refuses requests (None while it runs).

        An orchestrator that began to stop on its own counts at once, before
        the engine's run sees it end: a request then would only be refused.
        """
        orch = self._orch
        if self._dead is None and self._closing is None and orch is not None and not orch.running:
            return "its orchestrator stopped"
        return self._dead or self._closing

    # ------------------------------------------------------------------ requests
    def open(self, cls: type[S], prompt: Any, request_id: str | None = None,
             final_stage_id: int | None = None, request_timeout: float | None = None,
             resumable: bool = False, **kw: Any) -> S:
        """Register a ``cls`` stream for a new request and admit it (any thread: the admission is posted).

        Raises ``ValueError`` for bad parameters or a duplicate active id and
        :class:`EngineClosed` once the engine is closed.  The stream then gets
        the request's items (an ACK if ``want_ack``, batches, the terminal, or
        an exception such as :class:`Overloaded`).
        """
        if self.closed_reason is not None or self._orch is None:
            raise EngineClosed(self._closed_message())
        rid = request_id if request_id is not None else f"req-{self._id_prefix}-{next(self._ids)}"
        self._orch.router.resolve_final_stage(rid, final_stage_id)  # immutable config: thread-safe
        self._orch.router.check_priority(kw.get("priority", 0))
        if request_timeout is not None and not request_timeout > 0:
            raise ValueError(f"request_timeout must be a positive number of seconds, got {request_timeout!r}")
        s = cls(rid, prompt, final_stage_id, request_timeout, resumable=bool(resumable), **kw)
        self._demux.register(s)
        if self._dead is not None or self._closing is not None:  # raced with the fatal drain
            self._demux.unregister(s)
            raise EngineClosed(self._closed_message())
        try:
            self._post(self._admitter.admit, s)
        except EngineClosed:
            self._demux.unregister(s)
            raise
        return s

    def generate_batches(self, prompt: Any, *, request_id: str | None = None,
                         final_stage_id: int | None = None, request_timeout: float | None = None,
                         sampling: Any = None, resumable: bool = False,
                         companions: Mapping[str, Any] | None = None,
                         priority: int = 0) -> AsyncGenerator[list[Message], None]:
        """The request's messages, one list per dispatcher batch, the terminal last (Trio tasks).

        Waits while the request channel is full, within the admission bounds
        (past them: :class:`Overloaded`, nothing registered).  Cancellation,
        or leaving the iteration before the terminal, aborts the request.
        ``sampling``: per-stage sampling parameters (a list indexed by stage,
        or a mapping stage -> parameters; a bad one raises ValueError).
        ``companions``: ``{id: stage-0 prompt}``, as for ``Orchestrator.add_request``.
        ``priority``: an int, lower values served first (default 0; see docs/scheduling.md).
        The request is registered when the iteration starts; to send a
        resumable request's updates right away, use :meth:`add_request_async`.
        """
        return stream_batches(self, partial(self.open, TrioStream, prompt, request_id, final_stage_id,
                                            request_timeout, resumable, sampling=sampling,
                                            companions=dict(companions) if companions else None,
                                            priority=priority))

    def generate(self, prompt: Any, **kwargs: Any) -> AsyncIterator[Message]:
        """``async for out in engine.generate(prompt)``: :meth:`generate_batches`, one message at a time."""
        return messages(self.generate_batches(prompt, **kwargs))

    async def add_request_async(self, prompt: Any, *, request_id: str | None = None,
                                final_stage_id: int | None = None, request_timeout: float | None = None,
                                resumable: bool = False, sampling: Any = None,
                                want_timings: bool = False, priority: int = 0) -> AsyncRequestHandle:
        """Submit a request; return its :class:`AsyncRequestHandle` once accepted.

        Once it returns the orchestrator knows the request, so updates of a
        resumable one may follow at once -- and nothing has been sent to the
        caller's client yet, so an HTTP front can still answer with a status
        code: :class:`Overloaded` when the request was shed,
        ``handle.rejection`` when the engine refused it (a stage of its path
        has no live replica; it is stopping).  Cancelled while waiting, the
        request is aborted (or never registered).  ``want_timings``:
        ``handle.timings`` holds each stage's timing once the terminal was taken.
        """
        s = self.open(TrioStream, prompt, request_id, final_stage_id, request_timeout, resumable,
                      want_ack=True, sampling=sampling, want_timings=want_timings, priority=priority)
        return await open_accepted(self, s)

    def abort(self, request_id: str) -> None:
        """Abort a request from any thread, without waiting; its consumer gets ``aborted``.

        Unknown or finished id: no-op.  Raises EngineClosed once the engine is
        dead.  To wait for the stages' confirmations: :meth:`abort_confirmed_async`.
        """
        if self._dead is not None:
            raise EngineClosed(self._closed_message())
        s = self._demux.streams.get(request_id)
        if s is not None:
            self._post_quiet(self._abort_cb, s)

    def client_gone(self, s: Stream) -> None:
        """A consumer (a handle, a generator) stopped listening before the terminal: abort the request."""
        if s.state != DONE:
            s.detached = True
            self._post_quiet(self._abort_cb, s)

    def withdraw(self, s: Stream) -> None:
        """Withdraw a request still waiting for admission (any thread): it gets WITHDRAWN, or the ACK
        (or its terminal) if it got in first."""
        s.withdrawn = True
        self._post_quiet(self._withdraw_cb, s)

    def post_update(self, request_id: str, segment: Any, final: bool = False) -> Future[None]:
        """One more input segment for a live resumable request (any thread), answered through the future.

        A future cancelled before the update was taken up withdraws it.
        """
        fut: Future[None] = Future()
        self._post(self._update_cb, request_id, segment, bool(final), fut)
        return fut

    async def update_request_async(self, request_id: str, segment: Any, *, final: bool = False) -> None:
        """One more input segment for a live resumable request (``final``: the last one).

        Returns once the segment was handed to the stages; waits while the
        request itself still waits for admission.  Raises ``ValueError``
        (nothing changes) for an unknown or ended id, a request not added with
        ``resumable=True`` or after its final segment; :class:`EngineClosed`
        once the engine stopped.  Cancelled before the update was taken up, it
        is withdrawn; after, it still applies.
        """
        fut = self.post_update(request_id, segment, final)
        done = trio.Event()
        fut.add_done_callback(lambda f: done.set())  # settled in this run (the update forwarder)
        try:
            await done.wait()
        except trio.Cancelled:
            fut.cancel()
            raise
        fut.result()

    async def abort_confirmed_async(self, request_id: str, timeout: float | None = None) -> list[RpcResult]:
        """Abort and wait until every stage that held the request confirmed it stopped.

        As :meth:`Orchestrator.abort`: the consumer gets the ``aborted``
        terminal (with ``partial``) at once; the result lists each replica's
        confirmation or its error.
        """
        orch = self.control_orchestrator()
        s = self._demux.streams.get(request_id)
        if s is not None and s.state == PENDING:  # still waiting for admission: no stage has it
            self._abort_cb(s)
            return []
        return await orch.abort(request_id, timeout)

    def control_orchestrator(self) -> Orchestrator:
        """The running orchestrator (for the control plane); EngineClosed when there is none."""
        if self._orch is None or self._dead is not None:
            raise EngineClosed(self._closed_message())
        return self._orch

    # ------------------------------------------------------------------ metrics
    def stats(self) -> EngineStatistics:
        """A metrics snapshot (any thread: taken in the engine's run)."""
        token = self._token
        if self._dead is not None or self._orch is None or token is None:
            return collect_stats(None, self._demux, 0, False)
        if self._in_run():
            return self._stats_now()
        try:
            return trio.from_thread.run_sync(self._stats_now, trio_token=token)
        except trio.RunFinishedError:
            return collect_stats(None, self._demux, 0, False)

    async def stats_async(self, timeout: float = 5.0) -> EngineStatistics:
        """:meth:`stats` for a Trio task of the engine's run."""
        await trio.lowlevel.checkpoint()
        return self.stats()

    def _stats_now(self) -> EngineStatistics:
        return collect_stats(self._orch, self._demux, self._admitter.waiting, self._dead is None)

    def _timings_of(self, request_id: str) -> tuple[Any, ...]:
        return stage_timings(self._orch, request_id)

    # ------------------------------------------------------------------ other threads
    def call_soon(self, fn: Callable[..., object], *args: Any) -> None:
        """Run ``fn(*args)`` in the engine's run soon (any thread; never blocks).  Must not raise."""
        token = self._token
        if token is None or self._dead is not None:
            raise EngineClosed(self._closed_message())
        try:
            token.run_sync_soon(fn, *args)
        except trio.RunFinishedError:
            raise EngineClosed(self._closed_message()) from None

    def run_sync_in_trio(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn(*args)`` in the engine's run and return its result (the run itself, or a plain thread)."""
        if self._token is None or self._dead is not None:
            raise EngineClosed(self._closed_message())
        if self._in_run():
            return fn(*args)
        try:
            return trio.from_thread.run_sync(fn, *args, trio_token=self._token)
        except trio.RunFinishedError:
            raise EngineClosed(self._closed_message()) from None

    def run_in_trio(self, async_fn: Callable[..., Any], *args: Any) -> Any:
        """Await ``async_fn(*args)`` in the engine's run and return its result (plain threads only)."""
        if self._token is None or self._dead is not None:
            raise EngineClosed(self._closed_message())
        try:
            return trio.from_thread.run(async_fn, *args, trio_token=self._token)
        except trio.RunFinishedError:
            raise EngineClosed(self._closed_message()) from None

    # ------------------------------------------------------------------ in the run
    def _abort_cb(self, s: Stream) -> None:
        """Abort ``s`` wherever it is (waiting for admission, queued, routed)."""
        try:
            if s.state == DONE:
                return
            if s.state == PENDING:
                self._admitter.abort(s)
            elif self._orch is not None:
                self._orch.abort_nowait(s.request_id)
        except BaseException:
            log.exception("abort of %r failed", s.request_id)

    def _withdraw_cb(self, s: Stream) -> None:
        try:
            if s.state == PENDING:  # else already admitted or ended: the ACK/terminal is in its queue
                self._admitter.abort(s)  # s.withdrawn: it answers WITHDRAWN, not a terminal
        except BaseException:
            log.exception("withdrawal of %r failed", s.request_id)

    def _update_cb(self, request_id: str, segment: Any, final: bool, fut: Future[None]) -> None:
        """Hand the update to the forwarder (it answers ``fut``)."""
        try:
            self._updates.post(self._demux.streams.get(request_id), request_id, segment, final, fut)
        except BaseException as exc:  # never let a callback kill the run
            log.exception("update of %r failed", request_id)
            if fut.set_running_or_notify_cancel():
                fut.set_exception(exc)

    # ------------------------------------------------------------------ plumbing
    def _in_run(self) -> bool:
        return threading.get_ident() == self._run_thread

    def _post(self, fn: Callable[..., object], *args: Any) -> None:
        """Run ``fn(*args)`` in the run: now when called there, else posted through the token."""
        if self._in_run():
            if self._dead is not None:
                raise EngineClosed(self._closed_message())
            fn(*args)
        else:
            self.call_soon(fn, *args)

    def _post_quiet(self, fn: Callable[..., object], *args: Any) -> None:
        """:meth:`_post`, silent when the run is gone (aborts and stops: nothing left to do then)."""
        if self._in_run():
            fn(*args)
            return
        token = self._token
        if token is not None:
            try:
                token.run_sync_soon(fn, *args)
            except trio.RunFinishedError:
                pass

    def _closed_message(self) -> str:
        if not self._ready and self._closing is None:
            return ("the engine is not started: await nursery.start(engine.run) (the thread adapter: "
                    "call start() or use it as a context manager)")
        return f"the engine is closed: {self.closed_reason}"


@asynccontextmanager
async def open_trio_engine(pipeline: PipelineFactory, *, request_queue_size: int = 256,
                           shutdown_grace: float = 2.0, request_timeout: float | None = None,
                           admission_timeout: float | None = None, max_waiting: int | None = None,
                           max_inflight: Sequence[int | None] | None = None,
                           max_running: int | None = None) -> AsyncIterator[TrioEngine]:
    """``async with open_trio_engine(factory) as engine``: the engine in the caller's Trio run.

    The options are :class:`TrioEngine`'s.  Leaving the block shuts the
    orchestrator down (no drain); every request still open gets its
    ``shutdown`` terminal, and the block ends once the pipeline stopped.
    """
    engine = TrioEngine(pipeline, request_queue_size=request_queue_size, shutdown_grace=shutdown_grace,
                        request_timeout=request_timeout, admission_timeout=admission_timeout,
                        max_waiting=max_waiting, max_inflight=max_inflight, max_running=max_running)
    async with trio.open_nursery() as nursery:
        await nursery.start(engine.run)
        try:
            yield engine
        finally:
            engine.request_stop()
