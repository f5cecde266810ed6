"""Nobody listens in a dead worker's place on the data plane: a real rogue, a real async-chunk pipeline.

The attack: kill -9 the worker of stage 1 (it owns an async-chunk inbox), and
bind that inbox's ipc path the moment it is gone
(:mod:`trio_orch.testing.rogue_inbox`: a PLAIN server that accepts everyone
and writes down what it is offered).  Stage 0's worker reconnects to the path
every 10 ms and finds the rogue there first: the replacement the supervisor
starts takes 1.5 s more.  The rogue must get no credential and no chunk; once
the replacement binds the path, stage 0 must stream to it (libzmq gave up on
the endpoint after the failed handshake: the outbox connects afresh), and
every request must be answered.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import trio

from stages.config import echo_config
from trio_orch import OrchError, Orchestrator, OrchOutput
from trio_orch.cluster.launcher import inbox_address
from trio_orch.cluster.supervisor import RestartPolicy, supervised_pipeline
from trio_orch.testing import worker_alive

ROOT = Path(__file__).resolve().parents[2]
HANG = 60.0


def events(path: Path) -> list[dict[str, Any]]:
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return []
    return [json.loads(line) for line in lines if line.startswith("{")]


async def answers(orch: Orchestrator, ids: list[str]) -> dict[str, list[Any]]:
    """The outputs of ``ids``, once each has its terminal (an error fails the test)."""
    got: dict[str, list[Any]] = {rid: [] for rid in ids}
    done: set[str] = set()
    with trio.fail_after(HANG):
        while done != set(ids):
            msg = await orch.next_output()
            assert not isinstance(msg, OrchError), msg
            assert isinstance(msg, OrchOutput)
            got[msg.request_id].append(msg.data)
            if msg.finished:
                done.add(msg.request_id)
    return got


async def test_a_rogue_bound_at_a_dead_workers_inbox_gets_no_secret_and_no_chunk(tmp_path: Path) -> None:
    cfg = echo_config(2, final_stage_ids=[1], outputs=3, async_chunk=True, heartbeat_interval=0.2,
                      heartbeat_timeout=2.0, stop_grace=1.0)
    policy = RestartPolicy(max_restarts=3, window=30.0, backoff_initial=0.05)

    def slow_replacement(k: int, r: int, attempt: int) -> list[str]:
        return ["--startup-delay", "1.5"] if k == 1 and attempt > 0 else []

    report = tmp_path / "rogue.jsonl"
    rogue: subprocess.Popen[bytes] | None = None
    async with supervised_pipeline(cfg, policy, extra_args=slow_replacement) as pipe:
        orch = Orchestrator(pipe.stages, **pipe.orchestrator_kwargs())
        async with trio.open_nursery() as nursery:
            await nursery.start(orch.run)
            for i in range(2):
                await orch.add_request(f"before-{i}", f"before {i}")
            assert await answers(orch, ["before-0", "before-1"]) == {f"before-{i}": [f"before {i}"] * 3
                                                                     for i in range(2)}
            victim = pipe.worker(1, 0)
            victim_pid = victim.pid
            assert victim_pid is not None
            inbox = inbox_address(pipe.tmpdir, 1, 0)
            with report.open("wb") as out:
                rogue = subprocess.Popen([sys.executable, "-m", "trio_orch.testing.rogue_inbox", "--bind",
                                          inbox, "--after-death", str(victim_pid)], cwd=ROOT, stdout=out)
            try:
                with trio.fail_after(HANG):
                    while not any(e["event"] == "started" for e in events(report)):
                        await trio.sleep(0.01)
                    os.kill(victim_pid, signal.SIGKILL)
                    while not any(e["event"] == "accepted" for e in events(report)):  # stage 0 came to it
                        await trio.sleep(0.01)
                    while pipe.supervisor.restarts < 1 or pipe.worker(1, 0).client.ready is None:
                        await trio.sleep(0.02)
                # 1.5 s later: it was offered nothing, and no handshake completed (a PLAIN client would have
                # given it the pipeline secret, then stayed connected to it)
                taken = [e for e in events(report) if e["event"] in ("credentials", "handshake_succeeded")]
                assert taken == []
                replacement = pipe.worker(1, 0)
                assert replacement.pid != victim_pid
                ids = [f"after-{i}" for i in range(4)]
                for rid in ids:  # bound to the replacement: stage 0 streams their chunks to its inbox
                    await orch.add_request(rid, rid.replace("-", " "))
                assert await answers(orch, ids) == {rid: [rid.replace("-", " ")] * 3 for rid in ids}
                stats = await replacement.client.rpc("stats")
                assert stats["chunks_in"] == 12, stats
                assert stats["connector"]["inbox"]["curve_server"], stats["connector"]
                upstream = await pipe.worker(0, 0).client.rpc("stats")
                assert upstream["connector"]["outbox"][0]["mechanism"] == "CURVE", upstream["connector"]
            finally:
                rogue.send_signal(signal.SIGTERM)
                rogue.wait(HANG)
            await orch.shutdown()
    seen = events(report)
    done = seen[-1]
    assert done["event"] == "done", seen
    # the upstream came to it and left without a word: no credential offered, no chunk, no handshake
    assert done["accepted"] >= 1 and done["handshake_failed"] >= 1, done
    assert done["credentials"] == 0 and done["chunks"] == 0 and done["handshake_succeeded"] == 0, seen
    assert not worker_alive(victim_pid) and not worker_alive(replacement.pid or 0)
