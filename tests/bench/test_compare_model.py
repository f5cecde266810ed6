"""`trio-orch compare`: the model rows (18-22), their judges, and the model/design split of the table.

The judges are tested on measured dicts (each rule, case by case); the
scenarios are run against ``trio`` and ``asyncio-taskgroup`` and their causal
measurements asserted (what ended a wait, what was still running, what got
out), never their timings.  The committed comparison is checked for the
acceptance of the split: every row where the two differ is a model row.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.compare.cli import (
    VERDICT_LINES,
    VERDICTS,
    differences,
    headline,
    markdown_report,
    terminal_table,
    verdict,
)
from bench.compare.scenarios import SCENARIOS, Scenario, by_number, run_scenario
from bench.compare.scenarios.base import CUT, GRACE, KINDS
from bench.compare.scenarios.model import (
    judge_cancelled_twice,
    judge_cleanup_await,
    judge_sibling_crash,
    judge_swallowed_deadline,
    judge_thread_at_shutdown,
)
from bench.refs.orchestrator import AsyncioOrchestrator
from bench.refs.taskgroup import TaskGroupOrchestrator

DOCS = Path(__file__).resolve().parents[2] / "docs"


def measured(n: int, impl: str) -> dict:
    out = run_scenario(by_number(n), impl)
    assert out.driver_error is None, out.driver_error
    return out.metrics


# ---------------------------------------------------------------- judges on measured dicts
def test_swallowed_deadline_judge() -> None:
    base = {"cut": False, "returned_s": 0.051, "deadline_s": 0.05, "swallowed": 1,
            "deadline_ended_wait": True}
    assert judge_swallowed_deadline(base)[0] == "ok"
    assert judge_swallowed_deadline({**base, "cut": True, "returned_s": CUT})[0] == "hang"
    assert judge_swallowed_deadline({**base, "returned_s": 0.5})[0] == "overrun"


def test_thread_at_shutdown_judge() -> None:
    base = {"hung": False, "loop_thread_ended": True, "shutdown_s": 0.5, "loop_thread_end_s": 0.5,
            "call_s": 1.0, "grace_s": GRACE, "holds_process_exit": False}
    assert judge_thread_at_shutdown(base)[0] == "ok"
    assert judge_thread_at_shutdown({**base, "hung": True})[0] == "hang"
    assert judge_thread_at_shutdown({**base, "loop_thread_ended": False})[0] == "hang"
    slow_run = judge_thread_at_shutdown({**base, "shutdown_s": 1.0, "loop_thread_end_s": 1.0})
    assert slow_run[0] == "waited" and "run() returned" in slow_run[1]
    slow_loop = judge_thread_at_shutdown({**base, "loop_thread_end_s": 1.0})
    assert slow_loop[0] == "waited" and "runner waited" in slow_loop[1]
    held = judge_thread_at_shutdown({**base, "holds_process_exit": True})
    assert held[0] == "waited" and "non-daemon" in held[1]


def test_cancelled_twice_judge() -> None:
    done = {"closed": 2, "stream_ended": True, "terminals": 1}
    base = {"returned": True, "stages": 2, "at_return": done, "later": {"closed": 2, "terminals": 1}}
    assert judge_cancelled_twice(base)[0] == "ok"
    assert judge_cancelled_twice({**base, "returned": False})[0] == "hang"
    early = {"closed": 0, "stream_ended": False, "terminals": 1}
    assert judge_cancelled_twice({**base, "at_return": early})[0] == "detached"
    never = {"closed": 0, "terminals": 1}
    assert judge_cancelled_twice({**base, "at_return": early, "later": never})[0] == "cut"
    assert judge_cancelled_twice({**base, "at_return": {**done, "terminals": 0}})[0] == "detached"
    no_terminal = {**base, "at_return": {**done, "terminals": 0}, "later": {"closed": 2, "terminals": 0}}
    verdict, reason = judge_cancelled_twice(no_terminal)  # closed in time, but the request never ended
    assert verdict == "lost" and "never got a terminal" in reason


def test_cleanup_await_judge() -> None:
    base = {"hung": False, "cut_s": None, "notices_sent": 1, "without_terminal": 0}
    assert judge_cleanup_await(base)[0] == "ok"
    assert judge_cleanup_await({**base, "hung": True, "cut_s": 2.0})[0] == "hang"
    assert judge_cleanup_await({**base, "notices_sent": 0})[0] == "lost"
    assert judge_cleanup_await({**base, "without_terminal": 1})[0] == "lost"


def test_sibling_crash_judge() -> None:
    base = {"cut": False, "swept": False, "reported": True, "surfaced_after_s": 0.001,
            "error": "ExceptionGroup(... RuntimeError('E-front crashed'))"}
    assert judge_sibling_crash(base)[0] == "ok"
    assert judge_sibling_crash({**base, "surfaced_after_s": GRACE})[0] == "slow"
    assert judge_sibling_crash({**base, "cut": True})[0] == "hang"
    assert judge_sibling_crash({**base, "reported": False, "error": "CancelledError()"})[0] == "lost"
    assert judge_sibling_crash({**base, "swept": True, "reported": False, "error": None})[0] == "lost"


# ---------------------------------------------------------------- the scenarios, measured
def test_a_trio_deadline_survives_a_library_that_swallows_its_cancellation() -> None:
    trio_m = measured(18, "trio")
    assert trio_m["swallowed"] == 1 and trio_m["deadline_ended_wait"] and not trio_m["cut"]
    aio = measured(18, "asyncio-taskgroup")
    assert aio["swallowed"] == 1 and not aio["deadline_ended_wait"] and aio["cut"]  # only the watchdog


def test_a_cancelled_thread_call_holds_the_asyncio_loop_not_the_trio_run() -> None:
    trio_m = measured(19, "trio")
    assert trio_m["loop_thread_ended"] and trio_m["call_running_at_loop_end"] and trio_m["worker_daemon"]
    assert not trio_m["holds_process_exit"]
    aio = measured(19, "asyncio-taskgroup")
    assert aio["loop_thread_ended"] and not aio["call_running_at_loop_end"]  # the runner waited for it


def test_a_shielded_cleanup_is_done_when_trio_returns_and_detached_in_asyncio() -> None:
    trio_m = measured(20, "trio")
    assert trio_m["returned"] and trio_m["at_return"] == {"closed": 2, "stream_ended": True, "terminals": 1}
    aio = measured(20, "asyncio-taskgroup")
    assert aio["returned"] and aio["at_return"]["closed"] < 2 and aio["later"]["closed"] == 2


def test_an_unshielded_cleanup_await_is_cancelled_in_trio_and_runs_in_asyncio() -> None:
    """The row where Trio does worse: the same cleanup code needs a shield there."""
    assert measured(21, "trio")["notices_sent"] == 0
    assert measured(21, "asyncio-taskgroup")["notices_sent"] == 1


def test_a_sibling_error_needs_a_second_cancellation_under_taskgroup_only() -> None:
    trio_m = measured(22, "trio")
    assert trio_m["reported"] and trio_m["swallowed"] == 1 and not trio_m["cut"]
    aio = measured(22, "asyncio-taskgroup")
    assert aio["reported"] and aio["swallowed"] == 1 and aio["second_cancel_logged"]


# ---------------------------------------------------------------- the design choices asyncio-taskgroup has
def test_taskgroup_reports_the_errors_nobody_routed() -> None:
    m = measured(4, "asyncio-taskgroup")
    assert m["errors_surfaced"] == m["errors_injected"] == 4


def test_taskgroup_aborts_through_the_dispatcher_and_the_queue_path_misses_the_deadline(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Its abort goes straight to the loop; put it back in the request queue and row 9 turns hang."""
    assert not measured(9, "asyncio-taskgroup")["overrun_cut"]
    monkeypatch.setattr(TaskGroupOrchestrator, "abort", AsyncioOrchestrator.abort)
    assert run_scenario(by_number(9), "asyncio-taskgroup").metrics["overrun_cut"]


