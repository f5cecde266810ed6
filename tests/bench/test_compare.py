"""`trio-orch compare`: the Trio orchestrator's guarantees asserted on the comparison's scenarios.

The asyncio rows are recorded by the tool, not asserted here (what they show
is the finding); the asyncio references' routing is asserted in
tests/bench/test_asyncio_refs.py.  Verdicts must come from measurements: a test
changes an implementation and watches its verdict change.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from bench.compare.scenarios import SCENARIOS, by_number, run_scenario
from bench.compare.scenarios.base import CUT
from bench.compare.scenarios.shutdown import judge_no_hang_no_leak
from bench.drivers import vllm_omni
from bench.refs.omni import OmniEventDriven
from bench.refs.taskgroup import TaskGroupOrchestrator
from trio_orch.cli import main
from trio_orch.core import companions


def trio_run(n: int) -> dict:
    out = run_scenario(by_number(n), "trio")
    assert out.driver_error is None, out.driver_error
    return out.metrics


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 6, 12, 14, 15])
def test_trio_shutdown_and_faults_leave_nothing(n: int) -> None:
    """No hang, no task left, every request exactly one terminal and nothing after it."""
    m = trio_run(n)
    assert m["hung"] is False and m["stream_ended"] is True
    assert m["tasks_alive_after_run"] == 0
    assert m["without_terminal"] == 0
    assert m["duplicate_terminals"] == 0 and m["after_terminal"] == 0
    assert m["run_error"] is None


def test_trio_level_triggered_cancel_beats_a_swallowing_stage() -> None:
    m = trio_run(1)
    assert m["cancellations_swallowed"] == 1  # the stage did swallow one...
    assert m["shutdown_s"] < CUT  # ...and shutdown still finished (no grace needed)


def test_trio_reader_failure_reported_and_siblings_keep_serving() -> None:
    m = trio_run(3)
    assert m["orchestrator_running_after"] and m["sibling_served"]
    assert m["bound_request_terminal_before_shutdown"] and m["error_surfaced"]


def test_trio_no_state_leaked_when_cancelled_mid_submit() -> None:
    m = trio_run(6)
    assert m["registered_before_cancel"]
    assert m["router_state_left"] == 0 and m["stage_state_left"] == 0


def test_trio_consumer_cancellation_loses_nothing() -> None:
    m = trio_run(7)
    assert m["consumer_cancellations"] > 0
    assert m["lost"] == 0 and m["duplicated"] == 0 and m["out_of_order"] == 0
    assert m["delivered"] == m["sent"] and m["terminal_seen"]


def test_trio_no_orchestrator_task_outlives_run() -> None:
    m = trio_run(8)
    assert m["tasks_alive_after_run"] == m["helpers_alive_after_run"]  # only the application's helpers
    assert m["tasks_pending_at_loop_end"] == 0 and m["thread_ended"]


def test_trio_deadline_honoured_even_when_the_stage_is_saturated() -> None:
    m = trio_run(9)
    # The client's abort is not queued behind the blocked submit: it arrives while the stage is still
    # saturated (the submit is released only after the terminal came, or after the watchdog cut).
    assert not m["overrun_cut"]
    assert m["overrun_orchestrator_deadline_s"] is not None and m["timed_kind"] == "timeout"
    assert m["without_terminal"] == 0 and m["duplicate_terminals"] == 0


def test_trio_sigint_in_a_serving_process() -> None:
    m = trio_run(10)
    assert not m["exit_hung"] and m["terminals"] == m["in_flight"]


def test_trio_bridge_after_shutdown_raises_never_hangs() -> None:
    m = trio_run(11)
    probes = [*m["during_shutdown"].values(), *m["after_shutdown"].values()]
    assert "hang" not in probes
    assert m["during_shutdown"]["add_request"].startswith("error:")
    assert m["after_shutdown"]["add_request"].startswith("error:")
    assert m["after_shutdown"]["next_output"] == "error:EndOfStream"
    assert m["accepted_late"] == []


def test_trio_stage_death_ends_every_request_before_shutdown() -> None:
    m = trio_run(12)
    assert m["without_terminal_before_shutdown"] == 0
    kinds = m["kinds"]
    assert kinds["a1"] == ["replica_died"] and kinds["a0"] == ["stage_unavailable"]


def test_trio_refuses_late_input_updates_and_starts_nothing() -> None:
    m = trio_run(13)
    assert "unknown or ended" in m["update_after_abort_error"]
    assert "unknown or ended" in m["unknown_update_error"]
    assert m["requests_started_by_updates"] == 0 and m["after_terminal"] == m["messages_for_unknown_id"] == 0
    assert m["aborted_terminal_seen"] and m["updates_delivered"] == 1


def test_the_omni_references_reproduce_the_sources_update_fallback_and_taskgroup_stays_strict() -> None:
    omni = run_scenario(by_number(13), "omni-event")
    assert omni.verdict == "zombie", omni.reason
    assert omni.metrics["requests_started_by_updates"] == 2 and omni.metrics["fallback_warnings"] == 2
    assert omni.metrics["update_after_abort_error"] is None  # the caller never learns
    assert run_scenario(by_number(13), "asyncio-taskgroup").verdict == "ok"


def test_verdicts_are_derived_from_measurements() -> None:
    base = {"hung": False, "cut_s": None, "without_terminal": 0, "duplicate_terminals": 0,
            "tasks_alive_after_run": 0}
    assert judge_no_hang_no_leak(base)[0] == "ok"
    assert judge_no_hang_no_leak({**base, "hung": True, "cut_s": 2.0})[0] == "hang"
    assert judge_no_hang_no_leak({**base, "without_terminal": 1})[0] == "lost"
    assert judge_no_hang_no_leak({**base, "tasks_alive_after_run": 3})[0] == "leak"


def test_changing_an_implementation_changes_its_cell(monkeypatch: pytest.MonkeyPatch) -> None:
    """TaskGroup's reader tells its own cancellation from the stage's; give it omni's and S3 turns silent."""
    assert run_scenario(by_number(3), "asyncio-taskgroup").verdict == "ok"
    class Put:  # omni's reader awaits put() on its asyncio.Queue; TaskGroup's inbox takes a post
        def __init__(self, inbox: Any) -> None:
            self.inbox = inbox

        async def put(self, item: Any) -> None:
            self.inbox.post(item)

    monkeypatch.setattr(TaskGroupOrchestrator, "reader",
                        lambda self, k, stage: OmniEventDriven.reader(self, k, stage, Put(self.ready_q)))
    assert run_scenario(by_number(3), "asyncio-taskgroup").verdict == "silent"


