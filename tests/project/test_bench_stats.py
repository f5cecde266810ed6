"""The benchmark's statistics, verdicts and tables, on numbers made here (no process, no timing).

The benchmark's own runs are process tests (tests/bench/); what is checked
here is what turns samples into claims: the bootstrap intervals, the rule
that calls a difference only where intervals do not overlap, the floors'
verdict (none in a quick run), the targets' failed clauses, the verdict that
closes the report, tables that rich fits to the terminal and plots whose
legend stays off the data.
"""

from __future__ import annotations

import numpy as np
import pytest

from bench.chaos.cli import render_table as chaos_table
from bench.chaos.run import ChaosResult
from bench.drivers.floor import FloorDriver
from bench.perf import report
from bench.perf.stats import bootstrap_ci, percentiles_us, summarize, verdict
from bench.perf.targets import targets
from trio_orch.types import OrchOutput, StageOutput


def _samples(median_us: float, n: int, seed: int) -> list[float]:
    """Skewed latencies in seconds (lognormal, like the benchmark's) with the given median."""
    rng = np.random.default_rng(seed)
    return list(rng.lognormal(np.log(median_us * 1e-6), 0.4, n))


def test_the_drawn_bootstrap_agrees_with_resampling_by_brute_force() -> None:
    x = np.sort(np.asarray(_samples(100.0, 2000, seed=1)) * 1e6)
    rng = np.random.default_rng(7)
    resampled = x[rng.integers(0, x.size, (4000, x.size))]
    for q in (0.5, 0.99):
        brute = np.percentile(np.quantile(resampled, q, axis=1), [2.5, 97.5])
        lo, hi = bootstrap_ci(x, q)
        width = brute[1] - brute[0]
        assert abs(lo - brute[0]) < 0.1 * width and abs(hi - brute[1]) < 0.1 * width


@pytest.mark.parametrize("n", [1, 2, 3, 10, 101, 20_000])
def test_intervals_bracket_their_percentile_and_are_reproducible(n: int) -> None:
    lat = percentiles_us(_samples(50.0, n, seed=n))
    for pct in ("p50", "p99"):
        lo, hi = lat[f"{pct}_ci_us"]
        assert lo <= lat[f"{pct}_us"] <= hi
    assert percentiles_us(_samples(50.0, n, seed=n)) == lat  # seeded: the same samples, the same interval


def test_more_samples_give_a_narrower_p99_interval() -> None:
    few, many = percentiles_us(_samples(50.0, 500, 3)), percentiles_us(_samples(50.0, 50_000, 3))
    assert np.diff(many["p99_ci_us"])[0] < np.diff(few["p99_ci_us"])[0] / 4


def test_a_difference_is_called_only_where_the_intervals_do_not_overlap() -> None:
    assert verdict([1.0, 2.0], [3.0, 4.0]) == "lower"
    assert verdict([5.0, 6.0], [3.0, 4.0]) == "higher"
    assert verdict([1.0, 3.5], [3.0, 4.0]) == "="
    assert verdict([3.0, 4.0], [3.0, 4.0]) == "="
    assert verdict(None, [3.0, 4.0]) == "=" and verdict([float("nan")] * 2, [1.0, 2.0]) == "="


def _run(median_us: float, n: int, seed: int, cost_us: float, **extra: object) -> dict[str, object]:
    """One round: latencies around ``median_us``, ``cost_us`` of wall time and half of it CPU per output."""
    return {"latency": _samples(median_us, n, seed), "outputs": n, "elapsed_s": n * cost_us * 1e-6,
            "cpu_s": n * cost_us * 0.5e-6, "shutdown_s": 0.001, **extra}


def _results(medians: dict[str, dict[str, float]], n: int = 3000,
             cost: dict[str, float] | None = None) -> dict[str, object]:
    """A results dict as the benchmark builds it: per workload, per implementation, summarized rounds.

    ``cost``: wall time per output by implementation (default: its median latency).
    """
    impls = list(dict.fromkeys(i for per in medians.values() for i in per))
    results: dict[str, object] = {"implementations": impls, "workloads": {}}
    for w, (wl, per) in enumerate(medians.items()):
        results["workloads"][wl] = {  # type: ignore[index]
            impl: summarize([_run(m, n, 100 * w + k, (cost or {}).get(impl, m),
                                  **({} if "floor" in impl else {"push": True}))])
            for k, (impl, m) in enumerate(per.items())}
    results["targets"] = targets(results)
    return results


