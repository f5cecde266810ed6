"""The control plane against real worker processes: sleep/wake, weight reload, RPC to a stopped
replica, acknowledged aborts with partial output, profiling, a plug-in model's own method.

Each test opens its pipeline through ``checked_pipeline`` (no worker process, ipc file or
descriptor survives it).
"""

from __future__ import annotations

import os
import signal
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
import trio

from stages.config import PipelineConfig, StageConfig, echo_config
from stages.registry import build_model
from stages.weights import state_of
from tests.workers.test_workers import checked_pipeline
from trio_orch import OrchError, Orchestrator, OrchOutput, RpcResult
from trio_orch.engine.api import ControlError
from trio_orch.engine.control import sleep, update_weights, wake_up

pytestmark = pytest.mark.processes  # real worker processes or servers

THINKER = {"d_model": 128, "layers": 2, "heads": 4, "max_new_tokens": 12, "min_new_tokens": 12,
           "max_model_len": 64}


def thinker_config(**model: Any) -> PipelineConfig:
    stage = StageConfig("thinker", model={**THINKER, **model})
    return PipelineConfig([stage], final_stage_ids=[0]).validate()


def rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS"))


async def text_of(orch: Orchestrator, rid: str, prompt: str = "Hello") -> str:
    """One greedy request, start to terminal: its whole text."""
    await orch.add_request(rid, prompt, sampling=[{"temperature": 0}])
    parts: list[str] = []
    with trio.fail_after(60):
        while True:
            m = await orch.next_output()
            assert isinstance(m, OrchOutput), m
            parts.append(m.data["text"])
            if m.finished:
                return "".join(parts)


def save_weights(path: Path, seed: int, **model: Any) -> str:
    """Weights that fit the test thinker, from another seed (so its outputs differ)."""
    torch.save(state_of(build_model("thinker", {**THINKER, **model}, seed=seed)), path)
    return str(path)


@pytest.mark.slow
@pytest.mark.parametrize("level", [1, 2])
async def test_sleep_frees_the_worker_memory_and_wake_gives_the_same_outputs(level: int) -> None:
    big = {"d_model": 256, "layers": 4}  # ~33 MB of weights and KV cache: a drop well above noise
    async with checked_pipeline(thinker_config(**big)) as pipe:
        orch = Orchestrator(pipe.stages, **pipe.orchestrator_kwargs())
        async with trio.open_nursery() as nursery:
            await nursery.start(orch.run)
            before = await text_of(orch, "a")
            pid = pipe.pids[0]
            awake = rss(pid)
            [slept] = await sleep(orch, level)
            assert slept.error is None and slept.value["asleep"] == level
            freed = slept.value["freed_bytes"]
            assert freed > 20 << 20
            assert rss(pid) < awake - freed // 2  # measured from outside the worker
            assert orch.paused == "wait"  # asleep: nothing starts
            [woke] = await wake_up(orch)
            assert woke.error is None and woke.value["asleep"] == 0 and orch.paused is None
            assert await text_of(orch, "b") == before
            await orch.shutdown()


@pytest.mark.slow
async def test_reload_refuses_a_file_that_does_not_fit_and_keeps_the_old_weights(tmp_path: Path) -> None:
    wrong_shape = save_weights(tmp_path / "wide.pt", seed=3, d_model=64, heads=2)
    not_weights = tmp_path / "junk.pt"
    not_weights.write_bytes(b"not a torch file")
    good = save_weights(tmp_path / "good.pt", seed=3)
    async with checked_pipeline(thinker_config()) as pipe:
        orch = Orchestrator(pipe.stages, **pipe.orchestrator_kwargs())
        async with trio.open_nursery() as nursery:
            await nursery.start(orch.run)
            before = await text_of(orch, "a")
            for bad, why in ((wrong_shape, "does not fit"), (str(not_weights), "cannot read"),
                             (str(tmp_path / "missing.pt"), "no weights file")):
                with pytest.raises(ControlError, match=why) as info:
                    await update_weights(orch, bad)
                assert [r.error is not None for r in info.value.results] == [True]
                assert orch.paused is None  # resumed
            assert await text_of(orch, "b") == before  # the old weights stayed
            [loaded] = await update_weights(orch, good)
            assert loaded.error is None
            assert loaded.value["tensors"] == len(state_of(build_model("thinker", THINKER)))
            after = await text_of(orch, "c")
            assert after != before
            [direct] = await orch.collective_rpc("reload_weights", [wrong_shape])  # no recipe: still refused
            assert "does not fit" in (direct.error or "")
            assert await text_of(orch, "d") == after
            await orch.shutdown()


