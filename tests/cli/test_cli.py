"""The command line as a user meets it: help texts and the in-process demo."""

from __future__ import annotations

import subprocess
import sys

import pytest

from trio_orch.cli import commands, main


def test_top_level_help_lists_every_command(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    for name in commands():
        assert name in text
    assert "Trio" in text


def test_no_command_prints_help_and_fails(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    assert "COMMAND" in capsys.readouterr().out


def test_demo_help_explains_options(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    text = capsys.readouterr().out
    assert "--delay-ms" in text and "in-process" in text


@pytest.mark.processes
def test_demo_streams_every_request_to_its_terminal() -> None:
    proc = subprocess.run([sys.executable, "-m", "trio_orch.cli", "demo", "--delay-ms", "1", "a b c", "d e"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "entry point" not in proc.stderr, proc.stderr  # bench's commands load under -m too
    lines = proc.stdout.splitlines()
    assert sum("[finished]" in ln for ln in lines) == 2
    assert any("req-0 stage 0 text  'a'" in ln for ln in lines)
    assert any("req-1 stage 2 audio" in ln for ln in lines)
    assert lines[-1].startswith("done: 2 requests, dropped outputs: 0")


@pytest.mark.processes
def test_public_api_is_lazy_and_a_worker_process_never_imports_trio() -> None:
    code = ("import sys, stages.worker, trio_orch\n"
            "assert 'trio' not in sys.modules, 'the worker imported trio'\n"
            "assert 'torch' not in sys.modules, 'the echo worker imported torch'\n"
            "from trio_orch import Orchestrator, OrchOutput, open_orchestrator\n"
            "assert 'trio' in sys.modules and Orchestrator.__module__ == 'trio_orch.shell.orchestrator'\n"
            "import trio_orch as t; assert sorted(t.__all__) == sorted(set(dir(t)) & set(t.__all__))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.processes
def test_commands_load_lazily_and_bench_registers_its_own() -> None:
    """--help imports no command module; running one imports that one; bench comes in by entry point."""
    code = ("import sys\n"
            "from trio_orch.cli import COMMANDS, commands, main\n"
            "names = set(commands())\n"
            "bench = {'bench', 'chaos', 'compare'}\n"
            "assert bench <= names and not bench & set(COMMANDS)\n"
            "try:\n"
            "    main(['--help'])\n"
            "except SystemExit:\n"
            "    pass\n"
            "loaded = [m for m in ('trio_orch.serve.command', 'trio_orch.cli.generate', 'bench.perf.cli',"
            " 'torch')"
            " if m in sys.modules]\n"
            "assert not loaded, loaded\n"
            "try:\n"
            "    main(['demo', '--help'])\n"
            "except SystemExit:\n"
            "    pass\n"
            "assert 'trio_orch.cli.demo' in sys.modules and 'bench.perf.cli' not in sys.modules\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0 and capsys.readouterr().out.startswith("trio-orch 0.")


@pytest.mark.parametrize(("argv", "flag"), [
    (["--loop", "trio", "--http-server", "hypercorn"], "--http-server"),
    (["--http-server", "lean"], "--http-server"), (["--http-server"], "--http-server"),
    (["--max-accept-wait", "5"], "--max-accept-wait")])
def test_a_removed_serve_flag_is_a_usage_error_that_says_so(argv: list[str], flag: str,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    """Whatever value it comes with: exit 2 before anything starts, never silently ignored."""
    with pytest.raises(SystemExit) as exc:
        main(["serve", "--port", "0", *argv])
    assert exc.value.code == 2
    captured = capsys.readouterr()
    assert f"{flag} was removed" in captured.err and "starting" not in captured.out


@pytest.mark.parametrize(("argv", "message"), [
    (["--request-queue-size", "-1"], "--request-queue-size must be >= 0"),
    (["--replicas", "0"], "--replicas must be >= 1"),
    (["--port", "99999"], "--port must be 0..65535"),
    (["--port", "-1"], "--port must be 0..65535"),
    (["--max-body-reads", "0"], "max_body_reads: expected `int` >= 1, got 0"),
    (["--min-body-rate", "-1"], "min_body_rate: expected `int` >= 0, got -1"),
    (["--api-key", " "], "--api-key: the key may not be empty"),
    (["--api-key", "k", "--api-key-file", "f"], "give --api-key or --api-key-file, not both"),
    (["--admin-token-file", "/nonexistent/token"], "cannot read the admin token from /nonexistent/token"),
    (["--served-model-name", "m1", ""], "--served-model-name: a name may not be empty"),
])
def test_serve_refuses_bad_arguments_before_it_listens_or_starts_a_worker(
        argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--port", "0", *argv]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], err
    assert "starting" not in captured.out
