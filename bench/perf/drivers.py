"""Thread-side drivers: one orchestrator implementation each, driven from the main thread.

The benchmark (DESIGN §5, issue 6) measures every implementation through the
same small interface, from the main thread, so the numbers include the thread
bridge exactly as a serving front would see it:

* ``hand_over(stage, outputs)`` gives outputs to a stage client through the
  implementation's thread-safe entry (one wakeup of the orchestrator thread);
  each output carries ``t_produced`` taken just before the hand-over;
* ``get()`` blocks the main thread until the consumer side of the bridge
  yields the next batch of delivered messages;
* ``wait_submission()`` returns ``(stage, request_id, t_submitted)`` as the
  stage client records it when the orchestrator submits to it.
"""

from __future__ import annotations

import math
import queue
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from functools import partial
from typing import Any

import trio

from trio_orch.orchestrator import Orchestrator
from trio_orch.types import Message, OrchOutput, StageOutput

__all__ = ["BenchDriver", "FloorDriver", "TrioDriver", "thread_cpu_seconds"]


def thread_cpu_seconds(thread: threading.Thread) -> float:
    """CPU time consumed so far by ``thread`` (Linux: its pthread CPU clock)."""
    ident = thread.ident
    if ident is None:
        return 0.0
    try:
        return time.clock_gettime(time.pthread_getcpuclockid(ident))
    except (OSError, AttributeError):  # thread gone, or not Linux
        return 0.0


class BenchDriver(ABC):
    """One implementation under test, started in its own thread."""

    name: str = "?"
    description: str = ""

    def __init__(self) -> None:
        self.submissions: queue.SimpleQueue[tuple[int, str, float]] = queue.SimpleQueue()
        self.outputs: queue.SimpleQueue[list[Message]] = queue.SimpleQueue()
        self.thread: threading.Thread | None = None

    @abstractmethod
    def start(self, num_stages: int, final_stage_ids: set[int]) -> None:
        """Start the implementation in a background thread; return once it is ready."""

    @abstractmethod
    def add_request(self, request_id: str, prompt: Any, final_stage_id: int | None = None) -> None:
        """Add a request from the main thread (may block on backpressure)."""

    @abstractmethod
    def hand_over(self, stage_id: int, outputs: list[StageOutput]) -> None:
        """Give outputs to stage ``stage_id``'s client through the thread-safe entry."""

    @abstractmethod
    def shutdown(self) -> None:
        """Stop the implementation and join its thread."""

    def get(self, timeout: float = 10.0) -> list[Message]:
        """The next batch of messages delivered to the consumer (main thread)."""
        return self.outputs.get(timeout=timeout)

    def wait_submission(self, timeout: float = 10.0) -> tuple[int, str, float]:
        return self.submissions.get(timeout=timeout)

    startup_timeout = 10.0

    def _start_thread(self, *args: Any) -> None:
        """Run ``self._thread_main(*args)`` in a thread; return once it set ``_ready``."""
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self.thread = threading.Thread(target=self._thread_main, args=args,  # type: ignore[attr-defined]
                                       name=f"bench-{self.name}", daemon=True)
        self.thread.start()
        if not self._ready.wait(self.startup_timeout):
            raise RuntimeError(f"{self.name}: did not start within {self.startup_timeout:.0f} s")
        if self._error is not None:
            raise RuntimeError(f"{self.name}: failed to start") from self._error

    def cpu_seconds(self) -> float:
        """CPU time of the orchestrator thread so far."""
        return thread_cpu_seconds(self.thread) if self.thread else 0.0


class _FedStage:
    """A Trio stage client fed from the main thread via the Trio token.

    Offers both ``receive`` and the push fast path ``pump``: once pumped,
    ``feed`` (run by the token's callback) hands batches straight to the
    orchestrator.
    """

    def __init__(self, stage_id: int, submissions: queue.SimpleQueue[tuple[int, str, float]],
                 push: bool = True) -> None:
        self.stage_id = stage_id
        self._submissions = submissions
        self._send, self._recv = trio.open_memory_channel[list[StageOutput]](math.inf)
        self._deliver: Callable[[list[StageOutput]], None] | None = None
        if not push:
            self.pump = None  # type: ignore[assignment]

    def feed(self, outputs: list[StageOutput]) -> None:
        if self._deliver is not None:
            self._deliver(outputs)
        else:
            self._send.send_nowait(outputs)

    async def pump(self, deliver: Callable[[list[StageOutput]], None]) -> None:
        self._deliver = deliver
        try:
            await trio.sleep_forever()
        finally:
            self._deliver = None

    async def submit(self, request_id: str, payload: Any) -> None:
        self._submissions.put((self.stage_id, request_id, time.perf_counter()))

    async def abort(self, request_ids: list[str]) -> None:
        pass

    async def receive(self) -> list[StageOutput]:
        batch = await self._recv.receive()
        while True:
            try:
                more = self._recv.receive_nowait()
            except trio.WouldBlock:
                return batch
            batch = batch + more

    async def aclose(self) -> None:
        self._send.close()


