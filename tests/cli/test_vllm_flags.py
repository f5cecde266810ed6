"""A ``vllm serve`` launch line works with the command's name changed: vLLM's flags, parsed as ``trio-orch``.

Parsed as the ``trio-orch`` command parses them (no process started here):
the flags that mean something keep vLLM's meaning and default; one that
means nothing here is one line naming it and why, exit 2; a flag mistyped
gets the nearest one; none is ever abbreviated.
"""

from __future__ import annotations

import argparse
import importlib
import logging

import pytest

from trio_orch.cli.main import build_parser, commands, main
from trio_orch.http.access import Cors
from trio_orch.http.generation import CutPrompt
from trio_orch.serve import vllm_flags
from trio_orch.serve.checkpoint import resolve_model
from trio_orch.serve.command import front_app
from trio_orch.serve.vllm_flags import REFUSED

#: a stock vLLM launch line, as a team runs ``vllm serve`` today
STOCK = ["DIR", "--max-num-seqs", "8", "--max-model-len", "256", "--disable-log-requests",
         "--uvicorn-log-level", "warning"]


def serve_args(*argv: str) -> argparse.Namespace:
    args = build_parser(commands(), configure="serve").parse_args(["serve", *argv])
    resolve_model(args)
    return args


def refused(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """The one line ``trio-orch serve ARGV`` exits 2 with."""
    with pytest.raises(SystemExit) as info:
        main(["serve", *argv])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "usage:" not in err, err
    return err


def test_a_stock_vllm_launch_line_parses_with_vllms_meaning() -> None:
    args = serve_args(*STOCK)
    assert (args.model_dir, args.max_num_seqs, args.max_model_len) == ("DIR", 8, 256)
    flags = vllm_flags.check(args)
    assert flags.log_level == logging.WARNING and not flags.log_requests and flags.access_log
    assert flags.cors == Cors(("*",), ("*",), ("*",), False) and flags.log_stats  # vLLM's defaults
    assert serve_args("--model", "X").model_dir == "X"  # never taken as --model-name
    assert serve_args("--model", "X").served_model_name == ["X"]
    more = vllm_flags.check(serve_args("--enable-log-requests", "--max-log-len", "5", "--disable-log-stats",
                                       "--disable-uvicorn-access-log", "--root-path", "/api/",
                                       "--allowed-origins", '["https://a.example"]', "--allow-credentials",
                                       "--tensor-parallel-size", "1", "-pp", "1", "--api-server-count", "1",
                                       "--enforce-eager", "--no-enable-prefix-caching",
                                       "--no-enable-chunked-prefill", "--disable-fastapi-docs"))
    assert more.log_requests and more.max_log_len == 5 and not more.log_stats and not more.access_log
    assert more.root_path == "/api" and more.cors.origins == ("https://a.example",) and more.cors.credentials
    assert not more.docs and flags.docs


@pytest.mark.parametrize("argv", [["--tensor-parallel-size", "2"], ["-tp", "4"],
                                  ["--data-parallel-size", "2"], ["--gpu-memory-utilization", "0.9"],
                                  ["--enable-prefix-caching"], ["--quantization", "awq"],
                                  ["--trust-remote-code"]])
def test_a_vllm_flag_that_means_nothing_here_is_one_line_naming_it_and_why(
        argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    err = refused(capsys, *argv)
    assert err.startswith(f"trio-orch serve: error: {argv[0]}") and ": " in err.split(argv[0], 1)[1]


def test_every_refused_flag_says_why() -> None:
    assert all(len(why) > 20 for why in REFUSED.values())
    assert "--tensor-parallel-size" not in REFUSED  # 1 is taken: a size is refused by its value


def test_a_mistyped_flag_gets_the_nearest_one_and_none_is_abbreviated(
        capsys: pytest.CaptureFixture[str]) -> None:
    for given, near in (("--max-num", "--max-num-seqs"), ("--uvicorn-loglevel", "--uvicorn-log-level"),
                        ("--max-num-seq", "--max-num-seqs"), ("--allowed-origin", "--allowed-origins")):
        assert main(["serve", given, "8"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("trio-orch serve: error: unrecognized arguments")
        assert f"did you mean {near}?" in err


@pytest.mark.parametrize(("argv", "says"), [
    (["--allowed-origins", "https://a.example"], "takes a JSON list of strings"),
    (["--allowed-headers", "[1]"], "takes a JSON list of strings"),
])
def test_the_cors_flags_take_json_lists_as_vllms(argv: list[str], says: str,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        serve_args(*argv)
    assert says in capsys.readouterr().err


@pytest.mark.parametrize(("argv", "says"), [
    (["--max-num-seqs", "0"], "--max-num-seqs must be >= 1"),
    (["--ssl-keyfile", "k.pem", "--ssl-certfile", "c.pem", "--loop", "trio"], "does not speak TLS"),
    (["--ssl-keyfile", "k.pem"], "needs both"),
    (["--root-path", "api"], "must start with '/'"),
    (["--in-process", "--seed", "3"], "--seed seeds a worker pipeline"),
])
def test_bad_values_exit_2_before_anything_starts(argv: list[str], says: str,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--port", "0", *argv]) == 2
    assert says in capsys.readouterr().err


def test_tls_on_the_asyncio_front_is_uvicorns() -> None:
    args = serve_args("--ssl-keyfile", "k.pem", "--ssl-certfile", "c.pem", "--loop", "asyncio")
    flags = vllm_flags.check(args)
    assert flags.ssl == {"ssl_keyfile": "k.pem", "ssl_certfile": "c.pem", "ssl_ca_certs": None,
                         "ssl_cert_reqs": 0}


def test_max_log_len_cuts_the_prompt_of_a_request_line() -> None:
    record = logging.LogRecord("trio_orch.requests", logging.INFO, __file__, 1,
                               "received request %s (%s): prompt: %r, sampling: %s, priority: %d",
                               ("r1", "/v1/completions", "a long prompt", {}, 0), None)
    assert CutPrompt(6).filter(record) and record.getMessage().startswith(
        "received request r1 (/v1/completions): prompt: 'a long',")


def test_serve_help_names_the_routes_and_vllms_flags(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for word in ("/v1/completions", "/v1/audio/speech", "/tokenize", "/openapi.json", "--max-num-seqs",
                 "--disable-uvicorn-access-log", "--allowed-origins", "$VLLM_API_KEY",
                 "0 stopped after a clean"):
        assert word in text, word


@pytest.mark.parametrize(("command", "code"), [("serve", 0), ("generate", 130)])
def test_a_signal_before_the_command_takes_signals_over_exits_with_its_code(
        command: str, code: int, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """Stopped while it loads (nothing accepted yet): ``serve`` exits 0 as after a clean drain,
    ``generate`` with the shell's Ctrl-C code."""
    module = importlib.import_module(commands()[command].module)

    def interrupted(args: argparse.Namespace) -> int:
        raise KeyboardInterrupt("SIGTERM")

    monkeypatch.setattr(module, "run", interrupted)
    assert main([command, "hi"] if command == "generate" else [command]) == code
    assert "interrupted" in capsys.readouterr().err


def test_api_server_count_is_vllms_flag_and_its_fronts_run_either_loop(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert serve_args("-asc", "3").api_server_count == 3 and serve_args().api_server_count == 1
    args = serve_args("--api-server-count", "2", "--in-process")
    front_app(args)  # what checks the command line
    assert args.loop == "trio"  # without --loop, the fronts' loop
    args = serve_args("--api-server-count", "2", "--in-process", "--loop", "asyncio")
    front_app(args)
    assert args.loop == "asyncio"  # as given: the fronts serve with uvicorn
    # TLS is the asyncio front's: the fronts' default loop (trio) refuses it, as one process's does
    tls = ["--ssl-keyfile", "k.pem", "--ssl-certfile", "c.pem"]
    assert main(["serve", "--api-server-count", "2", *tls]) == 2
    assert "does not speak TLS: use --loop asyncio" in capsys.readouterr().err
    args = serve_args("--in-process")
    front_app(args)
    assert args.loop == "asyncio"
    assert main(["serve", "--api-server-count", "0"]) == 2
    assert "--api-server-count must be >= 1" in capsys.readouterr().err

