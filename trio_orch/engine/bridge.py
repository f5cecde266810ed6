"""The thread adapter: the engine in a background Trio run, used from plain threads and asyncio.

:class:`ThreadEngine` runs ``trio.run`` in a daemon thread that hosts one
:class:`~trio_orch.engine.trio_engine.TrioEngine` -- the engine, with its
admission, streams, update forwarding, metrics and control plane.  The
adapter adds only what a caller outside that run needs: the thread's
lifecycle (``start``/``close``/``with``), and the waiting forms of the
engine's calls -- blocking ones for plain threads (``add_request``,
``update_request``, ``stats``, the control plane's ``sleep()``...) and
asyncio ones that never block the loop (``generate``, ``add_request_async``,
``update_request_async``, ``stats_async``, ``sleep_async()``...).  Inbound
calls are posted to the engine's run through its Trio token; outbound, each
dispatcher batch wakes an asyncio loop once (``call_soon_threadsafe``) and a
plain thread through its queue.  Its asyncio forms satisfy the engine's
seam (:class:`~trio_orch.engine.api.EngineClient`: what ``serve --loop
asyncio`` serves the HTTP app over).  What is no more than the engine's --
its state, the calls that only post to its run, the control plane's two
forms -- is derived from the engine by name (:mod:`trio_orch.engine.derived`),
not written again.

Fatal drain: whatever ends the Trio thread (``close()``, a crash, a pipeline
that cannot start), every registered request gets a terminal
``OrchError(kind="shutdown")`` and every later call raises
:class:`EngineClosed` at once.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import queue
import threading
from collections.abc import AsyncGenerator, AsyncIterator, Iterator, Mapping, Sequence
from functools import partial
from time import monotonic
from typing import Any, Protocol, runtime_checkable

import trio

from trio_orch.engine.api import EngineClosed, EngineStartupError, EngineStatistics
from trio_orch.engine.base import PipelineFactory, collect_stats, unwrap
from trio_orch.engine.demux import ACK, WITHDRAWN, AsyncioStream, Demux, Stream, SyncStream
from trio_orch.engine.derived import blocking, on_asyncio, passthrough
from trio_orch.engine.handles import (
    AsyncRequestHandle,
    RequestHandle,
    messages,
    open_accepted,
    stream_batches,
)
from trio_orch.engine.trio_engine import TrioEngine
from trio_orch.types import Message

__all__ = ["HostedEngine", "ThreadEngine"]

log = logging.getLogger("trio_orch.engine.bridge")


@runtime_checkable
class HostedEngine(Protocol):
    """What the adapter needs of the engine it hosts, beyond the engine's seam (``EngineClient``).

    :class:`~trio_orch.engine.trio_engine.TrioEngine` has it, and so has an
    API-server process's :class:`~trio_orch.serve.fronts.remote.RemoteEngine`
    (``serve --api-server-count N --loop asyncio``): its run (``run``, ended
    by ``request_stop``), a stream registry fed from its run (``open``, into
    its ``demux``), and its run's token (``call_soon``, ``run_in_trio``).
    """

    async def run(self, *, task_status: Any = ...) -> None: ...
    def request_stop(self, drain: float | None = None) -> None: ...
    def mark_dead(self, reason: str) -> None: ...
    @property
    def running(self) -> bool: ...
    @property
    def closed_reason(self) -> str | None: ...
    @property
    def failure(self) -> BaseException | None: ...
    @property
    def demux(self) -> Demux: ...
    def open(self, cls: type[Any], prompt: Any, request_id: str | None = None,
             final_stage_id: int | None = None, request_timeout: float | None = None,
             resumable: bool = False, **kw: Any) -> Any: ...
    def abort(self, request_id: str) -> None: ...
    def client_gone(self, s: Stream) -> None: ...
    def withdraw(self, s: Stream) -> None: ...
    def post_update(self, request_id: str, segment: Any, final: bool = False) -> Any: ...
    def stats(self) -> EngineStatistics: ...
    async def stats_async(self, timeout: float = 5.0) -> EngineStatistics: ...
    def control_orchestrator(self) -> object: ...
    def call_soon(self, fn: Any, *args: Any) -> None: ...
    def run_in_trio(self, async_fn: Any, *args: Any) -> Any: ...


class ThreadEngine:
    """The engine in a background Trio thread; see the module docstring.

    ``pipeline`` and the admission and orchestrator options are
    :class:`~trio_orch.engine.trio_engine.TrioEngine`'s (``engine`` is that
    engine); :meth:`hosting` hosts an engine built elsewhere instead.
    ``startup_timeout`` bounds :meth:`start`; ``close_timeout`` bounds
    :meth:`close` (beyond any drain).
    """

    def __init__(self, pipeline: PipelineFactory, *, startup_timeout: float = 60.0,
                 close_timeout: float = 10.0, request_queue_size: int = 256,
                 shutdown_grace: float = 2.0, request_timeout: float | None = None,
                 admission_timeout: float | None = None, max_waiting: int | None = None,
                 max_inflight: Sequence[int | None] | None = None, max_running: int | None = None,
                 name: str = "trio-orch-engine") -> None:
        self._host(TrioEngine(pipeline, request_queue_size=request_queue_size,
                              shutdown_grace=shutdown_grace, request_timeout=request_timeout,
                              admission_timeout=admission_timeout, max_waiting=max_waiting,
                              max_inflight=max_inflight, max_running=max_running),
                   startup_timeout, close_timeout, name)

    @classmethod
    def hosting(cls, engine: HostedEngine, *, startup_timeout: float = 60.0, close_timeout: float = 10.0,
                name: str = "trio-orch-engine") -> ThreadEngine:
        """The adapter around ``engine``, built elsewhere (an API-server process's remote engine): its
        ``run`` goes in the adapter's Trio thread, as the engine's own does."""
        self = cls.__new__(cls)
        self._host(engine, startup_timeout, close_timeout, name)
        return self

    def _host(self, engine: HostedEngine, startup_timeout: float, close_timeout: float, name: str) -> None:
        #: the engine this adapter hosts (lives in the Trio thread)
        self.engine: Any = engine
        self.startup_timeout = startup_timeout
        self.close_timeout = close_timeout
        self.name = name
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()  # the engine runs, or the thread ended
        self._failure: BaseException | None = None

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> ThreadEngine:
        """Start the thread; return once the orchestrator runs.  Raises EngineStartupError."""
        if self._thread is not None:
            raise RuntimeError("ThreadEngine.start() called twice")
        self._thread = threading.Thread(target=self._thread_main, name=self.name, daemon=True)
        self._thread.start()
        atexit.register(self.close)  # a daemon thread dies abruptly at exit: stop the pipeline first
        if not self._ready.wait(self.startup_timeout):
            self.engine.request_stop()
            self._thread.join(self.close_timeout)
            self.engine.mark_dead(f"it did not become ready within {self.startup_timeout}s")
            raise EngineStartupError(f"engine did not become ready within {self.startup_timeout}s "
                                     "(the pipeline is still starting or hung)")
        if self.failure is not None or not self.engine.running:
            self._thread.join(self.close_timeout)
            f = self.failure
            what = f"{type(f).__name__}: {f}" if f is not None else self.engine.closed_reason
            raise EngineStartupError(f"engine failed to start: {what}") from f
        return self

    def close(self, drain: float | None = None) -> None:
        """Stop the orchestrator and the pipeline; idempotent, bounded in time.

        ``drain``: let in-flight requests finish for up to that many seconds
        first; otherwise they get their ``shutdown`` terminal at once.
        """
        if self._thread is None:
            self.engine.request_stop()
            self.engine.mark_dead("the engine was closed before it started")
            return
        atexit.unregister(self.close)
        self.engine.request_stop(drain)
        try:
            self._thread.join(self.close_timeout + (drain or 0.0))
        except RuntimeError:  # a signal interrupted start() inside Thread.start(): did it start?
            if not self._ready.wait(1.0):  # a thread that runs sees the stop flag and ends at once
                self.engine.mark_dead("the engine was closed before its thread started")
                return
            self._thread.join(self.close_timeout)
        if self._thread.is_alive():
            log.warning("engine thread did not stop within %.1fs; abandoning it", self.close_timeout)
            self.engine.mark_dead(f"its thread did not stop within {self.close_timeout}s")

    def join(self, timeout: float | None = None) -> bool:
        """Wait until the engine thread has exited (for any reason); False on timeout."""
        if self._thread is None:
            return True
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def __enter__(self) -> ThreadEngine:
        if self._thread is None:
            self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _thread_main(self) -> None:
        reason = None
        try:
            trio.run(self._trio_main)
        except BaseException as exc:
            inner = unwrap(exc)
            if isinstance(inner, EngineStartupError) and inner.__cause__ is not None:
                inner = inner.__cause__
            self._failure = inner
            reason = f"its orchestrator thread crashed: {type(inner).__name__}: {inner}"
        finally:
            self.engine.mark_dead(reason or "its orchestrator stopped")
            self._ready.set()

    async def _trio_main(self) -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(self.engine.run)
            self._ready.set()

    # ------------------------------------------------------------------ the adapter's own state
    @property
    def running(self) -> bool:
        """The engine accepts requests (and this adapter saw it start)."""
        return self._ready.is_set() and self.engine.running

    @property
    def thread_alive(self) -> bool:
        """The engine's Trio thread is running (False before start and once it exited)."""
        return self._thread is not None and self._thread.is_alive()

    @property
    def failure(self) -> BaseException | None:
        """What ended the Trio thread, if it crashed or could not start (None otherwise)."""
        return self._failure or self.engine.failure

    # ------------------------------------------------------------------ the engine's, as they are
    # (state safe to read from any thread, and calls that post to the engine's run)
    closed_reason = passthrough(TrioEngine.closed_reason)
    paused = passthrough(TrioEngine.paused)
    shedding = passthrough(TrioEngine.shedding)
    capacity = passthrough(TrioEngine.capacity)
    retry_after = passthrough(TrioEngine.retry_after)
    admission_waiting = passthrough(TrioEngine.admission_waiting)
    final_stage_ids = passthrough(TrioEngine.final_stage_ids)
    stage_params = passthrough(TrioEngine.stage_params)
    stage_kinds = passthrough(TrioEngine.stage_kinds)
    stage_info = passthrough(TrioEngine.stage_info)
    orchestrator = passthrough(TrioEngine.orchestrator)
    stages = passthrough(TrioEngine.stages)
    demux = passthrough(TrioEngine.demux)
    latency = passthrough(TrioEngine.latency)
    open_requests = passthrough(TrioEngine.open_requests)
    abort = passthrough(TrioEngine.abort)
    client_gone = passthrough(TrioEngine.client_gone)
    end_drain = passthrough(TrioEngine.end_drain)
    call_soon = passthrough(TrioEngine.call_soon)
    run_sync_in_trio = passthrough(TrioEngine.run_sync_in_trio)
    run_in_trio = passthrough(TrioEngine.run_in_trio)
    control_orchestrator = passthrough(TrioEngine.control_orchestrator)

    # ------------------------------------------------------------------ plain threads
    def add_request(self, prompt: Any, *, request_id: str | None = None, final_stage_id: int | None = None,
                    timeout: float | None = None, request_timeout: float | None = None,
                    sampling: Any = None, resumable: bool = False, priority: int = 0) -> RequestHandle:
        """Submit a request from a plain thread; return its :class:`RequestHandle` once accepted.

        Blocks while the request channel is full, for at most ``timeout``
        seconds (then ``TimeoutError``; nothing was registered), and within
        the engine's admission bounds (past them: :class:`Overloaded`).
        ``request_timeout`` bounds the request's life in the orchestrator.
        ``sampling``: per-stage sampling parameters (a list indexed by stage,
        or a mapping stage -> parameters), checked against each stage's.
        ``resumable``: it takes more input (:meth:`update_request`) until a ``final`` one.
        ``priority``: an int, lower values served first (default 0).
        Raises ``ValueError`` for bad parameters or a duplicate active id and
        :class:`EngineClosed` once the engine is closed.  Do not call it on an
        asyncio loop's thread (it blocks): use :meth:`generate` there.
        """
        s = self.engine.open(SyncStream, prompt, request_id, final_stage_id, request_timeout, resumable,
                             want_ack=True, sampling=sampling, priority=priority)
        h = RequestHandle(self, s)
        deadline = None if timeout is None else monotonic() + timeout
        while True:
            if deadline is None or s.withdrawn:
                item = s.q.get()
            else:
                try:
                    item = s.q.get(timeout=max(0.0, deadline - monotonic()))
                except queue.Empty:  # withdraw; the engine answers ACK or WITHDRAWN
                    self.engine.withdraw(s)
                    continue
            if item is ACK:
                return h
            if item is WITHDRAWN:
                raise TimeoutError(f"request channel stayed full for {timeout}s; request not submitted")
            h.take(item)  # outputs (or the terminal) overtook the acknowledgement
            if h.ended:
                return h

    def generate_sync(self, prompt: Any, **kwargs: Any) -> Iterator[Message]:
        """``for out in engine.generate_sync(prompt)``: add_request + iterate; closing early aborts."""
        yield from self.add_request(prompt, **kwargs)

    def update_request(self, request_id: str, segment: Any, *, final: bool = False,
                       timeout: float | None = None) -> None:
        """:meth:`TrioEngine.update_request_async` for plain threads.

        ``TimeoutError`` after ``timeout`` seconds if the update was not taken
        up by then (it is then withdrawn).  Updates of one request apply in
        the order of the calls.
        """
        fut = self.engine.post_update(request_id, segment, final)
        try:
            fut.result(timeout)
        except TimeoutError:
            if fut.cancel():
                raise TimeoutError(f"update of {request_id!r} not taken up within {timeout}s; "
                                   "withdrawn") from None
            fut.result()

    def stats(self) -> EngineStatistics:
        """A metrics snapshot (plain threads only; use :meth:`stats_async` on an asyncio loop)."""
        return self.engine.stats()

    # the control plane (written once on the engine), blocking
    collective_rpc = blocking(TrioEngine.collective_rpc_async)
    abort_confirmed = blocking(TrioEngine.abort_confirmed_async)
    pause = blocking(TrioEngine.pause_async)
    resume = blocking(TrioEngine.resume_async)
    sleep = blocking(TrioEngine.sleep_async)
    wake_up = blocking(TrioEngine.wake_up_async)
    update_weights = blocking(TrioEngine.update_weights_async)
    start_profile = blocking(TrioEngine.start_profile_async)
    stop_profile = blocking(TrioEngine.stop_profile_async)

    # ------------------------------------------------------------------ asyncio
    def _open_here(self, prompt: Any, *args: Any, **kw: Any) -> AsyncioStream:
        return self.engine.open(AsyncioStream, prompt, *args, loop=asyncio.get_running_loop(), **kw)

    def generate_batches(self, prompt: Any, *, request_id: str | None = None,
                         final_stage_id: int | None = None, request_timeout: float | None = None,
                         sampling: Any = None, resumable: bool = False,
                         companions: Mapping[str, Any] | None = None,
                         priority: int = 0) -> AsyncGenerator[list[Message], None]:
        """:meth:`TrioEngine.generate_batches` for asyncio code: never blocks the event loop.

        For consumers that write in bulk (one HTTP chunk per batch); cancelling
        the consuming task, or closing the generator early, aborts the request.
        """
        return stream_batches(self.engine, partial(self._open_here, prompt, request_id, final_stage_id,
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
        """:meth:`TrioEngine.add_request_async` for asyncio code (waits without blocking the loop)."""
        return await open_accepted(self, self._open_here(prompt, request_id, final_stage_id, request_timeout,
                                                         resumable, want_ack=True, sampling=sampling,
                                                         want_timings=want_timings, priority=priority))

    async def update_request_async(self, request_id: str, segment: Any, *, final: bool = False) -> None:
        """:meth:`TrioEngine.update_request_async` for asyncio code: awaited, never blocks the loop.

        Cancelled before the update was taken up, it is withdrawn; after, it still applies.
        """
        await asyncio.wrap_future(self.engine.post_update(request_id, segment, final))

    async def stats_async(self, timeout: float = 5.0) -> EngineStatistics:
        """A metrics snapshot, awaited on an asyncio loop without blocking it (nor an executor thread):
        the engine's ``stats_async`` runs as a task of its Trio run."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[EngineStatistics] = loop.create_future()

        def settle(value: Any, exc: BaseException | None) -> None:
            if not fut.done():
                fut.set_exception(exc) if exc is not None else fut.set_result(value)

        async def collect() -> None:  # in the Trio thread
            try:
                with trio.fail_after(timeout):
                    value, exc = await self.engine.stats_async(timeout), None
            except BaseException as e:  # a system task must not raise
                value, exc = None, e
            try:
                loop.call_soon_threadsafe(settle, value, exc)
            except RuntimeError:
                pass

        try:
            self.engine.call_soon(trio.lowlevel.spawn_system_task, collect)
            return await asyncio.wait_for(fut, timeout)
        except (EngineClosed, TimeoutError, trio.TooSlowError):
            return collect_stats(None, self.engine.demux, 0, False)

    # the control plane, for asyncio
    collective_rpc_async = on_asyncio(TrioEngine.collective_rpc_async)
    abort_confirmed_async = on_asyncio(TrioEngine.abort_confirmed_async)
    pause_async = on_asyncio(TrioEngine.pause_async)
    resume_async = on_asyncio(TrioEngine.resume_async)
    sleep_async = on_asyncio(TrioEngine.sleep_async)
    wake_up_async = on_asyncio(TrioEngine.wake_up_async)
    update_weights_async = on_asyncio(TrioEngine.update_weights_async)
    start_profile_async = on_asyncio(TrioEngine.start_profile_async)
    stop_profile_async = on_asyncio(TrioEngine.stop_profile_async)

