"""The engine's thread adapter, :class:`trio_orch.engine.bridge.ThreadEngine`, behind a driver.

Where :class:`bench.drivers.trio.TrioDriver` reads the orchestrator's whole
output stream through one queue, this driver consumes through the ThreadEngine's
public sync API: one :class:`~trio_orch.engine.handles.RequestHandle` per request (the
per-request demultiplexing a serving front gets).  :meth:`EngineDriver.next_batch`
serves the open handles round-robin, so with many concurrent requests a
message can wait behind its siblings in the consumer: that wait is part of
what it measures.  It offers the benchmark's calls only (post, hand over,
consume, submissions).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from bench.drivers.base import Driver, ShutdownReport
from trio_orch.engine import RequestHandle, ThreadEngine
from trio_orch.engine.base import static_pipeline
from trio_orch.testing import PushScriptedStage
from trio_orch.types import Message

__all__ = ["EngineDriver"]


class EngineDriver(Driver):
    """trio-orch through ``ThreadEngine``: push scripted stages, one handle per request."""

    framework = "trio"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.engine: ThreadEngine | None = None
        self._handles: list[RequestHandle] = []
        self._next = 0

    def start(self, timeout: float | None = None) -> EngineDriver:
        if self.engine is not None:
            return self
        self.stages = [PushScriptedStage(k, on_submit=self.record_submission) for k in range(self.num_stages)]
        self.engine = ThreadEngine(static_pipeline(self.stages, self.final_stage_ids),
                             startup_timeout=self.startup_timeout if timeout is None else timeout)
        self.engine.start()
        self.thread = self.engine.run_sync_in_trio(threading.current_thread)
        return self

    def shutdown(self, timeout: float | None = None, *, wait: float = 5.0) -> ShutdownReport:
        assert self.engine is not None
        t0 = time.perf_counter()
        self.engine.close(drain=timeout)
        stopped = self.engine.join(wait)
        return ShutdownReport(time.perf_counter() - t0, not stopped, None, None)

    def join(self, timeout: float) -> bool:
        return self.engine is None or self.engine.join(timeout)

    @property
    def stopped(self) -> bool:
        return self.engine is not None and not self.engine.running

    def post_request(self, request_id: str, prompt: Any, final_stage_id: int | None = None) -> None:
        assert self.engine is not None
        self._handles.append(self.engine.add_request(prompt, request_id=request_id,
                                                     final_stage_id=final_stage_id))

    def take_batch(self, timeout: float) -> list[Message] | None:
        handles = self._handles
        if not handles:
            raise TimeoutError("no open request")
        i = self._next % len(handles)
        h = handles[i]
        msg = h.get(timeout)
        if msg.finished:
            del handles[i]
        else:
            self._next = i + 1
        return [msg]

    def call_soon(self, fn: Callable[..., Any], *args: Any) -> None:
        assert self.engine is not None
        self.engine.call_soon(fn, *args)
