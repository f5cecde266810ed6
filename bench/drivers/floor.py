"""The benchmark's floors for in-process stages, behind a :class:`~bench.drivers.base.Driver`.

A floor takes every hop its path cannot do without and nothing else, so no
implementation can come in under it by skipping one of its hops; what an
implementation measures above it is its routing and its shell.  One driver,
two paths (the ``in_loop_consumer`` option picks, as it does for the
implementations beside it):

* **thread hand-off floor** (the thread workloads: ``a_seq``, ``c_chain``,
  ``b_*``): the producer thread hands a batch to a second thread, which
  turns the outputs into ``OrchOutput`` messages and hands them to the
  consumer thread -- two thread wake-ups on plain ``queue.SimpleQueue``
  (a futex each, no event loop, no task).  Every implementation's bridge
  pays those two wake-ups (with an event loop's wake-up on the way in);
  batches that arrive together leave as one, as a push path's burst does.
* **in-loop floor** (``loop_*``): a producer task's output goes straight
  into a Trio memory channel that the consumer task waits on -- one task
  wake-up, the one every implementation's in-loop path needs to reach its
  consumer.  No thread, no dispatcher task, no reader task.

Submissions are acknowledged where they are decided (so chain workloads
run); there is no routing at all.  The ZMQ path's floor is
:mod:`bench.drivers.zmq_floor`.
"""

from __future__ import annotations

import math
import queue
import time
from typing import Any

import trio

from bench.drivers.base import Driver
from trio_orch.types import Message, OrchOutput, StageOutput

__all__ = ["PATHS", "FloorDriver"]

#: what each floor bounds: the path -> the hops the floor takes
PATHS = {
    "thread": "producer thread -> a second thread -> consumer thread (two futex wake-ups, no loop, "
              "no task)",
    "loop": "producer task -> memory channel -> consumer task (one task wake-up, no thread)",
}

_STOP = object()


class FloorDriver(Driver):
    """The thread hand-off floor, or with ``in_loop_consumer`` the in-loop floor (see the module)."""

    framework = "threads"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.in_loop_consumer:
            self.framework = "trio"
        self.path = "loop" if self.in_loop_consumer else "thread"
        self._inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._batches: queue.SimpleQueue[list[Message] | None] = queue.SimpleQueue()
        self.token: trio.lowlevel.TrioToken | None = None
        self._done: trio.Event | None = None
        self._out_send: trio.MemorySendChannel[list[Message]] | None = None
        self._out_recv: trio.MemoryReceiveChannel[list[Message]] | None = None

    def thread_main(self) -> None:
        try:
            if self.in_loop_consumer:
                trio.run(self._loop_main)
            else:
                self._thread_main()
        except BaseException as exc:
            self.run_error = exc
        finally:
            self._batches.put(None)
            self.set_started()
            self.set_returned()

    def _messages(self, stage_id: int, outs: list[StageOutput], into: list[Message]) -> None:
        """The consumer's messages of one stage batch, and the submits its finished outputs decide."""
        if stage_id in self.final_stage_ids:
            into.extend(OrchOutput(o.request_id, stage_id, o.data, o.finished) for o in outs)
        if stage_id + 1 < self.num_stages:
            now = time.perf_counter()
            for o in outs:
                if o.finished:
                    self.submitted.put((stage_id + 1, o.request_id, now))

    # ------------------------------------------------------------------ thread hand-off floor
    def _thread_main(self) -> None:
        inbox, out = self._inbox, self._batches
        self.set_started()
        while True:
            item = inbox.get()
            batch: list[Message] = []
            while True:  # everything that arrived meanwhile leaves in one batch
                if item is _STOP:
                    if batch:
                        out.put(batch)
                    return
                if type(item) is str:
                    self.record_submission(0, item)
                else:
                    self._messages(item[0], item[1], batch)
                try:
                    item = inbox.get_nowait()
                except queue.Empty:
                    break
            if batch:
                out.put(batch)

    # ------------------------------------------------------------------ in-loop floor
    async def _loop_main(self) -> None:
        self.token = trio.lowlevel.current_trio_token()
        self._done = trio.Event()
        self._out_send, self._out_recv = trio.open_memory_channel[list[Message]](math.inf)
        self.set_started()
        await self._done.wait()

    def run_in_loop(self, afn: Any, *args: Any, timeout: float = 10.0) -> Any:
        async def bounded() -> Any:
            with trio.fail_after(timeout):
                return await afn(*args)

        return trio.from_thread.run(bounded, trio_token=self.token)

    async def loop_next_batch(self) -> list[Message] | None:
        """Everything already in the channel, waiting for the first (as the Trio driver's)."""
        assert self._out_recv is not None
        batch = list(await self._out_recv.receive())
        while True:
            try:
                batch.extend(self._out_recv.receive_nowait())
            except trio.WouldBlock:
                return batch

    def loop_emit(self, stage: int, outputs: list[StageOutput]) -> None:
        assert self._out_send is not None
        batch: list[Message] = []
        self._messages(stage, outputs, batch)
        if batch:
            self._out_send.send_nowait(batch)

    def loop_add(self, request_id: str, prompt: Any, final_stage_id: int | None = None) -> None:
        self.record_submission(0, request_id)

    # ------------------------------------------------------------------ the thread's calls
    def send_shutdown(self, timeout: float | None) -> None:
        if self.in_loop_consumer:
            assert self.token is not None and self._done is not None
            self.token.run_sync_soon(self._done.set)
        else:
            self._inbox.put(_STOP)

    def take_batch(self, timeout: float) -> list[Message] | None:
        try:
            return self._batches.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"no output within {timeout}s") from None

    def post_request(self, request_id: str, prompt: Any, final_stage_id: int | None = None) -> None:
        if self.in_loop_consumer:
            trio.from_thread.run_sync(self.record_submission, 0, request_id, trio_token=self.token)
        else:
            self._inbox.put(request_id)

    def emit_batch(self, stage: int, outputs: list[StageOutput]) -> None:
        if self.in_loop_consumer:
            assert self.token is not None
            self.token.run_sync_soon(self.loop_emit, stage, outputs)
        else:
            self._inbox.put((stage, outputs))
