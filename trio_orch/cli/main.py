"""The ``trio-orch`` command line: one subcommand per job, each loaded only when it runs.

A command is a :class:`Command`: the module that provides ``configure(parser)``
(add its options) and ``run(args) -> int``, and a one-line help.  The
product's own commands are listed in :data:`COMMANDS`; other packages add
theirs through the ``trio_orch.commands`` entry-point group (the benchmark,
comparison and chaos commands come from ``bench`` that way), naming a
``Command`` in a module that imports nothing heavy.  ``trio-orch --help``
imports no command module; ``trio-orch NAME ...`` imports that one alone, so
a broken or slow command never gets in the way of another.

Exit codes, the same for every command: 0 done, 1 failed, 2 bad command
line or config (an argument nobody takes: one line, with the nearest flag),
:data:`EXIT_SIGNAL` (130) stopped by Ctrl-C -- and, for ``generate``, by
SIGTERM too.  ``serve`` exits as uvicorn and ``vllm serve`` do: 0 after a
signal's clean drain, 1 when the drain was cut short.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import importlib.metadata
import logging
import re
import signal
import sys
import threading
from dataclasses import dataclass

from stages.lockdown import LockdownError, lock_down
from trio_orch.serve.signals import EXIT_SIGNAL

__all__ = ["COMMANDS", "Command", "build_parser", "commands", "main", "program"]

ENTRY_POINT_GROUP = "trio_orch.commands"

log = logging.getLogger("trio_orch.cli")


@dataclass(frozen=True, slots=True)
class Command:
    """A subcommand: the module that implements it and its one-line help; ``interrupted``: its exit code
    when SIGINT or SIGTERM stops it before it takes them over (the shell's Ctrl-C code; ``serve``: 0, as
    after its drain -- nothing was accepted yet)."""

    module: str
    help: str
    interrupted: int = EXIT_SIGNAL


#: the product's own subcommands
COMMANDS: dict[str, Command] = {
    "ctl": Command("trio_orch.cli.ctl",
                   "control a running server (--admin-token): stats, pause, sleep/wake, reload weights"),
    "demo": Command("trio_orch.cli.demo",
                    "in-process 3-stage pipeline, no processes or torch: print routed outputs"),
    "generate": Command("trio_orch.cli.generate",
                        "text + speech (WAV) for a prompt through the ZMQ stage workers"),
    "serve": Command("trio_orch.serve.command",
                     "serve the pipeline over HTTP in OpenAI's and vLLM's dialect (a 'vllm serve' launch "
                     "line works)", interrupted=0),
    "worker": Command("trio_orch.cli.worker",
                      "a stage replica that joins a running orchestrator over TCP (--head)"),
    "keys": Command("trio_orch.cli.keys", "make the CurveZMQ key pairs of a head and its workers"),
}


def commands() -> dict[str, Command]:
    """The product's commands, then those registered by installed packages (entry points)."""
    found = dict(COMMANDS)
    for ep in sorted(importlib.metadata.entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
        if ep.name in found:
            continue
        try:
            cmd = ep.load()
        except Exception as exc:  # a broken plug-in must not break the other commands
            log.warning("command %r (%s) could not be loaded: %r", ep.name, ep.value, exc)
            continue
        if isinstance(cmd, Command):
            found[ep.name] = cmd
        else:
            log.warning("entry point %r (%s) is not a trio_orch.cli.Command", ep.name, ep.value)
    return found


class Parser(argparse.ArgumentParser):
    """The ``trio-orch`` parser; ``subcommands`` maps each command's name to its own parser."""

    subcommands: dict[str, argparse.ArgumentParser]


def build_parser(available: dict[str, Command], configure: str | None = None) -> Parser:
    """The parser; only ``configure`` (a command name) gets its options, by importing its module.

    No option is ever taken for a longer one it begins (``allow_abbrev=False``): ``serve --model X``
    is never ``--model-name X``."""
    parser = Parser(
        prog="trio-orch", allow_abbrev=False,
        description=(
            "trio-orch: a Trio (structured concurrency) orchestrator for multi-stage inference "
            "pipelines (thinker -> talker -> vocoder), with ZeroMQ stage workers, an asyncio "
            "reference, and benchmarks comparing the two."
        ),
        epilog="Run 'trio-orch COMMAND --help' for the options of one command.",
    )
    parser.add_argument("-v", "--verbose", action="count", default=0,
                        help="more log output (-v info, -vv debug)")
    parser.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    parser.subcommands = {}
    for name, cmd in available.items():
        p = parser.subcommands[name] = sub.add_parser(name, help=cmd.help, description=cmd.help,
                                                      allow_abbrev=False)
        p.add_argument("-v", "--verbose", action="count", default=0, dest="sub_verbose",
                       help=argparse.SUPPRESS)
        if name == configure:
            importlib.import_module(cmd.module).configure(p)
    return parser


def version() -> str:
    try:
        return importlib.metadata.version("trio-orch")
    except importlib.metadata.PackageNotFoundError:  # running from a source tree
        from trio_orch import __version__

        return __version__


def main(argv: list[str] | None = None) -> int:
    # Importing a command takes a while: a SIGTERM meanwhile ends us like Ctrl-C (its exit code: the
    # command's ``interrupted``), not with a bare kill -- and so until the command takes SIGTERM over
    # (serve drains), which it does only once it has parsed and checked its options: the handler stays
    # until the command returns.
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _sigterm_as_ctrl_c) if main_thread else None
    interrupted = EXIT_SIGNAL
    try:
        try:
            argv = list(sys.argv[1:] if argv is None else argv)
            available = commands()
            chosen = next((a for a in argv if not a.startswith("-")), None)
            parser = build_parser(available, configure=chosen if chosen in available else None)
            args, extra = parser.parse_known_args(argv)
            if extra:
                return _unrecognized(parser, args.command, extra)
            if not args.command:
                parser.print_help()
                return 2
            verbosity = args.verbose + getattr(args, "sub_verbose", 0)
            level = logging.WARNING if verbosity == 0 else logging.INFO if verbosity == 1 else logging.DEBUG
            logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
            interrupted = available[args.command].interrupted
            module = importlib.import_module(available[args.command].module)
            return int(module.run(args) or 0)
        finally:
            if main_thread:
                signal.signal(signal.SIGTERM, previous)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return interrupted


