"""The engine's seam: everything a front -- the HTTP app, the command line, the serve command -- may call.

:class:`EngineClient` is that seam, written once as a Protocol.  Two engines
satisfy it (``tests/engine/test_engine_api.py`` checks both, member by member):

- :class:`~trio_orch.engine.trio_engine.TrioEngine`, the engine itself, whose
  awaitable calls run in the caller's Trio run (``serve --loop trio``);
- :class:`~trio_orch.engine.bridge.ThreadEngine`, its thread adapter, whose
  awaitable calls run on the caller's asyncio loop (``serve --loop asyncio``).

A client of an engine in another process would implement it too: nothing
here names a stage client, a replica or the orchestrator.  The stage
information a front needs is part of it -- each stage's kind
(:attr:`EngineClient.stage_kinds`) and sampling parameters, and what its
workers reported when they became ready (:meth:`EngineClient.stage_info`:
the tokenizer, the context length, the token caps) -- so nothing reaches into
``engine.stages[k]``.

One naming rule: every awaitable call ends in ``_async``, on both engines
(``await engine.sleep_async()``); the thread adapter adds, under the name
without the suffix, the blocking form for plain threads (``engine.sleep()``).

Also here: what a caller holds for an accepted request (:class:`AcceptedRequest`),
the engine's errors, and its metrics snapshot (:class:`EngineStatistics`).
``trio_orch/http`` and ``trio_orch/cli`` import engine types from this module
only (``tests/project/test_layout.py``).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Protocol, runtime_checkable

from stages.sampling_params import StageParams
from trio_orch.histogram import HistogramSnapshot
from trio_orch.shell.orchestrator import OrchestratorStatistics
from trio_orch.types import Message, OrchError, RpcResult

__all__ = ["AcceptedRequest", "ControlError", "EngineClient", "EngineClosed", "EngineStartupError",
           "EngineStatistics", "Overloaded", "ReportsReady", "StageIds"]

StageIds = Iterable[int] | None  #: the stages a control call goes to (None: every stage)


# ---------------------------------------------------------------------------- errors
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


class ControlError(RuntimeError):
    """A control recipe failed on at least one replica; ``results`` holds every replica's answer."""

    def __init__(self, message: str, results: Sequence[RpcResult]) -> None:
        bad = [f"stage {r.stage_id} replica {r.replica}: {r.error}" for r in results if r.error is not None]
        super().__init__(f"{message}: {'; '.join(bad)}" if bad else message)
        self.results = list(results)


# ---------------------------------------------------------------------------- the metrics snapshot
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
    #: stage k -> seconds from stage k-1's finishing output of a request to its submit to stage k
    stage_transfer: Mapping[int, HistogramSnapshot] = field(default_factory=dict)
    #: stage k -> bytes of the inputs sent to its workers (from stage k-1's outputs, for k >= 1)
    stage_input_bytes: Mapping[int, int] = field(default_factory=dict)
    #: stage -> each replica slot's state (``ready``, ``suspect``, ``restarting``, ``given_up``, ... with
    #: ``reason``), from stage clients that keep replicas (a replica pool); absent for the others
    replica_states: Mapping[int, tuple[Mapping[str, Any], ...]] = field(default_factory=dict)
    #: the HTTP counters of every API-server process, summed by the head (``serve --api-server-count``;
    #: the shape of ``FrontMetrics.counts``); None where one process serves HTTP and counts them itself
    fronts: Mapping[str, Any] | None = None

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


# ---------------------------------------------------------------------------- abilities of stage clients
@runtime_checkable
class ReportsReady(Protocol):
    """A stage client whose workers introduce themselves when ready (a replica pool of worker processes)."""

    def ready_info(self) -> Mapping[str, Any]:
        """What the first ready worker reported in its handshake (empty: none is ready yet)."""
        ...


# ---------------------------------------------------------------------------- the seam
class AcceptedRequest(Protocol):
    """What ``add_request_async`` returns: one accepted request, read in the caller's event loop.

    ``async for m in it``: its messages, terminal last (:meth:`batches`: one
    list per dispatcher batch).  Leaving it (``close``, an ``async with``
    block, an iteration left early) before the terminal aborts the request.
    ``rejection``: the terminal error of a request the engine ended before
    admitting it (a front answers it with a status code).  ``t_open``: when
    it was asked for (``time.perf_counter``); ``timings``: each stage's timing
    once the terminal was taken (asked for with ``want_timings``).
    """

    rejection: OrchError | None
    finished: bool

    @property
    def request_id(self) -> str: ...

    @property
    def t_open(self) -> float: ...

    @property
    def timings(self) -> tuple[Any, ...] | None: ...

    def batches(self) -> AsyncGenerator[list[Message], None]: ...

    def __aiter__(self) -> AsyncIterator[Message]: ...

    async def update(self, segment: Any, *, final: bool = False) -> None: ...

    def abort(self) -> None: ...

    def close(self) -> None: ...


