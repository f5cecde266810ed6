"""What every engine shares: its errors, the pipeline it runs, and its metrics snapshot.

A pipeline factory is called inside the orchestrator's Trio run and returns
an async context manager yielding the stage clients plus Orchestrator
options (:class:`PipelineSpec`, or any object shaped like
:class:`trio_orch.launcher.Pipeline`).  Used by the thread bridge
(:mod:`trio_orch.bridge`) and by the Trio engine (:mod:`trio_orch.trio_engine`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from trio_orch.demux import Demux
from trio_orch.orchestrator import Orchestrator
from trio_orch.types import StageClient

__all__ = ["EngineClosed", "EngineStartupError", "PipelineFactory", "PipelineSpec", "as_spec",
           "collect_stats", "static_pipeline", "unwrap"]


class EngineClosed(RuntimeError):
    """The engine is closed or its orchestrator thread has exited; the message says why."""


class EngineStartupError(RuntimeError):
    """The engine could not start; ``__cause__`` is the original failure."""


@dataclass
class PipelineSpec:
    """What a pipeline factory yields: stage clients plus Orchestrator options."""

    stages: Sequence[StageClient]
    final_stage_ids: Iterable[int]
    options: dict[str, Any] = field(default_factory=dict)  # async_chunk, forward_fn, prewarm_fn, ...


#: A zero-argument callable, called *inside the Trio thread*, returning an async
#: context manager that yields a PipelineSpec (or any object with ``stages`` and
#: ``final_stage_ids``, and optionally ``orchestrator_kwargs()``, as
#: :class:`trio_orch.launcher.Pipeline` has).  Leaving it stops the pipeline
#: (e.g. worker processes).
PipelineFactory = Callable[[], AbstractAsyncContextManager[Any]]


def static_pipeline(stages: Sequence[StageClient], final_stage_ids: Iterable[int],
                    **options: Any) -> PipelineFactory:
    """A factory for already-built, in-process stage clients (tests, demos)."""

    @asynccontextmanager
    async def factory() -> AsyncIterator[PipelineSpec]:
        yield PipelineSpec(stages, final_stage_ids, dict(options))

    return factory


def as_spec(obj: Any) -> PipelineSpec:
    if isinstance(obj, PipelineSpec):
        return obj
    stages = getattr(obj, "stages", None)
    finals = getattr(obj, "final_stage_ids", None)
    if stages is None or finals is None:
        raise TypeError(f"a pipeline factory must yield a PipelineSpec or an object with .stages and "
                        f".final_stage_ids, got {type(obj).__name__}")
    opts = getattr(obj, "orchestrator_kwargs", None) or getattr(obj, "orchestrator_options", None)
    opts = dict(opts() if callable(opts) else opts or {})
    opts.pop("final_stage_ids", None)
    return PipelineSpec(stages, finals, opts)


def unwrap(exc: BaseException) -> BaseException:
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc


def collect_stats(orch: Orchestrator | None, demux: Demux, admission_waiting: int,
                   alive: bool) -> dict[str, Any]:
    """A snapshot for /metrics; must run in the orchestrator's thread (it reads routing state)."""
    stats: dict[str, Any] = {
        "running": alive and orch is not None and orch.running,
        "admission_waiting": admission_waiting,
        "terminals_by_kind": dict(demux.terminals_by_kind),
        "errors_by_kind": dict(demux.errors_by_kind),
        "open_streams": len(demux.streams),
    }
    if orch is None:
        return stats
    router = orch.router
    inflight = dict.fromkeys(range(router.num_stages), 0)
    for req in router.requests.values():
        for k in req.submitted - req.finished:
            inflight[k] += 1
    by_replica: dict[tuple[int, str], int] = {}
    for k, stage in enumerate(orch.stages):
        fn = getattr(stage, "in_flight", None)  # ReplicaPool: requests per replica
        if callable(fn):
            for replica, n in enumerate(fn()):
                by_replica[(k, str(replica))] = int(n)
    stats.update(
        queued_requests=orch.queued_requests, active_requests=orch.active_requests,
        inflight_by_stage=inflight, inflight_by_replica=by_replica,
        stage_available=list(router.available), outputs_routed=router.outputs_routed,
        dropped_outputs=router.dropped_outputs, stage_deaths=dict(orch.stage_deaths),
    )
    return stats
