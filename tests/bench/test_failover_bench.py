"""``python -m bench.perf.failover``: a short real run, and its table."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.perf import failover

pytestmark = pytest.mark.processes  # real trio-orch serve processes and their workers


@pytest.mark.slow
def test_a_short_run_measures_both_settings_and_writes_the_table(tmp_path: Path) -> None:
    doc = tmp_path / "doc.md"
    doc.write_text(f"before\n{failover.BEGIN}\nold\n{failover.END}\nafter\n")
    out = tmp_path / "run.json"
    assert failover.main(["--seconds", "3", "--concurrency", "12", "--outputs", "20", "--json", str(out),
                          "--markdown", str(doc)]) == 0
    runs = json.loads(out.read_text())["runs"]
    assert [r["max_retries"] for r in runs] == [1, 0]
    for r in runs:
        assert r["requests"] == sum(r["by_status"].values()) > 0
        assert r["errors"] == r["requests"] - r["by_status"].get("200", 0)
        assert set(r["by_status"]) <= {"200", "503"}  # a replica_died answers 503, nothing else fails
    assert runs[1]["retried"] == 0  # failover off: nothing resent
    text = doc.read_text()
    assert text.startswith("before\n") and text.endswith("after\n") and "old" not in text
    assert "`--max-retries 1`" in text and "`--max-retries 0`" in text
