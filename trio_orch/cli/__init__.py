"""The ``trio-orch`` command line: the dispatcher (:mod:`trio_orch.cli.main`) and one module per command.

``trio_orch.cli:program`` is the console script (:func:`main` in a locked-down
process); other packages add commands by naming a :class:`Command` in the
``trio_orch.commands`` entry-point group.
"""

from trio_orch.cli.main import COMMANDS, EXIT_SIGNAL, Command, build_parser, commands, main, program

__all__ = ["COMMANDS", "EXIT_SIGNAL", "Command", "build_parser", "commands", "main", "program"]
