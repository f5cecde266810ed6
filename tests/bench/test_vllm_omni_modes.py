"""The real vLLM-Omni driven in the comparison's other modes: in-loop consumer, async chunk, CFG companions.

Skipped where vLLM-Omni is not installed (``bash bench/setup_vllm_omni.sh``);
there, run with ``.venv-vllm/bin/python -m pytest``.  Each test drives the
installed ``vllm_omni.engine.orchestrator.Orchestrator``: what it asserts is
what that code did with the fed stages.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from bench.drivers import vllm_omni
from trio_orch.types import OrchOutput, StageOutput

pytestmark = pytest.mark.skipif(not vllm_omni.available(),
                                reason="vLLM-Omni is not installed (bench/setup_vllm_omni.sh)")


def _driver(*args: Any, **kwargs: Any) -> vllm_omni.VllmOmniDriver:
    kwargs.setdefault("name", "vllm-omni")
    return vllm_omni.VllmOmniDriver(*args, **kwargs)


@pytest.mark.parametrize("event_driven", [True, False])
def test_a_consumer_inside_vllm_omnis_loop_reads_its_output_queue(event_driven: bool) -> None:
    """The comparison's in-loop consumer (row 7's) over vLLM-Omni: every output, in order, under
    cancellations; loop_add's request reaches stage 0 and its output comes back in the loop."""
    from bench.compare.scenarios.client import N7, asyncio_consumer

    with _driver(1, {0}, in_loop_consumer=True, event_driven=event_driven) as h:
        h.add_request("r1", "p")
        got, cancellations = h.run_in_loop(asyncio_consumer, h, timeout=30)
        assert [m.data for m in got] == list(range(N7)) and got[-1].finished
        assert cancellations > 0

        async def add_in_loop() -> list[Any] | None:
            h.loop_add("r2", "p")
            while not any(r == "r2" for r, _ in h.submissions(0)):
                await asyncio.sleep(0.001)
            h.loop_emit(0, [StageOutput("r2", "x", True)])
            return await h.loop_next_batch()

        assert h.run_in_loop(add_in_loop, timeout=10) == [OrchOutput("r2", 0, "x", True)]
        assert not h.shutdown().hung


def test_a_swallowed_deadline_inside_vllm_omnis_loop_is_measured() -> None:
    """Row 18's client in vLLM-Omni's loop: asyncio.timeout cancels once, the library swallows it,
    so only the outer watchdog ends the wait (asyncio's rule, whichever orchestrator feeds the queue)."""
    from bench.compare.scenarios.model import asyncio_swallowed_deadline

    with _driver(1, {0}, in_loop_consumer=True) as h:
        m = h.run_in_loop(asyncio_swallowed_deadline, h, timeout=30)
    assert m["swallowed"] == 1 and m["cut"] and not m["deadline_ended_wait"]


def test_vllm_omnis_async_chunk_mode_prewarms_later_stages_and_forwards_nothing() -> None:
    """With async_chunk its orchestrator submits to every later stage when stage 0 took the request,
    forwards no finished stage (the stage connectors carry the chunks), and holds the final output
    until every stage it submitted to has finished."""
    with _driver(3, {2}, async_chunk=True) as h:
        h.add_request("r1", "p")
        assert h.wait_until(lambda: all(h.submissions(k) for k in range(3)), timeout=10)
        h.emit_batch(0, [StageOutput("r1", "hidden", True)])
        h.emit_batch(2, [StageOutput("r1", "wav", True)])
        with pytest.raises(TimeoutError):
            h.next_output(timeout=0.3)  # stage 1 has not finished yet
        h.emit_batch(1, [StageOutput("r1", "codes", True)])
        assert h.next_output(timeout=10) == OrchOutput("r1", 2, "wav", True)
        assert [len(h.submissions(k)) for k in range(3)] == [1, 1, 1]


