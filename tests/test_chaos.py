"""The CI subset of ``trio-orch chaos``: real worker processes, one fault per test.

Echo workers (model compute is irrelevant to these faults), 2 replicas per
stage, a few hundred requests.  Each test asserts the guarantees, not timings:
every accepted request has exactly one terminal, no duplicates, nothing
after a terminal, no leaked process / fd / ipc file, still serving after.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import trio

from bench import chaos
from bench.chaos_faults import FAULTS
from bench.chaos_run import ChaosOptions, ChaosResult, run_fault

OPTS = ChaosOptions(requests=150, concurrency=32, echo=True, request_timeout=20.0, probe_requests=10,
                    progress=False)


async def run(name: str) -> ChaosResult:
    f = FAULTS[name]
    return await run_fault(name, f.description, f.inject, OPTS, **f.options)


def check(res: ChaosResult) -> None:
    assert res.error is None, res.error
    assert res.accepted >= 150 or res.fault == "shutdown"
    assert res.without_terminal == 0
    assert res.duplicates == 0 and res.after_terminal == 0
    assert (res.leaked_processes, res.leaked_fds, res.leaked_ipc_files) == (0, 0, 0)
    assert res.ok


async def test_chaos_kill9_worker() -> None:
    res = await run("kill9")
    check(res)
    assert res.still_serving == "yes" and res.restarts == 1
    assert set(res.failed) <= {"replica_died"}
    assert res.detect_s is not None and res.recover_s is not None


async def test_chaos_sigstop_worker() -> None:
    res = await run("sigstop")
    check(res)
    assert res.still_serving == "yes" and res.restarts == 1
    assert set(res.failed) <= {"replica_died"}


async def test_chaos_garbage_frames() -> None:
    res = await run("garbage")
    check(res)
    assert res.still_serving == "yes"
    assert res.failed == {}  # garbage costs no request its output
    assert res.notes["bad_garbage"] == 2 and res.notes["bad_unknown"] == 1
    assert res.restarts == 0


async def test_chaos_shutdown_under_load() -> None:
    res = await run("shutdown")
    check(res)
    assert res.still_serving == "n/a (stopped)"
    assert res.accepted + res.refused == 150  # every request was either accepted or refused
    assert set(res.failed) <= {"shutdown"}


def test_chaos_cli_writes_table_json_markdown(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """The reporting path (the runs themselves are the tests above)."""
    fake = ChaosResult("kill9", "kill -9 a talker replica", "echo", requests=10, accepted=10, completed=9,
                       failed={"replica_died": 1}, still_serving="yes", detect_s=0.1, recover_s=0.5,
                       restarts=1)
    monkeypatch.setattr(trio, "run", lambda fn, args: [fake])
    parser = argparse.ArgumentParser()
    chaos.configure(parser)
    jpath, mpath = tmp_path / "c.json", tmp_path / "c.md"
    args = parser.parse_args(["--quick", "--json", str(jpath), "--markdown", str(mpath)])
    assert chaos.run(args) == 0
    out = capsys.readouterr().out
    assert "kill9" in out and "replica_died 1" in out and "1/1 faults kept every guarantee" in out
    data = json.loads(jpath.read_text())
    assert data["results"][0]["fault"] == "kill9" and data["results"][0]["ok"] is True
    assert "| kill9 |" in mpath.read_text()
