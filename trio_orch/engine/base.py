"""What every engine shares: its errors, the pipeline it runs, and its metrics snapshot.

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
from trio_orch.engine.demux import Demux
from trio_orch.histogram import HistogramSnapshot
from trio_orch.shell.orchestrator import Orchestrator, OrchestratorStatistics
from trio_orch.types import ObservedStageClient, StageClient

__all__ = ["EngineClosed", "EngineStartupError", "EngineStatistics", "Overloaded", "PipelineFactory",
           "PipelineSpec", "as_spec", "collect_stats", "stage_timings", "static_pipeline", "unwrap"]


class EngineClosed(RuntimeError):
    """The engine is closed or its orchestrator thread has exited; the message says why."""


class EngineStartupError(RuntimeError):
    """The engine could not start; ``__cause__`` is the original failure."""


class Overloaded(Exception):
    """The request was shed: no room in the pipeline within the engine's admission bounds.

    Nothing was registered (no terminal follows); try again after
    ``retry_after`` seconds.  An HTTP front answers 429 with ``Retry-After``.
    """

    def __init__(self, message: str, *, retry_after: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after = retry_after


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


@dataclass(frozen=True, slots=True)
class EngineStatistics:
    """A read-only snapshot of an engine for /health and /metrics.

    ``orchestrator`` is None once the engine is closed (or before it runs);
    the convenience properties then read as an idle engine.
    """

    running: bool
    admission_waiting: int  #: callers waiting in the admitter for room in the request channel
    open_streams: int  #: requests whose consumer has not had the terminal yet
    terminals_by_kind: Mapping[str, int]  #: terminals delivered to consumers, by kind
    errors_by_kind: Mapping[str, int]  #: error terminals delivered to consumers, by kind
    orchestrator: OrchestratorStatistics | None
    inflight_by_replica: Mapping[tuple[int, str], int]  #: (stage, replica) -> requests bound there
    admitted: int = 0  #: requests the orchestrator accepted (each gets a terminal)
    shed_by_reason: Mapping[str, int] = field(default_factory=dict)  #: refused without being accepted
    dispatch_latency: HistogramSnapshot | None = None  #: a stage output -> its consumer took it
    first_output: Mapping[int, HistogramSnapshot] = field(default_factory=dict)  #: stage -> time to it
    duration: Mapping[str, HistogramSnapshot] = field(default_factory=dict)  #: terminal kind -> e2e time
    stage_queue: Mapping[int, HistogramSnapshot] = field(default_factory=dict)  #: worker-reported
    stage_compute: Mapping[int, HistogramSnapshot] = field(default_factory=dict)  #: worker-reported
    #: stage -> each replica slot's state (``ready``, ``suspect``, ``restarting``, ``given_up``, ... with
    #: ``reason``), from stage clients that keep replicas (a replica pool); absent for the others
    replica_states: Mapping[int, tuple[Mapping[str, Any], ...]] = field(default_factory=dict)

    @property
    def queued_requests(self) -> int:
        return self.orchestrator.core.queued if self.orchestrator else 0

    @property
    def active_requests(self) -> int:
        """Accepted requests without their terminal yet (queued included)."""
        return self.orchestrator.core.live if self.orchestrator else 0

    @property
    def outputs_routed(self) -> int:
        return self.orchestrator.core.outputs_routed if self.orchestrator else 0

    @property
    def dropped_outputs(self) -> int:
        return self.orchestrator.core.dropped_outputs if self.orchestrator else 0

    @property
    def stage_available(self) -> tuple[bool, ...]:
        return self.orchestrator.core.stage_available if self.orchestrator else ()

    @property
    def inflight_by_stage(self) -> tuple[int, ...]:
        return self.orchestrator.core.inflight_by_stage if self.orchestrator else ()

    @property
    def stage_deaths(self) -> Mapping[int, str]:
        return self.orchestrator.stage_deaths if self.orchestrator else MappingProxyType({})

    @property
    def replicas(self) -> tuple[tuple[int, int], ...]:
        """(live, total) replicas per stage."""
        if not self.orchestrator:
            return ()
        core = self.orchestrator.core
        return tuple(zip(core.replicas_live, core.replicas_total, strict=True))

    @property
    def admitted_by_stage(self) -> tuple[int, ...]:
        """Started requests that still have to pass each stage (what its bound counts)."""
        return self.orchestrator.core.claims_by_stage if self.orchestrator else ()

    @property
    def stage_limits(self) -> tuple[int | None, ...]:
        return self.orchestrator.core.stage_limits if self.orchestrator else ()

    @property
    def suspect_stages(self) -> list[int]:
        """Stages whose every replica that takes requests is suspect (silent past its heartbeats):
        alive as far as routing knows, but none of them is making progress."""
        return [k for k, reps in sorted(self.replica_states.items())
                if any(r["state"] == "suspect" for r in reps)
                and not any(r["state"] == "ready" for r in reps)]

    def stage_health(self, stage_id: int) -> dict[str, Any]:
        """What ``/health`` adds to a stage's entry: its replicas' states, and whether it was given up.

        ``given_up`` (with the last slot's ``reason``) only when every slot was given up: the
        stage is gone for good, not restarting.  Empty for stage clients that keep no replicas.
        """
        reps = self.replica_states.get(stage_id)
        if reps is None:
            return {}
        out: dict[str, Any] = {"replicas": [dict(r) for r in reps],
                               "suspect": sum(1 for r in reps if r["state"] == "suspect")}
        if reps and all(r["state"] == "given_up" for r in reps):
            out.update(given_up=True, reason=reps[-1].get("reason"))
        return out

    @property
    def draining(self) -> bool:
        """Shutting down: nothing new is accepted, requests in flight may still finish."""
        return self.orchestrator is not None and self.orchestrator.state == "stopping"


def collect_stats(orch: Orchestrator | None, demux: Demux, admission_waiting: int,
                  alive: bool) -> EngineStatistics:
    """A snapshot for /health and /metrics; must run in the orchestrator's thread.

    Stage clients that keep more (a :class:`~trio_orch.cluster.pool.ReplicaPool`:
    requests per replica, worker-reported queue and compute times) add it.
    """
    by_replica: dict[tuple[int, str], int] = {}
    queue: dict[int, HistogramSnapshot] = {}
    compute: dict[int, HistogramSnapshot] = {}
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
        replica_states=MappingProxyType(states),
    )


def stage_timings(orch: Orchestrator | None, request_id: str) -> tuple[Any, ...]:
    """Each stage's timing of a recent request (``ObservedStageClient``s; None elsewhere)."""
    if orch is None:
        return ()
    return tuple(stage.timing_of(request_id) if isinstance(stage, ObservedStageClient) else None
                 for stage in orch.stages)
