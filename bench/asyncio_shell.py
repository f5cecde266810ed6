"""What the asyncio references share: the vLLM-Omni thread/loop boundary around the routing core.

vLLM-Omni's orchestrator lives in a background thread with its own event loop;
the serving thread talks to it through janus queues (a request queue bounded
at 256, an output queue), the request handler registers a request before its
first ``await`` and submits it, readers only move stage outputs, and one
dispatcher routes them serially.  This module holds the parts every asyncio
variant shares -- request handling, performing the router's actions, the
shutdown cleanup -- so that the variants (:mod:`bench.asyncio_omni`,
:mod:`bench.asyncio_taskgroup`) differ only in how their tasks are started,
stopped and supervised, which is what the comparison is about.  Routing
decisions are made by the same :class:`trio_orch.router.Router` as the Trio
orchestrator's.

Two deliberate departures from the source, both so the references honour the
same contract as the Trio orchestrator (DESIGN §3): at shutdown every active
or still-queued request gets its ``shutdown`` terminal (the source does that
only after a fatal error), and a stage whose client dies gets
``replica_died`` terminals for its requests instead of stopping the whole
orchestrator (the source is fail-stop).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import janus

from trio_orch.router import Abort, Action, Emit, Router, Submit
from trio_orch.types import OrchError, OrchOutput, StageClient

__all__ = ["AbortMsg", "AddMsg", "AsyncioOrchestrator", "StageDied"]

log = logging.getLogger("bench.asyncio")

Message = OrchOutput | OrchError


class AddMsg:
    """``add_request`` handed from the serving thread; ``done`` is set once handled."""

    __slots__ = ("done", "final_stage_id", "prompt", "request_id")

    def __init__(self, request_id: str, prompt: Any, final_stage_id: int | None,
                 done: threading.Event | None = None) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.final_stage_id = final_stage_id
        self.done = done


class AbortMsg:
    """``abort`` handed from the serving thread (same queue as adds, as in vLLM-Omni)."""

    __slots__ = ("request_id",)

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id


class StageDied:
    """A reader's own failure, routed to the dispatcher as data."""

    __slots__ = ("exc",)

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


