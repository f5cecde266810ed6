"""The benchmark runs and reports every field; no timing is asserted (timings live in bench/)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from bench.implementations import make_driver, names
from bench.perf import report
from bench.perf.cli import run_benchmark
from bench.perf.targets import targets
from bench.perf.workloads import echo_pipeline, run_workload, zmq_seq
from trio_orch.cli import main

LATENCY_FIELDS = {"n", "p50_us", "p90_us", "p99_us", "max_us", "mean_us", "p50_ci_us", "p99_ci_us"}


@pytest.mark.slow
def test_quick_benchmark_reports_every_field_for_every_implementation() -> None:
    impls = names("fed")
    results, raw = run_benchmark(["a_seq", "c_chain", "b_64_unbatched", "idle"], impls, rounds=1, quick=True)
    wl = results["workloads"]
    for impl in impls:
        for name in ("a_seq", "c_chain", "b_64_unbatched"):
            res = wl[name][impl]
            assert set(res["latency"]) == LATENCY_FIELDS and res["latency"]["n"]
            assert res["throughput_per_s"] > 0 and res["cpu_us_per_output"] >= 0
            assert res["shutdown_ms"]["median"] >= 0
        assert wl["a_seq"][impl]["latency"]["n"] == 300  # every output was received once
        assert wl["b_64_unbatched"][impl]["outputs"] == 64 * 20
        chain = wl["c_chain"][impl]
        for key, n in (("admission", 50), ("forward_0_1", 50), ("forward_1_2", 50), ("forward", 100)):
            assert set(chain[key]) == LATENCY_FIELDS and chain[key]["n"] == n
        assert not math.isnan(wl["idle"][impl]["idle_cpu_pct"])
        assert len(raw[impl]) == 300
    # ratios are computed from the numbers in the same run
    rows = report.table_rows(results)
    trio_row = next(r for r in rows if r[:2] == ["a_seq", "trio"])
    assert trio_row[-3:] == ["1.00", "1.00", "1.00"] and trio_row[2] == "push"
    assert next(r for r in rows if r[:2] == ["a_seq", "asyncio-taskgroup"])[2] == "push"  # the same path
    assert next(r for r in rows if r[:2] == ["a_seq", "omni-event"])[2] == "reader"
    targets = {t["target"] for t in results["targets"]}
    assert any(n.startswith("a_seq p50") for n in targets) and any(n.startswith("idle") for n in targets)


def test_bench_command_writes_json_markdown_and_plots_and_ends_with_a_verdict(tmp_path: Path, capsys) -> None:
    from bench.perf.verdict import MAX_LINES
    from bench.perf.workloads import SWEEP, SWEEP_OUTPUTS_QUICK

    out = tmp_path / "out"
    rc = main(["bench", "--quick", "--workloads", "a_seq,b_64_batched,b_sweep", "--impls", "trio,floor",
               "--out", str(out), "--json", str(tmp_path / "r.json")])
    assert rc == 0
    text = capsys.readouterr().out
    assert "a_seq" in text and "Targets" in text
    data = json.loads((tmp_path / "r.json").read_text())
    assert set(data["workloads"]) == {"a_seq", "b_64_batched", "b_sweep"}
    assert set(data["workloads"]["a_seq"]) == {"trio", "floor"}
    for wl in ("a_seq", "b_64_batched"):  # every percentile's interval brackets it
        for res in data["workloads"][wl].values():
            lat = res["latency"]
            for pct in ("p50", "p99"):
                lo, hi = lat[f"{pct}_ci_us"]
                assert lo <= lat[f"{pct}_us"] <= hi
    for res in data["workloads"]["b_sweep"].values():  # the throughput curve: every concurrency measured
        assert list(res["curve"]) == [str(n) for n in SWEEP]
        for n, point in res["curve"].items():
            assert point["outputs"] == int(n) * max(2, SWEEP_OUTPUTS_QUICK // int(n))
            assert point["throughput_per_s"] > 0
    assert data["meta"]["intervals"]["coverage"] == 0.95
    assert data["meta"]["mode"] == "quick" and data["meta"]["floors_hold"] is None  # a quick run judges none
    assert "Legend" in text and "Floors" in text and "BEATEN" not in text and "not judged" in text
    closing = "Verdict, " + text.rstrip("\n").split("\nVerdict, ")[-1]  # the last block of the output
    assert closing.startswith("Verdict, quick run (1 round") and "no floor is judged" in closing
    assert len(closing.splitlines()) <= MAX_LINES and "targets: " in closing
    assert "| a_seq | trio |" in (out / "results.md").read_text()
    for png in ("a_seq_latency_cdf.png", "throughput_vs_concurrency.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_zmq_echo_workload_reports_latency_from_worker_timestamps() -> None:
    driver = make_driver("trio", workers=echo_pipeline(1)).start()
    pids = list(driver.worker_pids)
    assert len(pids) == 3 and all(Path(f"/proc/{p}").exists() for p in pids)
    try:
        res = zmq_seq(driver, 200)
    finally:
        driver.close()
    assert res["outputs"] == 200
    assert len(res["latency"]) == 200  # every output carried the worker's production time
    assert all(math.isfinite(x) for x in res["latency"])
    assert not any(Path(f"/proc/{p}").exists() for p in pids)  # the workers are gone (and reaped)


def test_asyncio_reference_runs_the_zmq_echo_workload_over_real_workers() -> None:
    res = run_workload("zmq_a_seq", "asyncio-taskgroup", quick=True)
    assert res["outputs"] == 200 and len(res["latency"]) == 200
    assert res["shutdown_s"] >= 0


def test_workloads_run_only_where_supported() -> None:
    """The torch pipeline needs the process layer: only trio-orch offers it; echo workers: not the floor."""
    assert names("pipeline") == ["trio"]
    assert "floor" not in names("workers") and "trio-engine" not in names("workers")
    results, _ = run_benchmark(["zmq_a_seq"], ["trio", "floor"], rounds=1, quick=True)
    assert set(results["workloads"]["zmq_a_seq"]) == {"trio"}


@pytest.mark.parametrize("impl", ["trio", "floor", "asyncio-taskgroup", "omni-event"])
def test_in_loop_workloads_consume_every_output_inside_the_loop(impl: str) -> None:
    """Producer and consumer run as tasks of the implementation's loop (AnyIO on either library)."""
    seq = run_workload("loop_a_seq", impl, quick=True)
    assert seq["outputs"] == 300 and len(seq["latency"]) == 300
    assert all(math.isfinite(x) for x in seq["latency"])  # every output measured (the values: bench only)
    chain = run_workload("loop_c_chain", impl, quick=True)
    assert len(chain["admission"]) == 50 and len(chain["forward"]) == 100 and len(chain["latency"]) == 100
    conc = run_workload("loop_b_512_unbatched", impl, quick=True)
    assert len(conc["latency"]) == conc["outputs"] == 512 * 10


