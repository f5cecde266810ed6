"""The ``trio-orch`` command line: one subcommand per job, loaded lazily.

Each entry of :data:`COMMANDS` names a module that provides
``configure(parser)`` (add its options) and ``run(args) -> int``.  Modules
are imported only when their subcommand runs, so ``trio-orch --help`` stays
fast and the orchestrator never imports torch unless a job needs it.

Exit codes, the same for every command: 0 done, 1 failed, 2 bad command
line or config, :data:`EXIT_SIGNAL` (130) stopped by Ctrl-C -- and, for
``generate`` and ``serve``, by SIGTERM too (``serve`` drains first).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import signal
import sys
import threading

#: the exit code of a command stopped by SIGINT (or SIGTERM): 128 + SIGINT, the shell's Ctrl-C code
EXIT_SIGNAL = 130

#: subcommand -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("trio_orch.demo", "in-process 3-stage pipeline, no processes or torch: print routed outputs"),
    "generate": ("trio_orch.generate", "text + speech (WAV) for a prompt through the ZMQ stage workers"),
    "bench": ("bench.perf.cli", "dispatch latency and throughput of every implementation, side by side"),
    "chaos": ("bench.chaos.cli", "fault matrix over real workers: kill -9, SIGSTOP, garbage, aborts, ..."),
    "compare": ("bench.compare.cli", "cancellation semantics measured: Trio vs. the asyncio references"),
    "serve": ("trio_orch.server", "serve the pipeline over HTTP: OpenAI-style chat completions with audio"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="trio-orch",
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
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(_module=module)
        p.add_argument("-v", "--verbose", action="count", default=0, dest="sub_verbose",
                       help=argparse.SUPPRESS)
        importlib.import_module(module).configure(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    # Importing the commands takes a while: a SIGTERM meanwhile ends us like Ctrl-C (130), not
    # with a bare kill.  Each command then handles SIGTERM its own way (serve drains).
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _sigterm_as_ctrl_c) if main_thread else None
    try:
        try:
            parser = build_parser()
            args = parser.parse_args(argv)
        finally:
            if main_thread:
                signal.signal(signal.SIGTERM, previous)
        if not args.command:
            parser.print_help()
            return 2
        verbosity = args.verbose + getattr(args, "sub_verbose", 0)
        level = logging.WARNING if verbosity == 0 else logging.INFO if verbosity == 1 else logging.DEBUG
        logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        module = importlib.import_module(args._module)
        return int(module.run(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return EXIT_SIGNAL


def _sigterm_as_ctrl_c(signum: int, frame: object) -> None:
    raise KeyboardInterrupt("SIGTERM")


def version() -> str:
    """The installed package's version (the source tree's own when not installed)."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        return installed("trio-orch")
    except PackageNotFoundError:
        return "0+unknown"


if __name__ == "__main__":
    sys.exit(main())