@runtime_checkable
class EngineClient(Protocol):
    """The engine as a front sees it; see the module docstring.

    State reads are safe from any thread.  Awaitable calls run in the
    caller's event loop (Trio for :class:`~trio_orch.engine.trio_engine.TrioEngine`,
    asyncio for the thread adapter).  Errors: ``ValueError`` for bad
    parameters (nothing registered or changed), :class:`Overloaded` when a
    request is shed, :class:`EngineClosed` once the engine stopped,
    :class:`ControlError` when a control recipe failed on a replica.
    """

    # ------------------------------------------------------------------ state
    @property
    def running(self) -> bool:
        """The engine accepts requests."""
        ...

    @property
    def closed_reason(self) -> str | None:
        """Why it refuses requests (None while it runs)."""
        ...

    @property
    def paused(self) -> str | None:
        """The pause mode in effect (None: not paused)."""
        ...

    @property
    def shedding(self) -> bool:
        """A request now would be shed (a hint for a front that refuses cheaply under a flood)."""
        ...

    @property
    def capacity(self) -> float:
        """At most how many requests it can hold now without shedding (``math.inf``: no bound)."""
        ...

    @property
    def retry_after(self) -> float:
        """Seconds a shed caller is told to wait."""
        ...

    # ------------------------------------------------------------------ the pipeline
    @property
    def final_stage_ids(self) -> frozenset[int]:
        """The pipeline's final-output stages (empty before start)."""
        ...

    @property
    def stage_params(self) -> Sequence[StageParams] | None:
        """Each stage's kind and sampling parameters, as the pipeline declared them (None: none)."""
        ...

    @property
    def stage_kinds(self) -> list[str] | None:
        """Each stage's kind (None: the pipeline declares none, e.g. in-process stages)."""
        ...

    def stage_info(self, stage: int) -> Mapping[str, Any]:
        """What ``stage``'s first ready worker reported in its handshake (empty: none, or in-process)."""
        ...

    # ------------------------------------------------------------------ requests
    def generate(self, prompt: Any, **kwargs: Any) -> AsyncIterator[Message]:
        """The request's messages, terminal last; leaving early aborts it (keywords: generate_batches')."""
        ...

    def generate_batches(self, prompt: Any, *, request_id: str | None = None,
                         final_stage_id: int | None = None, request_timeout: float | None = None,
                         sampling: Any = None, resumable: bool = False,
                         companions: Mapping[str, Any] | None = None,
                         priority: int = 0) -> AsyncGenerator[list[Message], None]:
        """:meth:`generate`, one list of messages per dispatcher batch."""
        ...

    async def add_request_async(self, prompt: Any, *, request_id: str | None = None,
                                final_stage_id: int | None = None, request_timeout: float | None = None,
                                resumable: bool = False, sampling: Any = None,
                                want_timings: bool = False, priority: int = 0) -> AcceptedRequest:
        """The request once admitted (or refused: ``rejection``), before its first output."""
        ...

    async def update_request_async(self, request_id: str, segment: Any, *, final: bool = False) -> None:
        """One more input segment for a live resumable request (``final``: the last one)."""
        ...

    def abort(self, request_id: str) -> None:
        """Abort a request without waiting (unknown or finished id: no-op)."""
        ...

    async def abort_confirmed_async(self, request_id: str, timeout: float | None = None) -> list[RpcResult]:
        """Abort and wait until every stage that held the request confirmed it stopped."""
        ...

    async def stats_async(self, timeout: float = 5.0) -> EngineStatistics:
        """A metrics snapshot (what ``/health`` and ``/metrics`` read)."""
        ...

    # ------------------------------------------------------------------ the control plane
    async def collective_rpc_async(self, method: str, args: Sequence[Any] = (),
                                   kwargs: Mapping[str, Any] | None = None, stage_ids: StageIds = None,
                                   timeout: float | None = None) -> list[RpcResult]:
        """Every replica's answer to ``method(*args, **kwargs)``."""
        ...

    async def pause_async(self, mode: str = "wait") -> None: ...

    async def resume_async(self) -> None: ...

    async def sleep_async(self, level: int = 1, stage_ids: StageIds = None, timeout: float | None = None,
                          drain_timeout: float | None = None) -> list[RpcResult]: ...

    async def wake_up_async(self, stage_ids: StageIds = None, timeout: float | None = None
                            ) -> list[RpcResult]: ...

    async def update_weights_async(self, path: str, stage_ids: StageIds = None, timeout: float | None = None,
                                   drain_timeout: float | None = None) -> list[RpcResult]: ...

    async def start_profile_async(self, dir: str, stage_ids: StageIds = None,
                                  timeout: float | None = None) -> list[RpcResult]: ...

    async def stop_profile_async(self, stage_ids: StageIds = None,
                                 timeout: float | None = None) -> list[RpcResult]: ...