def test_ratio_cells_say_lower_higher_or_equal_from_the_intervals() -> None:
    res = _results({"a_seq": {"floor": 20.0, "trio": 40.0, "asyncio-taskgroup": 80.0, "omni-event": 40.2}})
    rows = {r[1]: r for r in report.table_rows(res)[1:]}
    assert rows["trio"][8] == "1.00" and rows["trio"][2] == "push"
    assert rows["asyncio-taskgroup"][8].endswith("higher") and rows["floor"][8].endswith("lower")
    assert rows["omni-event"][8].endswith("=")  # 0.5 % apart: within the intervals
    assert rows["floor"][2].startswith("floor")
    for r in rows.values():  # every p50 and p99 cell shows its interval
        assert "[" in r[3] and "[" in r[4]


def test_the_floor_is_beaten_only_beyond_its_interval() -> None:
    held = _results({"a_seq": {"floor": 30.0, "trio": 30.1, "asyncio-taskgroup": 60.0}})
    assert report.floors_hold(held)
    beaten = _results({"a_seq": {"floor": 30.0, "trio": 20.0}})
    rows = report.floor_rows(beaten)
    assert rows[1][:3] == ["a_seq", "thread", "p50 us"] and rows[1][-1] == "BEATEN"
    assert not report.floors_hold(beaten)


def test_with_many_outputs_in_flight_the_floor_bounds_throughput_not_queueing_latency() -> None:
    # trio: a fifth of the floor's queueing latency, a tenth of its throughput -- the floor holds
    res = _results({"b_64_unbatched": {"floor": 500.0, "trio": 100.0}}, cost={"floor": 2.0, "trio": 20.0})
    measures = {r[2]: r[-1] for r in report.floor_rows(res)[1:]}
    assert measures == {"outputs/s": "holds", "cpu us/out": "holds"}
    faster = _results({"b_64_unbatched": {"floor": 500.0, "trio": 100.0}}, cost={"floor": 20.0, "trio": 2.0})
    assert {r[2]: r[-1] for r in report.floor_rows(faster)[1:]} == {"outputs/s": "BEATEN",
                                                                      "cpu us/out": "BEATEN"}


def test_a_missed_target_names_the_clause_that_failed() -> None:
    # trio meets the 30 us limit but is not clearly below asyncio-taskgroup: the clause says so
    res = _results({"a_seq": {"trio": 20.0, "asyncio-taskgroup": 20.05}})
    row = next(t for t in res["targets"] if t["target"].startswith("a_seq p50"))  # type: ignore[union-attr]
    assert row["met"] is False and row["value"] <= 30
    assert row["failed"] == [row["failed"][0]] and "asyncio-taskgroup" in row["failed"][0]
    assert "intervals overlap" in row["failed"][0]
    cell = next(r for r in report.target_rows(res) if r[0] == row["target"])[3]
    assert cell.startswith("MISSED: not below asyncio-taskgroup")
    met = _results({"a_seq": {"trio": 20.0, "asyncio-taskgroup": 60.0}})
    assert next(t for t in met["targets"] if t["target"].startswith("a_seq p50"))["met"] is True  # type: ignore[union-attr]


@pytest.mark.parametrize("columns", [100, 120])
def test_the_bench_report_fits_the_terminal_and_keeps_words_whole(columns: int) -> None:
    res = _results({"a_seq": {"floor": 20.0, "trio": 40.0, "asyncio-taskgroup": 80.0},
                    "b_512_unbatched": {"floor": 9000.0, "trio": 12000.0, "asyncio-taskgroup": 15000.0}})
    text = report.text_report(res, columns)
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= columns
    assert any("asyncio-taskgroup" in line for line in lines)  # not folded mid-word
    assert "Legend" in text and "[lo-hi]" in text and "lower / higher" in text


def test_the_chaos_matrix_fits_100_columns_with_its_notes_and_legend() -> None:
    row = ChaosResult("connector_peer_killed", "kill -9 the peer", "echo", requests=10, accepted=1020,
                      completed=1019, failed={"replica_died": 1, "stage_unavailable": 3}, still_serving="yes",
                      detect_s=0.1, recover_s=0.5, restarts=1, notes={"retried": 3, "held_when_hit": 7})
    text = chaos_table([row, row], 100)
    assert max(len(line) for line in text.splitlines()) <= 100
    assert "connector_peer_killed " in text and "stage_unavailable" in text
    assert "restarts=1, retried=3, held_when_hit=7" in text and "Legend" in text


