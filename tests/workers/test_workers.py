"""Real worker processes and real ZMQ sockets: end to end, replicas, abort, kill -9, shutdown.

Every test checks that nothing is left afterwards: no worker process, no
ipc file (the private directory is gone), no extra open file descriptor.
"""

from __future__ import annotations

import itertools
import os
import signal
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import numpy as np
import pytest
import trio

from stages.config import PipelineConfig, StageConfig, echo_config
from trio_orch import OrchError, Orchestrator, OrchOutput
from trio_orch.cluster.launcher import Pipeline, WorkerStartupError, open_pipeline
from trio_orch.testing.fds import describe_fds, open_fds

pytestmark = pytest.mark.processes  # real worker processes or servers

TINY = {
    "thinker": {"d_model": 32, "layers": 1, "heads": 2, "max_new_tokens": 12, "min_new_tokens": 12},
    "talker": {"d_model": 32, "layers": 1, "heads": 2, "chunk_frames": 4},
    "code2wav": {"dim": 16, "upsample": [4, 3], "chunk_frames": 4},
}


def tiny_speech_config(**kw: Any) -> PipelineConfig:
    stages = [StageConfig(k, model=dict(TINY[k])) for k in ("thinker", "talker", "code2wav")]
    return PipelineConfig(stages, final_stage_ids=[0, 2], **kw).validate()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@asynccontextmanager
async def checked_pipeline(config: PipelineConfig) -> AsyncIterator[Pipeline]:
    """open_pipeline, then assert no process, ipc file or fd survives it."""
    fds_before = open_fds()
    async with open_pipeline(config) as pipe:
        pids, tmpdir = pipe.pids, pipe.tmpdir
        assert all(_alive(p) for p in pids)
        assert any(f.startswith("ctl-") for f in os.listdir(tmpdir))  # the ipc sockets live here
        yield pipe
    assert not any(_alive(p) for p in pids), "a worker process survived the pipeline"
    assert not os.path.exists(tmpdir), "the ipc directory was left behind"
    leaked = describe_fds(open_fds() - fds_before)
    assert not leaked, "file descriptors left open:\n" + "\n".join(leaked)


async def collect(orch: Orchestrator, n_terminals: int, timeout: float = 30) -> list[OrchOutput | OrchError]:
    msgs: list[OrchOutput | OrchError] = []
    done = 0
    with trio.fail_after(timeout):
        while done < n_terminals:
            m = await orch.next_output()
            msgs.append(m)
            done += m.finished
    return msgs


@pytest.mark.slow
@pytest.mark.parametrize("async_chunk", [False, True], ids=["normal", "async_chunk"])
async def test_one_request_end_to_end_through_torch_workers(async_chunk: bool) -> None:
    async with checked_pipeline(tiny_speech_config(async_chunk=async_chunk)) as pipe:
        orch = Orchestrator(pipe.stages, **pipe.orchestrator_kwargs())
        async with trio.open_nursery() as nursery:
            await nursery.start(orch.run)
            await orch.add_request("r1", "Hello")
            msgs = await collect(orch, 1)
            await orch.shutdown()
    assert all(isinstance(m, OrchOutput) for m in msgs), msgs
    text = "".join(m.data["text"] for m in msgs if m.stage_id == 0)
    assert len(text) == 12 and text.isprintable()
    pcm = np.concatenate([m.data["pcm"] for m in msgs if m.stage_id == 2])
    assert pcm.dtype == np.float32 and len(pcm) == 12 * 2 * 12  # tokens x frames/token x hop
    assert np.abs(pcm).max() > 0.01
    assert msgs[-1].finished and sum(m.finished for m in msgs) == 1
    if async_chunk:  # stage 1 is not a final stage: the orchestrator saw no talker data
        assert pipe.stages[1].timings["r1"].t_done is not None


