"""trio-orch: a Trio (structured concurrency) multi-stage inference orchestrator.

The public API is exported lazily: ``from trio_orch import Orchestrator``
imports the Trio shell on first use, so that a stage worker process, which
imports only ``stages.wire``, never imports Trio.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

#: public name -> the module that defines it
_EXPORTS: dict[str, str] = {
    "Message": "trio_orch.types",
    "OrchError": "trio_orch.types",
    "OrchOutput": "trio_orch.types",
    "RpcResult": "trio_orch.types",
    "StageClient": "trio_orch.types",
    "StageDied": "trio_orch.types",
    "StageOutput": "trio_orch.types",
    "StageUnavailable": "trio_orch.types",
    "Orchestrator": "trio_orch.shell.orchestrator",
    "OrchestratorStatistics": "trio_orch.shell.orchestrator",
    "open_orchestrator": "trio_orch.shell.orchestrator",
    "ThreadEngine": "trio_orch.engine",
    "EngineClient": "trio_orch.engine",
    "TrioEngine": "trio_orch.engine",
    "open_trio_engine": "trio_orch.engine",
    "EngineClosed": "trio_orch.engine",
    "EngineStartupError": "trio_orch.engine",
    "Overloaded": "trio_orch.engine",
    "ControlError": "trio_orch.engine",
    "static_pipeline": "trio_orch.engine",
}

__all__ = [
    "ControlError",
    "EngineClient",
    "EngineClosed",
    "EngineStartupError",
    "Message",
    "OrchError",
    "OrchOutput",
    "Orchestrator",
    "OrchestratorStatistics",
    "Overloaded",
    "RpcResult",
    "StageClient",
    "StageDied",
    "StageOutput",
    "StageUnavailable",
    "ThreadEngine",
    "TrioEngine",
    "open_orchestrator",
    "open_trio_engine",
    "static_pipeline",
]

if TYPE_CHECKING:
    from trio_orch.engine import (
        ControlError,
        EngineClient,
        EngineClosed,
        EngineStartupError,
        Overloaded,
        ThreadEngine,
        TrioEngine,
        open_trio_engine,
        static_pipeline,
    )
    from trio_orch.shell.orchestrator import Orchestrator, OrchestratorStatistics, open_orchestrator
    from trio_orch.types import (
        Message,
        OrchError,
        OrchOutput,
        RpcResult,
        StageClient,
        StageDied,
        StageOutput,
        StageUnavailable,
    )


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'trio_orch' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
