"""The benchmark's floor behind a :class:`~bench.drivers.base.Driver`: no orchestrator at all.

A bare Trio-token hand-off plus one memory-channel hop and a queue put: the
cheapest a thread bridge with a task in the middle can be, so the other rows
of the benchmark can be read as "routing and shell cost above the floor".
Outputs become ``OrchOutput`` messages one to one; submissions are
acknowledged directly so chain workloads can run.  It offers the benchmark's
calls only.
"""

from __future__ import annotations

import math
import queue
import time
from typing import Any

import trio

from bench.drivers.base import Driver
from trio_orch.types import Message, OrchOutput, StageOutput

__all__ = ["FloorDriver"]


class FloorDriver(Driver):
    """A token hand-off and one channel hop, no routing."""

    framework = "trio"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._batches: queue.SimpleQueue[list[Message] | None] = queue.SimpleQueue()
        self.token: trio.lowlevel.TrioToken | None = None
        self._send: trio.MemorySendChannel[tuple[int, list[StageOutput]]] | None = None
        self._done: trio.Event | None = None
        self._out_send: trio.MemorySendChannel[list[Message]] | None = None
        self._out_recv: trio.MemoryReceiveChannel[list[Message]] | None = None

    def thread_main(self) -> None:
        try:
            trio.run(self._main)
        except BaseException as exc:
            self.run_error = exc
        finally:
            self._batches.put(None)
            self.set_started()
            self.set_returned()

    async def _main(self) -> None:
        self.token = trio.lowlevel.current_trio_token()
        self._send, recv = trio.open_memory_channel[tuple[int, list[StageOutput]]](math.inf)
        self._done = trio.Event()
        self._out_send, self._out_recv = trio.open_memory_channel[list[Message]](math.inf)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._hop, recv)
            self.set_started()
            await self._done.wait()
            nursery.cancel_scope.cancel()

    async def _hop(self, recv: trio.MemoryReceiveChannel[tuple[int, list[StageOutput]]]) -> None:
        put = self._out_send.send_nowait if self.in_loop_consumer and self._out_send else self._batches.put
        sub = self.submitted.put
        finals, n = self.final_stage_ids, self.num_stages
        while True:
            stage_id, outs = await recv.receive()
            if stage_id in finals:
                put([OrchOutput(o.request_id, stage_id, o.data, o.finished) for o in outs])
            if stage_id + 1 < n and any(o.finished for o in outs):
                now = time.perf_counter()
                for o in outs:
                    if o.finished:
                        sub((stage_id + 1, o.request_id, now))

    # ------------------------------------------------------------------ in the loop
    def run_in_loop(self, afn: Any, *args: Any, timeout: float = 10.0) -> Any:
        async def bounded() -> Any:
            with trio.fail_after(timeout):
                return await afn(*args)

        return trio.from_thread.run(bounded, trio_token=self.token)

    async def loop_next_batch(self) -> list[Message] | None:
        assert self._out_recv is not None
        return await self._out_recv.receive()

    def loop_emit(self, stage: int, outputs: list[StageOutput]) -> None:
        assert self._send is not None
        self._send.send_nowait((stage, outputs))

    def loop_add(self, request_id: str, prompt: Any, final_stage_id: int | None = None) -> None:
        self.record_submission(0, request_id)

    def send_shutdown(self, timeout: float | None) -> None:
        assert self.token is not None and self._done is not None
        self.token.run_sync_soon(self._done.set)

    def take_batch(self, timeout: float) -> list[Message] | None:
        try:
            return self._batches.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"no output within {timeout}s") from None

    def post_request(self, request_id: str, prompt: Any, final_stage_id: int | None = None) -> None:
        trio.from_thread.run_sync(self.record_submission, 0, request_id, trio_token=self.token)

    def emit_batch(self, stage: int, outputs: list[StageOutput]) -> None:
        assert self.token is not None and self._send is not None
        self.token.run_sync_soon(self._send.send_nowait, (stage, outputs))
