"""The stage-kind registry: one table read by config, worker, launcher, generate and serve."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from typing import Any

import httpx
import numpy as np
import pytest

from stages import registry
from stages.base import EchoModel
from stages.config import PipelineConfig, StageConfig, default_config
from stages.registry import KINDS, KindError
from stages.worker import build_parser
from trio_orch.cluster.launcher import Pipeline, forward_fn, forward_fn_for, prewarm_fn
from trio_orch.engine import ThreadEngine
from trio_orch.http.app import create_app
from trio_orch.testing.toy_pipeline import toy_pipeline


def test_every_built_in_kind_names_an_importable_path_and_a_known_modality() -> None:
    assert list(KINDS) == ["echo", "thinker", "talker", "code2wav", "encoder", "diffusion", "image-encoder",
                           "audio-encoder", "hf-causal-lm", "omni-thinker", "omni-talker", "omni-token2wav"]
    for kind, spec in KINDS.items():
        assert spec.kind == kind and spec.output in registry.MODALITIES
        module, _, cls = spec.model.partition(":")
        assert module.startswith("stages.") and cls
    assert registry.outputs_of(KINDS) == ["data", "text", "codes", "audio", "embedding", "image", "embedding",
                                          "embedding", "text", "text", "codes", "audio"]
    for (kind, role), spec in registry.ROLES.items():
        assert (spec.kind, spec.role) == (kind, role) and kind in KINDS and spec.output in registry.MODALITIES
    assert registry.outputs_of(["thinker", "thinker"], ["prefill", "decode"]) == ["codes", "text"]


def test_forward_fn_joins_a_stage_s_outputs_by_its_kind() -> None:
    fwd = forward_fn_for(["thinker", "talker", "code2wav"])
    tokens = [{"text": "a", "tokens": np.array([97], np.int32)}, {"text": "b", "tokens": np.array([98])}]
    assert fwd(0, "p", tokens)["tokens"].tolist() == [97, 98]
    codes = [{"codes": np.ones((2, 4), np.int32)}, {"codes": np.zeros((3, 4), np.int32)}]
    joined = fwd(1, "p", codes)["codes"]
    assert joined.shape == (5, 4) and joined[:2].all() and not joined[2:].any()
    assert fwd(2, "p", ["x", "y"]) == "y"  # code2wav keeps the default: the last output
    assert forward_fn(0, "p", tokens)["tokens"].tolist() == [97, 98]  # the default pipeline's


def test_a_pipeline_takes_forward_and_prewarm_from_its_kinds() -> None:
    assert prewarm_fn(2, "hi") == {"prewarm": 2, "prompt_chars": 2}
    pipe = Pipeline(default_config(), [], [], "/nonexistent")
    assert pipe.prewarm_fn(1, "hello") == {"prewarm": 1, "prompt_chars": 5}
    assert pipe.forward_fn(0, "p", [{"tokens": np.array([1, 2])}])["tokens"].tolist() == [1, 2]


@pytest.mark.parametrize("kind, message", [
    ("vocoder", "unknown kind 'vocoder'"),
    ("my.module:", "malformed plug-in model path"),
    ("a:b:c", "malformed plug-in model path"),
    ("9lives:Cat", "malformed plug-in model path"),
    ("__main__:Model", "cannot import this process's __main__"),
    (3, "a kind is a string"),
])
def test_bad_kind_names_are_refused_without_importing_anything(kind: Any, message: str) -> None:
    with pytest.raises(KindError, match=message):
        registry.check_kind_name(kind)


@pytest.mark.parametrize("kind, options, message", [
    ("thinker", {"max_new_tokns": 3}, "unknown model option 'max_new_tokns' for thinker.*did you mean "
                                      "'max_new_tokens'"),
    ("talker", {"a": 1, "b": 2}, "unknown model options 'a', 'b' for talker"),
    ("echo", {"outputs": 2, "device": "cuda"},
     r"'device' is set for the whole pipeline \(\[pipeline\] device\)"),
    ("code2wav", {"seed": 1}, "'seed' is set for the whole pipeline"),
    ("echo", [1], "model options must be a table"),
    ("echo", {"outputs": {1, 2}}, "model options must be numbers, strings"),
    ("thinker", {"max_new_tokens": "48"},
     "model option 'max_new_tokens' of thinker: expected `int`, got `str`"),
    ("thinker", {"max_new_tokens": -3}, "model option 'max_new_tokens' of thinker: expected `int` >= 1"),
    ("code2wav", {"upsample": [8, 0]}, r"model option 'upsample' of code2wav: \[1\]: expected `int` >= 1"),
    ("echo", {"outputs": True}, "model option 'outputs' of echo: expected `int`, got `bool`"),
])
def test_model_options_are_checked_against_the_constructor(kind: str, options: Any, message: str) -> None:
    with pytest.raises(KindError, match=message):
        registry.check_stage(kind, options)
    cfg = PipelineConfig([StageConfig("echo"), StageConfig(kind, model=options)])
    # the schema sees a model table that is no table first, and says where it is
    where = (r"stages\[1\]\.model: expected `object`" if not isinstance(options, dict)
             else f"stage 1: .*{message}")
    with pytest.raises(ValueError, match=f"pipeline config: {where}"):
        cfg.validate()


def test_good_options_pass_and_build_model_fills_what_the_constructor_declares() -> None:
    registry.check_stage("thinker", {"d_model": 32, "max_new_tokens": 4, "slots": 2})
    model = registry.build_model("echo", {"outputs": 3}, device="cuda", seed=5, slots=7)
    assert isinstance(model, EchoModel) and model.info() == {"kind": "echo", "outputs": 3}


@pytest.mark.processes
def test_checking_a_config_imports_neither_torch_nor_trio_and_a_worker_does_not_either() -> None:
    """Built-in options are read from the model's source; a worker of the echo kind stays light."""
    code = (
        "import sys\n"
        "from stages.config import default_config, from_dict\n"
        "cfg = default_config()\n"
        "try:\n"
        "    from_dict({'stages': [{'kind': 'thinker', 'model': {'layerz': 1}}]})\n"
        "except ValueError as exc:\n"
        "    assert 'did you mean' in str(exc), exc\n"
        "else:\n"
        "    raise AssertionError('the typo was accepted')\n"
        "import stages.worker\n"
        "from stages.registry import build_model\n"
        "build_model('echo', {'outputs': 2}).warmup()\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'trio'))\n"
        "assert not bad, bad[:5]\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_worker_kind_flag_takes_built_ins_and_import_paths_and_refuses_the_rest(
        capsys: pytest.CaptureFixture[str]) -> None:
    parser = build_parser()
    assert parser.parse_args(["--connect", "ipc://x", "--kind", "talker"]).kind == "talker"
    assert parser.parse_args(["--connect", "ipc://x", "--kind", "pkg.mod:Cls"]).kind == "pkg.mod:Cls"
    with pytest.raises(SystemExit) as exc:
        parser.parse_args(["--connect", "ipc://x", "--kind", "vocoder"])
    assert exc.value.code == 2 and "unknown kind 'vocoder'" in capsys.readouterr().err


