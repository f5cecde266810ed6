"""Where serve's API key and admin token come from: the flag, its file, systemd's credential, the environment.

The order, the files' rules (the secret alone, one trailing newline dropped; empty or unreadable is a
usage error, never "no key"), and the parser serve really uses.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import pytest

from trio_orch.serve import command
from trio_orch.serve.credentials import CREDENTIAL_FILES, read_secret_file, resolve


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    command.configure(parser)
    return parser.parse_args(list(argv))


def secret_file(path: Path, text: str, mode: int = 0o600) -> str:
    path.write_text(text)
    path.chmod(mode)
    return str(path)


def test_the_credential_file_names_are_the_documented_ones() -> None:
    assert CREDENTIAL_FILES == ("api-key", "admin-token")


def test_each_source_in_its_order(tmp_path: Path) -> None:
    creds = tmp_path / "creds"
    creds.mkdir()
    secret_file(creds / "api-key", "from-systemd\n")
    secret_file(creds / "admin-token", "token-from-systemd")
    env = {"CREDENTIALS_DIRECTORY": str(creds), "TRIO_ORCH_API_KEY": "from-env",
           "TRIO_ORCH_ADMIN_TOKEN": "token-from-env"}
    args = parse()
    resolve(args, env)
    assert (args.api_key, args.admin_token) == ("from-systemd", "token-from-systemd")
    args = parse("--api-key-file", secret_file(tmp_path / "k", "from-file\n"), "--admin-token", "from-flag")
    resolve(args, env)
    assert (args.api_key, args.admin_token) == ("from-file", "from-flag")
    (creds / "api-key").unlink()  # a unit that gives one credential: the other comes from further down
    args = parse()
    resolve(args, env)
    assert (args.api_key, args.admin_token) == ("from-env", "token-from-systemd")
    args = parse()
    resolve(args, {})
    assert (args.api_key, args.admin_token) == (None, None)  # none: open, and no /admin


def test_vllms_variable_gives_the_api_key_last(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A launch script written for ``vllm serve`` sets ``$VLLM_API_KEY``: read after everything else."""
    args = parse()
    resolve(args, {"VLLM_API_KEY": "from-vllm"})
    assert args.api_key == "from-vllm"
    args = parse("--api-key-file", secret_file(tmp_path / "k", "from-file"))
    resolve(args, {"VLLM_API_KEY": "from-vllm"})
    assert args.api_key == "from-file"
    with caplog.at_level(logging.WARNING, logger="trio_orch.serve.credentials"):
        args = parse()
        resolve(args, {"VLLM_API_KEY": "from-vllm", "TRIO_ORCH_API_KEY": "from-env"})
    assert args.api_key == "from-env"
    assert "$TRIO_ORCH_API_KEY and $VLLM_API_KEY hold different API keys" in caplog.text
    args = parse()
    resolve(args, {"VLLM_API_KEY": "k", "TRIO_ORCH_API_KEY": "k"})  # the same key twice: no warning
    assert args.api_key == "k"


@pytest.mark.parametrize(("argv", "message"), [
    (["--api-key", "k", "--api-key-file", "f"], "give --api-key or --api-key-file, not both"),
    (["--api-key", " "], "may not be empty"),
    (["--admin-token-file", "/nonexistent/token"], "cannot read the admin token from /nonexistent/token"),
])
def test_a_bad_source_is_a_usage_error_that_names_it(argv: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        resolve(parse(*argv), {})


@pytest.mark.parametrize(("text", "message"), [("\n", "is empty"), ("", "is empty"),
                                               ("one\ntwo\n", "more than one line")])
def test_a_file_holds_the_secret_alone(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        read_secret_file(secret_file(tmp_path / "k", text), "API key")


def test_a_credential_file_that_is_empty_is_an_error_not_an_open_server(tmp_path: Path) -> None:
    secret_file(tmp_path / "api-key", "")
    with pytest.raises(ValueError, match="is empty"):
        resolve(parse(), {"CREDENTIALS_DIRECTORY": str(tmp_path), "TRIO_ORCH_API_KEY": "from-env"})


def test_a_file_other_users_can_read_is_used_with_a_warning(tmp_path: Path,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="trio_orch.serve.credentials"):
        assert read_secret_file(secret_file(tmp_path / "k", "key\n", 0o644), "API key") == "key"
    assert "readable by other users (mode 644): chmod 600 it" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="trio_orch.serve.credentials"):
        assert read_secret_file(secret_file(tmp_path / "k2", "key", 0o600), "API key") == "key"
    assert caplog.text == ""