@pytest.mark.slow
async def test_update_weights_under_load_every_request_sees_one_set_of_weights(tmp_path: Path) -> None:
    new = save_weights(tmp_path / "new.pt", seed=11)
    async with checked_pipeline(thinker_config()) as pipe:
        orch = Orchestrator(pipe.stages, **pipe.orchestrator_kwargs())
        async with trio.open_nursery() as nursery:
            await nursery.start(orch.run)
            old_text = await text_of(orch, "warm-old")
            texts: dict[str, str] = {}
            starts: dict[str, bool] = {}  # request -> accepted after the update returned
            streaming = trio.Event()  # the first requests' outputs flow: the update meets them mid-way
            updated = trio.Event()

            async def consume() -> None:
                parts: dict[str, list[str]] = {}
                while len(texts) < 24:
                    m = await orch.next_output()
                    assert isinstance(m, OrchOutput), m
                    streaming.set()
                    parts.setdefault(m.request_id, []).append(m.data["text"])
                    if m.finished:
                        texts[m.request_id] = "".join(parts.pop(m.request_id))

            async def load() -> None:
                async def add(i: int) -> None:
                    starts[f"r{i}"] = updated.is_set()
                    await orch.add_request(f"r{i}", "Hello", sampling=[{"temperature": 0}])

                for i in range(8):  # in flight when the update starts
                    await add(i)
                await streaming.wait()
                for i in range(8, 16):  # accepted while it runs
                    await add(i)
                await updated.wait()
                for i in range(16, 24):  # accepted after it returned: the new weights only
                    await add(i)

            async def update() -> None:
                await streaming.wait()
                await update_weights(orch, new)
                updated.set()

            with trio.fail_after(120):
                async with trio.open_nursery() as inner:
                    inner.start_soon(consume)
                    inner.start_soon(load)
                    inner.start_soon(update)
            new_text = await text_of(orch, "after")
            await orch.shutdown()
    assert new_text != old_text
    assert set(texts.values()) <= {old_text, new_text}, "a request saw a mix of weights"
    assert all(texts[rid] == new_text for rid, after in starts.items() if after)
    assert sum(starts.values()) >= 8  # the last eight at least came after the update


@pytest.mark.slow
async def test_rpc_to_a_stopped_replica_times_out_alone_while_admission_goes_on() -> None:
    cfg = echo_config(2, outputs=2, final_stage_ids=[0, 1], heartbeat_timeout=120.0)
    cfg.stages[1].replicas = 2
    async with checked_pipeline(cfg) as pipe:
        orch = Orchestrator(pipe.stages, **pipe.orchestrator_kwargs())
        stopped = pipe.worker(1, 1).pid
        assert stopped is not None
        async with trio.open_nursery() as nursery:
            await nursery.start(orch.run)
            os.kill(stopped, signal.SIGSTOP)
            try:
                answers: list[list[RpcResult]] = []

                async def call() -> None:
                    answers.append(await orch.collective_rpc("health", timeout=5))

                nursery.start_soon(call)
                await orch.add_request("text-only", "hi", final_stage_id=0)  # admitted meanwhile ...
                with trio.fail_after(30):
                    msgs = [await orch.next_output(), await orch.next_output()]
                assert msgs[-1].finished and isinstance(msgs[-1], OrchOutput)
                assert not answers  # ... and it ended while the RPC still waits for the stopped one
                with trio.fail_after(30):
                    while not answers:
                        await trio.sleep(0.05)
            finally:
                os.kill(stopped, signal.SIGCONT)
            [s0, s1r0, s1r1] = answers[0]
            assert (s0.stage_id, s0.error) == (0, None) and s0.value["ok"]
            assert (s1r0.stage_id, s1r0.replica, s1r0.error) == (1, 0, None)
            assert (s1r1.stage_id, s1r1.replica, s1r1.value) == (1, 1, None)
            assert "timeout" in (s1r1.error or "")
            assert orch.statistics().rpc_errors == {"health": 1}
            await orch.shutdown()


