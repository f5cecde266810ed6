"""Over real worker processes, every shell with a routing core keeps the start order at the worker.

A worker that holds a backlog (one replica batching one request, the head
bounding nothing) lets a later urgent request join its batch before the
queued low-priority ones -- for the Trio orchestrator and for the asyncio
references, which start every add at once and so rely on the worker's order
alone.
"""

from __future__ import annotations

import pytest

from bench.implementations import make_driver, names
from stages.config import PipelineConfig, StageConfig
from trio_orch.types import OrchOutput

pytestmark = pytest.mark.processes  # real worker processes

#: the shells with a routing core that run over worker processes (zmq-floor has no core)
SHELLS = [n for n in names("workers") if n != "zmq-floor"]


def slow_echo() -> PipelineConfig:
    stage = StageConfig("echo", replicas=1, max_batch=1, model={"outputs": 25},
                        worker_args=["--step-delay-ms", "20"])
    return PipelineConfig([stage], final_stage_ids=[0]).validate()  # no head bound: the worker queues


@pytest.mark.parametrize("impl", SHELLS)
def test_a_later_urgent_request_leaves_the_workers_backlog_first(impl: str) -> None:
    with make_driver(impl, workers=slow_echo()).start() as h:
        h.add_request("busy", "b")
        msgs = [h.next_output(timeout=60)]  # the batch of one is occupied
        for i in range(3):
            h.add_request(f"low{i}", f"l{i}", priority=5)
        h.add_request("urgent", "u", priority=-5)
        while sum(m.finished for m in msgs) < 5:
            msgs.extend(h.next_batch(timeout=60))
    assert all(isinstance(m, OrchOutput) for m in msgs), msgs
    firsts: list[str] = []
    for m in msgs:
        if m.request_id not in firsts:
            firsts.append(m.request_id)
    assert firsts == ["busy", "urgent", "low0", "low1", "low2"]  # equal priorities: arrival order
