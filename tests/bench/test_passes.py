"""``python -m bench.perf.passes``: the per-output counts of a profiled run, and its table."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.perf.passes import main, markdown, profile_one


def test_a_profiled_in_loop_run_counts_calls_per_output_and_names_where_the_time_went() -> None:
    row = profile_one("loop_b_512_unbatched", "trio")
    assert row["outputs"] == 512 * 10  # the --quick size
    # every output is routed by a Python call or more; the loop goes round far less than once per output
    assert row["calls"] > 5 and 0 < row["passes"] < 1
    assert row["top"] and all(0 < share <= 1 for _, share in row["top"])
    assert not any("poll" == name.rsplit("(", 1)[-1].rstrip(")") for name, _ in row["top"])  # waits left out
    text = markdown([row])
    assert "| loop_b_512_unbatched | trio |" in text and "**loop_b_512_unbatched, trio**" in text


def test_the_command_refuses_an_unknown_workload_and_writes_its_table(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--workloads", "nope"])
    assert "unknown workload(s) nope" in capsys.readouterr().err
    out = tmp_path / "profile.md"
    assert main(["--workloads", "loop_a_seq", "--impls", "trio", "--markdown", str(out)]) == 0
    assert out.read_text().startswith("| workload | implementation |")
