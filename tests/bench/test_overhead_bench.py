"""``python -m bench.perf.overhead`` and ``python -m bench.gpu_check``: real runs on CPU, the recorded run.

The quick benchmark runs end to end here (both fronts of a real ``serve`` on
the tests' tiny checkpoint, the model alone in this process); the GPU check
is rehearsed on CPU (every step but the benchmark) and refuses to run
without CUDA.  The table in docs/performance.md must be what the recorded
run's JSON renders.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from bench import gpu_check
from bench.perf import overhead
from trio_orch.testing import child_pids, worker_alive

pytestmark = pytest.mark.processes  # real trio-orch serve processes and their workers

ROOT = Path(__file__).resolve().parents[2]


def _no_workers_left() -> bool:
    """No worker, and no model stepping alone (``bench.perf.alone``), is left running."""
    def alone(pid: int) -> bool:
        try:
            return b"bench.perf.alone" in Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            return False

    return not [p for p in child_pids() if worker_alive(p) or alone(p)]


@pytest.mark.slow
def test_a_quick_run_serves_and_steps_alone_the_same_requests_and_writes_the_table(tmp_path: Path,
                                                                                   tiny_qwen2: Any) -> None:
    doc = tmp_path / "doc.md"
    doc.write_text(f"before\n{overhead.BEGIN}\nold\n{overhead.END}\nafter\n")
    out = tmp_path / "run.json"
    assert overhead.main(["--quick", "--checkpoint", str(tiny_qwen2.path), "--json", str(out),
                          "--markdown", str(doc)], progress=lambda line: None) == 0
    run = json.loads(out.read_text())
    s = run["settings"]
    assert (s["levels"], s["tokens"], s["waves"], s["rounds"]) == ([1, 4], 4, 2, 1)
    for impl in ("alone", *overhead.FRONTS):
        for c in ("1", "4"):
            r = run["results"][impl][c]
            assert r["failed"] == 0 and r["mismatched_texts"] == 0, (impl, c, r)
            assert r["waves"] == 2 and r["requests"] == 2 * int(c), (impl, c, r)
            assert r["tokens"] == 4 * r["requests"], (impl, c, r)  # min_tokens = max_tokens = 4
            assert r["ttft_p50_ms"] is not None and r["itl_p50_ms"] is not None
    # alone, every step holds the whole wave: 4 steps a wave, of 4 requests at level 4, of 1 at level 1
    assert run["results"]["alone"]["4"]["steps"] == 8 and run["results"]["alone"]["1"]["steps"] == 8
    assert run["results"]["alone"]["4"]["tokens_per_step"] == 4.0
    for front in overhead.FRONTS:
        assert set(run["overhead"][front]) == {"1", "4"}
        assert run["results"][front]["1"]["steps"] >= 8  # served, the worker steps at least as often
        assert set(run["results"][front]["1"]["cpu_ms_per_token"]) == {"head", "worker"}
    text = doc.read_text()
    assert text.startswith("before\n") and text.endswith("after\n") and "old" not in text
    assert text.split(overhead.BEGIN, 1)[1].split(overhead.END, 1)[0] == "\n" + overhead.markdown(run)
    assert "| trio | 4 |" in text and "| asyncio | 1 |" in text
    assert "each prompt with the same text served and alone" in text
    assert _no_workers_left()


def test_the_table_in_the_docs_is_the_one_the_recorded_run_renders() -> None:
    """docs/performance.md's overhead table is ``markdown()`` of docs/bench/overhead.json: one run, both."""
    run = json.loads((ROOT / "docs/bench/overhead.json").read_text())
    doc = (ROOT / "docs/performance.md").read_text()
    assert doc.count(overhead.BEGIN) == 1 and doc.count(overhead.END) == 1
    assert doc.split(overhead.BEGIN, 1)[1].split(overhead.END, 1)[0] == "\n" + overhead.markdown(run)
    assert run["settings"]["levels"] == [1, 8, 32] and "--quick" not in run["command"]
    assert "--json docs/bench/overhead.json" in run["command"]
    assert "--markdown docs/performance.md" in run["command"]
    rows = [r[c] for r in run["results"].values() for c in r]
    assert all(row["failed"] == 0 and row["mismatched_texts"] == 0 for row in rows)
    assert run["machine"] != "not described"  # the doc says how loaded the machine was


