"""Failover when a replica does not die by kill -9: it hangs, or it leaves before finishing what it holds.

Real worker processes; one echo stage of two replicas, each batching one
request at a time, so of the requests on the replica that goes one is being
computed (it has produced output) and the others wait inside the worker
(they have produced nothing).  Whether the replica is evicted as hung (no
heartbeat after SIGSTOP), is asked to leave by the supervisor and its drain
time runs out, or is a remote worker whose leave grace runs out, the waiting
requests are resent to the other replica and complete there; at most the one
in its batch ends ``replica_died``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
import trio

from stages.auth import generate_keys
from stages.config import PipelineConfig, StageConfig
from trio_orch import OrchError, Orchestrator, OrchOutput
from trio_orch.cluster.launcher import Pipeline, open_pipeline
from trio_orch.cluster.pool import ReplicaPool
from trio_orch.cluster.registrar import HeadKeys, open_registrar
from trio_orch.cluster.supervisor import RestartPolicy, Supervisor, supervised_pipeline
from trio_orch.types import Message

pytestmark = pytest.mark.processes  # real worker processes

N = 8


def one_stage_echo(*, local_replicas: int = 2) -> PipelineConfig:
    """Each request takes 20 outputs 20 ms apart: far longer than it takes to hit the replica."""
    stage = StageConfig("echo", replicas=local_replicas, max_batch=1, model={"outputs": 20},
                        worker_args=["--step-delay-ms", "20"])
    return PipelineConfig([stage], final_stage_ids=[0], max_retries=1, heartbeat_interval=0.2,
                          heartbeat_timeout=1.5).validate()


async def run_with_fault(orch: Orchestrator, pool: ReplicaPool, victim: int,
                         fault: Callable[[], Awaitable[None]]) -> tuple[dict[str, list[Message]], set[str]]:
    """Add N requests, start ``fault`` once one of the victim replica's requests produced output;
    return every request's messages and the requests the victim held then."""
    msgs: dict[str, list[Message]] = {f"r{i}": [] for i in range(N)}
    for i in range(N):
        await orch.add_request(f"r{i}", i)
    held = {rid for rid in msgs if pool.replica_of(rid) == victim}
    assert len(held) >= 2, "the victim must hold a request in its batch and one waiting"
    async with trio.open_nursery() as nursery:
        with trio.fail_after(60):
            started = False
            while sum(bool(m) and m[-1].finished for m in msgs.values()) < N:
                m = await orch.next_output()
                msgs[m.request_id].append(m)
                if not started and m.request_id in held:
                    started = True
                    nursery.start_soon(fault)
    return msgs, held


def check_failed_over(msgs: dict[str, list[Message]], held: set[str], pool: ReplicaPool, victim: int,
                      retried: int) -> None:
    """The victim's waiting requests completed elsewhere; only one that had produced output failed."""
    terminals = {rid: m[-1] for rid, m in msgs.items()}
    assert all(m.finished for m in terminals.values())
    failed = {rid for rid, m in terminals.items() if isinstance(m, OrchError)}
    assert all(terminals[rid].kind == "replica_died" for rid in failed)  # type: ignore[union-attr]
    assert failed <= held and len(failed) <= 1  # at most its batch of one
    assert all(len(msgs[rid]) > 1 for rid in failed), "a request that had produced nothing failed"
    resent = {rid for rid in msgs if (tm := pool.timing_of(rid)) is not None and tm.retried_from == victim}
    assert resent and resent <= held and len(resent) == retried
    assert all(isinstance(terminals[rid], OrchOutput) for rid in resent)
    assert all(pool.timing_of(rid).replica != victim for rid in resent)  # type: ignore[union-attr]