@pytest.mark.slow
def test_compare_cli_only_one_writes_every_field(tmp_path, capsys) -> None:
    js, md = tmp_path / "out.json", tmp_path / "out.md"
    rc = main(["compare", "--only", "1", "--json", str(js), "--markdown", str(md), "-q"])
    assert rc == 0
    printed = capsys.readouterr().out
    result = json.loads(js.read_text())
    impls = ["trio", "omni-event", "omni-poll", "asyncio-taskgroup"]
    assert list(result["implementations"]) == impls
    assert [s["number"] for s in result["scenarios"]] == [1]
    sc = result["scenarios"][0]
    assert {"number", "key", "title", "kind", "because", "question", "rule", "results"} <= set(sc)
    assert sc["kind"] == "model" and sc["because"]
    for impl in impls:
        r = sc["results"][impl]
        assert set(r) == {"scenario", "impl", "verdict", "reason", "headline", "wall_s", "driver_error",
                          "metrics"}
        assert r["driver_error"] is None and r["verdict"] and r["reason"]
        assert {"shutdown_s", "hung", "cut_s", "run_error", "tasks_alive_after_run", "requests",
                "without_terminal", "duplicate_terminals", "after_terminal", "sent",
                "delivered_before_shutdown", "cancellations_swallowed"} <= set(r["metrics"])
        assert r["verdict"] in printed.split(impl, 1)[1] or r["verdict"] in printed
    assert sc["results"]["trio"]["verdict"] == "ok"
    text = md.read_text()
    assert "| 1 | model | stage receive() swallows one cancellation |" in text and "Rule:" in text
    assert "Kind: **model**" in text and "**Headline.**" in text
    assert set(result).issuperset({"watchdog_cut_s", "shutdown_grace_s", "python", "platform", "elapsed_s"})
    closing = printed.rstrip("\n").split("\nVerdict: ")[-1]  # the report ends with its verdict
    assert closing.startswith("1 scenarios x 4 implementations") and len(closing.splitlines()) <= 10
    assert "trio 1/1" in closing


def test_compare_cli_rejects_unknown_scenario(capsys) -> None:
    n = max(s.number for s in SCENARIOS) + 1
    assert main(["compare", "--only", str(n)]) == 2
    assert f"no scenario {n}" in capsys.readouterr().err


