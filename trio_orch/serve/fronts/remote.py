"""The front's side: :class:`RemoteEngine`, the engine's seam over the socket to the head.

An API-server process serves the same HTTP app as a single-process
``serve``; the app calls :class:`~trio_orch.engine.api.EngineClient`, and
here every call crosses to the head (:mod:`.host`), which decides it.  The
state properties (running, shedding, capacity, ...) read the head's last
:class:`~.wire.State`, pushed when it changes, so a front never waits to
read them; the pipeline's description comes once, in the head's
:class:`~.wire.Welcome`.  A request's messages arrive as the head's batches
and are handed to the task that reads them through a Trio memory channel;
leaving a request before its terminal tells the head, which aborts it.

It runs in the front's Trio run (``serve --loop trio``): start
:meth:`RemoteEngine.run` with ``nursery.start``; it returns from ``start``
once the head welcomed it.  With ``--loop asyncio`` the thread adapter
(:class:`~trio_orch.engine.ThreadEngine`, :meth:`~trio_orch.engine.ThreadEngine.hosting`)
runs it in a Trio thread, as it runs the engine itself in a single-process
``serve``: for that it has what the adapter needs of a hosted engine
(:class:`~trio_orch.engine.bridge.HostedEngine`) -- its run's token
(:meth:`call_soon`, :meth:`run_in_trio`), :meth:`request_stop`, and
:meth:`open`, which registers a stream of the adapter's (an asyncio one) in
this engine's own :class:`~trio_orch.engine.demux.Demux`, so the head's
batches reach the asyncio loop as a local engine's outputs do.
"""

from __future__ import annotations

import itertools
import math
import os
import threading
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping, Sequence
from concurrent.futures import Future
from typing import Any, TypeVar

import trio
import zmq

from stages.auth import Security
from stages.sampling_params import StageParams
from trio_orch.engine.api import (
    ControlError,
    EngineClosed,
    EngineStatistics,
    Overloaded,
    StageIds,
)
from trio_orch.engine.base import collect_stats
from trio_orch.engine.demux import ACK, ADMITTED, DONE, WITHDRAWN, Demux, Stream
from trio_orch.engine.handles import messages
from trio_orch.http.metrics import ExtraCounters, FrontMetrics
from trio_orch.serve.fronts.host import TIMINGS
from trio_orch.serve.fronts.wire import (
    Abort,
    Accepted,
    Add,
    Batch,
    Call,
    Count,
    Counted,
    Ended,
    Hello,
    Link,
    Refused,
    Reply,
    State,
    ToFront,
    Update,
    Welcome,
    from_wire,
    pack,
    unpack,
)
from trio_orch.types import Message, OrchError, RpcResult

__all__ = ["RemoteEngine", "RemoteRequest"]

S = TypeVar("S", bound=Stream)


class RemoteRequest:
    """One request a front added, read from the head's batches (satisfies ``AcceptedRequest``)."""

    def __init__(self, engine: RemoteEngine, request_id: str, t_open: float) -> None:
        self._engine = engine
        self._request_id = request_id
        self._t_open = t_open
        self._send, self._recv = trio.open_memory_channel[list[Message] | BaseException](math.inf)
        self._pending: list[Message] = []
        self._ended = False  # the terminal (or an error) arrived
        self.finished = False  # the caller took the terminal
        self.rejection: OrchError | None = None
        self._timings: tuple[Any, ...] | None = None

    @property
    def request_id(self) -> str:
        return self._request_id

    @property
    def t_open(self) -> float:
        return self._t_open

    @property
    def timings(self) -> tuple[Any, ...] | None:
        return self._timings

    def put(self, item: list[Message] | BaseException, timings: tuple[Any, ...] | None = None) -> None:
        """What the head sent for it (the owner task, never blocking)."""
        if timings is not None:
            self._timings = timings
        self._send.send_nowait(item)

    async def _next_batch(self) -> list[Message]:
        item = await self._recv.receive()
        if isinstance(item, BaseException):
            self._ended = self.finished = True
            raise item
        if item and item[-1].finished:
            self._ended = True
        return item

    async def batches(self) -> AsyncGenerator[list[Message], None]:
        """The messages, one list per head batch, the terminal last; leaving early aborts."""
        try:
            if self._pending:
                batch, self._pending = self._pending, []
                self.finished = batch[-1].finished
                yield batch
            while not self.finished:
                batch = await self._next_batch()
                self.finished = batch[-1].finished
                yield batch
        finally:
            self.close()

    def __aiter__(self) -> AsyncIterator[Message]:
        return self._messages()

    async def _messages(self) -> AsyncIterator[Message]:
        async for batch in self.batches():
            for m in batch:
                yield m

    async def update(self, segment: Any, *, final: bool = False) -> None:
        await self._engine.update_request_async(self._request_id, segment, final=final)

    def abort(self) -> None:
        self._engine.abort(self._request_id)

    def close(self) -> None:
        """Stop listening; the head aborts the request if it has not ended."""
        if not self._ended:
            self._ended = self.finished = True
            self._engine.left(self._request_id)
        self._engine.forget(self._request_id)

    async def __aenter__(self) -> RemoteRequest:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()


