"""``trio-orch generate`` and the pipeline config."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import tempfile
import wave
from pathlib import Path

import pytest
import soundfile

from stages.config import default_config, echo_config, load_config
from stages.lockdown import serving_pid
from tests.http_helpers import without_pyav
from trio_orch import cli
from trio_orch.cli.generate import out_format
from trio_orch.testing import child_pids, worker_alive

TINY_TOML = """
[pipeline]
final_stages = [0, 2]
seed = 3

[[stages]]
kind = "thinker"
[stages.model]
d_model = 32
layers = 1
heads = 2
max_new_tokens = 10
min_new_tokens = 10

[[stages]]
kind = "talker"
[stages.model]
d_model = 32
layers = 1
heads = 2

[[stages]]
kind = "code2wav"
[stages.model]
dim = 16
"""


@pytest.mark.slow
@pytest.mark.processes
def test_generate_compare_runs_both_modes_writes_a_wav_and_prints_timings(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = tmp_path / "tiny.toml"
    cfg.write_text(TINY_TOML)
    out = tmp_path / "hello.wav"
    scratch = tmp_path / "scratch"  # where the pipeline's private ipc directory goes
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    rc = cli.main(["generate", "Hello", "--out", str(out), "--config", str(cfg), "--compare"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "normal (stage by stage) mode" in text and "async-chunk mode" in text  # both ran
    assert text.count("time to first audio") == 3  # one per run + the comparison line
    assert "time to first audio: stage by stage" in text  # the comparison (no timing assert)
    with wave.open(str(out)) as w:
        assert (w.getnchannels(), w.getsampwidth(), w.getframerate()) == (1, 2, 24000)
        assert w.getnframes() == 10 * 2 * 480  # tokens x frames per token x hop
        assert any(w.readframes(w.getnframes()))
    assert not os.listdir(scratch)


def test_generate_reports_a_bad_config_clearly(tmp_path: Path, capsys) -> None:
    cfg = tmp_path / "bad.toml"
    cfg.write_text('[[stages]]\nkind = "vocoder"\n')
    assert cli.main(["generate", "Hi", "--config", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert "bad.toml" in err and "unknown kind 'vocoder'" in err


def test_default_config_is_thinker_talker_code2wav() -> None:
    cfg = default_config()
    assert [s.kind for s in cfg.stages] == ["thinker", "talker", "code2wav"]
    assert cfg.final_stage_ids == [0, 2] and not cfg.async_chunk and cfg.device == "cpu"
    cfg2 = cfg.with_overrides(async_chunk=True, replicas=3, device="cuda")
    assert cfg2.async_chunk and cfg2.device == "cuda" and all(s.replicas == 3 for s in cfg2.stages)
    assert cfg.stages[0].replicas == 1  # overrides copy


def test_load_config_parses_toml(tmp_path: Path) -> None:
    p = tmp_path / "p.toml"
    p.write_text(TINY_TOML)
    cfg = load_config(p)
    assert cfg.final_stage_ids == [0, 2] and cfg.seed == 3
    assert cfg.stages[0].model["max_new_tokens"] == 10


@pytest.mark.parametrize("toml, message", [
    ("[pipeline]\nasync_chunk = true\n", "at least one stage"),
    ('[[stages]]\nkind = "echo"\nreplicas = -1\n', r"stages\[0\]\.replicas: expected `int` >= 0"),
    ('[pipeline]\nfinal_stages = [3]\n[[stages]]\nkind = "echo"\n', "out of range"),
    ('[pipeline]\nbogus = 1\n[[stages]]\nkind = "echo"\n', "unknown key 'bogus' in pipeline"),
    ('[[stages]]\nkind = "echo"\ncolour = "red"\n', r"unknown key 'colour' in stages\[0\]"),
    ('[pipline]\nseed = 1\n[[stages]]\nkind = "echo"\n', "unknown table 'pipline'.*did you mean 'pipeline'"),
    ('[extras]\n[[stages]]\nkind = "echo"\n', "unknown table 'extras'"),
    ('[[stages]]\nkind = "echo"\nmax_batch = "8"\n', r"stages\[0\]\.max_batch: expected `int`, got `str`"),
    ('[[stages]]\nkind = "echo"\nmax_batch = 0\n', r"stages\[0\]\.max_batch: expected `int` >= 1"),
    ('[pipeline]\nheartbeat_timeout = "5"\n[[stages]]\nkind = "echo"\n',
     r"pipeline\.heartbeat_timeout: expected `float`, got `str`"),
    ('[pipeline]\ndevice = "gpu"\n[[stages]]\nkind = "echo"\n', r"pipeline\.device: expected `str` matching"),
    ('[[stages]]\nkind = "thinker"\n[stages.model]\nmax_new_tokens = "48"\n',
     "stage 0: model option 'max_new_tokens' of thinker: expected `int`, got `str`"),
    ('[[stages]]\nkind = "thinker"\n[stages.model]\nmax_new_tokens = -3\n',
     "stage 0: model option 'max_new_tokens' of thinker: expected `int` >= 1"),
    ("not toml [", "not valid TOML"),
])
def test_bad_configs_raise_value_error_naming_the_problem(tmp_path: Path, toml: str, message: str) -> None:
    p = tmp_path / "p.toml"
    p.write_text(toml)
    with pytest.raises(ValueError, match=message):
        load_config(p)


def test_echo_config_defaults() -> None:
    cfg = echo_config(3, replicas=2)
    assert [s.kind for s in cfg.stages] == ["echo"] * 3 and cfg.final_stage_ids == [2]
    assert all(s.replicas == 2 for s in cfg.stages)


@pytest.mark.parametrize(("argv", "message"), [
    (["generate", "   "], "the prompt is empty"),
    (["generate", "Hi", "--max-tokens", "0"], "--max-tokens must be between 1 and"),
    (["generate", "Hi", "--max-tokens", str(2**40)], "--max-tokens must be between 1 and"),
    (["generate", "Hi", "--out", "{tmp}/no/such/dir/out.wav"], "does not exist"),
    (["generate", "Hi", "--out", "{tmp}"], "is a directory"),
    (["generate", "Hi", "--out", "{tmp}/out.m4a"], ".m4a names no audio format this writes"),
    (["generate", "Hi", "--replicas", "0"], "--replicas must be >= 1"),
    (["generate", "Hi", "--listen", "tcp://127.0.0.1:7000"], "--listen needs --keys"),
    (["generate", "Hi", "--listen", "127.0.0.1:7000", "--keys", "{tmp}"], "--listen must be tcp://HOST:PORT"),
    (["generate", "Hi", "--listen", "tcp://127.0.0.1:7000", "--keys", "{tmp}/none"], "{tmp}/none"),
    (["generate", "Hi", "--join-timeout", "0"], "--join-timeout must be > 0"),
])
def test_generate_refuses_bad_arguments_before_any_worker_starts(
        argv: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main([a.format(tmp=tmp_path) for a in argv]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message.format(tmp=tmp_path) in err[0], err
    assert "starting workers" not in captured.err + captured.out


def test_out_names_the_audio_format_by_its_suffix_and_one_not_written_here_is_a_usage_error(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    assert [out_format(p) for p in (None, "a.wav", "b", "c.FLAC", "d.ogg", "e.opus", "f.mp3", "g.pcm")] == [
        "wav", "wav", "wav", "flac", "opus", "opus", "mp3", "pcm"]
    without_pyav(monkeypatch)
    assert cli.main(["generate", "Hi", "--out", str(tmp_path / "x.aac")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"--out {tmp_path / 'x.aac'}: 'aac' cannot be encoded here" in err[0], err
    assert "pip install 'trio-orch[audio]'" in err[0]


def test_trio_orch_version(capsys: pytest.CaptureFixture[str]) -> None:
    from importlib.metadata import version

    with pytest.raises(SystemExit) as done:
        cli.main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out.strip() == f"trio-orch {version('trio-orch')}"


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
@pytest.mark.processes
def test_generate_stopped_by_a_signal_exits_130_and_leaves_no_worker(sig: int, tmp_path: Path) -> None:
    cfg = tmp_path / "slow.toml"  # a slow echo stage: the signal comes while the request runs
    cfg.write_text('[pipeline]\nfinal_stages = [0]\n[[stages]]\nkind = "echo"\n'
                   'worker_args = ["--step-delay-ms", "100"]\n[stages.model]\noutputs = 200\n')
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    proc = subprocess.Popen([sys.executable, "-m", "trio_orch.cli", "generate", "Hi", "--config", str(cfg),
                             "--out", str(tmp_path / "o.wav")], cwd=Path(__file__).parents[2], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    assert proc.stdout is not None
    seen = b""
    while b"HiHi" not in seen:  # two outputs streamed: the request is running (200 would take 20 s)
        chunk = os.read(proc.stdout.fileno(), 4096)
        assert chunk, seen
        seen += chunk
    workers = child_pids(serving_pid(proc.pid))
    proc.send_signal(sig)
    rest, _ = proc.communicate(timeout=60)
    out = (seen + rest).decode()
    assert proc.returncode == 130, out
    assert f"{signal.Signals(sig).name}: stopping" in out
    assert not any(worker_alive(p) for p in workers)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["slow.toml"]  # no ipc directory left


def test_max_inflight_in_the_config_and_its_serving_default(tmp_path: Path) -> None:
    p = tmp_path / "p.toml"
    p.write_text('[[stages]]\nkind = "echo"\nmax_batch = 8\n[[stages]]\nkind = "echo"\nmax_inflight = 3\n'
                 '[[stages]]\nkind = "echo"\nmax_inflight = 0\n')
    cfg = load_config(p)
    assert cfg.admission_bounds(serving=True) == [8, 3, None]  # unset: max_batch; 0: no bound
    assert cfg.admission_bounds(serving=False) == [None, 3, None]
    p.write_text('[[stages]]\nkind = "echo"\nmax_inflight = -1\n')
    with pytest.raises(ValueError, match=r"stages\[0\]\.max_inflight: expected `int` >= 0"):
        load_config(p)


@pytest.mark.parametrize(("flags", "message"), [
    (["--temperature", "3"], "error: --temperature: 'temperature' must be in [0, 2], got 3.0"),
    (["--top-p", "0"], "error: --top-p: 'top_p' must be in (0, 1]"),
    (["--stage-param", "talker.temprature=1"],
     "error: --stage-param: stage_sampling.talker: talker takes no sampling parameter 'temprature'"),
    (["--stage-param", "talker=1"], "expected STAGE.KEY=VALUE"),
    (["--stage-param", "vocoder.voice=nova"],
     "no stage 'vocoder' (stages: 0 (thinker), 1 (talker), 2 (code2wav))"),
])
def test_generate_refuses_bad_sampling_flags_before_starting_workers(
        flags: list[str], message: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
        tmp_path: Path) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    assert cli.main(["generate", "Hi", *flags]) == 2
    captured = capsys.readouterr()
    assert message in captured.err and "starting workers" not in captured.err
    assert not os.listdir(tmp_path)


@pytest.mark.slow
@pytest.mark.processes
def test_generate_with_a_seed_is_reproducible_and_voices_differ(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "tiny.toml"
    cfg.write_text(TINY_TOML)

    def generate(name: str, *flags: str) -> tuple[str, bytes]:
        out = tmp_path / (name if "." in name else f"{name}.wav")
        assert cli.main(["generate", "Hello", "--out", str(out), "--config", str(cfg), *flags]) == 0
        text = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("text: "))
        return text, out.read_bytes()

    hot = ("--seed", "7", "--temperature", "1.0", "--stage-param", "talker.temperature=0.8")
    first = generate("a", *hot)
    assert generate("b", *hot) == first
    assert generate("c", *hot, "--async-chunk") == first  # the same in either mode
    nova = generate("d", *hot, "--voice", "nova")
    assert nova[0] == first[0] and nova[1] != first[1]
    text, flac = generate("e.flac", *hot)  # the suffix names the format: the same samples, losslessly
    with wave.open(io.BytesIO(first[1])) as w:
        frames = w.readframes(w.getnframes())
    samples, rate = soundfile.read(io.BytesIO(flac), dtype="int16")
    assert text == first[0] and rate == 24000 and samples.tobytes() == frames


@pytest.mark.slow
@pytest.mark.parametrize("async_chunk", [False, True], ids=["normal", "async_chunk"])
@pytest.mark.processes
def test_generate_stream_input_answers_each_line_of_stdin_in_one_request(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
        async_chunk: bool) -> None:
    import io
    import sys

    cfg = tmp_path / "tiny.toml"
    cfg.write_text(TINY_TOML)
    out = tmp_path / "talk.wav"
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    monkeypatch.setattr(sys, "stdin", io.StringIO("Hello\n\nHow are you?\nBye\n"))  # a blank line is skipped
    argv = ["generate", "--stream-input", "--out", str(out), "--config", str(cfg)]
    rc = cli.main(argv + (["--async-chunk"] if async_chunk else []))
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    lines = captured.out.splitlines()
    assert len(lines) == 3 and all(len(line) == 10 for line in lines)  # one answer line per segment
    with wave.open(str(out)) as w:
        assert w.getnframes() == 3 * 10 * 2 * 480  # three answers' audio in one file
    assert list(scratch.iterdir()) == []


def test_generate_stream_input_refuses_compare(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["generate", "--stream-input", "--compare"]) == 2
    assert "do not go together" in capsys.readouterr().err


def test_final_stage_ids_is_the_same_key_as_final_stages(tmp_path: Path) -> None:
    p = tmp_path / "p.toml"
    two = '[[stages]]\nkind = "echo"\n[[stages]]\nkind = "echo"\n'
    p.write_text("[pipeline]\nfinal_stage_ids = [0, 1]\n" + two)
    assert load_config(p).final_stage_ids == [0, 1]
    p.write_text("[pipeline]\nfinal_stages = [0]\nfinal_stage_ids = [1]\n" + two)
    with pytest.raises(ValueError, match="final_stages and final_stage_ids are one setting"):
        load_config(p)


@pytest.mark.parametrize("flags, named", [
    (["--size", "100x100"], "--size is"),
    (["--steps", "4", "--guidance-scale", "2"], "--steps, --guidance-scale are"),
])
def test_generate_refuses_image_options_on_a_speech_pipeline_before_any_worker_starts(
        flags: list[str], named: str, capsys: pytest.CaptureFixture[str]) -> None:
    # no processes mark: a worker started here would fail the test (tests/conftest.py)
    assert cli.main(["generate", "Hi", *flags]) == 2
    captured = capsys.readouterr()
    assert f"error: {named} for image pipelines (--pipeline text2image)" in captured.err
    assert "answers with audio and text, not an image" in captured.err
    assert "starting workers" not in captured.err


def test_generate_stream_input_with_no_input_exits_2_before_any_worker_starts(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    import io
    import sys

    monkeypatch.setattr(sys, "stdin", io.StringIO("\n  \n"))  # </dev/null, or only blank lines
    assert cli.main(["generate", "--stream-input"]) == 2
    captured = capsys.readouterr()
    assert "error: --stream-input read no line from standard input" in captured.err
    assert "starting workers" not in captured.err