class AsyncioOrchestrator:
    """Base of the asyncio references; subclasses provide :meth:`run`.

    Build it inside the loop that will run it (janus queues bind to it), then
    hand :attr:`request_queue`'s ``sync_q`` and :attr:`output_queue`'s
    ``sync_q`` to the serving thread.  Output batches (lists of messages) go
    to the output queue, one put per routing step.
    """

    #: bound the shutdown cleanup (stage aborts, aclose) by ``shutdown_grace``
    bounded_cleanup = False
    variant = "base"

    def __init__(
        self,
        stages: Sequence[StageClient],
        final_stage_ids: Iterable[int],
        *,
        async_chunk: bool = False,
        forward_fn: Callable[[int, Any, list[Any]], Any] | None = None,
        prewarm_fn: Callable[[int, Any], Any] | None = None,
        request_queue_size: int = 256,
        shutdown_grace: float = 2.0,
    ) -> None:
        self.stages = list(stages)
        self.router = Router(len(self.stages), final_stage_ids, async_chunk=async_chunk,
                             forward_fn=forward_fn, prewarm_fn=prewarm_fn)
        self.shutdown_grace = shutdown_grace
        self.request_queue: janus.Queue[AddMsg | AbortMsg] = janus.Queue(maxsize=request_queue_size)
        self.output_queue: janus.Queue[list[Message]] = janus.Queue()
        self.live: set[str] = set()  # accepted (by the serving thread), no terminal yet
        self.live_lock = threading.Lock()
        self.stage_deaths: dict[int, str] = {}
        self._stop_requested = asyncio.Event()
        self._stop = asyncio.Event()
        self._drained = asyncio.Event()
        self._drain_timeout: float | None = None
        self._timers: dict[str, asyncio.TimerHandle] = {}  # per-request deadlines
        self._expired_queued: set[str] = set()  # expired before the handler took them
        self._io_tasks: set[asyncio.Task[None]] = set()

    # ------------------------------------------------------------------ control (loop thread)
    def request_shutdown(self, timeout: float | None = None) -> None:
        """Begin shutting down; ``timeout`` lets active requests finish first."""
        if not self._stop_requested.is_set():
            self._drain_timeout = timeout
            self._stop_requested.set()
            self._check_drained()

    def set_deadline(self, request_id: str, timeout: float) -> None:
        """(Loop thread.)  Expire ``request_id`` ``timeout`` s from now, queued or running.

        Requests are not tasks, so ``asyncio.timeout`` does not apply; the
        idiom is a ``call_later`` timer whose callback decides synchronously.
        """
        old = self._timers.pop(request_id, None)
        if old is not None:
            old.cancel()
        loop = asyncio.get_running_loop()
        self._timers[request_id] = loop.call_later(timeout, self._expire, request_id)

    def _expire(self, request_id: str) -> None:
        self._timers.pop(request_id, None)
        if request_id in self.router:
            actions = self.router.expire(request_id)
            msgs = [a.message for a in actions if type(a) is Emit]
            self._deliver(msgs)
            io = [a for a in actions if type(a) is not Emit]
            if io:  # the stage aborts: fire and forget, as the source does for its side jobs
                task = asyncio.get_running_loop().create_task(self._perform(io))
                self._io_tasks.add(task)
                task.add_done_callback(self._io_tasks.discard)
        elif request_id in self.live:  # accepted, still in the request queue
            self._expired_queued.add(request_id)
            self._deliver([OrchError(request_id, None, "timeout", "its deadline passed while queued")])

    async def run(self) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    async def _wait_stop_requested(self) -> None:
        """Return once shutdown was requested and the optional drain is over."""
        await self._stop_requested.wait()
        if self._drain_timeout:
            try:
                await asyncio.wait_for(self._drained.wait(), self._drain_timeout)
            except TimeoutError:
                pass

    # ------------------------------------------------------------------ tasks
    async def _request_handler(self) -> None:
        """Take adds and aborts from the serving thread, in order."""
        q = self.request_queue.async_q
        while True:
            msg = await q.get()
            if type(msg) is AddMsg:
                await self._handle_add(msg)
            else:
                await self._perform(self.router.abort(msg.request_id))

    async def _handle_add(self, msg: AddMsg) -> None:
        if msg.request_id in self._expired_queued:  # its timeout terminal was already delivered
            self._expired_queued.discard(msg.request_id)
            if msg.done is not None:
                msg.done.set()
            return
        try:
            try:
                actions = self.router.add(msg.request_id, msg.prompt, msg.final_stage_id)
            except Exception as exc:  # prewarm_fn raised (input was validated by the caller)
                actions = [Emit(OrchError(msg.request_id, None, "forward_failed",
                                          f"add failed: {type(exc).__name__}: {exc}"))]
            await self._perform(actions)
        finally:
            if msg.done is not None:
                msg.done.set()

    def _route(self, stage_id: int, item: Any) -> list[Action]:
        if type(item) is list:
            return self.router.route_many(stage_id, item)
        exc = item.exc
        msg = f"stage {stage_id} died: {type(exc).__name__}: {exc}"
        log.warning("%s", msg)
        self.stage_deaths[stage_id] = msg
        return self.router.stage_died(stage_id, msg)

    # ------------------------------------------------------------------ I/O
    def _deliver(self, msgs: list[Message]) -> None:
        timers = self._timers
        with self.live_lock:
            for m in msgs:
                if m.finished:
                    self.live.discard(m.request_id)
                    if timers:
                        handle = timers.pop(m.request_id, None)
                        if handle is not None:
                            handle.cancel()
        self.output_queue.async_q.put_nowait(msgs)
        self._check_drained()

    def _check_drained(self) -> None:
        if self._stop_requested.is_set() and not self.live:
            self._drained.set()

    async def _perform(self, actions: list[Action]) -> None:
        """Deliver the emits at once, then do the stage I/O in decision order."""
        if not actions:
            return
        msgs = [a.message for a in actions if type(a) is Emit]
        if msgs:
            self._deliver(msgs)
        router = self.router
        for a in actions:
            if type(a) is Submit:
                if a.request_id not in router:
                    continue
                try:
                    await self.stages[a.stage_id].submit(a.request_id, a.payload)
                except Exception as exc:
                    await self._perform(router.submit_failed(
                        a.stage_id, a.request_id,
                        f"submit to stage {a.stage_id} failed: {type(exc).__name__}: {exc}"))
                    continue
                if a.request_id not in router:
                    await self._abort_on(a.stage_id, [a.request_id])
            elif type(a) is Abort:
                await self._abort_on(a.stage_id, a.request_ids)

    async def _abort_on(self, stage_id: int, request_ids: list[str]) -> None:
        try:
            await self.stages[stage_id].abort(request_ids)
        except Exception as exc:
            log.debug("abort %s on stage %d failed: %r", request_ids, stage_id, exc)

    # ------------------------------------------------------------------ shutdown
    def _finish_sync(self) -> list[Action]:
        """Refuse new work, give every accepted request its terminal; return the stage I/O left."""
        for handle in self._timers.values():
            handle.cancel()
        self._timers.clear()
        rq = self.request_queue
        rq.shutdown()  # the serving thread's put now raises janus.SyncQueueShutDown
        msgs: list[Message] = []
        while True:
            try:
                m = rq.async_q.get_nowait()
            except (asyncio.QueueEmpty, janus.AsyncQueueShutDown):
                break
            if type(m) is AddMsg and m.request_id not in self._expired_queued:
                msgs.append(OrchError(m.request_id, None, "shutdown",
                                      "orchestrator shut down before the request was handled"))
                if m.done is not None:
                    m.done.set()
        actions: list[Action] = [Emit(x) for x in msgs]
        actions.extend(self.router.shutdown())
        out = [a.message for a in actions if type(a) is Emit]
        if out:
            self._deliver(out)
        return [a for a in actions if type(a) is not Emit]

    async def _finish(self) -> None:
        """Terminals first, then stage aborts and closes (bounded or not), then end of stream."""
        io = self._finish_sync()
        try:
            if self.bounded_cleanup:
                try:
                    async with asyncio.timeout(self.shutdown_grace):
                        await self._cleanup_io(io)
                except TimeoutError:
                    log.warning("stage aborts took longer than %.1fs; abandoned", self.shutdown_grace)
                for stage in self.stages:
                    try:
                        async with asyncio.timeout(self.shutdown_grace):
                            await self._close_stage(stage)
                    except TimeoutError:
                        log.warning("closing %r took longer than %.1fs; abandoned",
                                    stage, self.shutdown_grace)
            else:
                await self._cleanup_io(io)
                for stage in self.stages:
                    await self._close_stage(stage)
        finally:
            self.output_queue.shutdown()

    async def _cleanup_io(self, io: list[Action]) -> None:
        for a in io:
            if type(a) is Abort and self.router.available[a.stage_id]:
                await self._abort_on(a.stage_id, a.request_ids)

    async def _close_stage(self, stage: StageClient) -> None:
        try:
            await stage.aclose()
        except Exception as exc:
            log.warning("closing stage %r failed: %r", stage, exc)