def test_vllm_omni_bundles_a_cfg_companion_into_the_diffusion_stages_input() -> None:
    """A forward function makes stage 1 a diffusion stage: vLLM-Omni defers the parent until its
    companion finished and calls the stage's input hook with both outputs."""
    from bench.compare.scenarios.companions import cfg_forward

    with _driver(2, {1}, forward_fn=cfg_forward) as h:
        assert h.stages[1].stage_type == "diffusion"
        h.add_request("r1", "a cat", companions={"r1:neg": "blurry"})
        assert h.wait_until(lambda: len(h.submissions(0)) == 2, timeout=10)
        h.emit_batch(0, [StageOutput("r1", "p-enc", True)])
        h.emit_batch(0, [StageOutput("r1:neg", "c-enc", True)])
        assert h.wait_until(lambda: h.submissions(1), timeout=10)
        assert h.submissions(1) == [("r1", {"cond": ["p-enc"], "uncond": {"r1:neg": ["c-enc"]}})]
        h.emit_batch(1, [StageOutput("r1", "png", True)])
        assert h.next_output(timeout=10) == OrchOutput("r1", 1, "png", True)


def test_vllm_omni_aborts_a_companion_with_its_parent_and_reports_its_late_output() -> None:
    with _driver(2, {1}, forward_fn=lambda *a: {"in": a[2]}) as h:
        h.add_request("r1", "a cat", companions={"r1:neg": "blurry"})
        assert h.wait_until(lambda: len(h.submissions(0)) == 2, timeout=10)
        h.abort("r1")
        assert h.wait_until(lambda: "r1:neg" in h.aborts(0), timeout=10)
        assert h.dropped_outputs == 0
        h.emit_batch(0, [StageOutput("r1:neg", "late", True)])
        assert h.wait_until(lambda: h.dropped_outputs == 1, timeout=10)  # its warning, counted
        assert h.submissions(1) == []


def test_companions_need_a_diffusion_stage_and_its_stages_take_no_cancellation_faults() -> None:
    from bench.drivers.base import Unsupported
    from trio_orch.testing import Misbehaviour

    with _driver(2, {1}) as h, pytest.raises(Unsupported, match="diffusion stage"):
        h.add_request("r1", "p", companions={"r1:neg": "n"})
    with pytest.raises(Unsupported, match="polled without an await"):
        _driver(2, {1}, forward_fn=lambda *a: a, misbehaviour={1: Misbehaviour(swallow_cancel_once=True)})


def _row(number: int) -> dict[str, Any]:
    """Row ``number`` of the comparison run against vLLM-Omni: its verdict and measurements."""
    from bench.compare.scenarios import by_number, run_scenario

    out = run_scenario(by_number(number), "vllm-omni")
    assert out.driver_error is None, out.driver_error
    assert out.verdict not in ("n/a", "error"), out.reason
    return {"verdict": out.verdict, **out.metrics}


def test_row_19_vllm_omnis_loop_thread_waits_for_a_close_handed_to_a_worker_thread() -> None:
    """Its synchronous stage shutdown hands the blocking part to the default executor: run() returns
    at once, and its thread's end (shutdown_default_executor, as the engine's) waits for the call."""
    m = _row(19)
    assert m["verdict"] == "waited" and not m["hung"]
    assert m["loop_thread_ended"] and not m["call_running_at_loop_end"]
    assert m["shutdown_s"] < m["loop_thread_end_s"]


def test_row_20_cancelled_twice_vllm_omni_closes_every_stage_but_ends_no_request() -> None:
    """Cancelled twice, its synchronous stage closes cannot be cut: both were done when run()
    returned; the request got no terminal then or later."""
    m = _row(20)
    assert m["verdict"] == "lost" and m["returned"] and m["second_cancel_sent"]
    assert m["at_return"]["closed"] == 2 and m["later"]["terminals"] == 0


def test_row_21_a_submit_vllm_omni_awaits_in_line_holds_its_shutdown() -> None:
    """The shutdown message waits behind the held submit: run() never returns; the submit's
    cleanup await got out when the watchdog tore the loop down (asyncio delivers one cancellation)."""
    m = _row(21)
    assert m["verdict"] == "hang" and m["submit_in_progress"]
    assert m["notices_sent"] == 1


def test_row_22_vllm_omnis_sweep_cancels_the_application_and_deadlocks_its_task_group() -> None:
    """Run next to a crashing front in one TaskGroup, its run() cancels the application's tasks and
    then gathers the group's own task, which waits for run(): the loop never ends by itself."""
    m = _row(22)
    assert m["verdict"] == "lost" and m["swept"] and not m["reported"]
    assert m["application_loop_ended"] is False
