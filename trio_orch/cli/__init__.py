"""The ``trio-orch`` command line: the dispatcher (:mod:`trio_orch.cli.main`) and one module per command.

``trio_orch.cli:main`` is the console script; other packages add commands by
naming a :class:`Command` in the ``trio_orch.commands`` entry-point group.
"""

from trio_orch.cli.main import COMMANDS, EXIT_SIGNAL, Command, build_parser, commands, main

__all__ = ["COMMANDS", "EXIT_SIGNAL", "Command", "build_parser", "commands", "main"]