def test_every_scenario_is_collected_and_listed(capsys) -> None:
    """Scenarios are found in their modules, numbered from 1 in order, each listed by --list.

    (Numbers are handed out per piece of work, so one may be missing until its work lands.)"""
    assert len(SCENARIOS) >= 12
    numbers = [s.number for s in SCENARIOS]
    assert numbers[0] == 1 and numbers == sorted(set(numbers))
    assert len({s.key for s in SCENARIOS}) == len(SCENARIOS)
    assert main(["compare", "--list"]) == 0
    listed = capsys.readouterr().out.splitlines()
    assert [line.split()[1] for line in listed] == [s.key for s in SCENARIOS]


def test_premise_of_scenario_3_pyzmq_close_cancels_a_pending_recv() -> None:
    """Scenario 3 models this: pyzmq's asyncio socket closed under a pending recv cancels it,
    so the waiting task sees CancelledError although nobody cancelled it (cancelling() == 0)."""
    import asyncio

    import zmq
    import zmq.asyncio

    seen: list[int] = []

    async def main() -> bool:
        ctx = zmq.asyncio.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.bind("inproc://premise-3")

        async def reader() -> None:
            try:
                await sock.recv_multipart()
            except asyncio.CancelledError:
                task = asyncio.current_task()
                assert task is not None
                seen.append(task.cancelling())
                raise

        task = asyncio.create_task(reader())
        await asyncio.sleep(0.01)
        sock.close()
        await asyncio.gather(task, return_exceptions=True)
        ctx.term()
        return task.cancelled()

    assert asyncio.run(main()) is True
    assert seen == [0]


def test_trio_a_companion_outliving_its_parent_reaches_nobody() -> None:
    m = trio_run(14)
    assert m["terminal_kind"] == "aborted" and m["duplicate_terminals"] == 0 and m["after_terminal"] == 0
    assert m["companion_aborted"] and m["late_output_counted"]
    assert m["forwards"] == 0 and m["companion_messages"] == 0


def test_trio_the_forward_waits_for_the_companion_in_every_order() -> None:
    m = trio_run(15)
    assert m["orders"] == {o: {"forwards": 1, "early": 0, "with_companion": 1}
                           for o in ("parent-first", "companion-first", "one-batch", "one-batch-reversed")}
    assert m["without_terminal"] == 0 and m["hung"] is False


def test_forwarding_before_the_companions_is_judged_degraded(monkeypatch: pytest.MonkeyPatch) -> None:
    """The seed's way (forward as soon as the parent finished) turns the cell: the verdict is measured."""
    monkeypatch.setattr(companions, "companions_ready", lambda state, req: True)
    out = run_scenario(by_number(15), "trio")
    assert out.verdict == "degraded" and out.metrics["early_forwards"] >= 1


def test_trio_serves_admission_while_a_collective_rpc_waits_for_a_hung_replica() -> None:
    m = trio_run(16)
    assert m["answers"] == {0: "ok", 1: "timeout", 2: "ok"}
    assert m["admitted_during_rpc"] and m["served_during_rpc"]
    assert m["without_terminal"] == 0 and m["hung"] is False and m["tasks_alive_after_run"] == 0


def test_the_seed_shaped_rpc_is_judged_blocked(monkeypatch: pytest.MonkeyPatch) -> None:
    """The TaskGroup reference answers RPCs in a task; awaited in its request handler it blocks admission."""
    assert run_scenario(by_number(16), "asyncio-taskgroup").verdict == "ok"
    monkeypatch.setattr(TaskGroupOrchestrator, "handle_rpc", OmniEventDriven.handle_rpc)
    out = run_scenario(by_number(16), "asyncio-taskgroup")
    assert out.verdict == "blocked", out.metrics
    assert out.metrics["answers"] == {0: "ok", 1: "timeout", 2: "ok"}


# ---------------------------------------------------------------- cells an implementation cannot express
def _fake_scenarios() -> list:
    """Two scenarios a fake cannot express: one needs a feature it lacks, one hits Unsupported."""
    from bench.compare.scenarios import Scenario
    from bench.implementations import make_driver

    def measure(impl: str) -> dict:
        make_driver(impl, 1, {0}).add_request("r1", "p")  # the plain Driver offers no add_request
        return {}

    def never(impl: str) -> dict:
        raise AssertionError("a scenario needing what the implementation lacks must not run")

    return [
        Scenario(901, "needs-teleport", "needs a teleporter", "?", "?", never, lambda m: ("ok", ""),
                 lambda m: "", needs=frozenset({"teleport"}), kind="design", because="?"),
        Scenario(902, "unsupported-call", "calls what the driver lacks", "?", "?", measure,
                 lambda m: ("ok", ""), lambda m: "", kind="design", because="?"),
    ]


