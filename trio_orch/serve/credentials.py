"""Where ``serve`` gets its own secrets, the API key and the admin token: files first.

Each secret comes from the first of these that gives it:

1. ``--api-key KEY`` / ``--admin-token TOKEN`` -- on the command line, which
   every process on the host can read (``ps``): for tests and throwaway runs;
2. ``--api-key-file FILE`` / ``--admin-token-file FILE`` (not with 1.);
3. systemd's credentials: ``$CREDENTIALS_DIRECTORY/api-key`` and
   ``$CREDENTIALS_DIRECTORY/admin-token`` (:data:`CREDENTIAL_FILES`; a unit's
   ``LoadCredential=api-key:/etc/trio-orch/api-key`` puts them there, readable
   by the service alone);
4. the environment: ``$TRIO_ORCH_API_KEY`` / ``$TRIO_ORCH_ADMIN_TOKEN``;
5. for the API key, vLLM's variable last: ``$VLLM_API_KEY`` (a launch
   script written for ``vllm serve`` keeps working; with both variables set
   and different, ``$TRIO_ORCH_API_KEY`` wins and a warning says so).

A file holds the secret alone; one trailing newline is dropped.  Prefer a
file (2. or 3.) to the environment: ``serve`` locks itself down and goes on
in a fresh child before it reads any (:func:`stages.lockdown.lock_down`: no
other process of the user can read the child's memory or environment), but
its environment is what it got at ``exec``: readable until then -- and, by a
process that opened it then, for as long as it runs -- and to root.
A file readable by other users is used with a warning.  An empty or
unreadable file is an error (exit 2), never "no key".

Client commands (``trio-orch ctl``) read the same variables and files from
here, without importing the HTTP app.
"""

from __future__ import annotations

import argparse
import logging
import os
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "API_KEY_ENV",
    "CREDENTIALS_DIRECTORY",
    "CREDENTIAL_FILES",
    "SECRETS",
    "TOKEN_ENV",
    "VLLM_API_KEY_ENV",
    "Secret",
    "add_arguments",
    "read_secret_file",
    "resolve",
]

log = logging.getLogger("trio_orch.serve.credentials")

#: the environment variable ``serve`` reads the API key from when nothing before it gives one
API_KEY_ENV = "TRIO_ORCH_API_KEY"
#: vLLM's variable for the API key, read after :data:`API_KEY_ENV`
VLLM_API_KEY_ENV = "VLLM_API_KEY"
#: the environment variable ``serve`` and ``ctl`` read the admin token from when nothing before it gives one
TOKEN_ENV = "TRIO_ORCH_ADMIN_TOKEN"

#: systemd's variable naming the directory of the unit's credentials (LoadCredential=, SetCredential=)
CREDENTIALS_DIRECTORY = "CREDENTIALS_DIRECTORY"


@dataclass(frozen=True)
class Secret:
    """One secret of ``serve``: its option (``--NAME``, ``--NAME-file``), credential file and variable."""

    dest: str  #: the attribute of the parsed arguments
    what: str  #: what it is called in messages
    option: str  #: ``--api-key``; the file option is this plus ``-file``
    credential: str  #: its file name under ``$CREDENTIALS_DIRECTORY``
    env: str  #: the environment variable read after the files
    also: tuple[str, ...] = ()  #: more variables read after ``env``, in order (another server's names)

    @property
    def file_option(self) -> str:
        return f"{self.option}-file"

    @property
    def file_dest(self) -> str:
        return f"{self.dest}_file"


SECRETS = (
    Secret("api_key", "API key", "--api-key", "api-key", API_KEY_ENV, (VLLM_API_KEY_ENV,)),
    Secret("admin_token", "admin token", "--admin-token", "admin-token", TOKEN_ENV),
)
#: the credential names a systemd unit gives ``serve`` (``LoadCredential=NAME:PATH``)
CREDENTIAL_FILES = tuple(s.credential for s in SECRETS)


def add_arguments(parser: argparse.ArgumentParser, secret: Secret, help: str, unset: str) -> None:
    """``--NAME`` and ``--NAME-file`` of ``secret``; ``help`` says what it does, ``unset`` what happens
    without it."""
    metavar = secret.what.split()[-1].upper()
    variables = ", else ".join(f"${v}" for v in (secret.env, *secret.also))
    parser.add_argument(secret.option, dest=secret.dest, default=None, metavar=metavar,
                        help=f"{help}. Taken from here, else {secret.file_option}, else systemd's credential "
                             f"${CREDENTIALS_DIRECTORY}/{secret.credential}, else {variables}; none: "
                             f"{unset}. Prefer a file: every user can read a command line in ps "
                             "(docs/operating.md: Secrets)")
    parser.add_argument(secret.file_option, dest=secret.file_dest, default=None, metavar="FILE",
                        help=f"read the {secret.what} from FILE (the secret alone; a trailing newline is "
                             f"dropped)")


def read_secret_file(path: str | os.PathLike[str], what: str) -> str:
    """The secret in ``path``; ValueError naming the file if it cannot be read or holds nothing."""
    p = Path(path)
    try:
        text = p.read_text()
        mode = p.stat().st_mode
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read the {what} from {p}: {exc}") from None
    value = text[:-1] if text.endswith("\n") else text
    if not value.strip():
        raise ValueError(f"{p} is empty: it must hold the {what}")
    if "\n" in value:
        raise ValueError(f"{p} holds more than one line: it must hold the {what} alone")
    if mode & (stat.S_IRGRP | stat.S_IROTH):
        log.warning("%s (the %s) is readable by other users (mode %o): chmod 600 it", p, what,
                    stat.S_IMODE(mode))
    return value


def _one(args: argparse.Namespace, secret: Secret, environ: Mapping[str, str]) -> str | None:
    given, file = getattr(args, secret.dest, None), getattr(args, secret.file_dest, None)
    if given is not None and file is not None:
        raise ValueError(f"give {secret.option} or {secret.file_option}, not both")
    if given is not None:
        if not given.strip():
            raise ValueError(f"{secret.option}: the {secret.what.split()[-1]} may not be empty (leave it out "
                             "to serve without one)")
        return str(given)
    if file is not None:
        return read_secret_file(file, secret.what)
    directory = environ.get(CREDENTIALS_DIRECTORY)
    if directory and (Path(directory) / secret.credential).exists():
        return read_secret_file(Path(directory) / secret.credential, secret.what)
    found = [(v, environ[v]) for v in (secret.env, *secret.also) if environ.get(v)]
    if not found:
        return None
    if len({value for _, value in found}) > 1:
        log.warning("$%s and $%s hold different %ss: $%s is used", found[0][0], found[1][0], secret.what,
                    found[0][0])
    return found[0][1]


def resolve(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> None:
    """Set ``args.api_key`` and ``args.admin_token`` from their sources (see the module docstring).

    Raises ValueError (a usage error) for a bad option or file.
    """
    env = os.environ if environ is None else environ
    for secret in SECRETS:
        setattr(args, secret.dest, _one(args, secret, env))