class _TrioThread(BenchDriver):
    """Common part: ``trio.run`` in a thread, readiness via an Event, stop via the token."""

    def start(self, num_stages: int, final_stage_ids: set[int]) -> None:
        self._start_thread(num_stages, final_stage_ids)

    def _thread_main(self, num_stages: int, final_stage_ids: set[int]) -> None:
        try:
            trio.run(self._trio_main, num_stages, final_stage_ids)
        except BaseException as exc:
            self._error = exc
            self._ready.set()

    async def _trio_main(self, num_stages: int, final_stage_ids: set[int]) -> None:
        raise NotImplementedError

    def shutdown(self) -> None:
        self.token.run_sync_soon(self._stop)
        assert self.thread is not None
        self.thread.join(3 * self.startup_timeout)
        if self.thread.is_alive():
            raise RuntimeError(f"{self.name}: thread did not stop within {3 * self.startup_timeout:.0f} s")

    def _stop(self) -> None:
        raise NotImplementedError


class TrioDriver(_TrioThread):
    """The trio-orch :class:`Orchestrator`; the output sink wakes the consumer once per batch."""

    name = "trio"
    description = "trio-orch Orchestrator (Trio thread, token in, one queue put per batch out)"
    push = True

    async def _trio_main(self, num_stages: int, final_stage_ids: set[int]) -> None:
        self.token = trio.lowlevel.current_trio_token()
        self.stages = [_FedStage(k, self.submissions, self.push) for k in range(num_stages)]
        self.orch = Orchestrator(self.stages, final_stage_ids, output_sink=self.outputs.put)
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            await nursery.start(self.orch.run)
            self._ready.set()

    def _stop(self) -> None:
        self.orch.request_shutdown()

    def add_request(self, request_id: str, prompt: Any, final_stage_id: int | None = None) -> None:
        """Post the add with the token (no wait); a full request channel queues it in a task."""
        self.token.run_sync_soon(self._add, request_id, prompt, final_stage_id)

    def _add(self, request_id: str, prompt: Any, final_stage_id: int | None) -> None:
        try:
            self.orch.add_request_nowait(request_id, prompt, final_stage_id=final_stage_id)
        except trio.WouldBlock:
            self._nursery.start_soon(
                partial(self.orch.add_request, request_id, prompt, final_stage_id=final_stage_id))

    def hand_over(self, stage_id: int, outputs: list[StageOutput]) -> None:
        self.token.run_sync_soon(self.stages[stage_id].feed, outputs)


class FloorDriver(_TrioThread):
    """The floor: a bare thread hand-off plus one channel hop, no routing at all.

    Outputs become ``OrchOutput`` messages one to one (as cheap as routing can
    get); submissions are acknowledged directly so chain workloads can run.
    """

    name = "floor"
    description = "bare token hand-off + one Trio channel hop + queue put, no routing"

    async def _trio_main(self, num_stages: int, final_stage_ids: set[int]) -> None:
        self.token = trio.lowlevel.current_trio_token()
        self._send, recv = trio.open_memory_channel[tuple[int, list[StageOutput]]](math.inf)
        self._finals = final_stage_ids
        self._num_stages = num_stages
        self._done = trio.Event()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._hop, recv)
            self._ready.set()
            await self._done.wait()
            nursery.cancel_scope.cancel()

    async def _hop(self, recv: trio.MemoryReceiveChannel[tuple[int, list[StageOutput]]]) -> None:
        put = self.outputs.put
        sub = self.submissions.put
        while True:
            stage_id, outs = await recv.receive()
            if stage_id in self._finals:
                put([OrchOutput(o.request_id, stage_id, o.data, o.finished) for o in outs])
            if stage_id + 1 < self._num_stages and any(o.finished for o in outs):
                now = time.perf_counter()
                for o in outs:
                    if o.finished:
                        sub((stage_id + 1, o.request_id, now))

    def _stop(self) -> None:
        self._done.set()

    def add_request(self, request_id: str, prompt: Any, final_stage_id: int | None = None) -> None:
        trio.from_thread.run_sync(self._admit, request_id, trio_token=self.token)

    def _admit(self, request_id: str) -> None:
        self.submissions.put((0, request_id, time.perf_counter()))

    def hand_over(self, stage_id: int, outputs: list[StageOutput]) -> None:
        self.token.run_sync_soon(self._send.send_nowait, (stage_id, outputs))
