"""The one registry of implementations: what it lists, what each supports, what it refuses."""

from __future__ import annotations

import pytest

from bench.drivers import vllm_omni
from bench.drivers.base import Unsupported
from bench.implementations import CAPABILITIES, IMPLEMENTATIONS, SKIPPED, make_driver, names
from bench.refs.omni import OmniEventDriven, OmniPolling
from bench.refs.taskgroup import TaskGroupOrchestrator
from stages.config import echo_config
from trio_orch.testing import Misbehaviour


def test_every_job_finds_its_implementations_in_table_order() -> None:
    real_omni = ["vllm-omni", "vllm-omni-poll"] if vllm_omni.available() else []
    assert list(IMPLEMENTATIONS) == ["floor", "zmq-floor", "trio", "trio-engine", "omni-event", "omni-poll",
                                     "asyncio-taskgroup", *real_omni]
    assert names("scripted") == ["trio", "omni-event", "omni-poll", "asyncio-taskgroup"]  # routing tests
    assert names("compare") == [*names("scripted"), *real_omni]  # compare (the real one on --impl)
    assert names("fed") == [n for n in IMPLEMENTATIONS if n != "zmq-floor"]  # bench, in-process
    assert set(SKIPPED).isdisjoint(IMPLEMENTATIONS)
    in_loop = ["floor", "trio", "omni-event", "omni-poll", "asyncio-taskgroup"]  # loop_*
    assert names("in_loop") == in_loop + (["vllm-omni", "vllm-omni-poll"] if vllm_omni.available() else [])
    assert names("workers") == ["zmq-floor", "trio", "omni-event", "omni-poll", "asyncio-taskgroup"]
    assert names("pipeline") == ["trio"]  # chaos, the torch pipeline
    assert all(i.description and i.supports <= set(CAPABILITIES) for i in IMPLEMENTATIONS.values())
    with pytest.raises(ValueError, match="unknown capability"):
        names("teleport")


def test_the_asyncio_references_register_themselves_with_their_class() -> None:
    for name, cls in (("omni-event", OmniEventDriven), ("omni-poll", OmniPolling),
                      ("asyncio-taskgroup", TaskGroupOrchestrator)):
        driver = make_driver(name, 2, {1})
        assert driver.framework == "asyncio" and driver.name == name
        assert driver.orchestrator_cls is cls and driver.use_runner is cls.use_runner
        assert IMPLEMENTATIONS[name].description == cls.description


def test_a_driver_is_refused_what_its_implementation_does_not_support() -> None:
    with pytest.raises(ValueError, match="unknown implementation 'nope'"):
        make_driver("nope")
    with pytest.raises(ValueError, match="'floor' does not support scripted"):
        make_driver("floor", 2, {1}, misbehaviour={0: Misbehaviour(hang_abort=True)})
    with pytest.raises(ValueError, match="'omni-event' does not support pipeline"):
        make_driver("omni-event", workers=echo_config(2, replicas=2))
    floor = make_driver("floor", 2, {1})
    with pytest.raises(Unsupported, match="floor: add_request"):
        floor.add_request("r1", "p")


@pytest.mark.skipif(vllm_omni.available(), reason="vLLM-Omni is installed here")
def test_the_real_vllm_omni_is_skipped_with_a_reason_where_it_is_not_installed() -> None:
    assert set(SKIPPED) == {"vllm-omni", "vllm-omni-poll"}
    assert all("setup_vllm_omni.sh" in why for why in SKIPPED.values())
    with pytest.raises(ValueError, match="'vllm-omni' is not available here: vLLM-Omni is not installed"):
        make_driver("vllm-omni", 1, {0})


def test_the_bench_names_what_it_skips_and_runs_the_rest(tmp_path, capsys) -> None:
    """Asking for an implementation that is not installed skips it with the reason; the run goes on."""
    import argparse

    from bench.perf import cli

    parser = argparse.ArgumentParser()
    cli.configure(parser)
    impls = "trio,vllm-omni-poll" if not vllm_omni.available() else "trio"
    args = parser.parse_args(["--quick", "--workloads", "a_seq", "--impls", impls, "--out", str(tmp_path),
                              "--no-plots"])
    assert cli.run(args) == 0
    err = capsys.readouterr().err
    assert ("vllm-omni-poll: skipped: vLLM-Omni is not installed" in err) != vllm_omni.available()
    assert (tmp_path / "results.json").exists()


@pytest.mark.skipif(not vllm_omni.available(), reason="vLLM-Omni is not installed (bench/setup_vllm_omni.sh)")
@pytest.mark.parametrize("name", ["vllm-omni", "vllm-omni-poll"])
def test_the_real_vllm_omni_routes_a_chain_and_an_abort(name: str) -> None:
    """Where it is installed: its own Orchestrator forwards stage 0 -> 1 and ends the request."""
    from trio_orch.types import OrchOutput, StageOutput

    with make_driver(name, 2, {1}) as d:
        d.add_request("r1", "p")
        assert d.wait_submission()[:2] == (0, "r1")
        d.emit_batch(0, [StageOutput("r1", "hidden", True)])
        assert d.wait_submission()[:2] == (1, "r1")
        d.emit_batch(1, [StageOutput("r1", "text", True)])
        out = d.next_output(timeout=30)
        assert isinstance(out, OrchOutput) and (out.request_id, out.stage_id, out.finished) == ("r1", 1, True)
        d.add_request("r2", "p")
        d.abort("r2")
        assert d.wait_until(lambda: d.call(lambda: d.active_requests) == 0, timeout=30)
