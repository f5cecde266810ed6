"""Sampling parameters through real worker processes over ZMQ, stage by stage and in async-chunk mode:
reproducible with a seed, alone or batched; each stage honours its own entry; the worker checks too."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
import trio

from stages.config import PipelineConfig, StageConfig, echo_config
from trio_orch import OrchError, Orchestrator, open_orchestrator
from trio_orch.cluster.launcher import Pipeline, open_pipeline
from trio_orch.testing import LeakProbe

pytestmark = pytest.mark.processes  # real worker processes or servers

TINY = {
    "thinker": {"d_model": 32, "layers": 1, "heads": 2, "max_new_tokens": 16},
    "talker": {"d_model": 32, "layers": 1, "heads": 2, "chunk_frames": 4},
    "code2wav": {"dim": 16, "upsample": [4, 3], "chunk_frames": 4},
}


def config(async_chunk: bool) -> PipelineConfig:
    stages = [StageConfig(k, model=dict(TINY[k])) for k in ("thinker", "talker", "code2wav")]
    return PipelineConfig(stages, final_stage_ids=[0, 2], async_chunk=async_chunk).validate()


@dataclass
class Answer:
    text: str = ""
    pcm: bytes = b""
    error: OrchError | None = None
    chunks: list[np.ndarray] = field(default_factory=list)


async def speak(orch: Orchestrator, requests: dict[str, Any], prompt: str = "Hello",
                pipe: Pipeline | None = None) -> dict[str, Answer]:
    """Add every request at once, collect each one's text and audio bytes.

    With ``pipe``, every stage is paused and released only once all the requests wait at it, so they
    share every stage's steps however the machine schedules the workers (no timing luck)."""
    answers = {rid: Answer() for rid in requests}
    if pipe is not None:
        for w in pipe.workers:
            await w.client.rpc("pause")
    for rid, sampling in requests.items():
        await orch.add_request(rid, prompt, sampling=sampling)
    async with trio.open_nursery() as nursery:
        if pipe is not None:
            nursery.start_soon(_release_stage_by_stage, pipe, len(requests))
        await _collect(orch, answers)
    return answers


async def _release_stage_by_stage(pipe: Pipeline, n: int) -> None:
    """Resume each stage once all ``n`` requests wait at it and the stage before has finished them."""
    for w in pipe.workers:
        with trio.fail_after(60):
            while (await w.client.rpc("stats"))["waiting"] < n:
                await trio.sleep(0.01)  # polls a condition in another process
        await w.client.rpc("resume")
        with trio.fail_after(60):
            while (s := await w.client.rpc("stats"))["waiting"] or s["active"]:
                await trio.sleep(0.01)


async def _collect(orch: Orchestrator, answers: dict[str, Answer]) -> None:
    left = set(answers)
    with trio.fail_after(60):
        while left:
            m = await orch.next_output()
            a = answers[m.request_id]
            if isinstance(m, OrchError):
                a.error = m
            elif m.stage_id == 0:
                a.text += m.data["text"]
            elif m.data is not None:
                a.chunks.append(m.data["pcm"])
            if m.finished:
                left.discard(m.request_id)
    for a in answers.values():
        a.pcm = np.concatenate(a.chunks).tobytes() if a.chunks else b""


HOT = [{"temperature": 1.0, "seed": 7}, {"temperature": 0.9, "seed": 7}, None]  # thinker and talker sample