def _fake_run() -> dict[str, Any]:
    def row(tps: float, ttft: float, steps: int, cpu: dict[str, float]) -> dict[str, Any]:
        return {"requests": 4, "failed": 0, "mismatched_texts": 0, "tokens": 16, "wall_s": 16 / tps,
                "waves": 1, "wave_wall_p50_ms": 16 / tps * 1e3,
                "tokens_per_s": tps, "ttft_p50_ms": ttft, "ttft_p99_ms": ttft * 2, "itl_p50_ms": 5.0,
                "itl_p99_ms": 9.0, "steps": steps, "tokens_per_step": 16 / steps, "cpu_ms_per_token": cpu,
                "wall_s_rounds": [16 / tps]}

    alone = row(100.0, 10.0, 4, {"model": 4.0})
    served = row(80.0, 20.0, 5, {"head": 1.5, "worker": 4.5})
    results = {"alone": {"2": alone}, "asyncio": {"2": served}, "trio": {"2": served}}
    ov = overhead.overhead_at(alone, served)
    settings = {"levels": [2], "tokens": 4, "waves": 2, "rounds": 1, "device": "cpu", "goal": 0.05,
                "checkpoint": "c"}
    head = {"samples": 10, "busy_cores": 0.4, "innermost": {"trio": 0.6, "zmq": 0.4}}
    worker = {"samples": 20, "busy_cores": 0.9, "innermost": {"model (torch)": 0.9, "worker loop": 0.1}}
    return {"command": "python -m bench.perf.overhead", "date": "2026-01-01", "cpus": 2,
            "loadavg": [1.0, 2.0], "machine": "m", "settings": settings,
            "results": results, "overhead": {"asyncio": {"2": ov}, "trio": {"2": ov}},
            "profile": {"level": 2, "seconds": 3.0,
                        **{f: {"head": head, "worker": worker} for f in overhead.FRONTS}}}


def test_the_overhead_is_served_wall_time_over_alone_and_the_table_says_where_it_went() -> None:
    run = _fake_run()
    assert run["overhead"]["trio"]["2"] == {"overhead": 0.25, "overhead_rounds": [0.25], "cpu_overhead": 0.5,
                                            "ttft_p50_ratio": 2.0, "itl_p50_ratio": 1.0}
    lines = overhead.markdown(run).splitlines()
    assert lines[2] == ("| asyncio | 2 | 80.0 / 100.0 | **+25.0%** (+25.0%) | **+50.0%** | 20.0 / 10.0 "
                        "| 40.0 / 20.0 | 5.0 / 5.0 | 9.0 / 9.0 |")
    assert "| trio | 2 | 5 / 4 | 3.2 / 4.0 | 1.5 | 4.5 | 4.0 |" in lines
    assert "| trio | worker | 0.9 | model (torch) 90%, worker loop 10% |" in lines
    assert "each prompt with the same text served and alone" in lines[-1]


def test_where_a_profiled_frame_goes() -> None:
    frame = "forward (transformers/models/qwen2/modeling_qwen2.py:40)"
    assert overhead.place_of(frame) == "model (transformers)"
    assert overhead.place_of("step (/repo/stages/worker.py:350)") == "worker loop"
    assert overhead.place_of("encode (/repo/stages/wire.py:20)") == "wire (msgspec frames)"
    assert overhead.place_of("route (/repo/trio_orch/core/router.py:9)") == "orchestrator"
    assert overhead.place_of("send (zmq/sugar/socket.py:700)") == "zmq"
    assert overhead.place_of("mystery (elsewhere.py:1)") == "other"


@pytest.mark.parametrize("argv", [["--levels", "64"], ["--levels", "0,1"], ["--tokens", "0"]])
def test_an_impossible_setting_is_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert overhead.main(argv) == 2
    assert "error: --levels" in capsys.readouterr().err


def test_prompts_are_different_and_the_same_every_run() -> None:
    assert overhead.prompts(8) == overhead.prompts(8) and len(set(overhead.prompts(8))) == 8
    assert overhead.prompts(1, offset=10_000) != overhead.prompts(1)


def test_the_gpu_check_without_cuda_exits_2_saying_so(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "bench.gpu_check", str(tmp_path / "out")], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "error: no CUDA device here" in proc.stderr and "--dry-run" in proc.stderr
    assert not (tmp_path / "out").exists()


def test_the_gpu_checks_dry_run_prints_every_step_on_cuda(capsys: pytest.CaptureFixture[str],
                                                           tmp_path: Path) -> None:
    assert gpu_check.main([str(tmp_path), "--dry-run"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in lines] == list(gpu_check.STEPS)
    assert "generate --model" in lines[2] and "--device cuda:0" in lines[2]
    assert "bench.perf.overhead --device cuda" in lines[4] and "--quick" not in lines[4]
    assert not list(tmp_path.iterdir())
    with pytest.raises(SystemExit):
        gpu_check.main([str(tmp_path), "--steps", "generate,nonsense"])
    assert "unknown step(s) nonsense" in capsys.readouterr().err


@pytest.mark.slow
def test_the_gpu_check_rehearsed_on_cpu_runs_each_step_and_writes_its_results(tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "bench.gpu_check", str(out), "--rehearse", "--steps",
                           "generate,placement"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["ok"] and list(summary["steps"]) == ["gpus", "checkpoint", "generate", "placement"]
    placed = json.loads((out / "placement.json").read_text())
    assert (placed["device"], placed["cuda_visible_devices"], placed["model_device"]) == ("cpu", "", "cpu")
    assert placed["answer"] and placed["refused"]["exit"] == 2
    assert "device cuda:0 asked for" in placed["refused"]["stderr"]
    assert "time to first token" in (out / "generate.log").read_text()
    assert _no_workers_left()
