"""Prefill/decode disaggregation: the thinker split over two stages, its KV cache handed worker to worker.

The split must change nothing but where the work runs: the decode stage's
text equals the unsplit thinker's for the same prompt and seed, with the
cache through the real wire codec (in process) and through real worker
processes; decode replicas may outnumber prefill replicas; a decode replica
that dies while the cache arrives gives that request ``replica_died``.
"""

from __future__ import annotations

from typing import Any

import pytest
import trio

from stages.base import ReqState
from stages.config import PipelineConfig, StageConfig, pd_config
from stages.toy.models import Thinker
from stages.toy.pd import DecodeThinker, PrefillThinker
from stages.wire import Chunk, WireCodec
from trio_orch import OrchError, OrchOutput, open_orchestrator
from trio_orch.cluster.launcher import open_pipeline
from trio_orch.testing import LeakProbe

SMALL = {"d_model": 32, "layers": 1, "heads": 2, "max_new_tokens": 16, "min_new_tokens": 16}
PROMPTS = ["Hello there", "The quick brown fox jumps"]


def whole(model: Thinker, prompt: str, **sampling: Any) -> str:
    req = ReqState("r", prompt, sampling=sampling)
    model.admit(req)
    text = ""
    while True:
        [res] = model.step([req])
        text += res.data["text"]
        if res.finished:
            model.release(req)
            return text


def split(prefill: PrefillThinker, decode: DecodeThinker, prompt: str, **sampling: Any) -> str:
    req = ReqState("r", prompt, downstream=0)
    prefill.admit(req)
    [res] = prefill.step([req])
    prefill.release(req)
    assert res.finished and res.data["prefilled"] == len(prompt.encode())
    codec = WireCodec(Chunk)  # the cache crosses the wire: arrays as their own frames, no pickling
    frames = codec.encode(Chunk("r", res.chunk, True))
    assert len(frames) == 5 and sum(memoryview(f).nbytes for f in frames[1:3]) == res.data["kv_bytes"]
    chunk = codec.decode([bytes(f) for f in frames])
    dec = ReqState("r", {"kv_handoff": res.data}, upstream=True, sampling=sampling)  # the text's stage
    decode.admit(dec)
    assert not decode.runnable(dec)  # waits for its cache
    decode.feed(dec, chunk.data, chunk.end)
    text = ""
    while True:
        [out] = decode.step([dec])
        text += out.data["text"]
        if out.finished:
            decode.release(dec)
            return text


@pytest.mark.parametrize("temperature", [0.0, 0.9], ids=["greedy", "sampled"])
def test_decode_from_a_handed_over_cache_gives_the_unsplit_thinkers_text(temperature: float) -> None:
    opts = {**SMALL, "temperature": temperature, "seed": 3}
    thinker, prefill, decode = Thinker(**opts), PrefillThinker(**opts), DecodeThinker(**opts)
    for m in (thinker, prefill, decode):
        m.warmup()
    texts = [(whole(thinker, p), split(prefill, decode, p)) for p in PROMPTS]
    assert all(len(a) == 16 for a, _ in texts)
    assert [a for a, _ in texts] == [b for _, b in texts]
    other = DecodeThinker(**{**opts, "seed": 4})  # other weights: the cache no longer fits what it computes
    other.warmup()
    assert split(prefill, other, PROMPTS[1]) != texts[1][0]


def test_a_seeded_request_decodes_the_same_text_whatever_the_decode_replica_did_before() -> None:
    opts = {**SMALL, "seed": 3}
    thinker, prefill, decode = Thinker(**opts), PrefillThinker(**opts), DecodeThinker(**opts)
    sampling = {"seed": 11, "temperature": 1.2, "top_k": 30}
    want = whole(thinker, PROMPTS[0], **sampling)
    split(prefill, decode, PROMPTS[1])  # the decode replica's own sampler moves on; the request's does not
    assert split(prefill, decode, PROMPTS[0], **sampling) == want
    assert split(prefill, decode, PROMPTS[0], **{**sampling, "seed": 12}) != want


def test_roles_refuse_what_they_cannot_serve() -> None:
    prefill, decode = PrefillThinker(**SMALL), DecodeThinker(**SMALL)
    with pytest.raises(ValueError, match="none was named"):
        prefill.admit(ReqState("r", "hi"))  # no decode replica to send the cache to
    with pytest.raises(ValueError, match="takes KV caches from a prefill stage"):
        decode.admit(ReqState("r", "hi"))
    req = ReqState("r", None, upstream=True)
    decode.admit(req)
    with pytest.raises(ValueError, match="needs k, v, hidden"):
        decode.feed(req, {"k": 1}, True)
    bigger = PrefillThinker(**{**SMALL, "d_model": 64})
    r2 = ReqState("r", "hi", downstream=0)
    bigger.admit(r2)
    with pytest.raises(ValueError, match="same model options"):
        decode.feed(req, bigger.step([r2])[0].chunk, True)


