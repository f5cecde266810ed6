"""What every engine shares: the pipeline it runs, and how its metrics snapshot is taken.

A pipeline factory is called inside the orchestrator's Trio run and returns
an async context manager yielding the stage clients plus Orchestrator
options (:class:`PipelineSpec`, or any object shaped like
:class:`trio_orch.cluster.launcher.Pipeline`).  Used by the engine
(:mod:`trio_orch.engine.trio_engine`) and so by its thread adapter (:mod:`trio_orch.engine.bridge`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from stages.sampling_params import StageParams, checker
from trio_orch.engine.api import EngineStatistics
from trio_orch.engine.demux import Demux
from trio_orch.histogram import HistogramSnapshot
from trio_orch.shell.orchestrator import Orchestrator
from trio_orch.types import ObservedStageClient, StageClient

__all__ = ["PipelineFactory", "PipelineSpec", "as_spec", "collect_stats", "stage_timings", "static_pipeline",
           "unwrap"]


@dataclass
class PipelineSpec:
    """What a pipeline factory yields: stage clients plus Orchestrator options.

    ``stage_params``: each stage's name and the sampling parameters it takes
    (None: the pipeline declares none, and requests cannot carry any); unless
    ``options`` has its own ``check_sampling``, requests are checked against it.
    """

    stages: Sequence[StageClient]
    final_stage_ids: Iterable[int]
    options: dict[str, Any] = field(default_factory=dict)  # async_chunk, forward_fn, prewarm_fn, ...
    stage_params: Sequence[StageParams] | None = None


#: A zero-argument callable, called *inside the Trio thread*, returning an async
#: context manager that yields a PipelineSpec (or any object with ``stages`` and
#: ``final_stage_ids``, and optionally ``orchestrator_kwargs()``, as
#: :class:`trio_orch.cluster.launcher.Pipeline` has).  Leaving it stops the pipeline
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
        spec = obj
    else:
        stages = getattr(obj, "stages", None)
        finals = getattr(obj, "final_stage_ids", None)
        if stages is None or finals is None:
            raise TypeError(f"a pipeline factory must yield a PipelineSpec or an object with .stages and "
                            f".final_stage_ids, got {type(obj).__name__}")
        opts = getattr(obj, "orchestrator_kwargs", None) or getattr(obj, "orchestrator_options", None)
        opts = dict(opts() if callable(opts) else opts or {})
        opts.pop("final_stage_ids", None)
        spec = PipelineSpec(stages, finals, opts, getattr(obj, "stage_params", None))
    if spec.stage_params is not None and "check_sampling" not in spec.options:
        spec = PipelineSpec(spec.stages, spec.final_stage_ids,
                            {**spec.options, "check_sampling": checker(spec.stage_params)}, spec.stage_params)
    return spec


def unwrap(exc: BaseException) -> BaseException:
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc


def collect_stats(orch: Orchestrator | None, demux: Demux, admission_waiting: int,
                  alive: bool) -> EngineStatistics:
    """A snapshot for /health and /metrics; must run in the orchestrator's thread.

    Stage clients that keep more (a :class:`~trio_orch.cluster.pool.ReplicaPool`:
    requests per replica, worker-reported queue and compute times, hand-offs
    from the stage before) add it.
    """
    by_replica: dict[tuple[int, str], int] = {}
    queue: dict[int, HistogramSnapshot] = {}
    compute: dict[int, HistogramSnapshot] = {}
    transfer: dict[int, HistogramSnapshot] = {}
    input_bytes: dict[int, int] = {}
    states: dict[int, tuple[Mapping[str, Any], ...]] = {}
    if orch is not None:
        for k, stage in enumerate(orch.stages):
            if not isinstance(stage, ObservedStageClient):  # a ReplicaPool declares what it keeps
                continue
            states[k] = tuple(MappingProxyType(dict(st)) for st in stage.replica_states())
            for replica, n in enumerate(stage.in_flight()):
                by_replica[(k, str(replica))] = int(n)
            queue[k] = stage.queue_seconds.snapshot()
            compute[k] = stage.compute_seconds.snapshot()
            transfer[k] = stage.transfer_seconds.snapshot()
            input_bytes[k] = stage.input_bytes
    return EngineStatistics(
        running=alive and orch is not None and orch.running,
        admission_waiting=admission_waiting,
        open_streams=len(demux.streams),
        terminals_by_kind=MappingProxyType(dict(demux.terminals_by_kind)),
        errors_by_kind=MappingProxyType(dict(demux.errors_by_kind)),
        orchestrator=orch.statistics() if orch is not None else None,
        inflight_by_replica=MappingProxyType(by_replica),
        admitted=demux.admitted,
        shed_by_reason=MappingProxyType(dict(demux.shed_by_reason)),
        dispatch_latency=demux.latency.snapshot(),
        first_output=MappingProxyType({k: h.snapshot() for k, h in sorted(demux.first_output.items())}),
        duration=MappingProxyType({k: h.snapshot() for k, h in sorted(demux.duration.items())}),
        stage_queue=MappingProxyType(queue),
        stage_compute=MappingProxyType(compute),
        stage_transfer=MappingProxyType(transfer),
        stage_input_bytes=MappingProxyType(input_bytes),
        replica_states=MappingProxyType(states),
    )


def stage_timings(orch: Orchestrator | None, request_id: str) -> tuple[Any, ...]:
    """Each stage's timing of a recent request (``ObservedStageClient``s; None elsewhere)."""
    if orch is None:
        return ()
    return tuple(stage.timing_of(request_id) if isinstance(stage, ObservedStageClient) else None
                 for stage in orch.stages)
