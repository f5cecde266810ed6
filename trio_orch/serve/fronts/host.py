"""The head's side of its API-server processes: the engine served to each front over its own socket.

:class:`EngineHost` runs in the head's Trio run beside the engine
(:class:`~trio_orch.engine.TrioEngine`) and binds one ipc socket per front
*slot* (:class:`FrontSlot`).  Each slot is guarded like a worker's control
socket: only the process launched for it -- its one-time launch ticket, from
its pid (:mod:`stages.credentials`) -- ever becomes a peer, so no other
process of the user can add requests, read a request's outputs or call the
control plane.

Every decision stays in the head: a front's :class:`~.wire.Add` goes through
the engine's one admission (capacity, the start queue, priority, shedding);
the engine names the request, so an id is unique across fronts; each
accepted request is one task here that forwards its batches to the front
that asked.  The front holds no request state the head does not hold too:
when a front dies (or is replaced), :meth:`FrontSlot.drop` cancels its
tasks, and each of its open requests is left by its consumer, which the
engine ends as ``aborted`` -- one terminal each, counted in the head.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any

import trio
import zmq

from stages.auth import Authenticator, Security
from trio_orch.cluster.pool import StageTiming
from trio_orch.engine.api import ControlError, EngineClient, EngineClosed, EngineStatistics, Overloaded
from trio_orch.http.metrics import FrontMetrics
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
    ToHead,
    Update,
    Welcome,
    pack,
    to_wire,
    unpack,
)

__all__ = ["EngineHost", "FrontSlot", "front_address"]

log = logging.getLogger("trio_orch.serve.fronts")

#: seconds between two looks at the engine's state (pushed to the fronts when it changed)
STATE_INTERVAL = 0.05
#: seconds a scrape waits for a front's counters (past it, that front's last ones count)
COUNT_TIMEOUT = 1.0


def front_address(directory: str, index: int) -> str:
    """The ipc address of front slot ``index`` (in the head's private directory)."""
    return f"ipc://{directory}/front-{index}"


class FrontSlot:
    """One front's socket in the head, and the tasks of the requests it holds (see the module docstring)."""

    def __init__(self, host: EngineHost, index: int, sock: zmq.Socket, address: str) -> None:
        self.host = host
        self.index = index
        self.address = address
        self.sock = sock
        self.link = Link(sock, ToHead, self._on_message)
        #: the requests of this front still open here: each one's task's cancel scope (cancelled: its
        #: client left, the handle is closed and the engine aborts the request)
        self.handles: dict[str, trio.CancelScope] = {}
        self.pid: int | None = None  #: the front's pid, from its Hello
        self.requests = 0  #: requests this front added (accepted or not)
        self.hello = trio.Event()
        #: the front's HTTP counters when it last answered a :class:`~.wire.Count` (None: never yet)
        self.counts: dict[str, Any] | None = None
        self._counting: dict[int, trio.Event] = {}
        self._calls = itertools.count(1)
        self._scope = trio.CancelScope()
        self._nursery: trio.Nursery | None = None

    @property
    def zap_domain(self) -> str:
        return f"trio-orch:front:{self.index}"

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Serve this front until :meth:`drop` (a new scope each time: a replaced front starts afresh)."""
        with self._scope:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                nursery.start_soon(self.link.run)
                task_status.started()
                await trio.sleep_forever()

    def drop(self) -> None:
        """The front is gone: its open requests are left (each ends ``aborted`` in the engine)."""
        self._scope.cancel()

    async def count(self, timeout: float) -> None:
        """Ask the front for its HTTP counters (:attr:`counts`); a front that does not answer in time
        keeps its last ones."""
        if not self.hello.is_set():
            return
        call = next(self._calls)
        done = self._counting[call] = trio.Event()
        self.send(Count(call))
        with trio.move_on_after(timeout):
            await done.wait()
        self._counting.pop(call, None)

    def reset(self) -> None:
        """Ready for the next front launched into this slot (after :meth:`drop` and its run returned):
        the counters of the front that left are kept in the host's (``retired``)."""
        if self.counts is not None:
            self.host.retired.append(self.counts)
            self.counts = None
        self._counting.clear()
        self.link.clear()
        self._scope = trio.CancelScope()
        self.hello = trio.Event()
        self.pid = None

    def send(self, msg: Any) -> None:
        self.link.send(msg)

    # ------------------------------------------------------------------ messages
    def _on_message(self, msg: Any) -> None:
        assert self._nursery is not None
        if isinstance(msg, Add):
            self.requests += 1
            self._nursery.start_soon(self._serve_request, msg)
        elif isinstance(msg, Abort):
            scope = self.handles.get(msg.request_id) if msg.gone else None
            if scope is not None:
                scope.cancel()  # its consumer left: the engine aborts and counts it so
            elif not msg.gone:
                with contextlib.suppress(EngineClosed):  # any request of the engine (the control plane's)
                    self.host.engine.abort(msg.request_id)
        elif isinstance(msg, Update):
            self._nursery.start_soon(self._answer, msg.call, self.host.engine.update_request_async,
                                     (msg.request_id, msg.segment), {"final": msg.final})
        elif isinstance(msg, Call):
            call = self.host.calls.get(msg.method)
            if call is None:
                self.send(Refused(msg.call, "value", f"no engine call named {msg.method!r}"))
            else:
                self._nursery.start_soon(self._answer, msg.call, call, (), msg.kwargs)
        elif isinstance(msg, Counted):
            waiter = self._counting.pop(msg.call, None)
            if waiter is not None:
                counts = unpack(msg.counts, dict[str, Any] | None)
                if counts is not None:
                    self.counts = counts
                waiter.set()
        elif isinstance(msg, Hello):
            self.pid = msg.pid
            self.send(self.host.welcome())
            self.hello.set()

    async def _answer(self, call: int, fn: Callable[..., Awaitable[Any]], args: tuple[Any, ...],
                      kwargs: dict[str, Any]) -> None:
        try:
            result = await fn(*args, **kwargs)
        except BaseException as exc:
            refused = _refusal(call, exc)
            if refused is None:
                raise
            self.send(refused)
            return
        self.send(Reply(call, b"" if result is None else pack(result), [s.requests for s in self.host.slots]))

    async def _serve_request(self, msg: Add) -> None:
        engine = self.host.engine
        try:
            handle = await engine.add_request_async(
                msg.prompt, request_id=msg.request_id, final_stage_id=msg.final_stage_id,
                request_timeout=msg.request_timeout, resumable=msg.resumable, sampling=msg.sampling,
                want_timings=msg.want_timings, priority=msg.priority)
        except BaseException as exc:
            refused = _refusal(msg.call, exc)
            if refused is None:
                raise
            self.send(refused)
            return
        rid = handle.request_id
        rejection = handle.rejection
        self.send(Accepted(msg.call, rid, to_wire(rejection) if rejection is not None else None))  # type: ignore[arg-type]
        if rejection is not None:
            return
        try:
            with trio.CancelScope() as self.handles[rid]:
                async for msgs in handle.batches():
                    timings = b""
                    if msg.want_timings and msgs[-1].finished and handle.timings is not None:
                        timings = pack(handle.timings)
                    self.send(Batch(rid, time.perf_counter(), [to_wire(m) for m in msgs], timings))
        except EngineClosed as exc:
            self.send(Ended(rid, str(exc)))
        finally:
            self.handles.pop(rid, None)
            handle.close()  # left early (the front is gone): the engine aborts it


def _refusal(call: int, exc: BaseException) -> Refused | None:
    """The :class:`Refused` a front raises again as ``exc`` (None: not an error a call answers)."""
    if isinstance(exc, Overloaded):
        return Refused(call, "overloaded", str(exc), retry_after=exc.retry_after)
    if isinstance(exc, EngineClosed):
        return Refused(call, "closed", str(exc))
    if isinstance(exc, ControlError):
        return Refused(call, "control", str(exc), results=pack(exc.results))
    if isinstance(exc, ValueError):
        return Refused(call, "value", str(exc))
    if isinstance(exc, (RuntimeError, TimeoutError, KeyError, TypeError)):
        return Refused(call, "runtime", f"{type(exc).__name__}: {exc}")
    return None


class EngineHost:
    """The engine served to ``count`` fronts, one guarded ipc socket each (see the module docstring).

    ``security``/``authenticator``: the head's, so a slot takes only the
    process launched for it (:meth:`FrontSlot.zap_domain` guarded; the
    launcher opens a launch per start).  Start :meth:`run` in the engine's
    Trio run once the engine is ready.
    """

    def __init__(self, engine: EngineClient, ctx: zmq.Context, directory: str, count: int, *,
                 security: Security, authenticator: Authenticator) -> None:
        self.engine = engine
        self.authenticator = authenticator
        self.slots: list[FrontSlot] = []
        #: the awaitable calls a front may make by name (the control plane and the statistics)
        self.calls: dict[str, Callable[..., Awaitable[Any]]] = {
            "stats_async": self.stats_async, "abort_confirmed_async": engine.abort_confirmed_async,
            "collective_rpc_async": engine.collective_rpc_async, "pause_async": engine.pause_async,
            "resume_async": engine.resume_async, "sleep_async": engine.sleep_async,
            "wake_up_async": engine.wake_up_async, "update_weights_async": engine.update_weights_async,
            "start_profile_async": engine.start_profile_async,
            "stop_profile_async": engine.stop_profile_async}
        for i in range(count):
            address = front_address(directory, i)
            sock = ctx.socket(zmq.DEALER)
            sock.linger = 0
            slot = FrontSlot(self, i, sock, address)
            security.server(sock, address, domain=slot.zap_domain)
            authenticator.launches.guard(slot.zap_domain)  # the front launched for it, no one else
            sock.bind(address)
            authenticator.watch(sock)
            self.slots.append(slot)
        self._state: State | None = None
        #: the last HTTP counters of the fronts that left (they stay in the server's totals)
        self.retired: list[dict[str, Any]] = []

    async def stats_async(self, timeout: float = 5.0) -> EngineStatistics:
        """The engine's snapshot, with every front's HTTP counters summed (``fronts``): the whole server's
        numbers, whichever front is scraped.  Each front is asked now, so what a front counted before it
        answered (a request counted before its stream's ``[DONE]``) is in; a front that left counts with
        what it had last said."""
        stats = await self.engine.stats_async(timeout)
        async with trio.open_nursery() as nursery:
            for slot in self.slots:
                nursery.start_soon(slot.count, min(timeout, COUNT_TIMEOUT))
        counts = [*self.retired, *(s.counts for s in self.slots if s.counts is not None)]
        return replace(stats, fronts=FrontMetrics.summed(counts).counts())

    def state(self) -> State:
        e = self.engine
        return State(e.running, e.closed_reason, e.paused, e.shedding, e.capacity, e.retry_after)

    def welcome(self) -> Welcome:
        e = self.engine
        params = e.stage_params
        n = len(params) if params is not None else (max(e.final_stage_ids) + 1 if e.final_stage_ids else 0)
        return Welcome(sorted(e.final_stage_ids), e.stage_kinds, pack(list(params) if params else None),
                       [dict(e.stage_info(k)) for k in range(n)], self.state())

    async def watch_state(self) -> None:
        """Push the engine's state to every front when it changes (until cancelled)."""
        while True:
            now = self.state()
            if now != self._state:
                self._state = now
                for slot in self.slots:
                    slot.send(now)
            await trio.sleep(STATE_INTERVAL)

    def close(self) -> None:
        """Close the sockets (after every slot's run returned)."""
        for slot in self.slots:
            self.authenticator.launches.forget(slot.zap_domain)
            slot.sock.close(linger=0)


#: a terminal's timings, as a front decodes them (:func:`~.wire.unpack`)
TIMINGS = tuple[StageTiming | None, ...]
