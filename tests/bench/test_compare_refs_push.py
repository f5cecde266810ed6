"""The push fast path, on both shells that have it: trio and the asyncio-taskgroup reference.

The benchmark feeds its in-process stages with ``push=True``; the TaskGroup
reference takes the same path as the Trio shell (``pump(deliver)``, routed at
once while the dispatcher is idle), so the comparison's design choices
include it.  Routing through it must keep the contract: order, forwards,
one terminal, a dead stage's requests ended.
"""

from __future__ import annotations

import pytest

from bench.implementations import make_driver
from bench.perf.workloads import uses_push
from bench.refs.testing import AsyncPushScriptedStage
from stages.config import echo_config
from trio_orch.testing import PushScriptedStage
from trio_orch.types import OrchError, OrchOutput

PUSH_STAGE = {"trio": PushScriptedStage, "asyncio-taskgroup": AsyncPushScriptedStage}


def forward(k, prompt, outs):
    return f"{prompt}|{k}:{'+'.join(outs)}"


@pytest.mark.parametrize("impl", list(PUSH_STAGE))
def test_pushed_batches_are_routed_in_order_and_forwarded(impl: str) -> None:
    with make_driver(impl, 2, {0, 1}, forward_fn=forward, push=True).start() as h:
        assert all(type(s) is PUSH_STAGE[impl] for s in h.stages)
        h.add_request("r1", "p")
        for i in range(20):  # a burst: routed at once or queued, never reordered
            h.emit(0, "r1", str(i), finished=i == 19)
        got = h.collect(20)
        assert [m.data for m in got] == [str(i) for i in range(20)]
        assert h.wait_until(lambda: h.submissions(1))
        assert h.submissions(1) == [("r1", "p|0:" + "+".join(str(i) for i in range(20)))]
        h.emit(1, "r1", "end", finished=True)
        assert h.next_output() == OrchOutput("r1", 1, "end", True)


@pytest.mark.parametrize("impl", list(PUSH_STAGE))
def test_a_pumped_stage_that_dies_ends_its_requests(impl: str) -> None:
    with make_driver(impl, 2, {1}, push=True).start() as h:
        h.add_request("r1", "p")
        h.emit(0, "r1", None, finished=True)
        assert h.wait_until(lambda: h.submissions(1))
        h.fail_stage(1, RuntimeError("stage 1 process exited"))
        msg = h.next_output()
        assert isinstance(msg, OrchError) and msg.kind == "replica_died" and msg.finished


@pytest.mark.processes
@pytest.mark.parametrize(("impl", "push"),
                         [("trio", True), ("asyncio-taskgroup", True), ("omni-event", False)])
def test_over_zmq_workers_the_shells_with_the_push_path_take_it(impl: str, push: bool) -> None:
    """The asyncio ZMQ client pumps as the Trio one does; the vLLM-Omni-shaped reference keeps receive()."""
    with make_driver(impl, workers=echo_config(1, final_stage_ids=[0], outputs=3)).start() as h:
        assert uses_push(h) is push
        for rid in ("a", "b"):
            h.add_request(rid, "x")
        msgs = []
        while sum(m.finished for m in msgs) < 2:
            msgs.append(h.next_output(timeout=10))
        for rid in ("a", "b"):
            mine = [m for m in msgs if m.request_id == rid]
            assert [m.finished for m in mine] == [False, False, True] and all(
                isinstance(m, OrchOutput) for m in mine)
