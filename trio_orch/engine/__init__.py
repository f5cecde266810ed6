"""The engine: the orchestrator with admission, per-request streams and the control plane.

One engine, :class:`TrioEngine`, runs in the caller's Trio run
(:func:`open_trio_engine`); :class:`Engine` is its thread adapter, for plain
threads and asyncio.
"""

from trio_orch.engine.base import (
    EngineClosed,
    EngineStartupError,
    EngineStatistics,
    Overloaded,
    PipelineFactory,
    PipelineSpec,
    static_pipeline,
)
from trio_orch.engine.bridge import Engine
from trio_orch.engine.control import ControlError
from trio_orch.engine.handles import AsyncRequestHandle, RequestHandle
from trio_orch.engine.trio_engine import TrioEngine, open_trio_engine

__all__ = ["AsyncRequestHandle", "ControlError", "Engine", "EngineClosed", "EngineStartupError",
           "EngineStatistics", "Overloaded", "PipelineFactory", "PipelineSpec", "RequestHandle", "TrioEngine",
           "open_trio_engine", "static_pipeline"]
