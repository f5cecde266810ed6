"""``python -m bench.perf.priority``: a short real run, its table, and the recorded run in the docs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.perf import priority

pytestmark = pytest.mark.processes  # a real trio-orch serve process and its worker


@pytest.mark.slow
def test_a_short_run_measures_the_three_phases_and_writes_the_table(tmp_path: Path) -> None:
    doc = tmp_path / "doc.md"
    doc.write_text(f"before\n{priority.BEGIN}\nold\n{priority.END}\nafter\n")
    out = tmp_path / "run.json"
    assert priority.main(["--loop", "trio", "--seconds", "2", "--low", "6", "--high", "1",
                          "--json", str(out), "--markdown", str(doc)]) == 0  # the recorded run: asyncio
    run = json.loads(out.read_text())
    assert run["settings"]["loop"] == "trio" and run["command"].endswith(f"--markdown {doc}")
    phases = run["phases"]
    assert [p["phase"] for p in phases] == ["unloaded", "fifo", "priority"]
    assert "low" not in phases[0] and all("low" in p for p in phases[1:])
    assert (phases[2]["high_priority"], phases[2]["low_priority"]) == (-5, 5)
    for p in phases:
        for cls in ("high", "low"):
            if cls in p:
                assert p[cls]["requests"] > 0 and p[cls]["errors"] == 0, p
                assert p[cls]["ttft_p99_ms"] is not None
    text = doc.read_text()
    assert text.startswith("before\n") and text.endswith("after\n") and "old" not in text
    assert "| priority | high (-5) |" in text and "| fifo | low (0) |" in text
    assert "`serve --loop trio`" in text


def test_the_table_in_the_docs_is_the_one_the_recorded_run_renders() -> None:
    """docs/performance.md's table is ``markdown()`` of docs/bench/priority.json: one run wrote both."""
    root = Path(__file__).resolve().parents[2]
    run = json.loads((root / "docs/bench/priority.json").read_text())
    doc = (root / "docs/performance.md").read_text()
    assert doc.count(priority.BEGIN) == 1 and doc.count(priority.END) == 1
    table = doc.split(priority.BEGIN, 1)[1].split(priority.END, 1)[0]
    assert table == "\n" + priority.markdown(run)
    assert [p["phase"] for p in run["phases"]] == list(priority.PHASES)
    assert all(c["errors"] == 0 for p in run["phases"] for c in (p.get("high"), p.get("low")) if c)
    assert "--markdown docs/performance.md" in run["command"]
    assert "--json docs/bench/priority.json" in run["command"]


def test_the_table_has_a_row_per_phase_and_class_and_the_ratio_to_the_unloaded_p99() -> None:
    row = {"requests": 10, "errors": 0, "ttft_p50_ms": 5.0, "ttft_p99_ms": 10.0, "e2e_p50_ms": 50.0,
           "e2e_p99_ms": 60.0}
    out = {"command": "python -m bench.perf.priority", "date": "2026-01-01", "cpus": 2, "loadavg": 1.0,
           "machine": "m", "settings": {"loop": "trio", "batch": 2, "outputs": 10, "step_ms": 20, "high": 2,
                                        "high_pause": 0.2, "low": 16, "seconds": 10.0},
           "phases": [{"phase": "unloaded", "high_priority": 0, "low_priority": 0, "high": row},
                      {"phase": "priority", "high_priority": -5, "low_priority": 5, "high": row,
                       "low": {**row, "ttft_p99_ms": 40.0}}]}
    lines = priority.markdown(out).splitlines()
    assert lines[2].startswith("| unloaded | high (0) | 10 | 0 | 5.0 / 10.0 | 1.0x |")
    assert lines[4].startswith("| priority | low (5) | 10 | 0 | 5.0 / 40.0 | 4.0x |")
    assert "`serve --loop trio`, one echo stage" in lines[-1]