async def test_eight_concurrent_requests_spread_over_two_replicas() -> None:
    cfg = echo_config(2, replicas=1, outputs=3, worker_args=["--step-delay-ms", "5"])
    cfg.stages[1].replicas = 2
    cfg.stages[1].worker_args = ["--step-delay-ms", "25"]  # all 8 still in flight there while placed
    async with checked_pipeline(cfg) as pipe:
        orch = Orchestrator(pipe.stages, **pipe.orchestrator_kwargs())
        async with trio.open_nursery() as nursery:
            await nursery.start(orch.run)
            for i in range(8):
                await orch.add_request(f"r{i}", f"p{i}")
            msgs = await collect(orch, 8)
            stats = [await c.rpc("stats") for c in pipe.stages[1].replicas]
            await orch.shutdown()
    assert sorted(m.request_id for m in msgs if m.finished) == [f"r{i}" for i in range(8)]
    assert all(isinstance(m, OrchOutput) for m in msgs)
    assert pipe.stages[1].placements == [4, 4]  # least-in-flight placement
    assert [s["submits"] for s in stats] == [4, 4]  # ... observed on the workers themselves
    assert max(s["max_batch_seen"] for s in stats) > 1  # continuous batching


async def test_abort_mid_stream_reaches_the_worker() -> None:
    cfg = echo_config(1, outputs=100_000, worker_args=["--step-delay-ms", "2"])
    async with checked_pipeline(cfg) as pipe:
        orch = Orchestrator(pipe.stages, **pipe.orchestrator_kwargs())
        async with trio.open_nursery() as nursery:
            await nursery.start(orch.run)
            await orch.add_request("r1", "x")
            first = await orch.next_output()
            assert isinstance(first, OrchOutput) and not first.finished
            await orch.abort("r1")
            msgs = [first, *await collect(orch, 1)]
            client = pipe.stages[0].replicas[0]
            with trio.fail_after(10):
                while (stats := await client.rpc("stats"))["aborts"] < 1:
                    await trio.sleep(0.01)
            await orch.shutdown()
    assert isinstance(msgs[-1], OrchError) and msgs[-1].kind == "aborted"
    assert stats["active"] == 0 and stats["waiting"] == 0
    assert stats["outputs"] < 100_000


async def test_kill_9_of_a_replica_fails_only_its_requests() -> None:
    # failover off: every request on the killed replica fails (tests/workers/test_failover.py: on)
    cfg = echo_config(1, replicas=2, outputs=40, worker_args=["--step-delay-ms", "10"], max_retries=0)
    async with checked_pipeline(cfg) as pipe:
        orch = Orchestrator(pipe.stages, **pipe.orchestrator_kwargs())
        async with trio.open_nursery() as nursery:
            await nursery.start(orch.run)
            for i in range(4):
                await orch.add_request(f"r{i}", i)
            pool = pipe.stages[0]
            victims = {f"r{i}" for i in range(4) if pool.replica_of(f"r{i}") == 0}
            assert len(victims) == 2
            first = await orch.next_output()  # mid-stream
            os.kill(pipe.worker(0, 0).pid, signal.SIGKILL)
            msgs = [first, *await collect(orch, 4)]
            assert pool.live_replicas() == [1]
            await orch.shutdown()
    terminals = {m.request_id: m for m in msgs if m.finished}
    assert set(terminals) == {f"r{i}" for i in range(4)}
    for rid, m in terminals.items():
        if rid in victims:
            assert isinstance(m, OrchError) and m.kind == "replica_died", m
        else:
            assert isinstance(m, OrchOutput), m


async def test_shutdown_with_requests_in_flight_leaves_nothing_behind() -> None:
    # In flight for at least 3 s (150 steps of 20 ms), and 6 x 150 chunks fit a worker-to-worker
    # queue (ZMQ's 1,000 messages) even if a starved downstream worker reads none of them: a full
    # queue fails its request ("not taking chunks"), which a loaded machine must not provoke here.
    cfg = echo_config(3, final_stage_ids=[0, 2], replicas=2, outputs=150,
                      worker_args=["--step-delay-ms", "20"], async_chunk=True)
    async with checked_pipeline(cfg) as pipe:
        orch = Orchestrator(pipe.stages, **pipe.orchestrator_kwargs())
        async with trio.open_nursery() as nursery:
            await nursery.start(orch.run)
            for i in range(6):
                await orch.add_request(f"r{i}", i)
            await orch.next_output()
            await orch.shutdown()
        msgs = []
        async for m in orch.outputs():
            msgs.append(m)
    terminals = [m for m in msgs if m.finished]
    assert sorted(m.request_id for m in terminals) == [f"r{i}" for i in range(6)]
    assert all(isinstance(m, OrchError) and m.kind == "shutdown" for m in terminals), terminals