def test_zmq_floor_round_trips_through_a_real_worker_and_leaves_nothing() -> None:
    """The floor's own thread owns the socket (the two thread hops every bridge takes); it ends with close."""
    driver = make_driver("zmq-floor", workers=echo_pipeline(1)).start()
    pids, tmpdir = list(driver.worker_pids), driver.worker_dir
    assert driver.thread is not None and driver.thread.is_alive()
    assert len(pids) == 1 and Path(f"/proc/{pids[0]}").exists() and tmpdir and Path(tmpdir).exists()
    try:
        res = zmq_seq(driver, 50)
    finally:
        driver.close()
    assert res["outputs"] == 50 and len(res["latency"]) == 50
    assert all(math.isfinite(x) for x in res["latency"])
    assert not Path(f"/proc/{pids[0]}").exists() and not Path(tmpdir).exists()
    assert not driver.thread.is_alive()
    assert names("workers")[0] == "zmq-floor" and "zmq-floor" not in names("fed")


def test_serving_targets_are_judged_from_the_run_numbers() -> None:
    """The serving rows and targets come from the summarized run (no numbers typed in)."""
    from bench.perf.cli import summarize_serving

    def run(ttfc: float, gap: float, ok: int, steps: int) -> dict[str, object]:
        return {"ttfc": [ttfc] * 10, "gaps": [gap] * 10, "ok": ok, "failed": 0, "wall_s": 1.0,
                "server_cpu_s": 0.5, "worker_steps": steps, "worker_cpu_s": 0.2}

    raw = {"echo workers": {"trio": [run(0.010, 0.002, 100, 4000)], "asyncio": [run(0.020, 0.002, 90, 900)]}}
    results = {"serving": summarize_serving(raw, 64), "workloads": {}, "implementations": ["trio"]}
    verdicts = {t["target"].split(": ", 1)[1]: t["met"] for t in targets(results)
                if t["target"].startswith("serving")}
    assert verdicts == {"--loop trio p50 time to first chunk >= 20 % below --loop asyncio": True,
                        "--loop trio p50 inter-chunk latency >= 20 % below --loop asyncio": False,
                        "--loop trio requests/s not below --loop asyncio": True}
    rows = report.serving_rows(results)
    assert rows[1][:4] == ["echo workers", "--loop trio", "100", "0"] and rows[1][4] == "10.00"
    assert rows[1][-2:] == ["40.0", "2.00"] and rows[2][-2:] == ["10.0", "2.22"]  # steps, worker CPU ms
    for r in raw["echo workers"].values():  # a run that did not measure the workers has no such columns
        del r[0]["worker_steps"], r[0]["worker_cpu_s"]
    assert len(report.serving_rows({"serving": summarize_serving(raw, 64)})[0]) == len(rows[0]) - 2


