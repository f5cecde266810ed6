"""The supervisor and bad worker input, with real worker processes and real ZMQ sockets.

Every test checks "exactly one terminal per request, the last message for it"
with a :class:`~trio_orch.testing.TerminalLedger` and that nothing is left
behind (:class:`~trio_orch.testing.LeakProbe`: processes, ipc files).  Bad
output comes from real ``stages.worker`` processes told to misbehave by their
``--fault-*`` flags.  No timing asserts.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import tempfile
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import pytest
import trio
import trio.testing
import zmq

from stages.config import PipelineConfig, StageConfig, echo_config
from trio_orch.cluster.launcher import Pipeline, WorkerHandle, open_pipeline, run_worker
from trio_orch.cluster.pool import ReplicaPool
from trio_orch.cluster.supervisor import CAUSES, RestartPolicy, Supervisor, classify_death, open_supervisor
from trio_orch.cluster.transport import ZmqStageClient
from trio_orch.shell.orchestrator import Orchestrator, open_orchestrator
from trio_orch.testing import LeakProbe, TerminalLedger

FAST = RestartPolicy(max_restarts=3, window=30.0, backoff_initial=0.05, backoff_max=0.5)


@asynccontextmanager
async def serving(cfg: Any, policy: RestartPolicy = FAST, **sup_kwargs: Any
                  ) -> AsyncIterator[tuple[Pipeline, Supervisor, Orchestrator, TerminalLedger]]:
    """Pipeline + supervisor + orchestrator + a consumer feeding a ledger; checks leaks on exit."""
    probe = LeakProbe()
    ledger = TerminalLedger()
    async with open_pipeline(cfg) as pipe, open_supervisor(pipe, policy, **sup_kwargs) as sup:
        probe.saw(pipe.pids)
        probe.saw_dir(pipe.tmpdir)
        async with open_orchestrator(pipe.stages, **pipe.orchestrator_kwargs()) as orch:
            async with trio.open_nursery() as nursery:
                async def consume() -> None:
                    async for msg in orch.outputs():
                        ledger.record(msg)

                nursery.start_soon(consume)
                yield pipe, sup, orch, ledger
                orch.request_shutdown()
        probe.saw(e.new_pid for e in sup.events)
    assert ledger.without_terminal() == 0
    assert ledger.duplicates == 0 and ledger.after_terminal == 0
    assert probe.leaks()["processes"] == 0
    assert probe.leaks()["ipc_files"] == 0


async def add(orch: Orchestrator, ledger: TerminalLedger, rid: str, prompt: Any = "p") -> None:
    await orch.add_request(rid, prompt)
    ledger.accepted.add(rid)


async def settle(ledger: TerminalLedger) -> None:
    """Wait until every accepted request has its terminal."""
    with trio.fail_after(20):
        while ledger.without_terminal():
            await trio.sleep(0.01)


def slow_echo(replicas: int = 2, stages: int = 2, **kw: Any) -> Any:
    return echo_config(stages, replicas=replicas, outputs=3, worker_args=["--step-delay-ms", "20"],
                       heartbeat_interval=0.2, heartbeat_timeout=1.0, stop_grace=1.0, **kw)


def test_policy_backoff_and_validation() -> None:
    p = RestartPolicy(backoff_initial=0.1, backoff_factor=2.0, backoff_max=0.5)
    assert [p.backoff(n) for n in (1, 2, 3, 4)] == [0.1, 0.2, 0.4, 0.5]
    with pytest.raises(ValueError, match="invalid restart policy"):
        RestartPolicy(window=0)
    assert classify_death("no message for 1.0s (missed heartbeats)") == "heartbeat_timeout"
    assert classify_death("worker process 7 exited with code -9; stderr") == "exited"
    assert classify_death("worker is dying: shutdown requested: leaving the pool") == "left"
    # A replica asked to leave: its clean exit may reach the head before its Dying sentinel.
    exited_first = "worker process 7 exited with code 0; stderr"
    assert classify_death(exited_first, exit_code=0, leaving=True) == "left"
    assert classify_death(exited_first, exit_code=0) == "exited"  # not asked to leave: a death
    assert classify_death("worker process 7 exited with code -9", exit_code=-9, leaving=True) == "exited"


async def test_kill9_restarts_replica_and_places_new_requests_on_it() -> None:
    async with serving(slow_echo()) as (pipe, sup, orch, ledger):
        for i in range(20):
            await add(orch, ledger, f"a{i}")
        victim = pipe.worker(0, 0).pid
        os.kill(victim, signal.SIGKILL)
        await sup.wait_restarts(1)
        await settle(ledger)
        kinds = ledger.by_kind()
        assert set(kinds) <= {"ok", "replica_died"}
        # requests bound to the victim ended at once, or (produced nothing yet) were failed over
        assert kinds.get("replica_died", 0) + orch.statistics().core.retried_by_stage[0] >= 1
        assert pipe.worker(0, 0).pid != victim
        ev = sup.events[0]
        assert (ev.stage_id, ev.replica, ev.cause, ev.outcome) == (0, 0, "exited", "restarted")
        assert sup.counters()["restarts.exited"] == 1
        before = pipe.stages[0].placements[0]
        for i in range(10):
            await add(orch, ledger, f"b{i}")
        await settle(ledger)
        assert pipe.stages[0].placements[0] > before  # the replacement serves
        assert all(ledger.terminal[f"b{i}"] == "ok" for i in range(10))
        fams = sup.prometheus_counters()
        restarts = fams["trio_orch_supervisor_restarts"][1]
        assert {ls: n for ls, n in restarts.items() if n} == {(("stage", "0"), ("cause", "exited")): 1}
        # every (stage, cause) is there from the start, at 0: rate() reads 0 rather than "no data"
        assert set(restarts) == {(("stage", str(k)), ("cause", c)) for k in (0, 1) for c in CAUSES}


@pytest.mark.slow
async def test_sigstopped_worker_is_detected_by_heartbeat_killed_and_restarted() -> None:
    async with serving(slow_echo()) as (pipe, sup, orch, ledger):
        for i in range(10):
            await add(orch, ledger, f"a{i}")
        victim = pipe.worker(1, 1).pid
        os.kill(victim, signal.SIGSTOP)
        await sup.wait_restarts(1)
        assert sup.events[0].cause == "heartbeat_timeout"
        assert not os.path.exists(f"/proc/{victim}")  # killed and reaped, not left stopped
        for i in range(10):
            await add(orch, ledger, f"b{i}")
        await settle(ledger)
        assert set(ledger.by_kind()) <= {"ok", "replica_died"}
        assert [ledger.terminal[f"b{i}"] for i in range(10)] == ["ok"] * 10


@pytest.mark.slow
async def test_last_replica_down_fails_fast_with_stage_unavailable_then_recovers() -> None:
    # The replacement takes a second to start: requests meanwhile must not wait for it.
    slow_start = lambda k, r, attempt: ["--startup-delay", "1.0"]  # noqa: E731
    async with serving(slow_echo(replicas=1, stages=1), extra_args=slow_start) as (pipe, sup, orch, ledger):
        os.kill(pipe.worker(0, 0).pid, signal.SIGKILL)
        await sup.wait_for(lambda: bool(sup.events))
        await add(orch, ledger, "during")
        await settle(ledger)
        assert ledger.terminal["during"] == "stage_unavailable"
        await sup.wait_restarts(1)
        await add(orch, ledger, "after")
        await settle(ledger)
        assert ledger.terminal["after"] == "ok"
        assert orch.running


async def test_crash_loop_exceeds_intensity_and_the_stage_is_given_up() -> None:
    policy = RestartPolicy(max_restarts=2, window=60.0, backoff_initial=0.01)
    always_fail = lambda k, r, attempt: ["--fail-at-startup", "bad weights"]  # noqa: E731
    async with serving(slow_echo(replicas=1, stages=1), policy, extra_args=always_fail) as (pipe, sup, orch,
                                                                                             ledger):
        os.kill(pipe.worker(0, 0).pid, signal.SIGKILL)
        with trio.fail_after(30):
            await sup.wait_for(lambda: sup.counters().get("gave_up", 0) == 1)
        assert sup.counters()["restart_failures"] == 2
        assert sup.events[0].outcome == "gave_up"
        await add(orch, ledger, "late")
        await settle(ledger)
        assert ledger.terminal["late"] == "stage_unavailable"
        assert orch.running  # the orchestrator survives a dead stage


async def test_replica_leaves_gracefully_and_rejoins() -> None:
    async with serving(slow_echo(stages=1)) as (pipe, sup, orch, ledger):
        for i in range(10):
            await add(orch, ledger, f"a{i}")
        await sup.leave(0, 1)
        await settle(ledger)
        assert ledger.by_kind() == {"ok": 10}  # leaving loses nothing
        placed = pipe.stages[0].placements[1]
        for i in range(6):
            await add(orch, ledger, f"b{i}")
        assert pipe.stages[0].placements[1] == placed  # nothing placed on a replica that left
        await sup.rejoin(0, 1)
        for i in range(6):
            await add(orch, ledger, f"c{i}")
        await settle(ledger)
        assert pipe.stages[0].placements[1] > placed
        assert ledger.by_kind() == {"ok": 22}
        assert sup.restarts == 0 and sup.counters()["deaths.left"] == 1


def echo_argv(addr: str, *, replica: int = 0, extra: list[str] | None = None) -> list[str]:
    """A real ``stages.worker`` echo replica (heartbeat 0.2 s)."""
    return [sys.executable, "-m", "stages.worker", "--connect", addr, "--stage-id", "0",
            "--replica", str(replica), "--kind", "echo", "--heartbeat-interval", "0.2", *(extra or [])]


@asynccontextmanager
async def open_stage(argv_for: list[Callable[[str], list[str]]], *, max_message_bytes: int | None = 1 << 20,
                     probe: LeakProbe | None = None) -> AsyncIterator[tuple[ReplicaPool, list[WorkerHandle]]]:
    """One stage of replicas, each started from its own command line (``addr -> argv``), behind a pool
    whose clients refuse messages over ``max_message_bytes``; stops them all."""
    tmpdir = tempfile.mkdtemp(prefix="trio-orch-test-stage-")
    if probe is not None:
        probe.saw_dir(tmpdir)
    ctx = zmq.Context()
    cfg = PipelineConfig([StageConfig("echo")], startup_timeout=20.0, stop_grace=1.0)
    pool = ReplicaPool(0)
    handles: list[WorkerHandle] = []
    try:
        async with trio.open_nursery() as nursery:
            for r, make in enumerate(argv_for):
                addr = f"ipc://{tmpdir}/ctl-r{r}"
                client = ZmqStageClient(ctx, addr, stage_id=0, replica=r, sink=pool.sink,
                                        heartbeat_timeout=2.0, name=f"stage 0 r{r}",
                                        max_message_bytes=max_message_bytes)
                pool.add_replica(client)
                await nursery.start(client.run)
                h = WorkerHandle(0, r, "echo", client, os.path.join(tmpdir, f"r{r}.stderr"))
                handles.append(h)
                await nursery.start(run_worker, h, make(addr), cfg)
                if probe is not None:
                    probe.saw([h.pid])
            try:
                yield pool, handles
            finally:
                nursery.cancel_scope.cancel()
    finally:
        ctx.destroy(linger=0)
        shutil.rmtree(tmpdir, ignore_errors=True)


@pytest.mark.parametrize("mode", ["unknown-rid", "duplicate-finish", "oversized", "garbage"])
async def test_bad_worker_output_is_counted_and_loses_no_other_output(mode: str) -> None:
    probe = LeakProbe()
    ledger = TerminalLedger()
    # Both replicas take a while per step, so requests in flight spread over them (least loaded first).
    argvs = [lambda a: echo_argv(a, replica=0, extra=[f"--fault-{mode}", "bad", "--step-delay-ms", "5"]),
             lambda a: echo_argv(a, replica=1, extra=["--step-delay-ms", "30"])]
    async with open_stage(argvs, max_message_bytes=1 << 20, probe=probe) as (pool, handles):
        async with open_orchestrator([pool], final_stage_ids=[0]) as orch:
            async with trio.open_nursery() as nursery:
                async def consume() -> None:
                    async for msg in orch.outputs():
                        ledger.record(msg)

                nursery.start_soon(consume)
                for i in range(40):
                    prompt = f"bad{i}" if i % 4 else f"good{i}"  # the faulty worker misbehaves on "bad" ones
                    await add(orch, ledger, f"r{i}", prompt)
                await settle(ledger)
                orch.request_shutdown()
        faulty = handles[0].client
        counts = {"unknown-rid": pool.stray_outputs["unknown"],
                  "duplicate-finish": pool.stray_outputs["duplicate_finish"],
                  "oversized": faulty.oversized_messages, "garbage": faulty.garbage_frames}
        on_faulty = {f"r{i}" for i in range(40) if pool.timings[f"r{i}"].replica == 0}
        bad_on_faulty = {r for r in on_faulty if int(r[1:]) % 4}
    # r0 ("good0") is placed first, on replica 0: the faulty worker saw good requests too
    assert "r0" in on_faulty and 0 < len(bad_on_faulty) < len(on_faulty) < 40
    assert counts[mode] == len(bad_on_faulty)
    assert ledger.without_terminal() == 0 and ledger.duplicates == 0 and ledger.after_terminal == 0
    want_bad = "stage_failed" if mode == "oversized" else "ok"
    for i in range(40):
        expect = want_bad if f"r{i}" in bad_on_faulty else "ok"
        assert ledger.terminal[f"r{i}"] == expect, (i, ledger.terminal[f"r{i}"])
    assert probe.leaks()["processes"] == 0 and probe.leaks()["ipc_files"] == 0


# ---------------------------------------------------------------------- pool hooks, with fake replicas
class FakeReplica:
    """Just enough of a ZmqStageClient for the pool: alive flag, submit/abort records."""

    def __init__(self) -> None:
        self.replica = -1
        self.alive = True
        self.closed = False
        self.submitted: list[str] = []
        self.input_bytes = 0

    async def submit(self, request_id: str, payload: Any, *, downstream: int = -1) -> None:
        self.submitted.append(request_id)

    async def abort(self, request_ids: list[str]) -> None:
        pass

    async def aclose(self) -> None:
        self.closed = True


def fake_pool(n: int = 2) -> tuple[Any, list[FakeReplica]]:
    from trio_orch.cluster.pool import ReplicaPool

    pool = ReplicaPool(0)
    reps = [FakeReplica() for _ in range(n)]
    for r in reps:
        pool.add_replica(r)  # type: ignore[arg-type]
    return pool, reps


async def test_replace_replica_evicts_an_unhandled_death_and_ignores_the_old_clients_late_events() -> None:
    from trio_orch.cluster.transport import ReplicaDied
    from trio_orch.types import StageOutput

    pool, (r0, r1) = fake_pool()
    pool.supervised = True
    await pool.submit("a", "x")  # -> replica 0
    await pool.submit("b", "y")  # -> replica 1
    r0.alive = False
    new = FakeReplica()
    pool.replace_replica(0, new)  # type: ignore[arg-type]  # the death was never received
    pool.sink(r0, ReplicaDied("r0 died"))  # type: ignore[arg-type]  # ... and arrives late
    outs = await pool.receive()
    assert [(o.request_id, o.error_kind) for o in outs] == [("a", "replica_died")]
    assert pool.live_replicas() == [0, 1]  # the late death did not evict the replacement
    await pool.submit("c", "z")
    assert new.submitted == ["c"]
    pool.sink(r1, [StageOutput("b", "ok", True)])  # type: ignore[arg-type]
    assert [o.request_id for o in await pool.receive()] == ["b"]


async def test_pool_waits_while_supervised_and_raises_stage_dead_when_supervision_stops(
        autojump_clock: trio.testing.MockClock) -> None:
    from trio_orch.cluster.transport import ReplicaDied
    from trio_orch.types import StageDied, StageUnavailable

    pool, (r0,) = fake_pool(1)
    pool.supervised = True
    r0.alive = False
    pool.sink(r0, ReplicaDied("gone"))  # type: ignore[arg-type]
    with trio.move_on_after(0.2) as scope:  # autojump clock: fires only once every task waits
        while True:
            await pool.receive()  # the death has no request to report: keeps waiting
    assert scope.cancelled_caught
    with pytest.raises(StageUnavailable):
        await pool.submit("r", "x")  # fail fast while no replica is live
    pool.stop_supervision()
    with pytest.raises(StageDied):
        await pool.receive()


async def test_stray_outputs_are_classified_counted_and_never_routed(
        autojump_clock: trio.testing.MockClock) -> None:
    from trio_orch.types import StageOutput

    pool, (r0, r1) = fake_pool()
    await pool.submit("a", "x")  # replica 0
    await pool.submit("b", "y")  # replica 1
    pool.sink(r0, [StageOutput("a", 1, True)])  # type: ignore[arg-type]
    assert [o.request_id for o in await pool.receive()] == ["a"]
    pool.sink(r0, [StageOutput("a", 2, True),  # finished twice
                   StageOutput("b", 3, False),  # b belongs to replica 1
                   StageOutput("zz", 4, True)])  # type: ignore[arg-type]  # never given
    await pool.abort(["b"])
    pool.sink(r1, [StageOutput("b", 5, True), StageOutput("a", 6, False)])  # type: ignore[arg-type]
    pool.sink(r1, [StageOutput("ok?", 7, True)])  # type: ignore[arg-type]
    with trio.move_on_after(0.1):  # autojump clock: fires only once every task waits
        got = await pool.receive()
        pytest.fail(f"stray outputs were routed: {got}")
    assert pool.stray_outputs == {"unknown": 4, "duplicate_finish": 1, "late": 1}