@pytest.mark.parametrize("stages, message", [
    ([StageConfig("thinker", role="prefill")], "stage 1 must have role 'decode'"),
    ([StageConfig("thinker", role="decode")], "the stage before it must have role 'prefill'"),
    ([StageConfig("thinker", role="prefill"), StageConfig("thinker", role="decode", model={"layers": 1})],
     "same kind and model options"),
    ([StageConfig("talker", role="prefill")], "kind 'talker' has no role 'prefill'"),
    ([StageConfig("thinker", role="encode")], "kind 'thinker' has no role 'encode'.*prefill"),
])
def test_split_configs_are_checked_before_any_worker_starts(stages: list[StageConfig], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        PipelineConfig(stages, final_stage_ids=[len(stages) - 1]).validate()
    with pytest.raises(ValueError, match=r"prefill\) gives no output"):
        PipelineConfig([StageConfig("thinker", role="prefill"), StageConfig("thinker", role="decode")],
                       final_stage_ids=[0, 1]).validate()


def pd_pipeline(decode_replicas: int, *, decode_args: dict[int, list[str]] | None = None) -> PipelineConfig:
    stages = [StageConfig("thinker", model=dict(SMALL), role="prefill"),
              StageConfig("thinker", model=dict(SMALL), role="decode", replicas=decode_replicas,
                          replica_args=decode_args or {})]
    return PipelineConfig(stages, final_stage_ids=[1], seed=7).validate()


async def texts_of(config: PipelineConfig, prompts: list[str], probe: LeakProbe) -> tuple[list[str], Any]:
    """Each prompt's text, one request at a time; and the placements of the last stage's pool."""
    texts = []
    async with open_pipeline(config) as pipe:
        probe.saw(pipe.pids)
        probe.saw_dir(pipe.tmpdir)
        async with open_orchestrator(pipe.stages, **pipe.orchestrator_kwargs()) as orch:
            for i, prompt in enumerate(prompts):
                await orch.add_request(f"r{i}", prompt)
                text = ""
                with trio.fail_after(60):
                    while True:
                        msg = await orch.next_output()
                        assert isinstance(msg, OrchOutput), msg
                        text += msg.data["text"]
                        if msg.finished:
                            break
                texts.append(text)
        return texts, list(pipe.stages[-1].placements)


@pytest.mark.slow
@pytest.mark.processes
async def test_the_split_pipelines_text_equals_the_single_thinkers() -> None:
    probe = LeakProbe()
    single = PipelineConfig([StageConfig("thinker", model=dict(SMALL))], seed=7).validate()
    want, _ = await texts_of(single, PROMPTS, probe)
    got, placements = await texts_of(pd_pipeline(2), PROMPTS, probe)
    assert got == want and all(len(t) == 16 for t in got)
    assert sum(placements) == len(PROMPTS)
    assert probe.leaks() == {"processes": 0, "fds": 0, "ipc_files": 0}


@pytest.mark.slow
@pytest.mark.processes
async def test_a_decode_replica_dying_as_the_cache_arrives_fails_that_request_with_replica_died() -> None:
    probe = LeakProbe()
    config = pd_pipeline(2, decode_args={0: ["--crash-on-chunk"]})
    async with open_pipeline(config) as pipe:
        probe.saw(pipe.pids)
        probe.saw_dir(pipe.tmpdir)
        async with open_orchestrator(pipe.stages, **pipe.orchestrator_kwargs()) as orch:
            await orch.add_request("doomed", PROMPTS[0])  # decode replica 0 (both idle: the lowest index)
            with trio.fail_after(30):  # never a hang
                msg = await orch.next_output()
            assert isinstance(msg, OrchError) and msg.request_id == "doomed", msg
            assert msg.kind == "replica_died" and msg.stage_id == 1
            await orch.add_request("next", PROMPTS[0])  # the surviving decode replica serves
            text = ""
            with trio.fail_after(30):
                while not (msg := await orch.next_output()).finished:
                    text += msg.data["text"]
            assert isinstance(msg, OrchOutput) and len(text + msg.data["text"]) == 16
            assert pipe.stages[1].live_replicas() == [1]
    assert probe.leaks() == {"processes": 0, "fds": 0, "ipc_files": 0}


def test_the_built_in_split_speech_pipeline_validates() -> None:
    cfg = pd_config()
    assert [s.label for s in cfg.stages] == ["thinker prefill", "thinker decode", "talker", "code2wav"]
    assert cfg.outputs() == ["codes", "text", "codes", "audio"] and cfg.hands_off(0) and not cfg.hands_off(1)