async def test_cancelled_pipeline_stops_its_workers() -> None:
    fds_before = open_fds()
    with trio.move_on_after(30) as scope:
        async with open_pipeline(echo_config(2)) as pipe:
            pids, tmpdir = pipe.pids, pipe.tmpdir
            scope.cancel()  # e.g. Ctrl-C or a crash elsewhere
            await trio.sleep_forever()
    assert scope.cancelled_caught
    assert not any(_alive(p) for p in pids) and not os.path.exists(tmpdir)
    assert not describe_fds(open_fds() - fds_before)


async def test_startup_failure_names_the_stage_and_shows_stderr() -> None:
    cfg = echo_config(2)
    cfg.stages[1].worker_args = ["--fail-at-startup", "CUDA out of memory (simulated)"]
    with pytest.raises(WorkerStartupError) as info:
        async with open_pipeline(cfg):
            pytest.fail("the pipeline must not start")
    msg = str(info.value)
    assert "stage 1 (echo) replica 0" in msg and "CUDA out of memory (simulated)" in msg


async def test_startup_timeout_is_enforced() -> None:
    cfg = echo_config(1, startup_timeout=0.5)
    cfg.stages[0].worker_args = ["--startup-delay", "30"]
    with pytest.raises(WorkerStartupError, match=r"not ready after 0\.5s"):
        async with open_pipeline(cfg):
            pass


async def test_silent_worker_is_declared_dead_and_killed() -> None:
    cfg = echo_config(1, outputs=1000, heartbeat_interval=0.1, heartbeat_timeout=0.6, stop_grace=0.5,
                      worker_args=["--hang-after-steps", "2"])
    async with checked_pipeline(cfg) as pipe:
        orch = Orchestrator(pipe.stages, **pipe.orchestrator_kwargs())
        async with trio.open_nursery() as nursery:
            await nursery.start(orch.run)
            await orch.add_request("r1", "x")
            msgs = await collect(orch, 1)
            pid = pipe.worker(0).pid
            with trio.fail_after(10):
                while _alive(pid):
                    await trio.sleep(0.05)
            await orch.shutdown()
    assert isinstance(msgs[-1], OrchError) and msgs[-1].kind == "replica_died"
    assert "heartbeat" in msgs[-1].message


async def test_garbage_and_stray_outputs_from_a_worker_are_survived() -> None:
    cfg = echo_config(1, outputs=5, worker_args=["--garbage-after-steps", "1",
                                                 "--unknown-rid-after-steps", "2"])
    async with checked_pipeline(cfg) as pipe:
        orch = Orchestrator(pipe.stages, **pipe.orchestrator_kwargs())
        async with trio.open_nursery() as nursery:
            await nursery.start(orch.run)
            await orch.add_request("r1", "x")
            msgs = await collect(orch, 1)
            stats = await pipe.stats()
            await orch.shutdown()
    assert [m.data for m in msgs] == ["x"] * 5 and msgs[-1].finished
    assert pipe.stages[0].replicas[0].garbage_frames == 1
    assert stats[0]["stage_id"] == 0 and stats[0]["outputs"] == 5 and stats[0]["steps"] == 5
    pool = pipe.stages[0]  # the stray output is dropped by the pool or by the router, and counted
    assert orch.dropped_outputs + getattr(pool, "stray_outputs", {}).get("unknown", 0) == 1


async def test_per_request_stage_error_fails_only_that_request() -> None:
    cfg = echo_config(1, outputs=2, worker_args=["--fail-requests-containing", "poison"])
    async with checked_pipeline(cfg) as pipe:
        orch = Orchestrator(pipe.stages, **pipe.orchestrator_kwargs())
        async with trio.open_nursery() as nursery:
            await nursery.start(orch.run)
            await orch.add_request("bad", "poison pill")
            await orch.add_request("good", "fine")
            msgs = await collect(orch, 2)
            await orch.shutdown()
    terminals = {m.request_id: m for m in msgs if m.finished}
    assert isinstance(terminals["bad"], OrchError) and terminals["bad"].kind == "stage_failed"
    assert "injected failure" in terminals["bad"].message
    assert isinstance(terminals["good"], OrchOutput)


HOLDER = """
import signal, sys, trio
from stages.config import echo_config
from trio_orch.cluster.launcher import open_pipeline

async def main():
    async with open_pipeline(echo_config(2, replicas=2, heartbeat_interval=0.2)) as pipe:
        print(pipe.tmpdir, *pipe.pids, flush=True)
        await trio.sleep_forever()

# Ctrl-C as a terminal delivers it: a shell starts a background job (a test run with &) ignoring SIGINT,
# and a process that starts with SIGINT ignored never gets KeyboardInterrupt.
signal.signal(signal.SIGINT, signal.default_int_handler)
trio.run(main)
"""