# ---------------------------------------------------------------- model or design, on every row
def test_every_scenario_states_its_kind_and_why() -> None:
    for sc in SCENARIOS:
        assert sc.kind in KINDS and sc.because and not sc.because.endswith("."), sc.number
    with pytest.raises(ValueError, match="kind must be one of"):
        Scenario(999, "k", "t", "q", "r", dict, lambda m: ("ok", ""), str, kind="luck", because="why")


def _result(rows: list[tuple[int, str, str, str]]) -> dict:
    return {"implementations": {"trio": "", "asyncio-taskgroup": ""}, "scenarios": [
        {"number": n, "title": f"t{n}", "kind": kind, "because": "b", "question": "q", "rule": "r",
         "results": {"trio": {"verdict": a, "headline": "h", "reason": "r"},
                     "asyncio-taskgroup": {"verdict": b, "headline": "h", "reason": "r"}}}
        for n, kind, a, b in rows],
        "watchdog_cut_s": CUT, "shutdown_grace_s": GRACE, "python": "3", "platform": "p", "elapsed_s": 1}


def test_differences_and_the_headline_come_from_the_verdicts() -> None:
    result = _result([(1, "model", "ok", "slow"), (2, "design", "ok", "ok"), (3, "model", "lost", "ok")])
    d = differences(result)
    assert d == {"model": [1, 3], "design": [], "left_worse": [3], "equal": [2]}
    text = headline(result)
    assert "2 because of the model (1, 3)" in text and "worse of the two in 3" in text
    md = markdown_report(result)
    assert "| 1 | model | t1 |" in md and "Kind: **model**" in md and "**Headline.**" in md


