"""Plug-in stage models named by import path: checked before any worker starts, run in workers."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import textwrap
import uuid
import wave
from pathlib import Path

import numpy as np
import pytest

from stages import registry
from stages.config import from_dict, load_config
from trio_orch import cli

EXAMPLE = Path(__file__).resolve().parents[1] / "plugin_example"

PLUGINS = '''
from stages.base import StageModel, StepResult
from stages.registry import StageSpec


def joined(prompt, outputs):
    return "+".join(map(str, outputs))


class Good(StageModel):
    stage_spec = StageSpec(output="text", next_input=joined, prewarm_input=lambda k, p: {"warm": k, "p": p})

    def __init__(self, size: int, flavour: str = "plain") -> None:
        self.size, self.flavour = size, flavour

    def step(self, reqs):
        return [StepResult(r.payload, True) for r in reqs]


class NoStep(StageModel):
    pass


class NotAModel:
    def step(self, reqs):
        return []


class BadOutput(Good):
    stage_spec = StageSpec(output="video")


class SpecNotASpec(Good):
    stage_spec = {"output": "text"}


class BadSampling(Good):
    stage_spec = StageSpec(output="text", sampling={"temperature": 0.7})


def function():
    return None
'''


@pytest.fixture()
def plugin_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A directory on sys.path for this test's plug-in modules."""
    d = tmp_path / "plugins"
    d.mkdir()
    monkeypatch.syspath_prepend(str(d))
    return d


def write_module(directory: Path, body: str) -> str:
    """Write a module under a fresh name (nothing cached from another test) and return the name."""
    name = f"plug_{uuid.uuid4().hex[:10]}"
    (directory / f"{name}.py").write_text(textwrap.dedent(body))
    return name


def test_a_plug_in_declares_its_forward_prewarm_and_output_and_is_built_with_its_options(
        plugin_dir: Path) -> None:
    mod = write_module(plugin_dir, PLUGINS)
    kinds = ["echo", f"{mod}:Good"]
    cfg = from_dict({"pipeline": {"final_stages": [1]},
                     "stages": [{"kind": "echo"}, {"kind": kinds[1], "model": {"size": 3}}]})
    assert [s.kind for s in cfg.stages] == kinds
    assert registry.outputs_of(kinds) == ["data", "text"]
    assert registry.prewarm_fn(kinds)(1, "hi") == {"warm": 1, "p": "hi"}
    assert registry.prewarm_fn(kinds)(0, "hi") == {"prewarm": 0, "prompt_chars": 2}  # echo: the default
    assert registry.forward_fn(kinds + kinds)(1, "p", ["a", "b"]) == "a+b"
    assert registry.source_root(kinds[1]) == str(plugin_dir)
    model = registry.build_model(kinds[1], {"size": 3, "flavour": "mint"}, device="cuda", seed=1)
    assert type(model).__name__ == "Good" and (model.size, model.flavour) == (3, "mint")


def test_a_plug_in_inside_a_package_is_found_from_the_package_s_parent(plugin_dir: Path) -> None:
    pkg = plugin_dir / f"pkg_{uuid.uuid4().hex[:10]}"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "models.py").write_text(PLUGINS)
    kind = f"{pkg.name}.sub.models:Good"
    assert registry.spec_for(kind).output == "text"
    assert registry.source_root(kind) == str(plugin_dir)


#: case -> (kind, model options, what the error says); {names} are filled in per test
CASES = {
    "module missing": ("nosuch_{u}:Model", {}, "module 'nosuch_{u}' not found"),
    "package missing": ("nosuch_{u}.stages:Model", {}, "module 'nosuch_{u}.stages' not found"),
    "dependency missing": ("{dep}:Model", {},
                           "importing module '{dep}' failed: No module named 'nosuch_dep_{u}'"),
    "syntax error": ("{syntax}:Model", {}, "importing module '{syntax}' failed: SyntaxError"),
    "import raises": ("{boom}:Model", {}, "importing module '{boom}' failed: RuntimeError: boom at import"),
    "attribute missing": ("{mod}:Nope", {}, "module '{mod}' has no attribute 'Nope'"),
    "not a class": ("{mod}:function", {}, "'{mod}:function' is a function, not a class"),
    "not a stage model": ("{mod}:NotAModel", {},
                          "is not a stage model: it must subclass stages.base.StageModel"),
    "no step": ("{mod}:NoStep", {}, "does not implement the stage model interface: step missing"),
    "bad output": ("{mod}:BadOutput", {"size": 1}, "stage_spec: output 'video' is not one of text, audio"),
    "spec of the wrong type": ("{mod}:SpecNotASpec", {"size": 1},
                               "stage_spec must be a stages.registry.StageSpec"),
    "sampling not of Params": ("{mod}:BadSampling", {"size": 1},
                               "stage_spec: sampling must map parameter names to .*Param"),
    "option typo": ("{mod}:Good", {"size": 1, "flavor": "x"},
                    "unknown model option 'flavor'.*did you mean 'flavour'"),
    "option missing": ("{mod}:Good", {}, "needs model option 'size' in \\[stages.model\\]"),
    "built-in option typo": ("thinker", {"max_new_tokns": 3},
                             "unknown model option 'max_new_tokns' for thinker"),
}


