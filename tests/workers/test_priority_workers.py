"""Real worker processes over ZMQ: a worker's backlog joins its batch in the head's order."""

from __future__ import annotations

import pytest
import trio

from stages.config import PipelineConfig, StageConfig
from trio_orch import Orchestrator, OrchOutput
from trio_orch.cluster.launcher import open_pipeline
from trio_orch.types import Message

pytestmark = pytest.mark.processes  # real worker processes


def one_slow_echo() -> PipelineConfig:
    stage = StageConfig("echo", replicas=1, max_batch=1, model={"outputs": 10},
                        worker_args=["--step-delay-ms", "20"])
    return PipelineConfig([stage], final_stage_ids=[0]).validate()


async def test_a_later_urgent_request_leaves_the_workers_backlog_first() -> None:
    async with open_pipeline(one_slow_echo()) as pipe:
        kwargs = {**pipe.orchestrator_kwargs(), "max_inflight": None}  # no head bound: the worker queues
        orch = Orchestrator(pipe.stages, **kwargs)
        msgs: list[Message] = []
        async with trio.open_nursery() as nursery:
            await nursery.start(orch.run)
            with trio.fail_after(60):
                await orch.add_request("busy", "b")
                msgs.append(await orch.next_output())  # the batch of one is occupied
                for i in range(3):
                    await orch.add_request(f"low{i}", f"l{i}", priority=5)
                await orch.add_request("urgent", "u", priority=-5)
                assert orch.queued_requests == 0  # all submitted: the worker holds the backlog
                while sum(m.finished for m in msgs) < 5:
                    msgs.append(await orch.next_output())
            await orch.shutdown()
    assert all(isinstance(m, OrchOutput) for m in msgs)
    firsts: list[str] = []
    for m in msgs:
        if m.request_id not in firsts:
            firsts.append(m.request_id)
    assert firsts == ["busy", "urgent", "low0", "low1", "low2"]  # equal priorities: arrival order
    assert {m.request_id for m in msgs if m.finished} == {"busy", "urgent", "low0", "low1", "low2"}
