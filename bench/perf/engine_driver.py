"""Benchmark driver for the production thread bridge, :class:`trio_orch.bridge.Engine`.

Where :class:`bench.perf.drivers.TrioDriver` reads the orchestrator's whole output
stream through one queue, this driver consumes through the Engine's public
sync API: one :class:`~trio_orch.bridge.RequestHandle` per request (the
per-request demultiplexing a serving front gets).  ``get`` serves the open
handles round-robin, so with many concurrent requests a message can wait
behind its siblings in the consumer: that wait is part of what it measures.
"""

from __future__ import annotations

from typing import Any

from bench.perf.drivers import BenchDriver, Message, _FedStage
from trio_orch.bridge import Engine, RequestHandle
from trio_orch.engine_base import static_pipeline
from trio_orch.types import StageOutput

__all__ = ["EngineDriver"]


class EngineDriver(BenchDriver):
    name = "trio-engine"
    description = "trio-orch through the production Engine bridge: one RequestHandle per request"

    def start(self, num_stages: int, final_stage_ids: set[int]) -> None:
        self.stages = [_FedStage(k, self.submissions) for k in range(num_stages)]
        self.engine = Engine(static_pipeline(self.stages, final_stage_ids), startup_timeout=10)
        self.engine.start()
        self.thread = self.engine._thread
        self._handles: list[RequestHandle] = []
        self._next = 0

    def add_request(self, request_id: str, prompt: Any, final_stage_id: int | None = None) -> None:
        self._handles.append(self.engine.add_request(prompt, request_id=request_id,
                                                     final_stage_id=final_stage_id))

    def hand_over(self, stage_id: int, outputs: list[StageOutput]) -> None:
        self.engine.call_soon(self.stages[stage_id].feed, outputs)

    def get(self, timeout: float = 10.0) -> list[Message]:
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

    def shutdown(self) -> None:
        self.engine.close()
