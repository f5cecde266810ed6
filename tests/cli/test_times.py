"""Every time given on a command line or in a config is a finite number of seconds, never negative.

``nan`` passes every comparison a range check makes with ``<`` and ``inf`` is
above any minimum: both once started a server whose drain then crashed, or
workers that failed later.  One rule (``stages.schema.Seconds``) refuses them:
a flag with a usage error (exit 2) while the command line is parsed, a config
key naming its path, an HTTP limit when it is made.
"""

from __future__ import annotations

import argparse
from typing import Any

import pytest

from stages import headless, worker
from stages.config import from_dict
from stages.schema import MAX_SECONDS, positive_seconds_arg, seconds_arg
from trio_orch.cli.main import main
from trio_orch.http.limits import HTTPLimits

NOT_TIMES = ["nan", "inf", "-inf", "-1", "1e400", "soon"]

#: every time flag of serve: (flag, whether 0 is allowed)
SERVE_TIMES = [("--request-timeout", True), ("--startup-timeout", False), ("--shutdown-timeout", True),
               ("--restart-window", False), ("--priority-aging", False), ("--admission-timeout", True),
               ("--body-timeout", False), ("--header-timeout", False), ("--keep-alive-timeout", False)]


@pytest.mark.parametrize("value", NOT_TIMES)
@pytest.mark.parametrize(("flag", "zero_ok"), SERVE_TIMES)
def test_serve_refuses_a_time_that_is_not_a_finite_number_of_seconds_before_anything_starts(
        flag: str, zero_ok: bool, value: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["serve", "--port", "0", f"{flag}={value}"])
    assert exc.value.code == 2
    captured = capsys.readouterr()
    assert f"argument {flag}: must be a finite number of seconds" in captured.err
    assert repr(value) in captured.err and "starting" not in captured.out


@pytest.mark.parametrize(("flag", "zero_ok"), SERVE_TIMES)
def test_zero_is_a_time_only_where_it_means_something(flag: str, zero_ok: bool) -> None:
    parse = seconds_arg if zero_ok else positive_seconds_arg
    assert parse("2.5") == 2.5
    if zero_ok:
        assert parse("0") == 0.0
    else:
        with pytest.raises(argparse.ArgumentTypeError, match="> 0"):
            parse("0")


@pytest.mark.parametrize("argv", [
    ["generate", "Hi", "--join-timeout", "nan"],
    ["ctl", "--timeout", "inf", "stats"],
    ["chaos", "--request-timeout", "nan"],
])
def test_the_other_commands_refuse_them_too(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2 and "must be a finite number of seconds" in capsys.readouterr().err


@pytest.mark.parametrize(("parser", "argv"), [
    (worker.build_parser, ["--connect", "ipc:///x", "--heartbeat-interval", "nan"]),
    (worker.build_parser, ["--connect", "ipc:///x", "--startup-delay", "inf"]),
    (headless.build_parser, ["--stage", "0", "--head", "tcp://h:1", "--head-timeout", "nan"]),
    (headless.build_parser, ["--stage", "0", "--head", "tcp://h:1", "--leave-grace", "inf"]),
])
def test_worker_flags_refuse_them(parser: Any, argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        parser().parse_args(argv)
    assert exc.value.code == 2 and "must be a finite number of seconds" in capsys.readouterr().err


@pytest.mark.parametrize(("key", "value", "message"), [
    ("startup_timeout", float("nan"), "pipeline.startup_timeout: expected `float` > 0.0"),
    ("heartbeat_timeout", float("inf"), f"pipeline.heartbeat_timeout: expected `float` <= {MAX_SECONDS}"),
    ("stop_grace", float("nan"), "pipeline.stop_grace: expected `float` >= 0"),
    ("heartbeat_interval", -1.0, "pipeline.heartbeat_interval: expected `float` >= 0"),
])
def test_a_config_time_that_is_not_finite_is_refused_naming_its_key(key: str, value: float,
                                                                     message: str) -> None:
    with pytest.raises(ValueError, match="pipeline config") as exc:
        from_dict({"pipeline": {key: value}, "stages": [{"kind": "echo"}]})
    assert message in str(exc.value)


@pytest.mark.parametrize("field", ["body_timeout", "header_timeout", "keep_alive_timeout"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), 0.0, -1.0])
def test_http_limits_refuse_a_time_that_is_not_finite_and_positive(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=f"^{field}: expected `float`"):
        HTTPLimits(**{field: value})
