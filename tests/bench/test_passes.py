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


def test_the_before_after_table_takes_the_median_of_each_side_and_the_ratio(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Computed from tables the module wrote, never typed in: medians over each side's runs."""
    def table(name: str, rows: list[tuple[str, str, float, float, float]]) -> Path:
        path = tmp_path / name
        path.write_text(markdown([{"workload": w, "impl": i, "passes": p, "steps": s, "calls": c, "top": []}
                                  for w, i, p, s, c in rows]))
        return path

    before = [table(f"b{i}.md", [("a_seq", "trio", 2.0, 1.0, c), ("gone", "trio", 1.0, 1.0, 1.0)])
              for i, c in enumerate((100.0, 90.0, 300.0))]
    for i, c in enumerate((80.0, 95.0, 10.0)):
        table(f"a{i}.md", [("a_seq", "trio", 1.0, 1.0, c)])
    with pytest.raises(SystemExit):
        main(["--before", str(before[0])])  # --after is missing
    assert main(["--before", str(tmp_path / "b*.md"), "--after", str(tmp_path / "a*.md")]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| a_seq")]
    # the medians: calls 100 before, 80 after; a row only one side has is left out
    assert rows == ["| a_seq | trio | 2.000, 1.000 (0.50) | 1.00, 1.00 (1.00) | 100.0, 80.0 (0.80) |"]