DAEMON_HOLDER = """
import sys, threading, trio
from stages.config import echo_config
from trio_orch.cluster.launcher import open_pipeline

async def main():
    # heartbeats (and the workers' own parent check) every 5 s: only the atexit net can be quick
    async with open_pipeline(echo_config(1, replicas=2, heartbeat_interval=5, heartbeat_timeout=10)) as pipe:
        print(pipe.tmpdir, *pipe.pids, flush=True)
        await trio.sleep_forever()

threading.Thread(target=trio.run, args=(main,), daemon=True).start()
sys.stdin.readline()  # then the interpreter exits under the daemon thread's feet
"""


@asynccontextmanager
async def holder(script: str = HOLDER) -> AsyncIterator[tuple[trio.Process, str, list[int]]]:
    """A separate orchestrator process holding a pipeline open: (process, ipc dir, worker pids).

    Killed and reaped on the way out if the test left it running (a failed test leaves no process).
    """
    import subprocess
    import sys

    proc = await trio.lowlevel.open_process([sys.executable, "-c", script], stdout=subprocess.PIPE,
                                            stdin=subprocess.PIPE)
    try:
        assert proc.stdout is not None
        line = b""
        with trio.fail_after(30):
            while not line.endswith(b"\n"):
                chunk = await proc.stdout.receive_some(4096)
                assert chunk, "the holder exited early"
                line += chunk
        tmpdir, *pids = line.decode().split()
        yield proc, tmpdir, [int(p) for p in pids]
    finally:
        with trio.CancelScope(shield=True):
            if proc.returncode is None:
                proc.send_signal(signal.SIGTERM)  # it stops its workers and removes its ipc dir
                with trio.move_on_after(10):
                    await proc.wait()
            if proc.returncode is None:
                proc.kill()
            await proc.wait()
            for pipe in (proc.stdin, proc.stdout):
                if pipe is not None:
                    await pipe.aclose()


async def _gone(pids: list[int], tmpdir: str, timeout: float = 10) -> None:
    with trio.fail_after(timeout):
        while any(_alive(p) for p in pids) or os.path.exists(tmpdir):
            await trio.sleep(0.05)


async def test_sigterm_to_the_orchestrator_process_stops_workers_and_cleans_up() -> None:
    async with holder() as (proc, tmpdir, pids):
        assert len(pids) == 4 and os.path.isdir(tmpdir)
        proc.send_signal(signal.SIGTERM)
        with trio.fail_after(10):
            assert await proc.wait() == 143
        await _gone(pids, tmpdir, timeout=1)  # cleaned up before the process exited


async def test_sigkill_of_the_orchestrator_process_leaves_no_worker_or_ipc_file() -> None:
    async with holder() as (proc, tmpdir, pids):
        proc.kill()
        await proc.wait()
        await _gone(pids, tmpdir)  # the orphaned workers notice and clean up after their parent


async def test_ctrl_c_in_the_orchestrator_process_stops_workers_and_cleans_up() -> None:
    async with holder() as (proc, tmpdir, pids):
        proc.send_signal(signal.SIGINT)  # what Ctrl-C delivers to the orchestrator (workers ignore it)
        with trio.fail_after(10):
            assert await proc.wait() != 0  # KeyboardInterrupt propagated out of trio.run
        await _gone(pids, tmpdir, timeout=1)


async def test_async_chunk_routes_each_request_to_its_reserved_downstream_replica() -> None:
    cfg = echo_config(3, final_stage_ids=[0, 2], replicas=2, outputs=3, async_chunk=True,
                      worker_args=["--step-delay-ms", "20"])  # all 8 in flight while they are placed
    async with checked_pipeline(cfg) as pipe:
        orch = Orchestrator(pipe.stages, **pipe.orchestrator_kwargs())
        async with trio.open_nursery() as nursery:
            await nursery.start(orch.run)
            for i in range(8):
                await orch.add_request(f"r{i}", f"p{i}")
            msgs = await collect(orch, 8)
            stats = [[await c.rpc("stats") for c in pool.replicas] for pool in pipe.stages]
            await orch.shutdown()
    assert all(isinstance(m, OrchOutput) for m in msgs), [m for m in msgs if isinstance(m, OrchError)]
    for i in range(8):  # stage 0 echoed 3 times, each echo went through stages 1 and 2 as a chunk
        by_stage = [[m.data for m in msgs if m.request_id == f"r{i}" and m.stage_id == k] for k in (0, 2)]
        assert by_stage == [[f"p{i}"] * 3, [f"p{i}"] * 3]
    assert [pool.placements for pool in pipe.stages] == [[4, 4]] * 3
    assert [[s["chunks_in"] for s in st] for st in stats[1:]] == [[12, 12], [12, 12]]
    assert all(s["inbox_pending"] == 0 for st in stats[1:] for s in st)