def test_the_thread_floor_hands_over_between_plain_threads_and_batches_what_arrived_together() -> None:
    floor = FloorDriver(2, {1})
    assert floor.framework == "threads" and floor.path == "thread"
    floor.start()
    try:
        floor.post_request("r", "p")
        assert floor.wait_submission(5)[:2] == (0, "r")
        floor.emit_batch(0, [StageOutput("r", "x", True)])  # not a final stage: a submit, no message
        assert floor.wait_submission(5)[:2] == (1, "r")
        floor.emit_batch(1, [StageOutput("r", "y", False)])
        got = floor.next_batch(5)
        assert got == [OrchOutput("r", 1, "y", False)]
    finally:
        floor.close()
    assert floor.stopped


def test_the_in_loop_floor_delivers_a_producer_tasks_output_to_the_consumer_task() -> None:
    floor = FloorDriver(1, {0}, in_loop_consumer=True)
    assert floor.path == "loop"
    floor.start()
    try:
        async def body() -> list[object]:
            floor.loop_emit(0, [StageOutput("r", 1, False)])
            floor.loop_emit(0, [StageOutput("r", 2, True)])
            return await floor.loop_next_batch()  # both: everything in the channel at once

        assert [m.data for m in floor.run_in_loop(body)] == [1, 2]
    finally:
        floor.close()


@pytest.mark.parametrize("workload", ["a_seq", "loop_a_seq"])
def test_asyncio_taskgroup_takes_the_push_path_wherever_trio_does(workload: str) -> None:
    """In the benchmark's own configuration (the thread and the in-loop workloads; ZMQ: see the docs)."""
    from bench.implementations import make_driver
    from bench.perf.workloads import WORKLOADS, uses_push

    took = {}
    for impl in ("trio", "asyncio-taskgroup", "omni-event"):
        driver = make_driver(impl, **WORKLOADS[workload].setup(True)).start()
        try:
            took[impl] = uses_push(driver)
        finally:
            driver.close()
    assert took == {"trio": True, "asyncio-taskgroup": True, "omni-event": False}


def test_headlines_separate_the_model_the_design_and_the_floor() -> None:
    from bench.perf.headlines import headlines

    res = _results({"a_seq": {"floor": 20.0, "trio": 40.0, "asyncio-taskgroup": 40.1, "omni-event": 80.0}})
    (line,) = headlines(res)
    model, design, floor = line.split(" -- ", 1)[1].split("; ")
    assert model.startswith("model: trio") and model.endswith("no difference (the intervals overlap)")
    assert design.startswith("design: omni-event") and design.endswith("omni-event higher")
    assert floor.startswith("above the floor: trio") and floor.endswith("trio higher")
    assert "[" in model and "x," in model  # both values with their intervals, and the ratio


@pytest.mark.parametrize("workload", ["a_seq", "c_chain", "b_64_unbatched", "b_512_batched", "loop_a_seq",
                                      "loop_c_chain", "loop_b_512_unbatched"])
def test_a_full_run_takes_at_least_10000_latency_samples_per_implementation(workload: str) -> None:
    """Measured on the floor (the cheapest implementation): a full run's size, its default 3 rounds."""
    from bench.perf.workloads import run_workload

    res = run_workload(workload, "floor", quick=False)
    assert 3 * len(res["latency"]) >= 10_000
    assert len(run_workload(workload, "floor", quick=True)["latency"]) < 10_000  # --quick stays small


# ---------------------------------------------------------------- the verdict, a quick run, the plots
def test_ratio_bounds_exclude_one_exactly_where_the_intervals_do_not_overlap() -> None:
    from bench.perf.stats import ratio_bounds

    rng = np.random.default_rng(5)
    for _ in range(2000):
        a, b = np.sort(rng.uniform(1, 10, 2)), np.sort(rng.uniform(1, 10, 2))
        lo, hi = ratio_bounds(list(a), list(b))
        assert lo <= a[0] / b[0] <= hi and lo <= a[1] / b[1] <= hi
        assert (lo > 1 or hi < 1) == (verdict(list(a), list(b)) != "=")
    assert ratio_bounds(None, [1.0, 2.0]) is None and ratio_bounds([1.0, 2.0], [0.0, 1.0]) is None


