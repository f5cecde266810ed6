"""The Trio orchestrator behind a thread-side :class:`~bench.drivers.base.Driver`.

``trio.run`` runs in a background thread; calls come in through the Trio
token (``trio.from_thread.run``/``run_sync`` when the caller needs the result,
``TrioToken.run_sync_soon`` when it does not), and the orchestrator's
``output_sink`` puts each batch of messages on a queue, so the consumer thread
wakes once per batch.  Self-contained on purpose: the production bridge
(``trio_orch/engine/bridge.py``) has its own driver, :mod:`bench.drivers.engine`.
"""

from __future__ import annotations

import contextlib
import functools
import queue
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import trio

from bench.drivers.base import Driver
from trio_orch.cluster.launcher import open_pipeline
from trio_orch.core import JoinRefused
from trio_orch.shell.orchestrator import Orchestrator
from trio_orch.testing import PushScriptedStage, ScriptedStage
from trio_orch.types import Message, RpcResult

__all__ = ["TrioDriver"]


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


class TrioDriver(Driver):
    """Drive :class:`trio_orch.Orchestrator` from a thread."""

    framework = "trio"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._batches: queue.SimpleQueue[list[Message] | None] = queue.SimpleQueue()
        self._stream_closed = False
        self.token: trio.lowlevel.TrioToken | None = None
        self.orch: Orchestrator | None = None
        self._joins: dict[str, str] = {}
        self._app: trio.Nursery | None = None

    # ------------------------------------------------------------------ the Trio thread
    def thread_main(self) -> None:
        try:
            trio.run(self._main)
        except BaseException as exc:
            if self.run_error is None:
                self.run_error = exc
        finally:
            self._close_stream()
            self.set_started()
            self.set_returned()

    def _make_stages(self, app: trio.Nursery) -> list[ScriptedStage]:
        cls = PushScriptedStage if self.push else ScriptedStage
        return [cls(k, misbehaviour=self.misbehaviour.get(k), helper_nursery=app,
                    on_submit=self.record_submission) for k in range(self.num_stages)]

    async def _main(self) -> None:
        self.token = trio.lowlevel.current_trio_token()
        me = trio.lowlevel.current_task()
        async with trio.open_nursery() as app:
            self._app = app
            async with contextlib.AsyncExitStack() as stack:
                try:
                    if self.workers is not None:
                        pipeline = await stack.enter_async_context(
                            open_pipeline(self.workers, handle_sigterm=False))
                        self.stages = list(pipeline.stages)
                        self.worker_pids = pipeline.pids
                        self.worker_dir = pipeline.tmpdir
                    else:
                        self.stages = self._make_stages(app)
                    self.orch = Orchestrator(
                        self.stages, self.final_stage_ids, async_chunk=self.async_chunk,
                        forward_fn=self.forward_fn, prewarm_fn=self.prewarm_fn,
                        request_queue_size=self.request_queue_size, shutdown_grace=self.shutdown_grace,
                        output_sink=None if self.in_loop_consumer else self._batches.put,
                        output_backlog=None if self.in_loop_consumer else self._batches.qsize)
                except BaseException as exc:
                    self.set_started(exc)
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
                self.set_started()
                await returned.wait()
                alive = _descendants(me, run_task)
                self.tasks_alive_after_run = len(alive)
                self.alive_after_run_names = [t.name for t in alive]
                self._close_stream()
                self.set_returned()
            app.cancel_scope.cancel()  # helpers the stages started in the application's nursery
        self.tasks_pending_at_loop_end = len(_descendants(me, set()))

    def abandon(self) -> None:
        """Cancel the application's nursery under a hung run() (shielded cleanup may still hang)."""
        if self.token is not None and self._app is not None:
            try:
                self.token.run_sync_soon(self._app.cancel_scope.cancel)
            except trio.RunFinishedError:
                pass

    def _close_stream(self) -> None:
        if not self._stream_closed:
            self._stream_closed = True
            self._batches.put(None)

    def take_batch(self, timeout: float) -> list[Message] | None:
        try:
            return self._batches.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"no output within {timeout}s") from None

    async def loop_next_batch(self) -> list[Message] | None:
        """Everything already in the output channel, waiting for the first (one scheduler pass)."""
        orch = self.orch
        assert orch is not None
        try:
            return await orch.next_batch()
        except trio.EndOfChannel:
            return None

    def loop_add(self, request_id: str, prompt: Any, final_stage_id: int | None = None) -> None:
        assert self.orch is not None
        self.orch.add_request_nowait(request_id, prompt, final_stage_id=final_stage_id)

    # ------------------------------------------------------------------ handovers
    def attach_replica(self, stage_id: int, member_id: str, handshake_s: float) -> None:
        """The join runs in the application's nursery (as a registrar's does), under the core's gate."""
        self.call_soon(self._spawn_join, stage_id, member_id, handshake_s)

    def _spawn_join(self, stage_id: int, member_id: str, handshake_s: float) -> None:
        assert self._app is not None
        self._app.start_soon(self._join, stage_id, member_id, handshake_s, name=f"join[{member_id}]")

    async def _join(self, stage_id: int, member_id: str, handshake_s: float) -> None:
        assert self.orch is not None
        outcome = "cancelled"
        try:
            await self.orch.joins.join(stage_id, member_id, functools.partial(trio.sleep, handshake_s))
            outcome = "joined"
        except JoinRefused as exc:
            outcome = f"refused:{exc.reason}"
        finally:
            self._joins[member_id] = outcome

    def join_outcomes(self) -> dict[str, str]:
        return dict(self._joins)

    def send_shutdown(self, timeout: float | None) -> None:
        assert self.orch is not None
        self.call_soon(self.orch.request_shutdown, timeout)

    def add_request(self, request_id: str, prompt: Any, *, final_stage_id: int | None = None,
                    wait: bool = True, timeout: float = 5.0, deadline: float | None = None,
                    **options: Any) -> None:
        assert self.orch is not None
        try:
            if wait:
                add = functools.partial(self._add_with_timeout, final_stage_id=final_stage_id,
                                        timeout=timeout, deadline=deadline, **options)
                trio.from_thread.run(add, request_id, prompt, trio_token=self.token)
            else:
                add = functools.partial(self.orch.add_request_nowait, final_stage_id=final_stage_id,
                                        timeout=deadline, **options)
                trio.from_thread.run_sync(add, request_id, prompt, trio_token=self.token)
        except trio.RunFinishedError as exc:
            raise RuntimeError("orchestrator is not running") from exc

    async def _add_with_timeout(self, request_id: str, prompt: Any, *, final_stage_id: int | None,
                                timeout: float, deadline: float | None, **options: Any) -> None:
        assert self.orch is not None
        with trio.fail_after(timeout):
            await self.orch.add_request(request_id, prompt, final_stage_id=final_stage_id,
                                        timeout=deadline, **options)

    def update_request(self, request_id: str, segment: Any, *, final: bool = False,
                       timeout: float = 5.0) -> None:
        assert self.orch is not None

        async def update() -> None:
            assert self.orch is not None
            with trio.fail_after(timeout):
                await self.orch.update_request(request_id, segment, final=final)

        try:
            trio.from_thread.run(update, trio_token=self.token)
        except trio.RunFinishedError as exc:
            raise RuntimeError("orchestrator is not running") from exc

    def post_request(self, request_id: str, prompt: Any, final_stage_id: int | None = None) -> None:
        """Post the add with the token (no wait); a full request channel queues it in a task."""
        assert self.token is not None
        self.token.run_sync_soon(self._post_add, request_id, prompt, final_stage_id)

    def _post_add(self, request_id: str, prompt: Any, final_stage_id: int | None) -> None:
        assert self.orch is not None and self._app is not None
        try:
            self.orch.add_request_nowait(request_id, prompt, final_stage_id=final_stage_id)
        except trio.WouldBlock:
            self._app.start_soon(
                functools.partial(self.orch.add_request, request_id, prompt, final_stage_id=final_stage_id))

    def abort(self, request_id: str) -> None:
        assert self.orch is not None
        try:
            self.call_soon(self.orch.abort_nowait, request_id)
        except trio.RunFinishedError:
            pass  # stopped: every request already had its terminal

    def collective_rpc(self, method: str, args: Sequence[Any] = (), kwargs: Mapping[str, Any] | None = None,
                       stage_ids: Iterable[int] | None = None, timeout: float = 5.0) -> list[RpcResult]:
        assert self.orch is not None
        call = functools.partial(self.orch.collective_rpc, method, args, kwargs, stage_ids, timeout)
        try:
            return trio.from_thread.run(call, trio_token=self.token)
        except trio.RunFinishedError as exc:
            raise RuntimeError("orchestrator is not running") from exc

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
    def router(self) -> Any:
        assert self.orch is not None
        return self.orch.router
