"""Per-stage sampling parameters without worker processes: what each kind takes, how requests and
OpenAI fields map onto stages, and that every submit (forwarded, prewarm) carries its stage's entry."""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
import pytest
import trio

from stages import registry
from stages.sampling_params import THINKER_PARAMS, VOICES, describe, with_defaults
from stages.wire import InboundMsg, Submit, WireCodec
from tests.waiting import await_until
from trio_orch import OrchOutput, open_orchestrator
from trio_orch.engine import PipelineSpec, ThreadEngine, open_trio_engine, static_pipeline
from trio_orch.openai.sampling import SamplingError, chat_sampling, map_sampling
from trio_orch.testing import ScriptedStage

KINDS = ["thinker", "talker", "code2wav"]
PARAMS = registry.stage_params(KINDS)


# ---------------------------------------------------------------- what each kind takes
def test_parameters_are_normalised_and_only_the_given_keys_are_kept() -> None:
    check = registry.check_sampling(KINDS)
    assert check(0, {"temperature": 0, "stop": "x", "seed": 7, "top_k": None}) == {
        "temperature": 0.0, "stop": ["x"], "seed": 7}
    assert type(check(0, {"temperature": 1})["temperature"]) is float
    assert check(1, {"voice": "nova", "max_tokens": 3}) == {"voice": "nova", "max_tokens": 3}
    assert check(2, {}) == {}