@pytest.mark.slow
async def test_a_hung_replica_evicted_by_its_heartbeat_hands_its_waiting_requests_over() -> None:
    async with supervised_pipeline(one_stage_echo(), RestartPolicy(backoff_initial=0.0)) as pipe:
        sup: Supervisor = pipe.supervisor  # type: ignore[attr-defined]
        orch = Orchestrator(pipe.stages, **pipe.orchestrator_kwargs())
        pool = pipe.stages[0]
        stopped = pipe.worker(0, 0).pid

        async def hang() -> None:
            os.kill(stopped, signal.SIGSTOP)

        async with trio.open_nursery() as nursery:
            await nursery.start(orch.run)
            msgs, held = await run_with_fault(orch, pool, 0, hang)
            with trio.fail_after(30):
                await sup.wait_for(lambda: bool(sup.events))
            retried = orch.statistics().core.retried_by_stage[0]
            await orch.shutdown()
    assert sup.events[0].cause == "heartbeat_timeout"
    assert not os.path.exists(f"/proc/{stopped}")  # the supervisor killed it, not left stopped
    check_failed_over(msgs, held, pool, 0, retried)


async def test_a_replica_whose_leave_ran_out_of_drain_time_hands_its_waiting_requests_over() -> None:
    async with supervised_pipeline(one_stage_echo(), RestartPolicy(backoff_initial=0.0)) as pipe:
        sup: Supervisor = pipe.supervisor  # type: ignore[attr-defined]
        orch = Orchestrator(pipe.stages, **pipe.orchestrator_kwargs())
        pool = pipe.stages[0]

        async def leave() -> None:
            await sup.leave(0, 0, drain_timeout=0.05)  # far less than its held requests need

        async with trio.open_nursery() as nursery:
            await nursery.start(orch.run)
            msgs, held = await run_with_fault(orch, pool, 0, leave)
            retried = orch.statistics().core.retried_by_stage[0]
            await orch.shutdown()
    assert [(ev.cause, ev.outcome) for ev in sup.events] == [("left", "left")]
    check_failed_over(msgs, held, pool, 0, retried)


REMOTE_TOML = """
[pipeline]
final_stages = [0]
heartbeat_interval = 0.2
heartbeat_timeout = 1.5
[[stages]]
kind = "echo"
max_batch = 1
[stages.model]
outputs = 20
"""


@pytest.mark.slow
async def test_a_remote_worker_whose_leave_grace_ran_out_hands_its_waiting_requests_over(
        tmp_path: Path) -> None:
    generate_keys(tmp_path / "keys", workers=1)
    cfg = tmp_path / "pipe.toml"
    cfg.write_text(REMOTE_TOML)
    pipe: Pipeline
    async with (open_pipeline(one_stage_echo(local_replicas=1), inbox_host="127.0.0.1") as pipe,
                open_registrar(pipe, "tcp://127.0.0.1:0", HeadKeys.load(tmp_path / "keys")) as reg):
        orch = Orchestrator(pipe.stages, **pipe.orchestrator_kwargs())
        pool = pipe.stages[0]
        argv = [sys.executable, "-m", "stages.headless", "--stage", "0", "--head", reg.address,
                "--keys", str(tmp_path / "keys"), "--key", "worker-1", "--config", str(cfg),
                "--advertise", "127.0.0.1", "--head-timeout", "2", "--step-delay-ms", "20",
                "--leave-grace", "0.1"]
        proc = await trio.lowlevel.open_process(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            async def leave() -> None:
                proc.send_signal(signal.SIGTERM)  # leave: finish what it holds within 0.1 s

            async with trio.open_nursery() as nursery:
                await nursery.start(orch.run)
                with trio.fail_after(60):
                    while reg.counters["joined"] < 1:
                        await trio.sleep(0.02)
                msgs, held = await run_with_fault(orch, pool, 1, leave)
                retried = orch.statistics().core.retried_by_stage[0]
                await orch.shutdown()
            with trio.fail_after(30):
                assert await proc.wait() == 0  # it left; it was not killed
            assert reg.counters["left"] == 1
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
    check_failed_over(msgs, held, pool, 1, retried)