def _with_serving(results: dict[str, object]) -> dict[str, object]:
    """``results`` with a serving run (trio's front slower at the first chunk) and its targets judged."""
    from bench.perf.cli import summarize_serving

    def run(ttfc: float, ok: int, seed: int) -> dict[str, object]:
        rng = np.random.default_rng(seed)
        return {"ttfc": list(rng.lognormal(np.log(ttfc), 0.2, 400)),
                "gaps": list(rng.lognormal(-6, 0.2, 400)), "ok": ok, "failed": 0, "wall_s": 1.0,
                "server_cpu_s": 0.5}

    results["serving"] = summarize_serving({"echo workers": {"trio": [run(0.03, 90, 1)],
                                                             "asyncio": [run(0.02, 100, 2)]}}, 64)
    results["targets"] = targets(results)
    return results


HEADLINE_RUN = {"a_seq": {"floor": 20.0, "trio": 40.0, "asyncio-taskgroup": 30.0, "omni-event": 80.0},
                "loop_a_seq": {"floor": 8.0, "trio": 12.0, "asyncio-taskgroup": 20.0, "omni-event": 50.0},
                "zmq_a_seq": {"zmq-floor": 90.0, "trio": 150.0, "asyncio-taskgroup": 260.0,
                              "omni-event": 300.0},
                "c_chain": {"floor": 20.0, "trio": 45.0, "asyncio-taskgroup": 50.0},
                "b_512_unbatched": {"floor": 900.0, "trio": 1200.0, "asyncio-taskgroup": 1500.0},
                "b_64_unbatched": {"floor": 300.0, "trio": 400.0, "asyncio-taskgroup": 350.0}}


@pytest.mark.parametrize("columns", [100, 120])
def test_the_report_ends_with_a_verdict_of_at_most_ten_lines_from_the_runs_numbers(columns: int) -> None:
    from bench.perf.verdict import MAX_LINES
    from bench.tables import render

    res = _with_serving(_results(HEADLINE_RUN, n=2000))
    block = render([report.closing(res)], columns)
    assert 4 <= len(block.splitlines()) <= MAX_LINES
    assert report.text_report(res, columns).endswith(block)  # it closes the report
    assert block.startswith("Verdict, full run") and "every floor holds" in block
    judged = [t for t in res["targets"] if t["met"] is not None]  # type: ignore[union-attr]
    assert f"targets: {sum(t['met'] for t in judged)} of {len(judged)} met" in block
    rows = {line.split()[0]: line for line in block.splitlines()[1:]}
    for wl in ("a_seq", "loop_a_seq", "zmq_a_seq"):  # the model ratio, its bounds and its word, computed
        mine, theirs = (res["workloads"][wl][i]["latency"] for i in ("trio", "asyncio-taskgroup"))  # type: ignore[index]
        lo, hi = mine["p50_ci_us"][0] / theirs["p50_ci_us"][1], mine["p50_ci_us"][1] / theirs["p50_ci_us"][0]
        cell = f"{mine['p50_us'] / theirs['p50_us']:.2f} [{lo:.2f}-{hi:.2f}] "
        assert cell + verdict(mine["p50_ci_us"], theirs["p50_ci_us"]) in rows[wl]
    s = res["serving"]["echo workers"]  # type: ignore[index]
    assert f"TTFC p50 {s['trio']['ttfc']['p50_us'] / s['asyncio']['ttfc']['p50_us']:.2f} [" in block
    assert f"req/s {s['trio']['requests_per_s'] / s['asyncio']['requests_per_s']:.2f}" in block
    assert "## Verdict" in report.markdown_report(res).split("Legend:")[-1]  # results.md closes with it too


def test_a_quick_run_says_its_intervals_are_wide_and_judges_no_floor() -> None:
    from bench.perf.verdict import MAX_LINES
    from bench.tables import render

    def run(mode: str) -> dict[str, object]:
        res = _results({"a_seq": {"floor": 30.0, "trio": 20.0, "asyncio-taskgroup": 25.0},
                        "b_64_unbatched": {"floor": 500.0, "trio": 100.0}}, n=300,
                       cost={"floor": 20.0, "trio": 2.0, "asyncio-taskgroup": 25.0})
        res["meta"] = {"mode": mode, "rounds": 1}
        return res

    full, quick = run("full"), run("quick")
    assert "BEATEN" in {r[-1] for r in report.floor_rows(full)} and report.floors_hold(full) is False
    assert {r[-1] for r in report.floor_rows(quick)[1:]} == {"not judged"}
    assert report.floors_hold(quick) is None
    text = report.text_report(quick, 100)
    assert "BEATEN" not in text and "floor not judged: a quick run" in text
    block = render([report.closing(quick)], 100)
    assert block.splitlines()[0] == ("Verdict, quick run (1 round, >= 300 samples per row): intervals are "
                                     "wide, no floor is judged")
    assert len(block.splitlines()) <= MAX_LINES
    assert "BEATEN" not in report.markdown_report(quick)


