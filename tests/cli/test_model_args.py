"""The checkpoint on the command line: ``serve MODEL_DIR`` is ``serve --model MODEL_DIR``, as vLLM's.

Parsed as the ``trio-orch`` command parses them (no process started): the
positional and the flag name the same checkpoint, ``--model`` is never taken
as a prefix of ``--model-name`` (nor is any serve flag abbreviated), the
served name defaults to the path as given, and what cannot be served exits 2
before anything starts.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import pytest

from trio_orch.cli.main import build_parser, commands, main
from trio_orch.serve.checkpoint import model_dir, resolve_model


def serve_args(*argv: str) -> argparse.Namespace:
    args = build_parser(commands(), configure="serve").parse_args(["serve", *argv])
    resolve_model(args)
    return args


def test_the_positional_and_the_flag_are_one_checkpoint_and_its_name_is_the_path_as_given() -> None:
    a, b = serve_args("models/tiny"), serve_args("--model", "models/tiny")
    assert a.model_dir == b.model_dir == "models/tiny"
    assert a.served_model_name == b.served_model_name == ["models/tiny"]  # vLLM's default
    assert serve_args("models/tiny", "--served-model-name", "x", "y").served_model_name == ["x", "y"]
    assert serve_args().served_model_name == ["trio-orch"] and serve_args().model_dir is None
    same = serve_args("m", "--model", "m")
    assert same.model_dir == "m"


def test_model_is_never_a_prefix_of_model_name_and_no_flag_is_abbreviated(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert serve_args("--model-name", "alias").served_model_name == ["alias"]
    assert serve_args("--model-name", "alias").model_dir is None
    for abbreviated in (["--model-na", "x"], ["--served-model", "x"], ["--max-model", "8"]):
        with pytest.raises(SystemExit) as info:
            serve_args(*abbreviated)
        assert info.value.code == 2
        assert "unrecognized arguments" in capsys.readouterr().err


def test_what_cannot_be_a_checkpoint_is_refused_before_anything_starts(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ValueError, match="two checkpoints given: MODEL_DIR a and --model b"):
        model_dir(argparse.Namespace(model_tag="a", model="b", max_model_len=None, dtype="auto"))
    for argv, says in ((["/no/such/dir"], "/no/such/dir: no such checkpoint directory"),
                       ([str(tmp_path)], "no config.json"),
                       (["--max-model-len", "64"], "--max-model-len and --dtype apply to a checkpoint"),
                       (["/x", "--in-process"], "or --in-process, not both"),
                       (["/x", "--pipeline", "speech"], "or --pipeline, not both")):
        assert main(["serve", "--port", "0", *argv]) == 2
        assert says in capsys.readouterr().err
    assert main(["generate", "--model", "/no/such/dir", "hi"]) == 2
    assert "/no/such/dir: no such checkpoint directory" in capsys.readouterr().err


@pytest.mark.slow
def test_without_the_hf_extra_a_checkpoint_is_refused_naming_it(
        tiny_qwen2: Any, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)  # as if it were not installed
    assert main(["serve", "--port", "0", str(tiny_qwen2.path)]) == 2
    assert "needs transformers: pip install 'trio-orch[hf]'" in capsys.readouterr().err
