"""Benchmark drivers for the asyncio references (see :mod:`bench.perf.drivers`).

Each runs one of the ``bench`` asyncio orchestrators the vLLM-Omni way: a
thread with its own event loop, janus queues as the bridge (adds go into the
request queue's ``sync_q``, output batches come out of the output queue's
``sync_q``), stage hand-overs via ``loop.call_soon_threadsafe`` (one wakeup).
"""

from __future__ import annotations

import asyncio
import queue
import time
from collections.abc import Callable
from typing import Any

import janus

from bench.perf.drivers import BenchDriver, Message
from bench.refs.omni import OmniEventDriven, OmniPolling
from bench.refs.orchestrator import AsyncioOrchestrator
from bench.refs.taskgroup import TaskGroupOrchestrator
from trio_orch.types import StageOutput

__all__ = ["ASYNCIO_DRIVERS", "AsyncioDriver"]


class _FedAsyncStage:
    """An asyncio stage client fed from the main thread via ``call_soon_threadsafe``."""

    def __init__(self, stage_id: int, submissions: queue.SimpleQueue[tuple[int, str, float]]) -> None:
        self.stage_id = stage_id
        self._submissions = submissions
        self._q: asyncio.Queue[list[StageOutput]] = asyncio.Queue()

    def feed(self, outputs: list[StageOutput]) -> None:
        self._q.put_nowait(outputs)

    async def submit(self, request_id: str, payload: Any) -> None:
        self._submissions.put((self.stage_id, request_id, time.perf_counter()))

    async def abort(self, request_ids: list[str]) -> None:
        pass

    async def receive(self) -> list[StageOutput]:
        batch = await self._q.get()
        while not self._q.empty():
            batch = batch + self._q.get_nowait()
        return batch

    async def aclose(self) -> None:
        pass


class AsyncioDriver(BenchDriver):
    orchestrator_cls: type[AsyncioOrchestrator] = OmniEventDriven

    def start(self, num_stages: int, final_stage_ids: set[int]) -> None:
        self._start_thread(num_stages, final_stage_ids)

    def _thread_main(self, num_stages: int, final_stage_ids: set[int]) -> None:
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(self._amain(num_stages, final_stage_ids))
        except BaseException as exc:
            self._error = exc
        finally:
            self._ready.set()
            loop.close()

    async def _amain(self, num_stages: int, final_stage_ids: set[int]) -> None:
        self.loop = asyncio.get_running_loop()
        self.stages = [_FedAsyncStage(k, self.submissions) for k in range(num_stages)]
        self.orch = self.orchestrator_cls(self.stages, final_stage_ids)
        self._ready.set()
        try:
            await self.orch.run()
        finally:
            self.orch.output_queue.shutdown()

    def add_request(self, request_id: str, prompt: Any, final_stage_id: int | None = None) -> None:
        """Accept and put the add on the janus request queue (no wait; blocks only when it is full)."""
        self.orch.add_request(request_id, prompt, final_stage_id=final_stage_id)

    def hand_over(self, stage_id: int, outputs: list[StageOutput]) -> None:
        self.loop.call_soon_threadsafe(self.stages[stage_id].feed, outputs)

    def get(self, timeout: float = 10.0) -> list[Message]:
        try:
            return self.orch.output_queue.sync_q.get(timeout=timeout)
        except janus.SyncQueueShutDown:
            raise RuntimeError(f"{self.name}: stopped") from None

    def shutdown(self) -> None:
        self.loop.call_soon_threadsafe(self.orch.request_shutdown, None)
        assert self.thread is not None
        self.thread.join(10)
        if self.thread.is_alive():
            raise RuntimeError(f"{self.name}: thread did not stop within 10 s")


class OmniEventDriver(AsyncioDriver):
    name = "omni-event"
    description = "vLLM-Omni style asyncio: janus bridge, reader per stage -> ready queue -> dispatcher"
    orchestrator_cls = OmniEventDriven


class OmniPollDriver(AsyncioDriver):
    name = "omni-poll"
    description = "vLLM-Omni legacy polling loop: each stage polled with a 1 ms wait, 1 ms sleep when idle"
    orchestrator_cls = OmniPolling


class TaskGroupDriver(AsyncioDriver):
    name = "asyncio-taskgroup"
    description = "modern asyncio: the same under asyncio.TaskGroup"
    orchestrator_cls = TaskGroupOrchestrator


ASYNCIO_DRIVERS: dict[str, Callable[[], BenchDriver]] = {
    d.name: d for d in (OmniEventDriver, OmniPollDriver, TaskGroupDriver)
}
