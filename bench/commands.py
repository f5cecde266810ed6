"""The ``trio-orch`` subcommands this package adds (registered as ``trio_orch.commands`` entry points).

Imports nothing heavy: the command line reads these to list the commands and
imports a command's module only when it runs.
"""

from __future__ import annotations

from trio_orch.cli import Command

__all__ = ["BENCH", "CHAOS", "COMPARE"]

BENCH = Command("bench.perf.cli", "dispatch latency and throughput of every implementation, side by side")
CHAOS = Command("bench.chaos.cli", "fault matrix over real workers: kill -9, SIGSTOP, garbage, aborts, ...")
COMPARE = Command("bench.compare.cli", "cancellation semantics measured: Trio vs. the asyncio references")