def test_presentation_follows_the_declared_modality() -> None:
    pcm = {"pcm": np.ones(4, np.float32), "sample_rate": 8000}
    assert registry.as_text("text", {"text": "hi"}) == "hi" and registry.as_text("data", "hi") == "hi"
    assert registry.as_text("codes", "hi") is None and registry.as_text("audio", {"text": "hi"}) is None
    samples, rate = registry.as_audio("audio", pcm)  # type: ignore[misc]
    assert rate == 8000 and samples.dtype == np.float32 and len(samples) == 4
    assert registry.as_audio("text", pcm) is None and registry.as_audio("codes", pcm) is None
    assert registry.text_stage([0, 2], ["text", "codes", "audio"]) == 0
    assert registry.text_stage([2], ["data", "data", "data"]) == 2
    assert registry.text_stage([1, 2], ["text", "codes", "audio"]) is None
    assert registry.text_stage([0, 2], None) == 0 and registry.text_stage([2], None) is None


def _post(app: Any, **body: Any) -> httpx.Response:
    async def post() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://app") as client:
            return await client.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "one two"}], **body})

    return asyncio.run(post())


def test_server_routes_and_shows_outputs_by_the_declared_modalities() -> None:
    """The toy pipeline's stages 0 and 2 are final: declared modalities decide what serve does."""
    with ThreadEngine(toy_pipeline(token_delay=0.001, audio_delay=0.001)) as engine:
        no_audio = create_app(engine, outputs=["text", "codes", "codes"])
        r = _post(no_audio, modalities=["text", "audio"])
        assert r.status_code == 400 and "no audio output" in r.json()["error"]["message"]
        r = _post(no_audio, modalities=["text"])
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"].strip()
        no_text = create_app(engine, outputs=["codes", "codes", "audio"])
        r = _post(no_text, modalities=["text"])
        assert r.status_code == 400 and "no text-only output" in r.json()["error"]["message"]
        r = _post(no_text, modalities=["text", "audio"], audio={"format": "pcm16"})
        message = r.json()["choices"][0]["message"]
        assert r.status_code == 200 and message["content"] == ""  # stage 0's text is not shown
        assert len(message["audio"]["data"]) > 0


def test_companions_reach_only_a_kind_whose_forward_conditions_on_them() -> None:
    assert registry.takes_companions(KINDS["encoder"]) and not registry.takes_companions(KINDS["thinker"])
    fwd = registry.forward_fn(["encoder", "diffusion"])
    enc = [{"embedding": np.ones((2, 4), np.float32)}]
    neg = {"r:neg": [{"embedding": np.zeros((1, 4), np.float32)}]}
    assert fwd(0, {"text": "a cat", "steps": 3}, enc, companions=neg)["companion"] == "r:neg"
    assert "uncond" not in fwd(0, "a cat", enc)  # no companions: the prompt alone
    with pytest.raises(ValueError, match=r"stage 0 \(thinker\) takes no companions"):
        registry.forward_fn(["thinker", "talker"])(0, "p", [{"tokens": np.array([1])}], companions=neg)


def test_which_kinds_read_tokens_and_can_be_told_what_to_say_is_the_registry_s_to_say() -> None:
    """A front never names a kind: it asks the registry how a stage reads text (tokenizer, speech)."""
    kinds = ("thinker", "talker", "code2wav", "echo")
    assert [registry.reads_tokens(k) for k in kinds] == ["text", "ids", "", ""]
    assert [registry.says(k) for k in ("thinker", "talker")] == [True, False]
    assert registry.reads_tokens("toy thinker") == "" and not registry.says("toy thinker")  # no kind at all
