"""``python -m trio_orch.cli``: the ``trio-orch`` command."""

import sys

from trio_orch.cli import program

if __name__ == "__main__":
    sys.exit(program())