@pytest.mark.parametrize("recorded", ["cancellation.json", "bench/vllm-omni-compare.json"])
def test_the_verdict_counts_the_runs_verdicts_in_at_most_ten_lines(recorded: str) -> None:
    import io

    from rich.console import Console
    from rich.text import Text

    result = json.loads((DOCS / recorded).read_text())
    console = Console(width=80, file=io.StringIO())
    console.print(Text("\n".join(verdict(result))))
    block = console.file.getvalue()
    assert len(block.splitlines()) <= VERDICT_LINES
    for impl in result["implementations"]:  # each implementation's ok count, from its cells
        cells = [sc["results"][impl]["verdict"] for sc in result["scenarios"]]
        shown = f"{impl} {cells.count('ok')}/{len(cells) - cells.count('n/a')}"
        assert shown in block, shown
    d = differences(result, "trio", "omni-event")
    assert (f"trio vs omni-event: {len(d['model']) + len(d['design'])} rows differ ({len(d['model'])} model, "
            f"{len(d['design'])} design)") in block
    trio_bad = [f"{sc['number']} {sc['results']['trio']['verdict']}" for sc in result["scenarios"]
                if sc["results"]["trio"]["verdict"] != "ok"]
    assert f"trio not ok in: {', '.join(trio_bad) or 'none'}" in block


def test_the_verdict_names_a_failed_driver() -> None:
    result = _result([(1, "model", "ok", "slow"), (2, "design", "hang", "ok")])
    result["scenarios"][1]["results"]["trio"]["driver_error"] = "boom"
    lines = verdict(result)
    assert lines[0] == "Verdict: 2 scenarios x 2 implementations, 1 s"
    assert "trio 1/2, asyncio-taskgroup 1/2" in lines[1] and lines[2] == "  trio not ok in: 2 hang"
    assert lines[3] == "  trio vs asyncio-taskgroup: 2 rows differ (1 model, 1 design); trio worse in 2"
    assert lines[-1].startswith("  driver errors: 2 trio;")


def test_the_terminal_table_fits_the_terminal_wraps_at_words_and_has_a_legend() -> None:
    long = "every request got exactly one terminal within the grace period, none after it"
    result = _result([(12, "design", "ok", "hang")])
    for sc in result["scenarios"]:
        for r in sc["results"].values():
            r["headline"] = long
    for columns in (80, 100, 140):
        table = terminal_table(result, columns)
        assert max(len(line) for line in table.splitlines()) <= columns and "…" not in table
        words = table.split()
        assert all(w in words for w in long.split())  # wrapped at word boundaries, never cut
        assert f"hang: {VERDICTS['hang']}" in " ".join(words) and "design:" in words


def test_the_committed_comparison_separates_model_from_design() -> None:
    """docs/cancellation.json: every row has a kind; where trio and asyncio-taskgroup differ it is model,
    at least six times; every verdict in it has a legend entry."""
    result = json.loads((DOCS / "cancellation.json").read_text())
    assert all(sc["kind"] in KINDS for sc in result["scenarios"])
    d = differences(result)
    assert d["design"] == [], f"rows that differ by design: {d['design']}"
    assert len(d["model"]) >= 6, d
    assert {sc["number"] for sc in result["scenarios"]} == {sc.number for sc in SCENARIOS}
    assert all(by_number(n).kind == "model" for n in d["model"])
    used = {r["verdict"] for sc in result["scenarios"] for r in sc["results"].values()}
    assert used <= set(VERDICTS), used - set(VERDICTS)


def test_the_committed_vllm_omni_comparison_runs_all_but_three_rows() -> None:
    """docs/bench/vllm-omni-compare.json: the real vLLM-Omni columns have at most three n/a rows, each
    with its reason, no driver error, a verdict in the model rows, and the versions measured;
    docs/vllm-omni.md has the command that reproduces it."""
    result = json.loads((DOCS / "bench" / "vllm-omni-compare.json").read_text())
    assert {sc["number"] for sc in result["scenarios"]} == {sc.number for sc in SCENARIOS}
    for impl in ("vllm-omni", "vllm-omni-poll"):
        cells = {sc["number"]: sc["results"][impl] for sc in result["scenarios"]}
        na = sorted(n for n, r in cells.items() if r["verdict"] == "n/a")
        assert len(na) <= 3, (impl, na)
        assert all(cells[n]["reason"] for n in na)
        assert not [n for n, r in cells.items() if r["driver_error"] or r["verdict"] == "error"], impl
        assert all(cells[n]["verdict"] not in ("n/a", "error") for n in (19, 20, 21, 22)), impl
    versions = result["versions"]  # which vLLM-Omni the columns measured
    assert versions["vllm"] and versions["vllm-omni"] and versions["trio-orch"]
    doc = (DOCS / "vllm-omni.md").read_text()
    assert ("trio-orch compare --impl trio --impl omni-event --impl vllm-omni --impl vllm-omni-poll "
            "--markdown docs/vllm-omni.md --json docs/bench/vllm-omni-compare.json") in doc
