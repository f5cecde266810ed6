"""The thread bridge: the Trio orchestrator in a background thread, used from sync and asyncio code.

:class:`Engine` runs ``trio.run`` in a daemon thread that hosts the pipeline
(stage clients, possibly worker processes) and the :class:`Orchestrator`.
Inbound calls never block the caller's event loop: they are posted with the
Trio token's ``run_sync_soon`` and admitted with ``add_request_nowait``; when
the request channel is full they wait, in FIFO order, in the bridge's own
admitter task (backpressure).  Outbound, the orchestrator's ``output_sink``
feeds a :class:`~trio_orch.engine.demux.Demux` that wakes each waiting side once per
dispatcher batch (one ``call_soon_threadsafe`` per asyncio loop per batch).

Fatal drain: whatever ends the Trio thread (``close()``, a crash, a pipeline
that cannot start), every registered request -- queued, waiting for
admission or in flight -- gets a terminal ``OrchError(kind="shutdown")`` and
every later call raises :class:`EngineClosed` at once.

Resumable requests (``resumable=True``) take more input while they run:
``update_request`` (sync) and ``update_request_async`` post each segment to
the Trio thread, where :class:`~trio_orch.engine.updates.UpdateForwarder`
applies them in call order, after the request's own admission.
:meth:`Engine.add_request_async` returns once the request was accepted, so
its updates can follow at once.

The handles a caller holds per request (:class:`RequestHandle`,
:class:`AsyncRequestHandle`) are in :mod:`trio_orch.engine.handles`.
:func:`open_trio_engine` (:mod:`trio_orch.engine.trio_engine`) is the same API for
Trio code, without a thread; :mod:`trio_orch.engine.base` holds the errors,
the pipeline factory contract and the metrics snapshot they share.
"""

from __future__ import annotations

import asyncio
import atexit
import itertools
import logging
import math
import os
import queue
import threading
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from contextlib import aclosing
from time import monotonic
from typing import Any

import trio

from stages.sampling_params import StageParams
from trio_orch.engine.admitter import Admitter
from trio_orch.engine.base import (
    EngineClosed,
    EngineStartupError,
    EngineStatistics,
    PipelineFactory,
    as_spec,
    collect_stats,
    stage_timings,
    unwrap,
)
from trio_orch.engine.control import EngineControl
from trio_orch.engine.demux import (
    ACK,
    DONE,
    PENDING,
    WITHDRAWN,
    AsyncioStream,
    Demux,
    Stream,
    SyncStream,
)
from trio_orch.engine.handles import AsyncRequestHandle, RequestHandle, observe_latency
from trio_orch.engine.updates import UpdateForwarder
from trio_orch.shell.orchestrator import Orchestrator
from trio_orch.types import Message, RpcResult, StageClient

__all__ = ["Engine"]

log = logging.getLogger("trio_orch.engine.bridge")


