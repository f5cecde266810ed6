"""The Trio shell: the orchestrator's one nursery (readers, dispatcher, request handler, deadlines).

It moves events into the routing core (:mod:`trio_orch.core`) and performs the
actions the core returns; it holds no routing rule of its own.
"""

from trio_orch.shell.orchestrator import Orchestrator, OrchestratorStatistics, open_orchestrator

__all__ = ["Orchestrator", "OrchestratorStatistics", "open_orchestrator"]