def test_the_operating_table_is_rendered_from_runs_json(tmp_path: Path) -> None:
    """docs/operating.md's serving block: every number from a run's JSON, nothing else replaced."""
    from bench.perf.operating import BEGIN, END, markdown_table, write_markdown

    run = {"serve_args": "--max-inflight 2", "cpus": 2, "exit_code": 130,
           "unloaded": {"p50_ms": 81.0, "p99_ms": 170.0, "engine_p99_ms_bucket": 250.0},
           "burst": {"rounds": 5, "requests": 5120, "admitted": 13, "shed_429": 5107, "other": [],
                     "admitted_p50_ms": 190.0, "admitted_p99_ms": 333.0, "shed_p99_ms": 41.0,
                     "engine_p99_ms_bucket": 500.0, "p99_vs_unloaded": 1.96},
           "kill": {"polls": 90, "first_503_after_ms": 20, "503_for_s": 2.5, "200_during_outage": 0}}
    table = markdown_table([run])
    row = ("| `--max-inflight 2` | 81 / 170 | ≤ 250 | 5 x 1024 -> 13 / 5107 / 0 | 190 / 333 (1.96x) "
           "| ≤ 500 | 41 |")
    assert row in table
    assert "(90 polls): first 503 after 20 ms, 503 `degraded` for 2.5 s" in table
    doc = tmp_path / "operating.md"
    doc.write_text(f"before\n{BEGIN}\nold\n{END}\nafter\n")
    write_markdown(doc, table)
    assert doc.read_text() == f"before\n{BEGIN}\n{table}{END}\nafter\n"


def test_a_pinned_run_says_where_its_processes_ran_and_cpu_lists_parse() -> None:
    import argparse

    from bench.perf.operating import cpu_list, run_label

    assert cpu_list("0,2-3") == {0, 2, 3} and cpu_list("1") == {1}
    with pytest.raises(argparse.ArgumentTypeError, match="not a CPU list"):
        cpu_list("one")
    assert run_label({"serve_args": ""}) == "defaults"
    assert run_label({"serve_args": "--max-inflight 1", "server_cpus": [0], "client_cpus": [1]}) == (
        "`--max-inflight 1` (server on CPU 0, load generator on CPU 1)")


def test_the_burst_client_times_each_answer_from_its_request_and_reports_cut_ones() -> None:
    """``at_once`` against a real loopback server that answers some requests and cuts the others."""
    import socket
    import threading

    from bench.perf.http_clients import at_once

    ls = socket.socket()
    ls.bind(("127.0.0.1", 0))
    ls.listen(64)

    def serve() -> None:
        for i in range(6):
            conn, _ = ls.accept()
            with conn:
                conn.recv(65536)
                if i % 3 == 2:
                    conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
                    continue  # closed with a reset, no answer
                status = b"200 OK" if i % 3 == 0 else b"429 Too Many Requests"
                conn.sendall(b"HTTP/1.1 " + status + b"\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")

    t = threading.Thread(target=serve)
    t.start()
    try:
        got = at_once("127.0.0.1", ls.getsockname()[1], 6, b"GET / HTTP/1.1\r\nhost: x\r\n\r\n", timeout=30)
    finally:
        t.join(30)
        ls.close()
    assert sorted(code for code, _ in got) == [0, 0, 200, 200, 429, 429]
    assert all(seconds >= 0 for _, seconds in got)


def test_one_request_returns_the_answer_s_json_and_runs_the_hook_once_the_request_is_written() -> None:
    """What the probe relies on: the hook runs after the request left (the server already has it),
    and the answer's JSON comes back with its status."""
    import json
    import socket
    import threading

    from bench.perf.http_clients import one_request

    ls = socket.socket()
    ls.bind(("127.0.0.1", 0))
    ls.listen(4)
    seen: list[bytes] = []

    def serve() -> None:
        conn, _ = ls.accept()
        with conn:
            seen.append(conn.recv(65536))
            body = json.dumps({"timings": {"stages": [{"compute_ms": 5.0}]}}).encode()
            conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: " + str(len(body)).encode()
                         + b"\r\nconnection: close\r\n\r\n" + body)

    t = threading.Thread(target=serve)
    t.start()
    hooked: list[int] = []
    try:
        code, took, answer = one_request("127.0.0.1", ls.getsockname()[1], b"GET / HTTP/1.1\r\n\r\n",
                                         lambda: hooked.append(len(seen)))
    finally:
        t.join(30)
        ls.close()
    assert code == 200 and took >= 0 and answer["timings"]["stages"][0]["compute_ms"] == 5.0
    assert hooked == [hooked[0]] and seen == [b"GET / HTTP/1.1\r\n\r\n"]