def test_the_recorded_runs_documents_are_rendered_from_their_json_and_close_with_a_verdict() -> None:
    """docs/bench/results.md (and the after-cuts run): the report of the recorded JSON, byte for byte."""
    import json
    from pathlib import Path

    from bench.perf.verdict import MAX_LINES
    from bench.tables import render

    docs = Path(__file__).resolve().parents[2] / "docs" / "bench"
    for run in (docs, docs / "after-cuts"):
        results = json.loads((run / "results.json").read_text())
        assert (run / "results.md").read_text() == report.markdown_report(results)
        assert len(render([report.closing(results)], 100).splitlines()) <= MAX_LINES


def _drawn(fig: object) -> tuple[object, object, object]:
    """(the figure's box, its legend's, its axes') once drawn."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    r = canvas.get_renderer()
    (legend,) = fig.legends  # type: ignore[attr-defined]
    (ax,) = fig.axes  # type: ignore[attr-defined]
    return fig.bbox, legend.get_window_extent(r), ax.get_window_extent(r)  # type: ignore[attr-defined]


def test_the_plots_put_their_legend_outside_the_data_and_the_curve_has_every_concurrency() -> None:
    from bench.perf.workloads import SWEEP

    def sweep_run(cost_us: float) -> dict[str, object]:
        curve = {str(n): {"outputs": 4096, "elapsed_s": 4096 * cost_us * 1e-6 * (1 + n / 512), "cpu_s": 0.01}
                 for n in SWEEP}
        return {"curve": curve, "outputs": 6 * 4096, "elapsed_s": 1.0, "cpu_s": 0.06}

    impls = {"floor": 2.0, "trio": 8.0, "trio-engine": 10.0, "omni-event": 12.0, "omni-poll": 20.0,
             "asyncio-taskgroup": 9.0}
    res = {"workloads": {"b_sweep": {i: summarize([sweep_run(c)]) for i, c in impls.items()}}}
    fig = report.throughput_figure(res)
    assert len(SWEEP) >= 5
    for line in fig.axes[0].get_lines():
        assert list(line.get_xdata()) == list(SWEEP)
    rows = report.curve_rows(res)
    assert rows[0][1:] == [f"{n} in\nflight" for n in SWEEP] and len(rows) == 1 + len(impls)
    cdf = report.cdf_figure({i: _samples(c * 5, 500, k) for k, (i, c) in enumerate(impls.items())})
    for figure in (fig, cdf):
        whole, legend, data = _drawn(figure)
        assert not legend.overlaps(data)  # type: ignore[attr-defined]
        assert whole.x0 <= legend.x0 and legend.x1 <= whole.x1  # type: ignore[attr-defined]
        assert len(figure.legends[0].get_texts()) == len(impls)


def test_tables_are_fitted_by_rich_numbers_and_names_whole_brackets_shown() -> None:
    from bench.tables import markdown_table, render, table

    header = ["impl", "note", "p50 us\n[95% CI]", "x [bounds]"]
    rows = [["asyncio-taskgroup", "a long note that has to wrap between its words " * 3,
             "1,234.5\n[1,200-1,300]", "0.91 [0.85-0.96] lower"]] * 2
    text = render([table(header, rows, names={0}, numbers={2, 3})], 80)
    assert max(len(line) for line in text.splitlines()) <= 80
    assert "asyncio-taskgroup" in text and "[95% CI]" in text and "x [bounds]" in text
    assert "0.91 [0.85-0.96] lower" in text and "[1,200-1,300]" in text  # numbers keep their width
    assert all(w in text.split() for w in rows[0][1].split())  # the text column wrapped between words
    assert markdown_table([header, rows[0]]).splitlines()[:2] == [
        "| impl | note | p50 us [95% CI] | x [bounds] |", "|---|---|---|---|"]