class Engine(EngineControl):
    """The orchestrator in a background Trio thread; see the module docstring.

    The control plane (collective RPC, pause, sleep, weight sync, profiling,
    acknowledged aborts) comes from :class:`~trio_orch.engine.control.EngineControl`.

    ``pipeline`` is a :data:`PipelineFactory`.  ``startup_timeout`` bounds
    :meth:`start`; ``close_timeout`` bounds :meth:`close` (beyond any drain).
    ``request_queue_size``, ``shutdown_grace``, ``request_timeout`` and
    ``max_inflight`` go to the :class:`Orchestrator` (the pipeline's own
    options come on top).  ``admission_timeout`` and ``max_waiting`` bound how
    long and how many requests wait for room in the request channel; past
    them a request is shed with :class:`Overloaded` (None: no bound, callers
    wait -- backpressure).  See :mod:`trio_orch.engine.admitter`.
    """

    def __init__(self, pipeline: PipelineFactory, *, startup_timeout: float = 60.0,
                 close_timeout: float = 10.0, request_queue_size: int = 256,
                 shutdown_grace: float = 2.0, request_timeout: float | None = None,
                 admission_timeout: float | None = None, max_waiting: int | None = None,
                 max_inflight: Sequence[int | None] | None = None,
                 name: str = "trio-orch-engine") -> None:
        self._pipeline = pipeline
        self.startup_timeout = startup_timeout
        self.close_timeout = close_timeout
        self._orch_options: dict[str, Any] = {"request_queue_size": request_queue_size,
                                              "shutdown_grace": shutdown_grace}
        if request_timeout is not None:
            self._orch_options["request_timeout"] = request_timeout
        self._max_inflight = max_inflight
        self.name = name
        self._demux = Demux()
        self._demux.timings_of = self._timings_of
        self._admitter = Admitter(self._demux, timeout=admission_timeout, max_waiting=max_waiting)
        self._ids = itertools.count()
        self._id_prefix = f"{os.getpid():x}-{id(self) & 0xFFFFFF:x}"
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._token: trio.lowlevel.TrioToken | None = None
        self._main_scope: trio.CancelScope | None = None
        self._orch: Orchestrator | None = None
        self._stage_params: Sequence[StageParams] | None = None
        self._failure: BaseException | None = None
        self._stop_flag = False
        self._drain: float | None = None
        self._closing: str | None = None  # set: new requests are refused with this reason
        self._dead: str | None = None  # set: the Trio thread is gone (or abandoned)
        self._updates = UpdateForwarder()  # update_request's Trio side
        self._admitter.on_admitted = self._updates.admitted
        self._admitter.on_dropped = self._updates.dropped

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> Engine:
        """Start the thread; return once the orchestrator runs.  Raises EngineStartupError."""
        if self._thread is not None:
            raise RuntimeError("Engine.start() called twice")
        self._thread = threading.Thread(target=self._thread_main, name=self.name, daemon=True)
        self._thread.start()
        atexit.register(self.close)  # a daemon thread dies abruptly at exit: stop the pipeline first
        if not self._ready.wait(self.startup_timeout):
            self._request_stop(None)
            self._thread.join(self.close_timeout)
            self._mark_dead(f"it did not become ready within {self.startup_timeout}s")
            raise EngineStartupError(f"engine did not become ready within {self.startup_timeout}s "
                                     "(the pipeline is still starting or hung)")
        if self._failure is not None or self._dead is not None:
            self._thread.join(self.close_timeout)
            f = self._failure
            what = f"{type(f).__name__}: {f}" if f is not None else self._dead
            raise EngineStartupError(f"engine failed to start: {what}") from f
        return self

    def close(self, drain: float | None = None) -> None:
        """Stop the orchestrator and the pipeline; idempotent, bounded in time.

        ``drain``: let in-flight requests finish for up to that many seconds
        first; otherwise they get their ``shutdown`` terminal at once.
        """
        if self._closing is None:
            self._closing = "the engine was closed"
        if self._thread is None:
            self._mark_dead("the engine was closed before it started")
            return
        atexit.unregister(self.close)
        self._request_stop(drain)
        try:
            self._thread.join(self.close_timeout + (drain or 0.0))
        except RuntimeError:  # a signal interrupted start() inside Thread.start(): did it start?
            if not self._ready.wait(1.0):  # a thread that runs sees the stop flag and ends at once
                self._mark_dead("the engine was closed before its thread started")
                return
            self._thread.join(self.close_timeout)
        if self._thread.is_alive():
            log.warning("engine thread did not stop within %.1fs; abandoning it", self.close_timeout)
            self._mark_dead(f"its thread did not stop within {self.close_timeout}s")

    def join(self, timeout: float | None = None) -> bool:
        """Wait until the engine thread has exited (for any reason); False on timeout."""
        if self._thread is None:
            return True
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def __enter__(self) -> Engine:
        if self._thread is None:
            self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def running(self) -> bool:
        return self._ready.is_set() and self._closing is None and self._dead is None

    @property
    def orchestrator(self) -> Orchestrator | None:
        """The orchestrator (lives in the Trio thread: read it there, see :meth:`call_soon`)."""
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
    def thread_alive(self) -> bool:
        """The engine's Trio thread is running (False before start and once it exited)."""
        return self._thread is not None and self._thread.is_alive()

    @property
    def failure(self) -> BaseException | None:
        """What ended the Trio thread, if it crashed or could not start (None otherwise)."""
        return self._failure

    @property
    def demux(self) -> Demux:
        """The per-request streams the orchestrator's batches are routed to (introspection)."""
        return self._demux

    @property
    def open_requests(self) -> set[str]:
        """Ids of the requests whose consumer has not had the terminal yet (a snapshot)."""
        return set(self._demux.streams)

    @property
    def shedding(self) -> bool:
        """The engine shed a request and has had no room since: a new one now would be shed too.

        A hint for a front that wants to refuse cheaply under a flood (any thread);
        the admission decision itself stays with the core and the admitter.
        """
        return monotonic() < self._admitter.shedding_until

    @property
    def capacity(self) -> float:
        """At most how many requests it can hold now without shedding (``math.inf``: no bound).

        The orchestrator's capacity plus the requests that may wait for room;
        it follows the live replicas.  Read from any thread without a lock: an
        estimate for a front (:class:`~trio_orch.http.limits.Shedder`), which
        refuses a new request once as many are already on their way.
        """
        orch = self.orchestrator
        if orch is None:
            return math.inf
        return orch.capacity() + self._admitter.waiting_bound

    @property
    def retry_after(self) -> float:
        """Seconds a shed caller is told to wait."""
        return self._admitter.retry_after

    @property
    def admission_waiting(self) -> int:
        """Requests waiting for room in the request channel (readable from any thread)."""
        return self._admitter.waiting

    @property
    def closed_reason(self) -> str | None:
        """Why the engine refuses requests (None while it runs)."""
        return self._dead or self._closing

    def _request_stop(self, drain: float | None) -> None:
        self._stop_flag = True
        self._drain = drain
        self._post_quiet(self._stop_cb)

    def end_drain(self) -> None:
        """Cut a drain begun by :meth:`close` short: what is still in flight ends now (any thread)."""
        self._drain = None
        self._post_quiet(self._stop_cb)

    def _stop_cb(self) -> None:
        if self._orch is not None:
            self._orch.request_shutdown(self._drain)
        elif self._main_scope is not None:
            self._main_scope.cancel()

    def _mark_dead(self, reason: str) -> None:
        if self._dead is None:
            self._dead = reason
        if self._closing is None:
            self._closing = reason
        self._demux.sweep("shutdown", f"the engine stopped: {self._dead}")

    # ------------------------------------------------------------------ the Trio thread
    def _thread_main(self) -> None:
        reason = None
        try:
            trio.run(self._trio_main)
        except BaseException as exc:
            exc = unwrap(exc)
            self._failure = exc
            reason = f"its orchestrator thread crashed: {type(exc).__name__}: {exc}"
            if self._ready.is_set():
                log.error("engine thread crashed", exc_info=exc)
        finally:
            self._mark_dead(reason or ("the engine was closed" if self._stop_flag
                                       else "its orchestrator stopped"))
            self._updates.close(self._dead or "its orchestrator stopped")  # the Trio thread is gone
            self._ready.set()

    async def _trio_main(self) -> None:
        self._token = trio.lowlevel.current_trio_token()
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
                    nursery.start_soon(self._admitter.run, orch, name="trio_orch.engine.bridge.admitter")
                    nursery.start_soon(self._updates.run, orch, name="trio_orch.engine.bridge.updates")
                    self._orch = orch
                    self._set_ready()
                    if self._stop_flag:
                        orch.request_shutdown(self._drain)
                    await orch.wait_stopped()
                    # No more terminals can come from the orchestrator: refuse and drain now,
                    # before the pipeline's own shutdown (which may take a while).
                    if self._closing is None:
                        self._closing = "its orchestrator stopped"
                    self._demux.sweep("shutdown", f"the engine stopped: {self._closing}")
                    nursery.cancel_scope.cancel()

    def _set_ready(self) -> None:
        """The orchestrator runs and accepts requests."""
        self._ready.set()

    def _admit_cb(self, s: Stream) -> None:
        self._admitter.admit(s)

    def _abort_cb(self, s: Stream) -> None:
        """Trio thread: abort ``s`` wherever it is (waiting for admission, queued, routed)."""
        try:
            if s.state == DONE:
                return
            if s.state == PENDING:
                self._admitter.abort(s)
                return
            if self._orch is not None:
                self._orch.abort_nowait(s.request_id)
        except BaseException:
            log.exception("abort of %r failed", s.request_id)

    # ------------------------------------------------------------------ plumbing
    def _post(self, fn: Callable[..., object], *args: Any) -> None:
        token = self._token
        if token is None or self._dead is not None:
            raise EngineClosed(self._closed_message())
        try:
            token.run_sync_soon(fn, *args)
        except trio.RunFinishedError:
            raise EngineClosed(self._closed_message()) from None

    def _post_quiet(self, fn: Callable[..., object], *args: Any) -> None:
        token = self._token
        if token is not None:
            try:
                token.run_sync_soon(fn, *args)
            except trio.RunFinishedError:
                pass

    def _closed_message(self) -> str:
        if not self._ready.is_set() and self._closing is None:
            return "the engine is not started: call start() or use it as a context manager"
        return f"the engine is closed: {self._dead or self._closing}"

    def _open(self, cls: type[Stream], prompt: Any, request_id: str | None, final_stage_id: int | None,
              request_timeout: float | None, resumable: bool = False, **kw: Any) -> Stream:
        """Register a stream for a new request and post its admission to the Trio thread."""
        if self._closing is not None or self._dead is not None or self._orch is None:
            raise EngineClosed(self._closed_message())
        rid = request_id if request_id is not None else f"req-{self._id_prefix}-{next(self._ids)}"
        self._orch.router.resolve_final_stage(rid, final_stage_id)  # immutable config: thread-safe
        if request_timeout is not None and not request_timeout > 0:
            raise ValueError(f"request_timeout must be a positive number of seconds, got {request_timeout!r}")
        s = cls(rid, prompt, final_stage_id, request_timeout, resumable=bool(resumable), **kw)
        self._demux.register(s)
        if self._dead is not None or self._closing is not None:  # raced with the fatal drain
            self._demux.unregister(s)
            raise EngineClosed(self._closed_message())
        try:
            self._post(self._admit_cb, s)
        except EngineClosed:
            self._demux.unregister(s)
            raise
        return s

    def _open_async(self, prompt: Any, request_id: str | None, final_stage_id: int | None,
                    request_timeout: float | None, resumable: bool, **kw: Any) -> Any:
        """:meth:`_open` for the caller's event loop: an asyncio stream here (see InLoopEngine)."""
        return self._open(AsyncioStream, prompt, request_id, final_stage_id, request_timeout, resumable,
                          loop=asyncio.get_running_loop(), **kw)

    def client_gone(self, s: Stream) -> None:
        """A consumer (a handle, a generator) stopped listening before the terminal: abort the request."""
        if s.state != DONE:
            s.detached = True
            self._post_quiet(self._abort_cb, s)

    # ------------------------------------------------------------------ sync API
    def add_request(self, prompt: Any, *, request_id: str | None = None, final_stage_id: int | None = None,
                    timeout: float | None = None, request_timeout: float | None = None,
                    sampling: Any = None, resumable: bool = False) -> RequestHandle:
        """Submit a request from a plain thread; return its :class:`RequestHandle` once accepted.

        Blocks while the request channel is full, for at most ``timeout``
        seconds (then ``TimeoutError``; nothing was registered).
        ``request_timeout`` bounds the request's life in the orchestrator.
        ``sampling``: per-stage sampling parameters (a list indexed by stage,
        or a mapping stage -> parameters), checked against each stage's.
        ``resumable``: it takes more input (:meth:`update_request`) until a ``final`` one.
        Raises ``ValueError`` for bad parameters or a duplicate active id and
        :class:`EngineClosed` once the engine is closed.  Do not call it on an
        asyncio loop's thread (it blocks): use :meth:`generate` there.
        """
        s = self._open(SyncStream, prompt, request_id, final_stage_id, request_timeout, resumable,
                       want_ack=True, sampling=sampling)
        assert isinstance(s, SyncStream)
        h = RequestHandle(self, s)
        deadline = None if timeout is None else monotonic() + timeout
        while True:
            if deadline is None or s.withdrawn:
                item = s.q.get()
            else:
                try:
                    item = s.q.get(timeout=max(0.0, deadline - monotonic()))
                except queue.Empty:  # withdraw; the Trio thread answers ACK or WITHDRAWN
                    s.withdrawn = True
                    self._post_quiet(self._withdraw_cb, s)
                    continue
            if item is ACK:
                return h
            if item is WITHDRAWN:
                raise TimeoutError(f"request channel stayed full for {timeout}s; request not submitted")
            h.take(item)  # outputs (or the terminal) overtook the acknowledgement
            if h.ended:
                return h

    def _withdraw_cb(self, s: Stream) -> None:
        try:
            if s.state != PENDING:
                return  # already admitted or ended: the ACK/terminal is in its queue
            self._admitter.abort(s)  # s.withdrawn: it answers WITHDRAWN, not a terminal
        except BaseException:
            log.exception("withdrawal of %r failed", s.request_id)

    def generate_sync(self, prompt: Any, **kwargs: Any) -> Iterator[Message]:
        """``for out in engine.generate_sync(prompt)``: add_request + iterate; closing early aborts."""
        yield from self.add_request(prompt, **kwargs)

    def abort(self, request_id: str) -> None:
        """Abort a request from any thread, without blocking; its consumer gets ``aborted``.

        Unknown or finished id: no-op.  Raises EngineClosed once the engine is dead.
        """
        if self._dead is not None:
            raise EngineClosed(self._closed_message())
        s = self._demux.streams.get(request_id)
        if s is not None:
            self._post_quiet(self._abort_cb, s)

    def update_request(self, request_id: str, segment: Any, *, final: bool = False,
                       timeout: float | None = None) -> None:
        """One more input segment for a live resumable request (plain threads; ``final``: the last one).

        Returns once the segment was handed to the stages.  Raises
        ``ValueError`` (nothing changes) for an unknown or ended id, a request
        not added with ``resumable=True`` or after its final segment;
        :class:`EngineClosed` once the engine stopped; ``TimeoutError`` after
        ``timeout`` seconds if the update was not taken up by then (it is then
        withdrawn).  Updates of one request apply in the order of the calls.
        """
        fut = self._post_update(request_id, segment, final)
        try:
            fut.result(timeout)
        except TimeoutError:
            if fut.cancel():
                raise TimeoutError(f"update of {request_id!r} not taken up within {timeout}s; "
                                   "withdrawn") from None
            fut.result()

    async def update_request_async(self, request_id: str, segment: Any, *, final: bool = False) -> None:
        """:meth:`update_request` for asyncio code: awaited, never blocks the loop.

        Cancelled before the update was taken up, it is withdrawn; after, it still applies.
        """
        await asyncio.wrap_future(self._post_update(request_id, segment, final))

    def _post_update(self, request_id: str, segment: Any, final: bool) -> Future[None]:
        fut: Future[None] = Future()
        self._post(self._update_cb, request_id, segment, bool(final), fut)
        return fut

    def _update_cb(self, request_id: str, segment: Any, final: bool, fut: Future[None]) -> None:
        """Trio thread: hand the update to the forwarder (it answers ``fut``)."""
        try:
            self._updates.post(self._demux.streams.get(request_id), request_id, segment, final, fut)
        except BaseException as exc:  # never let a callback kill the Trio run
            log.exception("update of %r failed", request_id)
            if fut.set_running_or_notify_cancel():
                fut.set_exception(exc)

    def call_soon(self, fn: Callable[..., object], *args: Any) -> None:
        """Run ``fn(*args)`` in the Trio thread soon (any thread; never blocks).  Must not raise."""
        self._post(fn, *args)

    def run_sync_in_trio(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn(*args)`` in the Trio thread and return its result (plain threads only)."""
        if self._token is None or self._dead is not None:
            raise EngineClosed(self._closed_message())
        try:
            return trio.from_thread.run_sync(fn, *args, trio_token=self._token)
        except trio.RunFinishedError:
            raise EngineClosed(self._closed_message()) from None

    def run_in_trio(self, async_fn: Callable[..., Any], *args: Any) -> Any:
        """Await ``async_fn(*args)`` in the Trio thread and return its result (plain threads only)."""
        if self._token is None or self._dead is not None:
            raise EngineClosed(self._closed_message())
        try:
            return trio.from_thread.run(async_fn, *args, trio_token=self._token)
        except trio.RunFinishedError:
            raise EngineClosed(self._closed_message()) from None

    def control_orchestrator(self) -> Orchestrator:
        """The running orchestrator (for the control plane); EngineClosed when there is none."""
        if self._orch is None or self._dead is not None:
            raise EngineClosed(self._closed_message())
        return self._orch

    async def confirmed_abort(self, request_id: str, timeout: float | None) -> list[RpcResult]:
        """Trio thread: abort wherever the request is; wait for the stages' confirmations."""
        s = self._demux.streams.get(request_id)
        if s is not None and s.state == PENDING:  # still waiting for admission: no stage has it
            self._abort_cb(s)
            return []
        return await self.control_orchestrator().abort(request_id, timeout)

    def stats(self) -> EngineStatistics:
        """A metrics snapshot (plain threads only; use :meth:`stats_async` on an asyncio loop)."""
        try:
            return self.run_sync_in_trio(self._stats_now)
        except EngineClosed:
            return collect_stats(None, self._demux, 0, False)

    def _stats_now(self) -> EngineStatistics:
        return collect_stats(self._orch, self._demux, self._admitter.waiting, self._dead is None)

    def _timings_of(self, request_id: str) -> tuple[Any, ...]:
        return stage_timings(self._orch, request_id)

    @property
    def latency(self) -> Any:
        """The handover-latency histogram (dispatcher batch -> consumer)."""
        return self._demux.latency

    # ------------------------------------------------------------------ asyncio API
    async def generate(self, prompt: Any, *, request_id: str | None = None,
                       final_stage_id: int | None = None, request_timeout: float | None = None,
                       sampling: Any = None, resumable: bool = False,
                       companions: Mapping[str, Any] | None = None) -> AsyncIterator[Message]:
        """``async for out in engine.generate(prompt)``: the request's messages, terminal last.

        Never blocks the event loop.  Cancellation of the consuming task, or
        closing the generator before the terminal, aborts the request.
        ``sampling`` as for :meth:`add_request` (bad parameters: ValueError).
        ``companions``: ``{id: stage-0 prompt}``, as for ``Orchestrator.add_request``.
        The request is registered when the iteration starts; to send a
        resumable request's updates right away, use :meth:`add_request_async`.
        """
        batches = self.generate_batches(prompt, request_id=request_id, final_stage_id=final_stage_id,
                                        request_timeout=request_timeout, sampling=sampling,
                                        resumable=resumable, companions=companions)
        async with aclosing(batches):  # leaving early closes it now: the request is aborted at once
            async for msgs in batches:
                for m in msgs:
                    yield m

    async def generate_batches(self, prompt: Any, *, request_id: str | None = None,
                               final_stage_id: int | None = None, request_timeout: float | None = None,
                               sampling: Any = None, resumable: bool = False,
                               companions: Mapping[str, Any] | None = None) -> AsyncIterator[list[Message]]:
        """Like :meth:`generate`, but one list of messages per wake-up (per dispatcher batch).

        For consumers that write in bulk (one HTTP chunk per batch) or count
        every microsecond; the terminal is the last message of the last list.
        """
        s = self._open_async(prompt, request_id, final_stage_id, request_timeout, resumable,
                             sampling=sampling, companions=dict(companions) if companions else None)
        observe = self._demux.latency.observe
        ended = False
        try:
            while not ended:
                item = await s.next_item()
                if isinstance(item, BaseException):
                    ended = True
                    raise item
                t, msgs = item
                observe_latency(observe, t, msgs)
                ended = msgs[-1].finished
                yield msgs
        finally:
            if not ended:
                self.client_gone(s)

    async def add_request_async(self, prompt: Any, *, request_id: str | None = None,
                                final_stage_id: int | None = None, request_timeout: float | None = None,
                                resumable: bool = False, sampling: Any = None,
                                want_timings: bool = False) -> AsyncRequestHandle:
        """Submit a request from asyncio code; return its :class:`AsyncRequestHandle` once accepted.

        Waits (without blocking the loop) while the request channel is full,
        within the engine's admission bounds.  Once it returns the orchestrator
        knows the request, so updates of a resumable one may follow at once --
        and nothing has been sent to the caller's client yet, so an HTTP front
        can still answer with a status code: :class:`Overloaded` when the
        request was shed, ``handle.rejection`` when the engine refused it (a
        stage of its path has no live replica; it is stopping).  Raises as
        :meth:`add_request` otherwise; cancelled while waiting, the request is
        aborted (or never registered).  ``want_timings``: ``handle.timings``
        holds each stage's timing once the terminal was taken.
        """
        s = self._open_async(prompt, request_id, final_stage_id, request_timeout, resumable,
                             want_ack=True, sampling=sampling, want_timings=want_timings)
        handle = AsyncRequestHandle(self, s)
        try:
            await handle.wait_accepted()
        except BaseException:
            handle.close()
            raise
        return handle

    async def stats_async(self, timeout: float = 5.0) -> EngineStatistics:
        """A metrics snapshot, awaited on an asyncio loop without blocking it."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[EngineStatistics] = loop.create_future()

        def settle(value: Any, exc: BaseException | None) -> None:
            if not fut.done():
                fut.set_exception(exc) if exc is not None else fut.set_result(value)

        def collect() -> None:
            try:
                value, exc = self._stats_now(), None
            except BaseException as e:
                value, exc = None, e
            try:
                loop.call_soon_threadsafe(settle, value, exc)
            except RuntimeError:
                pass

        try:
            self._post(collect)
            return await asyncio.wait_for(fut, timeout)
        except (EngineClosed, TimeoutError):
            return collect_stats(None, self._demux, 0, False)