class _Waiter:
    """A caller waiting for the head's answer to one call."""

    __slots__ = ("answer", "event", "t_open")

    def __init__(self) -> None:
        self.event = trio.Event()
        self.answer: Any = None
        self.t_open = time.perf_counter()


class RemoteEngine:
    """The engine's seam over the head's socket at ``address`` (see the module docstring).

    ``security``: the front's credentials (its launch ticket) for the slot's
    ipc socket; ``name`` names the front in its errors.
    """

    def __init__(self, ctx: zmq.Context, address: str, security: Security | None = None, *,
                 name: str = "front") -> None:
        self.name = name
        self.address = address
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.linger = 0
        if security is not None:
            security.control_client(self.sock, address)
        self._link = Link(self.sock, ToFront, self._on_message)
        self._calls = itertools.count(1)
        self._waiting: dict[int, _Waiter] = {}
        self._requests: dict[str, RemoteRequest] = {}
        self._welcome: Welcome | None = None
        self._state = State(False, "not connected to the head yet", None, False, 0.0, 1.0)
        self._stage_params: list[StageParams] | None = None
        self._welcomed = trio.Event()
        self._lost: str | None = None
        self._demux = Demux()  # the streams of a hosting adapter (open), by the head's request id
        self._opening: dict[int, Stream] = {}  # call -> a stream whose Add the head has not answered yet
        self._token: trio.lowlevel.TrioToken | None = None
        self._run_thread: int | None = None
        self._scope: trio.CancelScope | None = None
        self._nursery: trio.Nursery | None = None
        self._stop = False
        #: this front's HTTP counters, handed to the head when it asks (it sums them for ``/metrics``)
        self.front: FrontMetrics | None = None
        #: requests each front added, as the head counted them at its last answer (``/metrics`` shows them)
        self.front_requests: list[int] = []

    def counters(self) -> ExtraCounters:
        """The head's per-front request counts, in ``/metrics``' extra-counters shape."""
        return {"trio_orch_api_server_requests": (
            "requests each API-server process added to the engine, as the head counted them",
            {(("front", str(i)),): n for i, n in enumerate(self.front_requests)})}

    # ------------------------------------------------------------------ the run
    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Connect, say hello, serve the socket until cancelled (or :meth:`request_stop`); ``started``
        once the head welcomed us."""
        self._token = trio.lowlevel.current_trio_token()
        self._run_thread = threading.get_ident()
        self.sock.connect(self.address)
        try:
            with trio.CancelScope() as self._scope:
                if self._stop:
                    self._scope.cancel()
                async with trio.open_nursery() as nursery:
                    self._nursery = nursery
                    nursery.start_soon(self._link.run)
                    self._link.send(Hello(os.getpid()))
                    await self._welcomed.wait()
                    task_status.started()
        finally:
            self.mark_dead(f"{self.name}: its connection to the head closed")
            self.sock.close(linger=0)

    def _on_message(self, msg: Any) -> None:
        if isinstance(msg, Count):
            self._link.send(Counted(msg.call, pack(self.front.counts() if self.front is not None else None)))
        elif isinstance(msg, Batch):
            r = self._requests.get(msg.request_id)
            if r is not None:
                r.put([from_wire(m) for m in msg.msgs], unpack(msg.timings, TIMINGS) if msg.timings else None)
                return
            s = self._demux.streams.get(msg.request_id)
            if s is not None:
                if msg.timings:
                    s.timings = unpack(msg.timings, TIMINGS)
                self._demux.sink([from_wire(m) for m in msg.msgs])  # type: ignore[misc]
        elif isinstance(msg, State):
            self._state = msg
        elif isinstance(msg, (Accepted, Refused)) and msg.call in self._opening:
            self._opened(self._opening.pop(msg.call), msg)
        elif isinstance(msg, Accepted):
            w = self._waiting.pop(msg.call, None)
            if w is None:  # its caller left meanwhile: the head must not keep it
                self._link.send(Abort(msg.request_id, gone=True))
                return
            r = RemoteRequest(self, msg.request_id, w.t_open)
            if msg.rejection is not None:
                r.rejection = from_wire(msg.rejection)  # type: ignore[assignment]
                r._pending = [r.rejection]  # type: ignore[list-item]
                r._ended = True
            else:
                self._requests[msg.request_id] = r
            w.answer = r
            w.event.set()
        elif isinstance(msg, (Reply, Refused)):
            if isinstance(msg, Reply) and msg.fronts:
                self.front_requests = list(msg.fronts)
            w = self._waiting.pop(msg.call, None)
            if w is not None:
                w.answer = msg
                w.event.set()
        elif isinstance(msg, Ended):
            r = self._requests.pop(msg.request_id, None)
            if r is not None:
                r.put(EngineClosed(msg.message))
            s = self._demux.streams.get(msg.request_id)
            if s is not None:
                self._demux.fail(s, EngineClosed(msg.message))
        elif isinstance(msg, Welcome):
            self._welcome = msg
            self._state = msg.state
            self._stage_params = unpack(msg.stage_params, list[StageParams] | None)
            self._welcomed.set()

    def _fail_all(self, exc: EngineClosed) -> None:
        for r in self._requests.values():
            r.put(exc)
        self._requests.clear()
        opening, self._opening = self._opening, {}
        for s in opening.values():
            self._demux.fail(s, exc)
        self._demux.sweep("shutdown", f"the engine stopped: {exc}")
        for w in self._waiting.values():
            w.answer = Refused(0, "closed", str(exc))
            w.event.set()
        self._waiting.clear()

    async def _ask(self, make: Any) -> Any:
        """Send ``make(call)`` and wait for the head's answer (raised again here when it refused)."""
        if self._lost is not None:
            raise EngineClosed(self._lost)
        call = next(self._calls)
        w = _Waiter()
        self._waiting[call] = w
        try:
            self._link.send(make(call))
            await w.event.wait()
        finally:
            self._waiting.pop(call, None)  # cancelled: an answer that comes later is dropped (or aborted)
        if isinstance(w.answer, Refused):
            raise _error(w.answer)
        return w.answer

    async def _call(self, method: str, kind: Any, **kwargs: Any) -> Any:
        reply: Reply = await self._ask(lambda call: Call(call, method, kwargs))
        return unpack(reply.result, kind) if reply.result else None

    # ------------------------------------------------------------------ hosted by the thread adapter
    def request_stop(self, drain: float | None = None) -> None:
        """End :meth:`run` (any thread): the front drains its HTTP side itself, so ``drain`` is not used."""
        self._stop = True
        if self._scope is not None:
            self._post_quiet(self._scope.cancel)

    def mark_dead(self, reason: str) -> None:
        """Refuse everything from now on; every open request ends (the first reason given stays)."""
        if self._lost is None:
            self._lost = reason
        self._fail_all(EngineClosed(self._lost))

    @property
    def failure(self) -> BaseException | None:
        """Nothing crashes here that the run does not raise itself."""
        return None

    @property
    def demux(self) -> Demux:
        """The streams of a hosting adapter, and their dispatch latency."""
        return self._demux

    def control_orchestrator(self) -> None:
        """EngineClosed at once when the head's connection is gone (the control plane's first check)."""
        if self._lost is not None:
            raise EngineClosed(self._lost)

    def call_soon(self, fn: Callable[..., object], *args: Any) -> None:
        """Run ``fn(*args)`` in this engine's run soon (any thread; never blocks)."""
        if self._token is None or self._lost is not None:
            raise EngineClosed(self._lost or f"{self.name}: not connected to the head yet")
        try:
            self._token.run_sync_soon(fn, *args)
        except trio.RunFinishedError:
            raise EngineClosed(f"{self.name}: its run has ended") from None

    def run_in_trio(self, async_fn: Callable[..., Any], *args: Any) -> Any:
        """Await ``async_fn(*args)`` in this engine's run and return its result (plain threads only)."""
        if self._token is None or self._lost is not None:
            raise EngineClosed(self._lost or f"{self.name}: not connected to the head yet")
        try:
            return trio.from_thread.run(async_fn, *args, trio_token=self._token)
        except trio.RunFinishedError:
            raise EngineClosed(f"{self.name}: its run has ended") from None

    def _post_quiet(self, fn: Callable[..., object], *args: Any) -> None:
        """Run ``fn(*args)`` in the run: now when called there, else posted; silent when the run is gone."""
        if threading.get_ident() == self._run_thread:
            fn(*args)
            return
        if self._token is not None:
            try:
                self._token.run_sync_soon(fn, *args)
            except trio.RunFinishedError:
                pass

    def open(self, cls: type[S], prompt: Any, request_id: str | None = None,
             final_stage_id: int | None = None, request_timeout: float | None = None,
             resumable: bool = False, **kw: Any) -> S:
        """A ``cls`` stream for a new request, added in the head (any thread); see
        :meth:`TrioEngine.open <trio_orch.engine.trio_engine.TrioEngine.open>`.  Its id is the head's: it
        is registered under it once the head accepted the request."""
        if kw.pop("companions", None):
            raise ValueError("companion requests are not served through an API-server process")
        if self._lost is not None:
            raise EngineClosed(self._lost)
        s = cls(request_id or "", prompt, final_stage_id, request_timeout, resumable=bool(resumable), **kw)
        self.call_soon(self._open_cb, s)
        return s

    def _open_cb(self, s: Stream) -> None:
        if self._lost is not None:
            self._demux.fail(s, EngineClosed(self._lost))
            return
        call = next(self._calls)
        self._opening[call] = s
        self._link.send(Add(call, s.prompt, s.request_id or None, s.final_stage_id, s.timeout, s.resumable,
                            s.sampling, s.want_timings, s.priority))

    def _opened(self, s: Stream, answer: Accepted | Refused) -> None:
        """The head's answer to ``s``'s Add: registered (then the ACK, or its rejection), or refused."""
        if isinstance(answer, Refused):
            self._demux.fail(s, _error(answer))
            return
        if answer.rejection is None and (s.detached or s.withdrawn):  # its caller left meanwhile
            self._link.send(Abort(answer.request_id, gone=True))
            s.state = DONE
            return
        s.request_id = answer.request_id
        self._demux.register(s)  # the head's ids are unique
        s.state = ADMITTED
        if answer.rejection is not None:
            self._demux.end(s, from_wire(answer.rejection))  # type: ignore[arg-type]
        elif s.want_ack:
            self._demux.put(s, ACK)

    def client_gone(self, s: Stream) -> None:
        """A stream's consumer left before its terminal (any thread): the head aborts the request."""
        if s.state != DONE:
            s.detached = True
            self._post_quiet(self._gone_cb, s)

    def _gone_cb(self, s: Stream) -> None:
        if s.state == ADMITTED and self._lost is None:  # else the head's answer to its Add aborts it
            self._link.send(Abort(s.request_id, gone=True))

    def withdraw(self, s: Stream) -> None:
        """A plain thread gave up waiting for ``s``'s admission: WITHDRAWN, or the ACK if it came first."""
        s.withdrawn = True
        self._post_quiet(self._withdraw_cb, s)

    def _withdraw_cb(self, s: Stream) -> None:
        if s.state != DONE and s.state != ADMITTED:  # still waiting for the head's answer (which aborts it)
            self._demux.put(s, WITHDRAWN)

    def post_update(self, request_id: str, segment: Any, final: bool = False) -> Future[None]:
        """:meth:`update_request_async` from another thread, answered through the future."""
        fut: Future[None] = Future()

        async def update() -> None:
            if not fut.set_running_or_notify_cancel():
                return  # withdrawn before it was taken up
            try:
                await self.update_request_async(request_id, segment, final=final)
            except BaseException as exc:
                fut.set_exception(exc)
            else:
                fut.set_result(None)

        def spawn() -> None:
            if self._nursery is None or self._lost is not None:
                if fut.set_running_or_notify_cancel():
                    fut.set_exception(EngineClosed(self._lost or f"{self.name}: not running"))
                return
            self._nursery.start_soon(update)

        self.call_soon(spawn)
        return fut

    def stats(self) -> EngineStatistics:
        """A metrics snapshot from the head (plain threads); an idle one when the head is gone."""
        try:
            return self.run_in_trio(self.stats_async)
        except (EngineClosed, trio.TooSlowError):
            return collect_stats(None, self._demux, 0, False)

    # ------------------------------------------------------------------ requests' side
    def left(self, request_id: str) -> None:
        """A request's reader left before its terminal: the head aborts it."""
        if self._lost is None:
            self._link.send(Abort(request_id, gone=True))

    def forget(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    # ------------------------------------------------------------------ state
    @property
    def running(self) -> bool:
        return self._lost is None and self._state.running

    @property
    def closed_reason(self) -> str | None:
        return self._lost or self._state.closed_reason

    @property
    def paused(self) -> str | None:
        return self._state.paused

    @property
    def shedding(self) -> bool:
        return self._state.shedding

    @property
    def capacity(self) -> float:
        return self._state.capacity

    @property
    def retry_after(self) -> float:
        return self._state.retry_after

    # ------------------------------------------------------------------ the pipeline
    @property
    def final_stage_ids(self) -> frozenset[int]:
        return frozenset(self._welcome.final_stage_ids) if self._welcome is not None else frozenset()

    @property
    def stage_params(self) -> Sequence[StageParams] | None:
        return self._stage_params

    @property
    def stage_kinds(self) -> list[str] | None:
        return list(self._welcome.stage_kinds) if self._welcome and self._welcome.stage_kinds else None

    def stage_info(self, stage: int) -> Mapping[str, Any]:
        info = self._welcome.stage_info if self._welcome is not None else []
        return info[stage] if 0 <= stage < len(info) else {}

    # ------------------------------------------------------------------ requests
    def generate(self, prompt: Any, **kwargs: Any) -> AsyncIterator[Message]:
        return messages(self.generate_batches(prompt, **kwargs))

    async def generate_batches(self, prompt: Any, *, request_id: str | None = None,
                               final_stage_id: int | None = None, request_timeout: float | None = None,
                               sampling: Any = None, resumable: bool = False,
                               companions: Mapping[str, Any] | None = None,
                               priority: int = 0) -> AsyncGenerator[list[Message], None]:
        if companions:
            raise ValueError("companion requests are not served through an API-server process")
        handle = await self.add_request_async(prompt, request_id=request_id, final_stage_id=final_stage_id,
                                              request_timeout=request_timeout, resumable=resumable,
                                              sampling=sampling, priority=priority)
        async for batch in handle.batches():
            yield batch

    async def add_request_async(self, prompt: Any, *, request_id: str | None = None,
                                final_stage_id: int | None = None, request_timeout: float | None = None,
                                resumable: bool = False, sampling: Any = None,
                                want_timings: bool = False, priority: int = 0) -> RemoteRequest:
        return await self._ask(lambda call: Add(call, prompt, request_id, final_stage_id, request_timeout,
                                                resumable, sampling, want_timings, priority))

    async def update_request_async(self, request_id: str, segment: Any, *, final: bool = False) -> None:
        await self._ask(lambda call: Update(call, request_id, segment, final))

    def abort(self, request_id: str) -> None:
        """Abort a request from any thread, without waiting."""
        if self._lost is not None:
            raise EngineClosed(self._lost)
        self._post_quiet(self._link.send, Abort(request_id))

    async def abort_confirmed_async(self, request_id: str, timeout: float | None = None) -> list[RpcResult]:
        return await self._call("abort_confirmed_async", list[RpcResult], request_id=request_id,
                                timeout=timeout) or []

    async def stats_async(self, timeout: float = 5.0) -> EngineStatistics:
        with trio.fail_after(timeout):
            return await self._call("stats_async", EngineStatistics, timeout=timeout)

    # ------------------------------------------------------------------ the control plane
    async def collective_rpc_async(self, method: str, args: Sequence[Any] = (),
                                   kwargs: Mapping[str, Any] | None = None, stage_ids: StageIds = None,
                                   timeout: float | None = None) -> list[RpcResult]:
        return await self._call("collective_rpc_async", list[RpcResult], method=method, args=list(args),
                                kwargs=dict(kwargs or {}), stage_ids=_ids(stage_ids), timeout=timeout) or []

    async def pause_async(self, mode: str = "wait") -> None:
        await self._call("pause_async", None, mode=mode)

    async def resume_async(self) -> None:
        await self._call("resume_async", None)

    async def sleep_async(self, level: int = 1, stage_ids: StageIds = None, timeout: float | None = None,
                          drain_timeout: float | None = None) -> list[RpcResult]:
        return await self._call("sleep_async", list[RpcResult], level=level, stage_ids=_ids(stage_ids),
                                timeout=timeout, drain_timeout=drain_timeout) or []

    async def wake_up_async(self, stage_ids: StageIds = None, timeout: float | None = None
                            ) -> list[RpcResult]:
        return await self._call("wake_up_async", list[RpcResult], stage_ids=_ids(stage_ids),
                                timeout=timeout) or []

    async def update_weights_async(self, path: str, stage_ids: StageIds = None, timeout: float | None = None,
                                   drain_timeout: float | None = None) -> list[RpcResult]:
        return await self._call("update_weights_async", list[RpcResult], path=path,
                                stage_ids=_ids(stage_ids), timeout=timeout, drain_timeout=drain_timeout) or []

    async def start_profile_async(self, dir: str, stage_ids: StageIds = None,
                                  timeout: float | None = None) -> list[RpcResult]:
        return await self._call("start_profile_async", list[RpcResult], dir=dir, stage_ids=_ids(stage_ids),
                                timeout=timeout) or []

    async def stop_profile_async(self, stage_ids: StageIds = None,
                                 timeout: float | None = None) -> list[RpcResult]:
        return await self._call("stop_profile_async", list[RpcResult], stage_ids=_ids(stage_ids),
                                timeout=timeout) or []


def _ids(stage_ids: StageIds) -> list[int] | None:
    return None if stage_ids is None else [int(k) for k in stage_ids]


def _error(refused: Refused) -> Exception:
    """The exception the head raised, raised again in the front."""
    if refused.kind == "overloaded":
        return Overloaded(refused.message, retry_after=refused.retry_after)
    if refused.kind == "closed":
        return EngineClosed(refused.message)
    if refused.kind == "value":
        return ValueError(refused.message)
    if refused.kind == "control":
        exc = ControlError(refused.message, [])
        exc.args = (refused.message,)
        exc.results = unpack(refused.results, list[RpcResult])
        return exc
    return RuntimeError(refused.message)