@pytest.mark.slow
async def test_an_acknowledged_abort_returns_after_the_worker_stopped_and_keeps_the_partial_text() -> None:
    cfg = thinker_config(max_new_tokens=48, min_new_tokens=48)
    cfg.stages[0].worker_args = ["--step-delay-ms", "20"]
    async with checked_pipeline(cfg) as pipe:
        orch = Orchestrator(pipe.stages, **pipe.orchestrator_kwargs())
        async with trio.open_nursery() as nursery:
            await nursery.start(orch.run)
            await orch.add_request("r", "Hello")
            seen: list[str] = []
            with trio.fail_after(30):
                while len(seen) < 3:
                    m = await orch.next_output()
                    assert isinstance(m, OrchOutput)
                    seen.append(m.data["text"])
            acks = await orch.abort("r")
            assert acks == [RpcResult(0, 0, ["r"], None)]  # the worker held it and confirmed
            [stats] = await orch.collective_rpc("stats")
            assert stats.value["active"] == stats.value["waiting"] == 0  # stopped before the answer
            with trio.fail_after(30):
                while not isinstance(m := await orch.next_output(), OrchError):
                    seen.append(m.data["text"])
            assert m.kind == "aborted"
            partial = "".join(d["text"] for d in m.partial[0])
            assert partial == "".join(seen) and 3 <= len(partial) < 48  # everything shown, in order
            assert await orch.abort("r") == []
            await orch.shutdown()


@pytest.mark.slow
async def test_profile_writes_a_trace_of_the_steps(tmp_path: Path) -> None:
    cfg = thinker_config()
    # the worker starts torch's profiler in its own loop, sending no heartbeat meanwhile: on a loaded
    # machine that took past the default 5 s, and the head rightly declared it dead
    cfg.heartbeat_timeout = 120.0
    async with checked_pipeline(cfg.validate()) as pipe:
        orch = Orchestrator(pipe.stages, **pipe.orchestrator_kwargs())
        async with trio.open_nursery() as nursery:
            await nursery.start(orch.run)
            # starting torch's profiler, and writing its trace, take seconds on a loaded machine: past
            # the 5 s default RPC timeout there (the timeout is not what this tests)
            [started] = await orch.collective_rpc("start_profile", [str(tmp_path / "prof")], timeout=120)
            assert started.error is None
            [again] = await orch.collective_rpc("start_profile", [str(tmp_path / "prof")], timeout=120)
            assert "already running" in (again.error or "")
            await text_of(orch, "a")
            [stopped] = await orch.collective_rpc("stop_profile", timeout=120)
            await orch.shutdown()
    trace = Path(stopped.value["trace"])
    assert trace.parent == tmp_path / "prof" and trace.stat().st_size > 0
    assert "aten::" in trace.read_text()  # the model's torch ops were recorded


PLUGIN = '''
from stages.base import StageModel, StepResult
from stages.control import rpc_method


class Counter(StageModel):
    def __init__(self) -> None:
        self.scale = 1

    def step(self, reqs):
        return [StepResult(len(str(r.payload)) * self.scale, True) for r in reqs]

    @rpc_method()
    def set_scale(self, scale: int) -> dict:
        if scale < 1:
            raise ValueError("scale must be >= 1")
        self.scale = scale
        return {"scale": scale}
'''


async def test_a_plugin_model_adds_its_own_rpc_method(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "ctl_plugin.py").write_text(textwrap.dedent(PLUGIN))
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = PipelineConfig([StageConfig("ctl_plugin:Counter")], final_stage_ids=[0]).validate()
    async with checked_pipeline(cfg) as pipe:
        orch = Orchestrator(pipe.stages, **pipe.orchestrator_kwargs())
        async with trio.open_nursery() as nursery:
            await nursery.start(orch.run)
            [bad] = await orch.collective_rpc("set_scale", [0])
            assert bad.error == "set_scale: ValueError: scale must be >= 1"
            [ok] = await orch.collective_rpc("set_scale", kwargs={"scale": 3})
            assert ok == RpcResult(0, 0, {"scale": 3}, None)
            [names] = await orch.collective_rpc("methods")
            assert "set_scale" in names.value and "stats" in names.value
            [unknown] = await orch.collective_rpc("set_scael")
            assert "unknown rpc method 'set_scael'" in (unknown.error or "")
            await orch.add_request("r", "abcd")
            with trio.fail_after(30):
                assert (await orch.next_output()).data == 12
            await orch.shutdown()
