"""Failover with real worker processes: kill -9 one of two replicas while requests queue on it.

Each replica batches one request at a time, so of the requests placed on the
killed replica one is being computed (it has produced output) and the others
wait inside the worker (they have produced nothing).  Those are resent to the
surviving replica and complete; only the one in the batch ends
``replica_died``.  With ``max_retries=0`` every request on it fails, as
before failover existed.
"""

from __future__ import annotations

import os
import signal
import tomllib
from types import SimpleNamespace

import pytest
import trio

from stages.config import PipelineConfig, StageConfig, from_dict
from trio_orch import OrchError, Orchestrator, OrchOutput
from trio_orch.cli.main import main
from trio_orch.cluster.launcher import Pipeline, open_pipeline
from trio_orch.cluster.supervisor import RestartPolicy, supervised_pipeline
from trio_orch.types import Message

pytestmark = pytest.mark.processes  # real worker processes

N = 8


def one_stage_echo(max_retries: int) -> PipelineConfig:
    stage = StageConfig("echo", replicas=2, max_batch=1, model={"outputs": 20},
                        worker_args=["--step-delay-ms", "20"])
    return PipelineConfig([stage], final_stage_ids=[0], max_retries=max_retries).validate()


@pytest.mark.parametrize("max_retries", [1, 0])
async def test_kill_9_resends_the_requests_queued_on_the_dead_replica(max_retries: int) -> None:
    async with open_pipeline(one_stage_echo(max_retries)) as pipe:
        orch = Orchestrator(pipe.stages, **pipe.orchestrator_kwargs())
        pool = pipe.stages[0]
        msgs: list[Message] = []
        async with trio.open_nursery() as nursery:
            await nursery.start(orch.run)
            for i in range(N):
                await orch.add_request(f"r{i}", i)
            victims = {f"r{i}" for i in range(N) if pool.replica_of(f"r{i}") == 0}
            assert len(victims) == N // 2
            with trio.fail_after(30):
                while not any(m.request_id in victims for m in msgs):  # one of them is in the batch
                    msgs.append(await orch.next_output())
                answered = {m.request_id for m in msgs}
                os.kill(pipe.worker(0, 0).pid, signal.SIGKILL)
                while sum(m.finished for m in msgs) < N:
                    msgs.append(await orch.next_output())
            retried = orch.statistics().core.retried_by_stage
            await orch.shutdown()
    terminals = {m.request_id: m for m in msgs if m.finished}
    assert set(terminals) == {f"r{i}" for i in range(N)}
    failed = {rid for rid, m in terminals.items() if isinstance(m, OrchError)}
    assert all(m.kind == "replica_died" for rid, m in terminals.items() if rid in failed)
    assert failed <= victims, "a request on the surviving replica failed"
    if max_retries:
        # at most its in-flight batch (one request) fails: the one that had produced output there
        assert len(failed) <= 1 and failed <= answered & victims
        assert retried == (len(victims - failed),)
        for rid in victims - failed:
            m = terminals[rid]
            assert isinstance(m, OrchOutput)
            tm = pool.timing_of(rid)
            assert tm is not None and (tm.replica, tm.retried_from) == (1, 0)
    else:
        assert failed == victims and retried == (0,)


async def test_with_no_replica_left_the_queued_requests_wait_for_the_restarted_one() -> None:
    """The only replica is killed: its queued requests are resent once the supervisor's replacement is ready.

    Nothing is resent while the stage has no live replica; the requests keep
    their deadline (60 s here, far more than a restart takes).
    """
    stage = StageConfig("echo", replicas=1, max_batch=1, model={"outputs": 20},
                        worker_args=["--step-delay-ms", "20"])
    cfg = PipelineConfig([stage], final_stage_ids=[0], max_retries=1).validate()
    async with supervised_pipeline(cfg, RestartPolicy(backoff_initial=0.0)) as pipe:
        orch = Orchestrator(pipe.stages, request_timeout=60, **pipe.orchestrator_kwargs())
        pool = pipe.stages[0]
        msgs: list[Message] = []
        async with trio.open_nursery() as nursery:
            await nursery.start(orch.run)
            for i in range(4):
                await orch.add_request(f"r{i}", i)
            with trio.fail_after(60):
                msgs.append(await orch.next_output())  # r0 is in the batch: it produced output
                os.kill(pipe.worker(0, 0).pid, signal.SIGKILL)
                while sum(m.finished for m in msgs) < 4:
                    msgs.append(await orch.next_output())
            stats = orch.statistics().core
            await orch.shutdown()
    terminals = {m.request_id: m for m in msgs if m.finished}
    failed = {rid for rid, m in terminals.items() if isinstance(m, OrchError)}
    assert failed <= {"r0"} and all(terminals[r].kind == "replica_died" for r in failed)
    assert stats.retried_by_stage == (4 - len(failed),) and stats.waiting_by_stage == (0,)
    for rid in set(terminals) - failed:
        tm = pool.timing_of(rid)
        assert tm is not None and tm.retried_from == 0  # resent to the slot's replacement


def test_generate_and_serve_refuse_a_negative_max_retries(capsys: pytest.CaptureFixture[str]) -> None:
    for command in ("generate", "serve"):
        assert main([command, "--max-retries", "-1"]) == 2
        assert "--max-retries must be >= 0" in capsys.readouterr().err


def test_the_config_file_sets_max_retries_and_refuses_a_bad_one() -> None:
    """``[pipeline] max_retries`` reaches the orchestrator's keywords; a negative or non-int is refused."""
    toml = '[pipeline]\nfinal_stages = [0]\nmax_retries = {}\n[[stages]]\nkind = "echo"\n'
    cfg = from_dict(tomllib.loads(toml.format(3)))
    assert cfg.max_retries == 3
    pipe = SimpleNamespace(config=cfg, final_stage_ids=[0], forward_fn=None, prewarm_fn=None,
                           check_sampling=None)
    assert Pipeline.orchestrator_kwargs(pipe)["max_retries"] == 3  # type: ignore[arg-type]
    assert from_dict(tomllib.loads(toml.replace("max_retries = {}\n", ""))).max_retries == 1  # the default
    for bad, why in (("-1", "expected `int` >= 0"), ('"2"', "expected `int`, got `str`"),
                     ("true", "expected `int`, got `bool`")):
        with pytest.raises(ValueError, match=f"pipeline.max_retries: {why}"):
            from_dict(tomllib.loads(toml.format(bad)))
