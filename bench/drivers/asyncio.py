"""The asyncio references behind a thread-side :class:`~bench.drivers.base.Driver`.

As in vLLM-Omni, the orchestrator runs in a thread with its own event loop
and the serving thread talks to it through janus queues: adds and aborts go
into the request queue (``sync_q.put``), output batches come out of the
output queue (``sync_q.get``).  Stage handovers use
``loop.call_soon_threadsafe``.  The serving-thread side validates a request
and refuses a duplicate active id before queueing it: the references'
own ``add_request`` does that against the routing core.  One driver class
serves the three references: the registry (:mod:`bench.implementations`)
gives it the orchestrator class and the way its thread runs the loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import queue
import threading
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import Any

import janus

from bench.drivers.base import Driver
from bench.refs.launcher import open_worker_stages
from bench.refs.orchestrator import AddMsg, AsyncioOrchestrator
from bench.refs.testing import AsyncPushScriptedStage, AsyncScriptedStage
from trio_orch.types import Message, RpcResult

__all__ = ["AsyncioDriver"]


class AsyncioLoopDriver(Driver):
    """What every driver of an orchestrator running in an asyncio loop of its thread shares.

    Calls into that loop from the serving thread (:meth:`call`, :meth:`call_soon`,
    :meth:`run_in_loop`), stopping it under a hung run (:meth:`abandon`), and the
    end of the orchestrator's run as every scenario measures it (:meth:`run_orchestrator`).
    """

    framework = "asyncio"
    loop: asyncio.AbstractEventLoop | None = None

    async def run_orchestrator(self, run: Callable[[], Awaitable[Any]], output_queue: Any) -> None:
        """Say it started, await ``run()``, then record what it left alive and shut its output queue."""
        self.set_started()
        me = asyncio.current_task()
        loop = asyncio.get_running_loop()  # this finally may run at garbage collection, off the loop
        try:
            await run()
        except BaseException as exc:
            self.run_error = exc
        finally:
            output_queue.shutdown()
            alive = [t for t in asyncio.all_tasks(loop) if t is not me and not t.done()]
            self.tasks_alive_after_run = len(alive)
            self.alive_after_run_names = [t.get_name() for t in alive]
            self.set_returned()

    def abandon(self) -> None:
        """Stop the loop under the hung run()."""
        loop = self.loop
        if loop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(loop.stop)
            except RuntimeError:
                pass

    def call(self, fn: Callable[..., Any], *args: Any, timeout: float = 5.0) -> Any:
        assert self.loop is not None
        fut: concurrent.futures.Future[Any] = concurrent.futures.Future()

        def run() -> None:
            try:
                fut.set_result(fn(*args))
            except BaseException as exc:
                fut.set_exception(exc)

        self.loop.call_soon_threadsafe(run)
        try:
            return fut.result(timeout)
        except concurrent.futures.TimeoutError:
            raise TimeoutError(f"the loop did not run the call within {timeout}s") from None

    def call_soon(self, fn: Callable[..., Any], *args: Any) -> None:
        assert self.loop is not None
        self.loop.call_soon_threadsafe(fn, *args)

    def run_in_loop(self, afn: Callable[..., Any], *args: Any, timeout: float = 10.0) -> Any:
        assert self.loop is not None
        fut = asyncio.run_coroutine_threadsafe(afn(*args), self.loop)
        try:
            return fut.result(timeout)
        except concurrent.futures.TimeoutError:
            fut.cancel()
            raise TimeoutError(f"the coroutine did not finish within {timeout}s") from None


class AsyncioDriver(AsyncioLoopDriver):
    """Drive an :class:`AsyncioOrchestrator` subclass (``orchestrator_cls``) from a thread.

    The thread runs the loop the way the reference says (its ``use_runner``).
    ``push`` gives pushing stages to a reference that has the push fast path
    (its ``push_path``); the others' stages are the plain ones.
    """

    def __init__(self, *args: Any, orchestrator_cls: type[AsyncioOrchestrator], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.orchestrator_cls = orchestrator_cls
        self.use_runner = orchestrator_cls.use_runner
        self.loop: asyncio.AbstractEventLoop | None = None
        self._abandoned = False
        self.orch: AsyncioOrchestrator | None = None

    # ------------------------------------------------------------------ the loop thread
    def thread_main(self) -> None:
        try:
            if self.use_runner:
                runner = asyncio.Runner()
                try:
                    runner.run(self._amain())
                finally:
                    loop = runner.get_loop()
                    runner.close()  # cancels and awaits what is left, as asyncio.run() does
                    self.tasks_pending_at_loop_end = _pending(loop)
            else:
                loop = asyncio.new_event_loop()
                asyncio.set_event_loop(loop)
                try:
                    loop.run_until_complete(self._amain())
                finally:
                    if self._abandoned:  # measured and reported already: no noise when they are collected
                        loop.set_exception_handler(lambda loop, context: None)
                    loop.close()  # leaves pending tasks pending ("destroyed but it is pending")
                    self.tasks_pending_at_loop_end = _pending(loop)
        except BaseException as exc:
            if self.run_error is None:
                self.run_error = exc
        finally:
            self.set_started()
            self.set_returned()

    async def _amain(self) -> None:
        self.loop = asyncio.get_running_loop()
        async with contextlib.AsyncExitStack() as stack:
            try:
                if self.workers is not None:
                    self.stages = await stack.enter_async_context(open_worker_stages(self.workers))
                    self.worker_pids = [s.pid for s in self.stages if s.pid is not None]
                    self.worker_dir = os.path.dirname(self.stages[0].address.removeprefix("ipc://"))
                else:
                    cls = (AsyncPushScriptedStage if self.push and self.orchestrator_cls.push_path
                           else AsyncScriptedStage)
                    self.stages = [cls(k, misbehaviour=self.misbehaviour.get(k),
                                       on_submit=self.record_submission) for k in range(self.num_stages)]
                self.orch = self.orchestrator_cls(
                    self.stages, self.final_stage_ids, async_chunk=self.async_chunk,
                    forward_fn=self.forward_fn, prewarm_fn=self.prewarm_fn,
                    request_queue_size=self.request_queue_size, shutdown_grace=self.shutdown_grace)
            except BaseException as exc:
                self.set_started(exc)
                return
            await self.run_orchestrator(self.orch.run, self.orch.output_queue)

    def abandon(self) -> None:
        """Stop the loop under the hung run() (its pending tasks are left unfinished)."""
        self._abandoned = True
        super().abandon()

    def take_batch(self, timeout: float) -> list[Message] | None:
        assert self.orch is not None
        try:
            return self.orch.output_queue.sync_q.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"no output within {timeout}s") from None
        except janus.SyncQueueShutDown:
            return None

    async def loop_next_batch(self) -> list[Message] | None:
        assert self.orch is not None
        try:
            return await self.orch.output_queue.async_q.get()
        except janus.AsyncQueueShutDown:
            return None

    def loop_add(self, request_id: str, prompt: Any, final_stage_id: int | None = None) -> None:
        """Accept and queue the add from inside the loop (the request queue's asyncio side)."""
        orch = self.orch
        assert orch is not None
        with orch.lock:
            ticket = orch.router.accept(request_id, prompt, final_stage_id=final_stage_id)
        orch.request_queue.async_q.put_nowait(AddMsg(ticket, None))

    # ------------------------------------------------------------------ handovers
    def send_shutdown(self, timeout: float | None) -> None:
        assert self.orch is not None
        self.call_soon(self.orch.request_shutdown, timeout)

    def add_request(self, request_id: str, prompt: Any, *, final_stage_id: int | None = None,
                    wait: bool = True, timeout: float = 5.0, deadline: float | None = None,
                    **options: Any) -> None:
        orch = self.orch
        assert orch is not None
        done = threading.Event() if wait else None
        orch.add_request(request_id, prompt, final_stage_id=final_stage_id, timeout=deadline, done=done,
                         **options)
        if done is not None and not done.wait(timeout):
            raise TimeoutError(f"request {request_id!r} was not handled within {timeout}s")

    def update_request(self, request_id: str, segment: Any, *, final: bool = False,
                       timeout: float = 5.0) -> None:
        assert self.orch is not None
        self.orch.update_request(request_id, segment, final=final, timeout=timeout)

    def post_request(self, request_id: str, prompt: Any, final_stage_id: int | None = None) -> None:
        """Accept and put the add on the janus request queue (no wait; blocks only when it is full)."""
        assert self.orch is not None
        self.orch.add_request(request_id, prompt, final_stage_id=final_stage_id)

    def abort(self, request_id: str) -> None:
        assert self.orch is not None
        self.orch.abort(request_id)

    def attach_replica(self, stage_id: int, member_id: str, handshake_s: float) -> None:
        self.call_soon(self.orch.join_replica, stage_id, member_id, handshake_s)

    def join_outcomes(self) -> dict[str, str]:
        return dict(self.orch.join_outcomes) if self.orch is not None else {}

    def collective_rpc(self, method: str, args: Sequence[Any] = (), kwargs: Mapping[str, Any] | None = None,
                       stage_ids: Iterable[int] | None = None, timeout: float = 5.0) -> list[RpcResult]:
        """The serving thread's call: through the request queue, as the reference takes it."""
        assert self.orch is not None
        return self.orch.collective_rpc(method, args, kwargs, stage_ids, timeout)

    @property
    def router(self) -> Any:
        assert self.orch is not None
        return self.orch.router


def _pending(loop: asyncio.AbstractEventLoop) -> int:
    return sum(1 for t in asyncio.all_tasks(loop) if not t.done())
