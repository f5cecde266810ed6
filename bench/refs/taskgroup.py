"""The modern asyncio reference: the same orchestrator under ``asyncio.TaskGroup`` (3.11+).

Same thread/loop boundary, janus queues, request handler, reader-per-stage and
serial dispatcher as :class:`bench.refs.omni.OmniEventDriven`, but the tasks
live in one :class:`asyncio.TaskGroup`: a task that crashes cancels its
siblings and the error comes out of ``run()`` as an ``ExceptionGroup``;
shutdown cancels the group's tasks and the group waits for them, at most
``shutdown_grace`` before an ``asyncio.timeout`` cancels them a second time;
the cleanup is bounded with ``asyncio.timeout`` too; there is no
``all_tasks()`` sweep (the
thread runs the loop with :class:`asyncio.Runner`, whose close cancels what is
left).  Readers use ``Task.cancelling()`` (3.11+) to tell a cancellation of
their own task from a ``CancelledError`` raised by the stage client (pyzmq
raises one when a socket is closed under a pending ``recv``).

What TaskGroup does not change is that cancellation stays edge-triggered: a
task that catches ``CancelledError`` once and keeps awaiting is not cancelled
again until something delivers a second cancel (here: the stop deadline).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from bench.refs.control import RpcMsg, concurrent_rpc
from bench.refs.orchestrator import AsyncioOrchestrator
from trio_orch.types import StageClient, StageDied

__all__ = ["TaskGroupOrchestrator"]

log = logging.getLogger("bench.refs.taskgroup")


class TaskGroupOrchestrator(AsyncioOrchestrator):
    """Event-driven asyncio orchestrator with structured task supervision."""

    variant = "asyncio-taskgroup"
    description = "modern asyncio: the same under asyncio.TaskGroup + asyncio.timeout, no sweep"
    use_runner = True
    bounded_cleanup = True
    _tg: asyncio.TaskGroup
    _rpc_tasks: set[asyncio.Task[None]]

    async def run(self) -> None:
        try:
            # The stop is bounded: if the group's tasks have not finished ``shutdown_grace``
            # after being cancelled, the deadline cancels this task, and TaskGroup answers
            # that by cancelling its children once more.
            async with asyncio.timeout(None) as stop_deadline:
                async with asyncio.TaskGroup() as tg:
                    self._tg, self._rpc_tasks = tg, set()
                    ready_q: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
                    tasks = [tg.create_task(self.request_handler(), name="orchestrator-request-handler"),
                             tg.create_task(self._dispatcher(ready_q), name="orchestrator-dispatcher")]
                    tasks += [tg.create_task(self.reader(k, s, ready_q), name=f"orchestrator-reader-{k}")
                              for k, s in enumerate(self.stages)]
                    await self.wait_stop_requested()
                    self.stopping.set()
                    stop_deadline.reschedule(asyncio.get_running_loop().time() + self.shutdown_grace)
                    for t in (*tasks, *self._rpc_tasks):
                        t.cancel()
        except TimeoutError:
            log.warning("orchestrator tasks still running %.1fs after cancel; cancelled them again",
                        self.shutdown_grace)
        finally:
            self.stopping.set()
            await self.finish()

    async def stop_joins(self) -> None:
        """Structured: the core's rule, every handshake in progress is cancelled at once."""
        tasks = list(self.join_tasks.values())
        self.cancel_joins()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)

    async def handle_rpc(self, msg: RpcMsg) -> None:
        """A task of the group asks every stage at once; the request handler moves on."""
        task = self._tg.create_task(concurrent_rpc(self.stages, msg), name=f"orchestrator-rpc-{msg.method}")
        self._rpc_tasks.add(task)
        task.add_done_callback(self._rpc_tasks.discard)

    async def _dispatcher(self, ready_q: asyncio.Queue[tuple[int, Any]]) -> None:
        while True:
            stage_id, item = await ready_q.get()
            await self.perform(self.route(stage_id, item))

    async def reader(self, stage_id: int, stage: StageClient, ready_q: asyncio.Queue[Any]) -> None:
        try:
            while True:
                outs = await stage.receive()
                ready_q.put_nowait((stage_id, outs))
        except asyncio.CancelledError as exc:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise  # our own cancellation
            ready_q.put_nowait((stage_id, StageDied.of(exc)))
        except Exception as exc:
            ready_q.put_nowait((stage_id, StageDied.of(exc)))