@pytest.mark.parametrize(("stage", "params", "message"), [
    (0, {"temprature": 1.0}, "thinker takes no sampling parameter 'temprature'.*did you mean 'temperature'"),
    (0, {"temperature": 2.5}, r"thinker: 'temperature' must be in \[0, 2\], got 2.5"),
    (0, {"temperature": float("nan")}, "thinker: 'temperature' must be a finite number"),
    (0, {"top_p": 0}, r"'top_p' must be in \(0, 1\]"),
    (0, {"seed": True}, "'seed' must be an integer, got bool"),
    (0, {"seed": -1}, "'seed' must be in"),
    (0, {"max_tokens": 0}, "'max_tokens' must be >= 1"),
    (0, {"stop": ["ok", ""]}, "'stop': each string must have 1 to 64 characters"),
    (0, {"stop": ["s"] * 17}, "'stop' takes at most 16 entries"),
    (0, {"stop_token_ids": [300]}, r"'stop_token_ids': each entry must be in \[0, 256\]"),
    (1, {"voice": "bob"}, "talker: 'voice' must be one of alloy"),
    (1, {"stop": ["x"]}, "talker takes no sampling parameter 'stop'"),
    (2, {"temperature": 0.5}, r"code2wav takes no sampling parameter 'temperature' \(its parameters: voice"),
    (0, ["temperature"], "thinker: sampling parameters must be a mapping"),
])
def test_bad_parameters_name_the_kind_and_the_key(stage: int, params: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        registry.check_sampling(KINDS)(stage, params)


def test_echo_takes_none_and_defaults_come_from_model_then_schema() -> None:
    with pytest.raises(ValueError, match=r"echo takes no sampling parameter 'seed' \(it takes none\)"):
        registry.check_sampling(["echo"])(0, {"seed": 1})
    full = with_defaults(THINKER_PARAMS, {"top_k": 5}, temperature=0.5, max_tokens=10)
    assert (full["top_k"], full["temperature"], full["max_tokens"], full["top_p"]) == (5, 0.5, 10, 1.0)
    assert {row[0] for row in describe(THINKER_PARAMS)} == set(THINKER_PARAMS)


# ---------------------------------------------------------------- the wire
def test_submit_carries_sampling_and_peers_one_version_apart_still_decode() -> None:
    codec = WireCodec(InboundMsg)
    msg = codec.decode(codec.encode(Submit("r", "hi", 2, {"temperature": 0.5, "stop": ["x"]})))
    assert msg == Submit("r", "hi", 2, {"temperature": 0.5, "stop": ["x"]})

    class OldSubmit(msgspec.Struct, tag="submit", array_like=True):  # before sampling existed
        request_id: str
        payload: Any
        downstream: int = -1

    old = msgspec.msgpack.Encoder().encode(OldSubmit("r", "hi", 1))
    assert codec.decode([old]) == Submit("r", "hi", 1, None)
    new = codec.encode(Submit("r", "hi", 1, {"seed": 3}))
    assert msgspec.msgpack.decode(new[0], type=OldSubmit) == OldSubmit("r", "hi", 1)


# ---------------------------------------------------------------- through the orchestrator
def fwd(k: int, prompt: object, outs: list[Any]) -> str:
    return f"{k}>{'+'.join(map(str, outs))}"


async def test_each_stage_gets_its_own_entry_when_the_request_is_forwarded() -> None:
    stages = [ScriptedStage(k) for k in range(3)]
    async with open_orchestrator(stages, {0, 2}, forward_fn=fwd,
                                 check_sampling=registry.check_sampling(KINDS)) as orch:
        await orch.add_request("r1", "hi", sampling=[{"temperature": 0, "seed": 7}, None, {"voice": "nova"}])
        await stages[0].emit("r1", "a", finished=True)
        await stages[1].emit("r1", "b", finished=True)
        await stages[2].emit("r1", "c", finished=True)
        with trio.fail_after(5):
            while not (await orch.next_output()).finished:
                pass
    assert stages[0].sampling == [("r1", {"temperature": 0.0, "seed": 7})]
    assert stages[1].submissions == [("r1", "0>a")] and stages[1].sampling == []  # no entry: its defaults
    assert stages[2].sampling == [("r1", {"voice": "nova"})]


async def test_async_chunk_prewarm_submits_carry_their_stage_s_entry() -> None:
    stages = [ScriptedStage(k) for k in range(3)]
    async with open_orchestrator(stages, {0, 2}, async_chunk=True,
                                 check_sampling=registry.check_sampling(KINDS)) as orch:
        await orch.add_request("r1", "hi",
                               sampling={1: {"temperature": 0.7, "seed": 1}, 2: {"voice": "echo"}})
        assert [len(s.submissions) for s in stages] == [1, 1, 1]  # all at once: stage 1 and 2 prewarmed
        assert stages[0].sampling == []
        assert stages[1].sampling == [("r1", {"temperature": 0.7, "seed": 1})]
        assert stages[2].sampling == [("r1", {"voice": "echo"})]
        orch.abort_nowait("r1")


async def test_a_bad_entry_is_refused_at_acceptance_and_nothing_is_submitted() -> None:
    stages = [ScriptedStage(k) for k in range(3)]
    async with open_orchestrator(stages, {0, 2}, forward_fn=fwd,
                                 check_sampling=registry.check_sampling(KINDS)) as orch:
        with pytest.raises(ValueError, match="stage 1: talker takes no sampling parameter 'stop'"):
            await orch.add_request("r1", "hi", sampling=[{"seed": 1}, {"stop": ["x"]}])
        with pytest.raises(ValueError, match=r"stage 5.*stages are 0..2"):
            await orch.add_request("r1", "hi", sampling={5: {"seed": 1}})
        assert all(not s.submissions for s in stages) and orch.active_requests == 0
        await orch.add_request("r1", "hi")  # the id was never taken
        assert stages[0].submissions == [("r1", "hi")]
        orch.abort_nowait("r1")


# ---------------------------------------------------------------- the engines
def test_engine_sync_and_asyncio_callers_pass_sampling_and_get_value_errors() -> None:
    stages = [ScriptedStage(0)]
    spec = PipelineSpec(stages, [0], {}, registry.stage_params(["thinker"]))
    with ThreadEngine(lambda: FixedPipeline(spec)) as engine:
        assert engine.stage_params is not None and engine.stage_params[0].name == "thinker"
        with pytest.raises(ValueError, match="'top_k' must be >= 0"):
            engine.add_request("bad", sampling=[{"top_k": -1}])
        h = engine.add_request("p", request_id="s1", sampling=[{"top_k": 3}])
        engine.call_soon(stages[0].emit_nowait, "s1", "x", True)
        assert [m.data for m in h] == ["x"]

        async def use_asyncio() -> None:
            with pytest.raises(ValueError, match="'stop' must be a string or a list of strings"):
                async for _ in engine.generate("p", sampling={0: {"stop": 5}}):
                    pass
            gen = engine.generate("p", request_id="a1", sampling={0: {"seed": 9}})
            first = asyncio.ensure_future(gen.__anext__())
            await await_until(lambda: any(rid == "a1" for rid, _ in stages[0].submissions), "a1 submitted")
            engine.call_soon(stages[0].emit_nowait, "a1", "y", True)
            assert (await first).data == "y"
            await gen.aclose()

        asyncio.run(use_asyncio())
    assert [(rid, p) for rid, p in stages[0].sampling] == [("s1", {"top_k": 3}), ("a1", {"seed": 9})]
    assert [rid for rid, _ in stages[0].submissions] == ["s1", "a1"]  # the refused ones never reached it


async def test_trio_engine_passes_sampling() -> None:
    stages = [ScriptedStage(0)]
    async with open_trio_engine(static_pipeline(stages, [0])) as engine:
        with pytest.raises(ValueError, match="sampling must be a list"):
            async for _ in engine.generate("p", sampling="hot"):
                pass
        gen = engine.generate("p", request_id="t1", sampling=[{"anything": 1}])  # no checker: as given
        async with trio.open_nursery() as nursery:
            nursery.start_soon(stages[0].emit, "t1", "z", True)
            with trio.fail_after(5):
                out = await gen.__anext__()
        assert out == OrchOutput("t1", 0, "z", True)
        await gen.aclose()
    assert stages[0].sampling == [("t1", {"anything": 1})]


class FixedPipeline:
    """An async context manager yielding a fixed PipelineSpec (a pipeline factory's result)."""

    def __init__(self, spec: PipelineSpec) -> None:
        self.spec = spec

    async def __aenter__(self) -> PipelineSpec:
        return self.spec

    async def __aexit__(self, *exc: object) -> None:
        return None


# ---------------------------------------------------------------- OpenAI fields -> stages
def mapped(body: dict[str, Any], audio: bool = True, final: int | None = None) -> dict[int, dict[str, Any]]:
    return chat_sampling(body, audio=audio, stages=PARAMS, final_stage_ids=[0, 2],
                         outputs=registry.outputs_of(KINDS), final_stage_id=final)


def test_openai_fields_go_to_the_stages_they_concern() -> None:
    body = {"temperature": 0, "top_p": 0.5, "max_tokens": 9, "stop": "x", "frequency_penalty": 0.5,
            "presence_penalty": -1, "seed": 7, "audio": {"voice": "onyx", "format": "wav"}}
    assert mapped(body) == {
        0: {"temperature": 0.0, "top_p": 0.5, "max_tokens": 9, "stop": ["x"], "frequency_penalty": 0.5,
            "presence_penalty": -1.0, "seed": 7},
        1: {"seed": 7, "voice": "onyx"},
        2: {"voice": "onyx"}}
    # text only: the request stops at the thinker, so only the thinker gets the seed; no voice
    assert mapped({"seed": 7, "audio": {"voice": "onyx"}}, audio=False, final=0) == {0: {"seed": 7}}
    assert mapped({"max_tokens": 5, "max_completion_tokens": 3}) == {0: {"max_tokens": 3}}  # the newer wins


def test_stage_sampling_names_stages_by_kind_or_index_and_wins() -> None:
    got = mapped({"seed": 1, "stage_sampling": {"talker": {"temperature": 0.7, "seed": 2},
                                                "2": {"voice": "sage"}, 0: {"top_k": 4}}})
    assert got == {0: {"seed": 1, "top_k": 4}, 1: {"seed": 2, "temperature": 0.7}, 2: {"voice": "sage"}}


@pytest.mark.parametrize(("body", "param", "message"), [
    ({"temperature": 3}, "temperature", r"'temperature' must be in \[0, 2\]"),
    ({"stop": 5}, "stop", "'stop' must be a string or a list of strings"),
    ({"stage_sampling": {"talker": {"stop": ["x"]}}}, "stage_sampling.talker",
     "stage_sampling.talker: talker takes no sampling parameter 'stop'"),
    ({"stage_sampling": {"vocoder": {}}}, "stage_sampling.vocoder",
     r"no stage 'vocoder' \(stages: 0 \(thinker\), 1 \(talker\), 2 \(code2wav\)\)"),
    ({"stage_sampling": {"7": {}}}, "stage_sampling.7", "no stage '7'"),
    ({"stage_sampling": ["talker"]}, "stage_sampling", "must be an object"),
])
def test_fields_that_do_not_fit_are_errors_naming_the_field(body: dict[str, Any], param: str,
                                                             message: str) -> None:
    with pytest.raises(SamplingError, match=message) as info:
        mapped(body)
    assert info.value.param == param


def test_fields_no_stage_can_honour_are_refused_not_dropped() -> None:
    echo = registry.stage_params(["echo", "echo"])
    for fields, param in (({"temperature": 0.5}, "temperature"), ({"seed": 1}, "seed"),
                          ({"voice": "nova"}, "audio.voice"), ({"stage_sampling": {"0": {"x": 1}}},
                                                               "stage_sampling.0")):
        with pytest.raises(SamplingError, match=r"cannot be honoured|takes no sampling parameter") as info:
            map_sampling(fields, echo, text_stage=0, last_stage=1)
        assert info.value.param == param
    with pytest.raises(SamplingError, match="this pipeline declares no sampling parameters"):
        map_sampling({"seed": 1}, None, text_stage=0, last_stage=0)
    with pytest.raises(SamplingError, match="'echo' names 2 stages: use a stage index"):
        map_sampling({"stage_sampling": {"echo": {}}}, echo, text_stage=0, last_stage=1)
    assert map_sampling({"temperature": None, "stage_sampling": None}, echo, text_stage=0, last_stage=1) == {}
    assert len(VOICES) == len(set(VOICES))


def test_the_documented_parameter_tables_are_the_kinds_own() -> None:
    """docs/sampling.md lists every parameter of every built-in kind as the schema says."""
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "sampling.md").read_text()
    for kind in KINDS:
        section = doc.split(f"### `{kind}`", 1)[1].split("###", 1)[0]
        rows = [f"| `{n}` | {a} | {d} | {m} |" for n, a, d, m in describe(registry.spec_for(kind).sampling)]
        listed = [line for line in section.splitlines() if line.startswith("| `")]
        assert listed == rows, kind
