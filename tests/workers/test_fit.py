"""Pipelines that fit: a stage that cannot read what the stage before it emits is refused at start.

The speech pipeline with a 1,000-word ``tokenizer.json`` on its thinker: the
talker's default vocabulary (the byte thinker's 257 ids) cannot take its ids,
so the config is refused -- exit 2 from ``serve`` and ``generate``, naming
both stages and both sizes, no worker started; with the talker's
``vocab_size`` set to fit, the same pipeline runs end to end.  The talker
also refuses an out-of-vocabulary token for the one request that carries it
(another client's submit), never with an index error.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import trio

from stages.base import ReqState
from stages.config import PipelineConfig, StageConfig, default_config, from_dict
from stages.fit import Sizes, check_fit
from stages.registry import stage_sizes
from stages.toy.models import Talker, Thinker
from tests.tokenizer_helpers import word_tokenizer
from trio_orch.cluster.launcher import open_pipeline
from trio_orch.shell.orchestrator import open_orchestrator
from trio_orch.testing import LeakProbe
from trio_orch.types import OrchError

ROOT = Path(__file__).resolve().parents[2]
WORDS = [f"w{i}" for i in range(1000)] + ["[UNK]"]
SMALL = {"d_model": 32, "layers": 1, "heads": 2}


@pytest.fixture()
def words(tmp_path: Path) -> Path:
    return word_tokenizer(tmp_path / "tokenizer.json", WORDS)  # 1,000 words, [UNK] and </s>: 1,002 ids


def speech(tokenizer: Path, talker: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"pipeline": {"final_stages": [0, 2]},
            "stages": [{"kind": "thinker", "model": {**SMALL, "tokenizer": str(tokenizer)}},
                       {"kind": "talker", "model": {**SMALL, **(talker or {})}},
                       {"kind": "code2wav", "model": {"dim": 16}}]}


def test_the_built_in_pipelines_fit_and_declare_their_sizes() -> None:
    default_config()
    assert stage_sizes("thinker", {}) == Sizes(emits={"vocabulary": 257})
    assert stage_sizes("talker", {}).reads == {"vocabulary": 257}
    assert stage_sizes("talker", {"codebooks": 3}).emits == {"codebooks": 3, "codebook_size": 256}
    assert stage_sizes("code2wav", {}).reads == {"codebooks": 4, "codebook_size": 256}
    assert stage_sizes("echo", {}) is None  # declares nothing: nothing is checked


def test_a_large_vocabulary_before_the_default_talker_is_refused_naming_both(words: Path) -> None:
    with pytest.raises(ValueError) as info:
        from_dict(speech(words))
    assert str(info.value) == (
        "pipeline config: stage 0 (thinker) emits token ids from a vocabulary of 1002, but stage 1 (talker) "
        "reads token ids from a vocabulary of 257; set stage 1's vocab_size to at least 1002 "
        "([stages.model])")
    assert from_dict(speech(words, {"vocab_size": 1002})).stages[1].model["vocab_size"] == 1002


def test_codebooks_must_match_and_a_smaller_vocabulary_fits() -> None:
    with pytest.raises(ValueError, match=r"stage 1 \(talker\) emits frames of codebooks: 4, but stage 2 "
                                         r"\(code2wav\) reads frames of codebooks: 2"):
        PipelineConfig([StageConfig("thinker"), StageConfig("talker"), StageConfig("code2wav",
                        model={"codebooks": 2})], final_stage_ids=[0, 2]).validate()
    check_fit(["a", "b"], [Sizes(emits={"vocabulary": 100}), Sizes(reads={"vocabulary": 257})])
    with pytest.raises(ValueError, match=r"emits hidden states of width 64, but stage 1 .* width 32"):
        check_fit(["a", "b"], [Sizes(emits={"hidden_size": 64}), Sizes(reads={"hidden_size": 32})])


def test_the_talker_refuses_a_token_outside_its_vocabulary_for_that_request_alone() -> None:
    talker = Talker(**SMALL, slots=2)
    with pytest.raises(ValueError, match="token 300 is not in its vocabulary of 257"):
        talker.admit(ReqState("r", {"tokens": np.array([97, 300], np.int32)}))
    streamed = ReqState("s", None, upstream=True, input_done=False)
    talker.admit(streamed)
    with pytest.raises(ValueError, match="token -1"):
        talker.feed(streamed, np.array([-1], np.int32), False)
    talker.admit(ReqState("ok", {"tokens": []}))  # an empty input segment is fine


def test_a_thinker_with_a_word_tokenizer_emits_ids_of_its_vocabulary(words: Path) -> None:
    thinker = Thinker(**SMALL, tokenizer=str(words), slots=1, temperature=0.0)
    assert thinker.vocab == 1002


@pytest.mark.processes
@pytest.mark.parametrize("command", ["serve", "generate"])
def test_the_command_line_refuses_the_mismatch_at_start(tmp_path: Path, words: Path, command: str) -> None:
    cfg = speech(words)
    toml = tmp_path / "speech.toml"
    lines = ["[pipeline]", "final_stages = [0, 2]"]
    for st in cfg["stages"]:
        lines += ["[[stages]]", f'kind = "{st["kind"]}"', "[stages.model]"]
        lines += [f"{k} = {v!r}".replace("'", '"') for k, v in st["model"].items()]
    toml.write_text("\n".join(lines) + "\n")
    args = ["serve", "--port", "0"] if command == "serve" else ["generate", "--out", str(tmp_path / "o.wav")]
    proc = subprocess.run([sys.executable, "-m", "trio_orch.cli", *args, "--config", str(toml)], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120, env=dict(os.environ))
    assert proc.returncode == 2, proc.stderr
    assert "stage 0 (thinker) emits token ids from a vocabulary of 1002" in proc.stderr
    assert "stage 1 (talker) reads token ids from a vocabulary of 257" in proc.stderr
    assert "starting" not in proc.stdout + proc.stderr and "Traceback" not in proc.stderr  # no worker started


@pytest.mark.processes
@pytest.mark.slow
async def test_with_the_talker_s_vocabulary_set_the_pipeline_runs_end_to_end(words: Path) -> None:
    cfg = from_dict(speech(words, {"vocab_size": 1002}))
    probe = LeakProbe()
    pcm = 0
    with trio.fail_after(120):
        async with open_pipeline(cfg) as pipe, open_orchestrator(pipe.stages,
                                                                 **pipe.orchestrator_kwargs()) as orch:
            probe.saw(pipe.pids)
            probe.saw_dir(pipe.tmpdir)
            prompt = " ".join(WORDS[990:1000])  # ids near the top of the vocabulary
            await orch.add_request("r", prompt, sampling={0: {"max_tokens": 6, "temperature": 0}})
            while True:
                out = await orch.next_output()
                assert not isinstance(out, OrchError), out
                if out.stage_id == 2:
                    pcm += len(out.data["pcm"])
                if out.finished:
                    break
    assert pcm > 0
    assert probe.leaks() == {"processes": 0, "fds": 0, "ipc_files": 0}