async def test_bad_model_options_are_refused_before_any_worker_and_bad_values_fail_startup() -> None:
    cfg = echo_config(1)
    cfg.stages[0].model = {"bogus_size": 3}  # a name the constructor does not take: checked here
    with pytest.raises(ValueError, match="stage 0: unknown model option 'bogus_size' for echo"):
        async with open_pipeline(cfg):
            pass
    cfg.stages[0].model = {"outputs": 0}  # out of the range its constructor's annotation says: here too
    with pytest.raises(ValueError, match="stage 0: model option 'outputs' of echo: expected `int` >= 1"):
        async with open_pipeline(cfg):
            pass
    thinker = PipelineConfig([StageConfig("thinker", model={"d_model": 30, "heads": 4})])
    with pytest.raises(WorkerStartupError, match="must be divisible by heads"):  # only the model can judge
        async with open_pipeline(thinker):
            pass


async def test_abort_in_async_chunk_mode_reaches_every_stage_and_drops_late_chunks() -> None:
    def settled(stats: list[dict[str, Any]]) -> bool:
        return all(s["aborts"] == 1 for s in stats) and all(
            up["chunks_out"] == down["chunks_in"] for up, down in itertools.pairwise(stats))

    cfg = echo_config(3, final_stage_ids=[0, 2], outputs=100_000, async_chunk=True,
                      worker_args=["--step-delay-ms", "2"])
    async with checked_pipeline(cfg) as pipe:
        orch = Orchestrator(pipe.stages, **pipe.orchestrator_kwargs())
        async with trio.open_nursery() as nursery:
            await nursery.start(orch.run)
            await orch.add_request("r1", "x")
            with trio.fail_after(10):
                while (await orch.next_output()).stage_id != 2:  # chunks flow through stage 1 to 2
                    pass
            await orch.abort("r1")
            with trio.fail_after(10):  # every stage saw the abort, and every chunk sent before it arrived
                while not settled(stats := await pipe.stats()):
                    await trio.sleep(0.01)
            await orch.shutdown()
    assert all(s["active"] == 0 and s["waiting"] == 0 for s in stats)
    assert all(s["inbox_pending"] == 0 for s in stats[1:])  # ... and are dropped, not buffered


async def test_text_only_request_in_async_chunk_mode_leaves_no_chunks_downstream() -> None:
    cfg = echo_config(3, final_stage_ids=[0, 2], outputs=3, async_chunk=True)
    async with checked_pipeline(cfg) as pipe:
        orch = Orchestrator(pipe.stages, **pipe.orchestrator_kwargs())
        async with trio.open_nursery() as nursery:
            await nursery.start(orch.run)
            await orch.add_request("text", "x", final_stage_id=0)  # stage 1 and 2 never submitted
            msgs = await collect(orch, 1)
            with trio.fail_after(10):  # stage 0 streamed 3 chunks to stage 1: they are dropped
                while (s1 := (await pipe.stats())[1])["aborts"] < 1 or s1["inbox_pending"]:
                    await trio.sleep(0.01)
            in_flight = [pool.in_flight() for pool in pipe.stages]
            await orch.shutdown()
    assert [m.data for m in msgs] == ["x"] * 3 and all(m.stage_id == 0 for m in msgs)
    assert in_flight == [[0], [0], [0]]


async def test_interpreter_exit_with_a_pipeline_open_in_a_daemon_thread_leaves_nothing() -> None:
    async with holder(DAEMON_HOLDER) as (proc, tmpdir, pids):
        assert len(pids) == 2
        assert proc.stdin is not None
        await proc.stdin.send_all(b"exit\n")
        with trio.fail_after(10):
            assert await proc.wait() == 0
        await _gone(pids, tmpdir, timeout=2)  # the atexit safety net killed them and removed the dir