@pytest.mark.slow
@pytest.mark.parametrize("async_chunk", [False, True], ids=["normal", "async_chunk"])
async def test_seeds_voices_and_batching_through_worker_processes(async_chunk: bool) -> None:
    probe = LeakProbe()
    async with open_pipeline(config(async_chunk)) as pipe:
        probe.saw(pipe.pids)
        probe.saw_dir(pipe.tmpdir)
        async with open_orchestrator(pipe.stages, **pipe.orchestrator_kwargs()) as orch:
            first = (await speak(orch, {"a": HOT}))["a"]
            assert first.error is None and first.text and first.pcm
            again = (await speak(orch, {"a1": HOT}))["a1"]
            assert (again.text, again.pcm) == (first.text, first.pcm)  # the same text and audio bytes
            # batched with three others: the same tokens (text, and codes: the audio follows them)
            mixed = await speak(orch, {"x": [{"temperature": 1.5}, {"temperature": 1.2}, None], "a2": HOT,
                                       "y": [{"seed": 3}, {"voice": "nova"}, {"voice": "nova"}],
                                       "z": [{"top_k": 3, "seed": 1}, None, None]}, pipe=pipe)
            assert mixed["a2"].text == first.text
            assert np.allclose(_samples(mixed["a2"]), _samples(first), atol=1e-5)  # float rounding aside
            assert min(await _max_batch(pipe)) == 4  # they really shared every stage's steps
            other_seed = (await speak(orch, {"b": [{"temperature": 1.0, "seed": 8}, None, None]}))["b"]
            assert other_seed.text != first.text
            # greedy: the seed does not matter; each stage honours its own entry
            greedy = await speak(orch, {
                "g1": [{"temperature": 0, "seed": 1}, None, None],
                "g2": [{"temperature": 0, "seed": 2}, None, None],
                "talker_hot": [{"temperature": 0}, {"temperature": 1.0, "seed": 5}, None],
                "talker_voice": [{"temperature": 0}, {"voice": "onyx"}, None],
                "vocoder_voice": [{"temperature": 0}, None, {"voice": "onyx"}]})
            g1 = greedy["g1"]
            assert greedy["g2"].text == g1.text
            assert np.allclose(_samples(greedy["g2"]), _samples(g1), atol=1e-5)
            for rid in ("talker_hot", "talker_voice", "vocoder_voice"):
                assert greedy[rid].text == g1.text and not _close(greedy[rid], g1), rid
            assert not _close(greedy["talker_voice"], greedy["vocoder_voice"])
            # a stop string: the text ends before it (tokens after it never reach the talker)
            stop = first.text[4:6]
            stopped = (await speak(orch, {"s": [{**HOT[0], "stop": [stop]}, HOT[1], None]}))["s"]
            assert stopped.text == first.text[: first.text.index(stop)]
            assert len(stopped.pcm) < len(first.pcm)
    assert probe.leaks() == {"processes": 0, "fds": 0, "ipc_files": 0}


def _samples(a: Answer) -> np.ndarray:
    return np.frombuffer(a.pcm, np.float32)


def _close(a: Answer, b: Answer) -> bool:
    return len(a.pcm) == len(b.pcm) and np.allclose(_samples(a), _samples(b), atol=1e-3)


async def _max_batch(pipe: Pipeline) -> list[int]:
    return [s.get("max_batch_seen", 0) for s in await pipe.stats()]


@pytest.mark.parametrize("async_chunk", [False, True], ids=["normal", "async_chunk"])
async def test_a_worker_refuses_parameters_its_kind_does_not_take(async_chunk: bool) -> None:
    """Without the orchestrator's check (as from another client) the worker's own check answers:
    the parameters reached it, with a submit (stage 1 in async-chunk mode: the prewarm submit)."""
    async with open_pipeline(echo_config(2, final_stage_ids=[1], async_chunk=async_chunk)) as pipe:
        opts = {k: v for k, v in pipe.orchestrator_kwargs().items() if k != "check_sampling"}
        async with open_orchestrator(pipe.stages, **opts) as orch:
            await orch.add_request("bad", "hi", sampling={1: {"seed": 1}})
            await orch.add_request("ok", "hi", sampling={1: None})
            with trio.fail_after(30):
                got = {m.request_id: m for m in [await orch.next_output(), await orch.next_output()]}
    err = got["bad"]
    assert isinstance(err, OrchError) and err.stage_id == 1 and err.kind == "stage_failed"
    assert "echo takes no sampling parameter 'seed' (it takes none)" in err.message
    assert not isinstance(got["ok"], OrchError) and got["ok"].finished


def test_the_asyncio_twin_client_sends_sampling_too() -> None:
    """bench/'s asyncio ZMQ client puts a stage's parameters on the wire like the Trio one."""
    import asyncio

    from bench.refs.launcher import open_worker_stages

    async def main() -> dict[str, Any]:
        async with asyncio.timeout(30), open_worker_stages(echo_config(1)) as (client,):
            await client.submit("bad", "hi", sampling={"seed": 1})
            await client.submit("ok", "hi")
            got: dict[str, Any] = {}
            while len(got) < 2:
                for out in await client.receive():
                    got[out.request_id] = out
            return got

    got = asyncio.run(main())
    assert "echo takes no sampling parameter 'seed'" in (got["bad"].error or "")
    assert got["ok"].error is None and got["ok"].data == "hi"
