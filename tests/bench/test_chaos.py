"""The CI subset of ``trio-orch chaos``: real worker processes, one fault per test.

Echo workers (model compute is irrelevant to these faults), 2 replicas per
stage, a few hundred requests; the ``remote_*`` faults add headless workers
that join over loopback TCP.  Each test asserts the guarantees, not timings:
every accepted request has exactly one terminal, no duplicates, nothing
after a terminal, no leaked process / fd / ipc file, still serving after.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import pytest
import trio

from bench.chaos import cli as chaos
from bench.chaos.faults import FAULTS
from bench.chaos.run import ChaosOptions, ChaosResult

OPTS = ChaosOptions(requests=150, concurrency=32, echo=True, request_timeout=20.0, probe_requests=10,
                    progress=False)


async def run(name: str) -> ChaosResult:
    return await FAULTS[name].run(OPTS)


def check(res: ChaosResult) -> None:
    assert res.error is None, res.error
    assert res.accepted >= 150 or res.fault == "shutdown"
    assert res.without_terminal == 0
    assert res.duplicates == 0 and res.after_terminal == 0
    assert (res.leaked_processes, res.leaked_fds, res.leaked_ipc_files) == (0, 0, 0)
    assert res.ok


@pytest.mark.slow
async def test_chaos_kill9_worker() -> None:
    res = await run("kill9")
    check(res)
    assert res.still_serving == "yes" and res.restarts == 1
    assert set(res.failed) <= {"replica_died"}
    assert res.detect_s is not None and res.recover_s is not None


@pytest.mark.slow
async def test_chaos_sigstop_worker() -> None:
    res = await run("sigstop")
    check(res)
    assert res.still_serving == "yes" and res.restarts == 1
    assert set(res.failed) <= {"replica_died"}


@pytest.mark.slow
async def test_chaos_garbage_frames() -> None:
    res = await run("garbage")
    check(res)
    assert res.still_serving == "yes"
    assert res.failed == {}  # garbage costs no request its output
    assert res.notes["bad_garbage"] == 2 and res.notes["bad_unknown"] == 1
    assert res.restarts == 0


@pytest.mark.slow
async def test_chaos_slow_consumer_backlog_builds_up_and_drains() -> None:
    # enough load that the outputs outlast the 2 s of slow reading and meet the paused consumer
    opts = dataclasses.replace(OPTS, requests=1000, concurrency=64)
    res = await FAULTS["slow_consumer"].run(opts)
    check(res)
    assert res.still_serving == "yes" and res.failed == {}
    assert res.notes["peak_backlog_msgs"] > 0  # the paused consumer let the output stream back up
    assert res.recover_s is not None  # ... and it drained once the consumer resumed


@pytest.mark.slow
async def test_chaos_channel_full_refuses_then_recovers() -> None:
    res = await run("channel_full")
    check(res)
    assert res.still_serving == "yes" and res.failed == {}
    assert res.notes["refused_channel_full"] > 0  # the gated stage 0 kept the request channel full
    assert res.notes["accepted_during_stall"] > 0 and res.recover_s is not None


@pytest.mark.slow
async def test_chaos_shutdown_under_load() -> None:
    res = await run("shutdown")
    check(res)
    assert res.still_serving == "n/a (stopped)"
    assert res.accepted + res.refused == 150  # every request was either accepted or refused
    assert set(res.failed) <= {"shutdown"}


@pytest.mark.slow
async def test_chaos_rogue_worker_is_refused_and_the_replacement_serves() -> None:
    res = await run("rogue_worker")
    check(res)
    assert res.still_serving == "yes" and res.restarts == 1
    assert set(res.failed) <= {"replica_died"}
    assert res.notes["rogue_connected"] == 0 and res.notes["rogue_submits"] == 0
    assert res.notes["rogue_refused"] >= 2 and res.notes["refused_stranger"] >= 1
    assert res.notes["refused_stale"] >= 1


@pytest.mark.slow
async def test_chaos_rogue_inbox_gets_nothing_and_the_replacement_gets_the_chunks() -> None:
    res = await run("rogue_inbox")
    check(res)
    assert res.still_serving == "yes" and res.restarts == 1
    assert set(res.failed) <= {"replica_died"}
    assert res.notes["rogue_accepted"] >= 1  # the talkers came to it ...
    assert res.notes["rogue_credentials"] == 0 and res.notes["rogue_chunks"] == 0  # ... and handed it nothing


@pytest.mark.slow
async def test_chaos_remote_worker_lost_mid_stream_then_back_under_a_new_identity() -> None:
    res = await run("remote_lost")
    check(res)
    assert res.still_serving == "yes" and set(res.failed) <= {"replica_died"}
    assert res.notes["held_when_lost"] > 0  # stopped while it held requests
    assert (res.notes["lost"], res.notes["joined"]) == (1, 2)  # lost once, then joined again
    assert res.detect_s is not None and res.recover_s is not None


@pytest.mark.slow
async def test_chaos_remote_stale_reregistration_is_refused_while_a_fresh_worker_joins() -> None:
    res = await run("remote_stale")
    check(res)
    assert res.still_serving == "yes" and set(res.failed) <= {"replica_died"}
    assert res.notes["refused_stale"] == 1 and res.notes["stale_exit"] == 1
    assert (res.notes["lost"], res.notes["joined"]) == (1, 2)
    assert res.recover_s is not None


@pytest.mark.slow
async def test_chaos_remote_worker_with_an_unknown_key_is_refused_and_counted() -> None:
    res = await run("remote_unknown_key")
    check(res)
    assert res.still_serving == "yes" and res.failed == {}
    assert res.notes["auth_refused_curve_register"] >= 1 and res.notes["intruder_exit"] == 1
    assert "joined" not in res.notes and "registrations" not in res.notes  # it never got to register


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


@pytest.mark.slow
async def test_serve_restarts_a_killed_worker_and_shows_it_on_metrics() -> None:
    """kill -9 a worker of a real ``trio-orch serve``: restarted, counted on /metrics, still serving."""
    import os
    import signal

    import httpx

    from bench.chaos.server import ServerProcess, chat_body, parse_metrics

    opts = ChaosOptions(request_timeout=20.0, progress=False)
    server = ServerProcess(opts, replicas=1)
    await server.start()
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(server.drain_output)
            async with httpx.AsyncClient(timeout=30) as client:
                victim = min(server.worker_pids)
                os.kill(victim, signal.SIGKILL)
                metrics: dict[str, float] = {}
                with trio.fail_after(30):
                    while not any(k.startswith("trio_orch_supervisor_restarts_total") and n > 0
                                  for k, n in metrics.items()):  # every (stage, cause) is there from 0
                        await trio.sleep(0.1)
                        metrics = parse_metrics((await client.get(server.url + "/metrics")).text)
                deaths = [k for k, n in metrics.items()
                          if k.startswith("trio_orch_supervisor_deaths_total") and n]
                assert deaths and all('cause="exited"' in k for k in deaths)
                r = await client.post(server.url + "/v1/chat/completions",
                                      json=chat_body(opts, 0, stream=False))
                assert r.status_code == 200
            code, _ = await server.stop(signal.SIGINT)
            assert code == 0  # serve's exit code after a clean signal-triggered drain
    finally:
        if server.proc is not None and server.proc.returncode is None:
            await server.stop(signal.SIGKILL)
    assert len(server.worker_pids) == 4  # 3 first workers + the replacement, all gone now
    assert server.leaks() == (0, 0)


@pytest.mark.slow
async def test_chaos_says_what_it_does_while_the_workers_start(capsys: pytest.CaptureFixture[str]) -> None:
    opts = dataclasses.replace(OPTS, requests=20, probe_requests=2, progress=True)
    res = await FAULTS["abort_storm"].run(opts)
    assert res.ok and res.without_terminal == 0, res.error
    err = capsys.readouterr().err
    assert "abort_storm: starting 6 workers ..." in err
    assert err.index("starting 6 workers") < err.index("workers ready after")


def test_a_request_refused_before_acceptance_is_not_counted_as_lost() -> None:
    """429 (shed) and 503 (draining) answers owe no terminal: refused, not failed, not without terminal."""
    from bench.chaos.server import count_outcomes

    res = ChaosResult("http_disconnect", "-", "-")
    count_outcomes(res, {"ok": 90, "left": 80, "http_429": 13, "http_503": 2, "cut": 1, "refused": 4,
                         "stage_failed": 1})
    assert res.refused == 13 + 2 + 4 and res.accepted == 90 + 80 + 1 + 1
    assert res.failed == {"left": 80, "stage_failed": 1}  # a refusal is not a failure
    assert res.without_terminal == 1 and res.completed == 90  # only the cut stream lost its terminal
    assert res.notes["refused_by_status"] == "429: 13, 503: 2"