def program() -> int:
    """The ``trio-orch`` program (the console script, ``python -m trio_orch.cli``): :func:`main` in a
    process locked down first.

    Before the command line is parsed or any secret read, the process is closed to the other processes
    of its user and goes on in a fresh child (:func:`stages.lockdown.lock_down`, ``fresh``): ``serve``
    holds the API key, the admin token and the pipeline's credentials, and a ``/proc/<pid>/mem`` opened
    between ``exec`` and this line would read them for as long as the process lives.  The launched
    process stays as the child's stand-in (it passes signals on and exits as the child does:
    :func:`stages.lockdown.serving_pid` finds the child).  :func:`main` alone leaves its process as it is
    (tests call it in theirs).
    """
    try:
        lock_down(fresh=True)
    except LockdownError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return main()


#: a flag in a usage line
_FLAG = re.compile(r"(?<![\w-])(--?[A-Za-z][\w-]*)")


def _unrecognized(parser: Parser, command: str | None, extra: list[str]) -> int:
    """One line for arguments nobody took, with the nearest flag of the command when one is close."""
    own = parser.subcommands.get(command or "", parser)
    flags = _FLAG.findall(own.format_usage())  # the flags it shows (a hidden one is never suggested)
    first = next((a for a in extra if a.startswith("-")), extra[0]).split("=")[0]
    near = difflib.get_close_matches(first, flags, n=1, cutoff=0.6)
    hint = f" (did you mean {near[0]}?)" if near else f" (see '{own.prog} --help')"
    print(f"{own.prog}: error: unrecognized arguments: {' '.join(extra)}{hint}", file=sys.stderr)
    return 2


def _sigterm_as_ctrl_c(signum: int, frame: object) -> None:
    raise KeyboardInterrupt("SIGTERM")

