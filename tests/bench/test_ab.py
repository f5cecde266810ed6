"""``python -m bench.perf.ab``: one workload on two commits, alternating, and the table of both."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from bench.perf.ab import MEASURES, SERVING_MEASURES, main

pytestmark = pytest.mark.processes  # child interpreters, a git worktree


def test_the_same_commit_on_both_sides_gives_a_row_per_measure_and_the_worktree_is_removed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    scratch = tmp_path / "tmp"  # its own temporary folder: another run's worktree in /tmp is not this one's
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    out = tmp_path / "ab.md"
    assert main(["--base", "HEAD", "--workloads", "loop_a_seq", "--rounds", "1", "--markdown", str(out)]) == 0
    rows = [line for line in out.read_text().splitlines() if line.startswith("| loop_a_seq | trio |")]
    assert [r.split(" | ")[2] for r in rows] == list(MEASURES)
    for r in rows:  # both sides measured: positive numbers and a finite ratio
        cells = r.strip("| ").split(" | ")
        base, head = (float(x.split(" [")[0].replace(",", "")) for x in cells[3:5])
        assert base > 0 and head > 0 and float(cells[5]) > 0
        assert cells[6] == "="  # one round a side on the same commit: nothing is claimed from it
    assert not list(scratch.glob("trio-orch-ab-*"))  # the temporary worktree is gone


def test_an_unknown_revision_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--base", "no-such-revision-anywhere"])
    assert "unknown revision 'no-such-revision-anywhere'" in capsys.readouterr().err


@pytest.mark.slow
def test_serving_on_both_sides_counts_the_workers_steps_per_request(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--serving``: both fronts on base and head, the worker steps per request among the measures."""
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    out = tmp_path / "ab.md"
    args = ["--base", "HEAD", "--serving", "--rounds", "1", "--seconds", "0.5", "--markdown", str(out)]
    assert main(args) == 0
    rows = [line.strip("| ").split(" | ") for line in out.read_text().splitlines()[2:]]
    assert {(r[0], r[1]) for r in rows} == {(f"--loop {f}", m) for f in ("trio", "asyncio")
                                             for m in SERVING_MEASURES}
    for r in rows:
        base, head = float(r[2].replace(",", "")), float(r[3].replace(",", ""))
        assert base > 0 and head > 0
    steps = {r[0]: float(r[3]) for r in rows if r[1] == "worker_steps_per_request"}
    assert all(s <= 3 * 16 for s in steps.values())  # a request takes 16 steps at most on each of 3 stages
    assert not list(scratch.glob("trio-orch-ab-*"))


def test_a_difference_is_claimed_only_when_every_round_of_one_side_is_beyond_the_other() -> None:
    from bench.perf.ab import compared

    assert compared("outputs_per_s", [10, 12, 11], [13, 14, 15]) == "better"
    assert compared("p99_us", [10, 12, 11], [13, 14, 15]) == "worse"
    assert compared("p99_us", [10, 12, 11], [11.5, 14, 15]) == "="
    assert compared("cpu_us_per_output", [10, 12, 11], [8, 9, 9]) == "better"
    assert compared("cpu_us_per_output", [10], [8]) == "="  # one round a side: too few to tell