@pytest.fixture()
def names(plugin_dir: Path) -> dict[str, str]:
    u = uuid.uuid4().hex[:10]
    return {"u": u, "mod": write_module(plugin_dir, PLUGINS),
            "dep": write_module(plugin_dir, f"import nosuch_dep_{u}\n"),
            "syntax": write_module(plugin_dir, "class Model(:\n"),
            "boom": write_module(plugin_dir, "raise RuntimeError('boom at import')\n")}


@pytest.mark.parametrize("case", list(CASES))
def test_a_bad_stage_model_is_a_config_error_naming_the_stage_before_any_worker_starts(
        case: str, names: dict[str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    kind, options, message = CASES[case]
    kind, message = kind.format(**names), message.format(**names)
    with pytest.raises(ValueError, match=f"^pipeline config: stage 1: .*{message}"):
        from_dict({"stages": [{"kind": "echo"}, {"kind": kind, "model": options}]})
    toml = tmp_path / "bad.toml"
    lines = [f"{k} = {v!r}".replace("'", '"') for k, v in options.items()]
    toml.write_text(f'[[stages]]\nkind = "echo"\n\n[[stages]]\nkind = "{kind}"\n[stages.model]\n'
                    + "\n".join(lines) + "\n")
    assert cli.main(["generate", "Hi", "--config", str(toml)]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {toml}: pipeline config: stage 1: "), err
    assert "starting workers" not in captured.err + captured.out  # refused before any worker


def test_serve_refuses_a_bad_plug_in_the_same_way(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    toml = tmp_path / "bad.toml"
    toml.write_text(f'[[stages]]\nkind = "nosuch_{uuid.uuid4().hex[:10]}:Model"\n')
    assert cli.main(["serve", "--port", "0", "--config", str(toml)]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and "pipeline config: stage 0: module 'nosuch_" in err[0], err
    assert "starting" not in captured.out  # no engine, no worker


def _leftover_processes(marker: str) -> list[str]:
    """Command lines of live processes that mention ``marker`` (a worker's private ipc directory)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if marker in cmd and int(pid) != os.getpid():
            found.append(cmd)
    return found


def _wav(path: Path) -> tuple[int, np.ndarray]:
    with wave.open(str(path)) as w:
        assert (w.getnchannels(), w.getsampwidth()) == (1, 2)
        return w.getframerate(), np.frombuffer(w.readframes(w.getnframes()), "<i2")


def _expected_morse(words: list[str], **options: float) -> np.ndarray:
    sys.path.insert(0, str(EXAMPLE))
    try:
        import morse_demo
    finally:
        sys.path.remove(str(EXAMPLE))
    pcm = np.concatenate([morse_demo.morse_pcm(w, **options) for w in words])
    return (np.clip(pcm, -1.0, 1.0) * 32767).astype("<i2")


@pytest.mark.slow
@pytest.mark.processes
def test_the_worked_example_runs_through_the_trio_orch_command_in_worker_processes(tmp_path: Path) -> None:
    """As a user runs it: the console script, the example's directory on PYTHONPATH, both modes."""
    scratch = tmp_path / "scratch"  # the pipelines' private ipc directories go here
    scratch.mkdir()
    script = Path(sys.executable).with_name("trio-orch")
    command = [str(script)] if script.exists() else [sys.executable, "-m", "trio_orch.cli"]
    env = {**os.environ, "PYTHONPATH": str(EXAMPLE), "TMPDIR": str(scratch)}
    out = tmp_path / "morse.wav"
    proc = subprocess.run([*command, "generate", "Hello plug-ins", "--config", str(EXAMPLE / "morse.toml"),
                           "--out", str(out), "--compare"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("text: HELLO! PLUG-INS! \n") == 2  # stage by stage, then async-chunk
    assert proc.stdout.count("time to first audio") == 3
    rate, samples = _wav(out)
    assert rate == 8000
    assert np.array_equal(samples, _expected_morse(["HELLO", "PLUG-INS"], tone_hz=700.0, unit_ms=40.0))
    assert not os.listdir(scratch) and not _leftover_processes(str(scratch))


@pytest.mark.slow
@pytest.mark.processes
def test_workers_import_a_plug_in_from_where_the_parent_found_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """No PYTHONPATH: only this process's sys.path has the example, the workers get --python-path."""
    monkeypatch.delenv("PYTHONPATH", raising=False)
    monkeypatch.syspath_prepend(str(EXAMPLE))
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    out = tmp_path / "one.wav"
    cfg = load_config(EXAMPLE / "morse.toml")
    assert registry.source_root(cfg.stages[0].kind) == str(EXAMPLE)
    # the plug-ins declare sampling parameters: Shout a word limit, Morse a per-request pitch
    rc = cli.main(["generate", "hello plug-ins", "--config", str(EXAMPLE / "morse.toml"), "--out", str(out),
                   "--max-tokens", "1", "--stage-param", "1.tone_hz=500"])
    assert rc == 0
    assert "text: HELLO! \n" in capsys.readouterr().out
    rate, samples = _wav(out)
    assert rate == 8000 and np.array_equal(samples, _expected_morse(["HELLO"], tone_hz=500.0, unit_ms=40.0))
    assert not os.listdir(scratch) and not _leftover_processes(str(scratch))