def test_what_an_implementation_cannot_express_is_an_na_cell_not_an_error(tmp_path, monkeypatch) -> None:
    """A lacking feature and a driver's Unsupported both give n/a with the reason; compare exits 0."""
    import bench.compare.scenarios as scenarios
    import bench.implementations as impls
    from bench.drivers.base import Driver

    fake = impls.Implementation("fake", "a fake implementation", Driver, frozenset({"compare"}),
                                {"teleport": "the fake has no teleporter"})
    monkeypatch.setitem(impls.IMPLEMENTATIONS, "fake", fake)
    monkeypatch.setattr(scenarios, "SCENARIOS", _fake_scenarios())
    js = tmp_path / "out.json"
    assert main(["compare", "--impl", "fake", "-q", "--json", str(js)]) == 0
    cells = {sc["number"]: sc["results"]["fake"] for sc in json.loads(js.read_text())["scenarios"]}
    assert cells[901]["verdict"] == cells[902]["verdict"] == "n/a"
    assert cells[901]["reason"] == "the fake has no teleporter" and cells[901]["headline"] == "no teleport"
    assert "fake: add_request" in cells[902]["reason"]
    assert cells[901]["driver_error"] is None and cells[902]["driver_error"] is None


@pytest.mark.skipif(vllm_omni.available(), reason="vLLM-Omni is installed here")
def test_compare_names_why_the_real_vllm_omni_is_not_there(capsys) -> None:
    assert main(["compare", "--impl", "vllm-omni", "--only", "1", "-q"]) == 2
    err = capsys.readouterr().err
    assert "'vllm-omni' is not available here: vLLM-Omni is not installed" in err
    assert "setup_vllm_omni.sh" in err


def test_compare_refuses_an_implementation_that_does_not_run_it(capsys) -> None:
    assert main(["compare", "--impl", "floor", "--only", "1", "-q"]) == 2
    assert "'floor' does not run the comparison" in capsys.readouterr().err


@pytest.mark.skipif(not vllm_omni.available(), reason="vLLM-Omni is not installed (bench/setup_vllm_omni.sh)")
def test_the_real_vllm_omni_gets_measured_verdicts_and_honest_na_cells() -> None:
    """Where it is installed: its own orchestrator evicts a dead stage and keeps serving (measured, ok);
    the deadline scenario is n/a (it keeps no per-request deadline), not an error."""
    broken = run_scenario(by_number(3), "vllm-omni")
    assert broken.driver_error is None and broken.verdict == "ok", broken.reason
    assert broken.metrics["sibling_served"] and broken.metrics["bound_request_terminal_before_shutdown"]
    died = run_scenario(by_number(12), "vllm-omni")
    assert died.driver_error is None and died.metrics["without_terminal_before_shutdown"] == 0
    errors = run_scenario(by_number(4), "vllm-omni")  # its pool logs a failing client shutdown
    assert errors.driver_error is None and {"E-close-0", "E-close-1"} <= set(errors.metrics["surfaced_which"])
    na = run_scenario(by_number(9), "vllm-omni")
    assert na.verdict == "n/a" and "deadline" in na.reason and na.driver_error is None


@pytest.mark.skipif(not vllm_omni.available(), reason="vLLM-Omni is not installed (bench/setup_vllm_omni.sh)")
def test_the_real_vllm_omni_is_measured_in_its_async_chunk_mode_and_with_cfg_companions() -> None:
    """Where it is installed: rows 2 and 5 run its own async-chunk mode, 14 and 15 its CFG companions
    into a diffusion stage -- measured cells, not n/a; membership stays n/a with its reason."""
    for n in (2, 5, 14, 15):
        out = run_scenario(by_number(n), "vllm-omni")
        assert out.driver_error is None and out.verdict not in ("n/a", "error"), (n, out.reason)
        if n == 15:
            assert out.metrics["missing_forwards"] == 0 and out.metrics["forwards_without_companion"] == 0
    na = run_scenario(by_number(17), "vllm-omni")
    assert na.verdict == "n/a" and "MembershipController" in na.reason and na.driver_error is None


def test_the_committed_comparison_has_every_scenario() -> None:
    """docs/cancellation.md is regenerated when a scenario is added (its documented command)."""
    from pathlib import Path

    from bench.compare.scenarios import SCENARIOS

    doc = (Path(__file__).resolve().parents[2] / "docs" / "cancellation.md").read_text()
    missing = [sc.number for sc in SCENARIOS if f"### {sc.number}. {sc.title}" not in doc]
    assert not missing, f"regenerate docs/cancellation.md (trio-orch compare --markdown ...): rows {missing}"
