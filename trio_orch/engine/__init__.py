"""The engine: the orchestrator with admission, per-request streams and the control plane.

One engine, :class:`TrioEngine`, runs in the caller's Trio run
(:func:`open_trio_engine`); :class:`ThreadEngine` is its thread adapter, for
plain threads and asyncio.  What a front may call is :class:`EngineClient`
(:mod:`trio_orch.engine.api`), which both satisfy.
"""

from trio_orch.engine.api import (
    AcceptedRequest,
    ControlError,
    EngineClient,
    EngineClosed,
    EngineStartupError,
    EngineStatistics,
    Overloaded,
)
from trio_orch.engine.base import PipelineFactory, PipelineSpec, static_pipeline
from trio_orch.engine.bridge import ThreadEngine
from trio_orch.engine.handles import AsyncRequestHandle, RequestHandle
from trio_orch.engine.trio_engine import TrioEngine, open_trio_engine

__all__ = ["AcceptedRequest", "AsyncRequestHandle", "ControlError", "EngineClient", "EngineClosed",
           "EngineStartupError", "EngineStatistics", "Overloaded", "PipelineFactory", "PipelineSpec",
           "RequestHandle", "ThreadEngine", "TrioEngine", "open_trio_engine", "static_pipeline"]
