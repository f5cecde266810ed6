"""The Trio orchestrator behind the thread-side :class:`~bench.drivers.base.Harness`.

``trio.run`` runs in a background thread; calls come in through the Trio
token (``trio.from_thread.run``/``run_sync`` when the caller needs the result,
``TrioToken.run_sync_soon`` when it does not), and the orchestrator's
``output_sink`` hands each batch of messages to a condition variable, so the
consumer thread wakes once per batch.  Self-contained on purpose: the
production bridge (``trio_orch/bridge.py``) is built separately.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import threading
from collections.abc import Callable
from typing import Any

import trio

from bench.drivers.base import Harness, Message
from bench.trio_stages import TrioScriptedStage
from trio_orch.launcher import open_pipeline
from trio_orch.orchestrator import Orchestrator

__all__ = ["TrioHarness"]


def _descendants(task: trio.lowlevel.Task, exclude: set[trio.lowlevel.Task]) -> list[trio.lowlevel.Task]:
    out: list[trio.lowlevel.Task] = []
    stack = list(task.child_nurseries)
    while stack:
        nursery = stack.pop()
        for t in nursery.child_tasks:
            if t in exclude:
                continue
            out.append(t)
            stack.extend(t.child_nurseries)
    return out


class TrioHarness(Harness):
    """Drive :class:`trio_orch.Orchestrator` from a thread."""

    framework = "trio"
    impl = "trio"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._cond = threading.Condition()
        self._batches: collections.deque[list[Message]] = collections.deque()
        self._stream_closed = False
        self.token: trio.lowlevel.TrioToken | None = None
        self.orch: Orchestrator | None = None
        self._app_scope: trio.CancelScope | None = None

    # ------------------------------------------------------------------ the Trio thread
    def _thread_main(self) -> None:
        try:
            trio.run(self._main)
        except BaseException as exc:
            if self.run_error is None:
                self.run_error = exc
        finally:
            self._close_stream()
            self._started.set()
            self._run_returned.set()

    async def _main(self) -> None:
        self.token = trio.lowlevel.current_trio_token()
        me = trio.lowlevel.current_task()
        async with trio.open_nursery() as app:
            self._app_scope = app.cancel_scope
            async with contextlib.AsyncExitStack() as stack:
                try:
                    if self.workers is not None:
                        pipeline = await stack.enter_async_context(
                            open_pipeline(self.workers, handle_sigterm=False))
                        self.stages = list(pipeline.stages)
                        self.worker_pids = pipeline.pids
                        self.worker_dir = pipeline.tmpdir
                    else:
                        self.stages = [TrioScriptedStage(k, misbehaviour=self.misbehaviour.get(k),
                                                         helper_nursery=app)
                                       for k in range(self.num_stages)]
                    self.orch = Orchestrator(
                        self.stages, self.final_stage_ids, async_chunk=self.async_chunk,
                        forward_fn=self.forward_fn, prewarm_fn=self.prewarm_fn,
                        request_queue_size=self.request_queue_size, shutdown_grace=self.shutdown_grace,
                        output_sink=None if self.in_loop_consumer else self._sink)
                except BaseException as exc:
                    self._start_error = exc
                    app.cancel_scope.cancel()
                    return
                returned = trio.Event()
                run_task: set[trio.lowlevel.Task] = set()

                async def run_orch(task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
                    run_task.add(trio.lowlevel.current_task())
                    assert self.orch is not None
                    try:
                        await self.orch.run(task_status=task_status)
                    except trio.Cancelled:
                        raise
                    except BaseException as exc:
                        self.run_error = exc
                    finally:
                        returned.set()

                await app.start(run_orch)
                self._started.set()
                await returned.wait()
                alive = _descendants(me, run_task)
                self.tasks_alive_after_run = len(alive)
                self.alive_after_run_names = [t.name for t in alive]
                self._close_stream()
                self._run_returned.set()
            app.cancel_scope.cancel()  # helpers the stages started in the application's nursery
        self.tasks_pending_at_loop_end = len(_descendants(me, set()))

    def abandon(self) -> None:
        """Cancel the application's nursery under a hung run() (shielded cleanup may still hang)."""
        if self.token is not None and self._app_scope is not None:
            try:
                self.token.run_sync_soon(self._app_scope.cancel)
            except trio.RunFinishedError:
                pass

    def _sink(self, msgs: list[Message]) -> None:
        with self._cond:
            self._batches.append(msgs)
            self._cond.notify()

    def _close_stream(self) -> None:
        with self._cond:
            self._stream_closed = True
            self._cond.notify_all()

    def _next_batch(self, timeout: float) -> list[Message] | None:
        with self._cond:
            if not self._cond.wait_for(lambda: self._batches or self._stream_closed, timeout):
                raise TimeoutError(f"no output within {timeout}s")
            if self._batches:
                return self._batches.popleft()
            return None

    async def loop_next_batch(self) -> list[Message] | None:
        assert self.orch is not None
        try:
            return [await self.orch.next_output()]
        except trio.EndOfChannel:
            return None

    # ------------------------------------------------------------------ handovers
    def _request_shutdown(self, timeout: float | None) -> None:
        assert self.orch is not None
        self.call_soon(self.orch.request_shutdown, timeout)

    def add_request(self, request_id: str, prompt: Any, *, final_stage_id: int | None = None,
                    wait: bool = True, timeout: float = 5.0, deadline: float | None = None) -> None:
        assert self.orch is not None
        try:
            if wait:
                trio.from_thread.run(self._add_with_timeout, request_id, prompt, final_stage_id, timeout,
                                     deadline, trio_token=self.token)
            else:
                add = functools.partial(self.orch.add_request_nowait, final_stage_id=final_stage_id,
                                        timeout=deadline)
                trio.from_thread.run_sync(add, request_id, prompt, trio_token=self.token)
        except trio.RunFinishedError as exc:
            raise RuntimeError("orchestrator is not running") from exc

    async def _add_with_timeout(self, request_id: str, prompt: Any, final_stage_id: int | None,
                                timeout: float, deadline: float | None) -> None:
        assert self.orch is not None
        with trio.fail_after(timeout):
            await self.orch.add_request(request_id, prompt, final_stage_id=final_stage_id,
                                        timeout=deadline)

    def abort(self, request_id: str) -> None:
        assert self.orch is not None
        try:
            self.call_soon(self.orch.abort_nowait, request_id)
        except trio.RunFinishedError:
            pass  # stopped: every request already had its terminal

    def call(self, fn: Callable[..., Any], *args: Any, timeout: float = 5.0) -> Any:
        return trio.from_thread.run_sync(fn, *args, trio_token=self.token)

    def call_soon(self, fn: Callable[..., Any], *args: Any) -> None:
        assert self.token is not None
        self.token.run_sync_soon(fn, *args)

    def run_in_loop(self, afn: Callable[..., Any], *args: Any, timeout: float = 10.0) -> Any:
        async def bounded() -> Any:
            with trio.fail_after(timeout):
                return await afn(*args)

        return trio.from_thread.run(bounded, trio_token=self.token)

    @property
    def active_requests(self) -> int:
        assert self.orch is not None
        return self.orch.active_requests

    def _router(self) -> Any:
        assert self.orch is not None
        return self.orch.router
