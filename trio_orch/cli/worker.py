"""``trio-orch worker``: a stage replica that joins a running orchestrator over TCP.

The command line of :mod:`stages.headless` (imported only when the command runs).
"""

from __future__ import annotations

import argparse


def configure(parser: argparse.ArgumentParser) -> None:
    from stages.headless import configure as add_options

    add_options(parser)


def run(args: argparse.Namespace) -> int:
    from stages.headless import main

    return main(args=args)
