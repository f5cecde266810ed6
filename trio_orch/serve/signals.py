"""What a signal means to a command: the exit code of a command stopped by one, and its name.

Kept apart from the fronts so that the command line (``trio-orch``) can name
the exit code without importing a server.
"""

from __future__ import annotations

import signal

__all__ = ["EXIT_SIGNAL", "signal_name"]

#: the exit code of a command stopped by SIGINT (or SIGTERM): 128 + SIGINT, the shell's Ctrl-C code
#: (``generate``; ``serve`` drains and exits 0, or 1 when the drain was cut short)
EXIT_SIGNAL = 130


def signal_name(signum: int) -> str:
    return signal.Signals(signum).name
