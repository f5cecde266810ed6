"""trio-orch: a Trio (structured concurrency) multi-stage inference orchestrator."""

from trio_orch.orchestrator import Orchestrator, open_orchestrator
from trio_orch.types import OrchError, OrchOutput, StageClient, StageOutput, StageUnavailable

__all__ = [
    "OrchError",
    "OrchOutput",
    "Orchestrator",
    "StageClient",
    "StageOutput",
    "StageUnavailable",
    "open_orchestrator",
]

__version__ = "0.1.0"
