"""Message types shared by the routing core, the Trio shell and the stage clients.

Plain slotted classes with no I/O or event-loop dependency, so that the
routing core, the Trio orchestrator and the asyncio references in ``bench/``
all speak the same vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from trio_orch.histogram import Histogram

__all__ = [
    "ERROR_KINDS",
    "ConfirmingStageClient",
    "ControlledStageClient",
    "JoinableStageClient",
    "Message",
    "NowaitSubmitClient",
    "ObservedStageClient",
    "OrchError",
    "OrchOutput",
    "PrioritizedStageClient",
    "PushStageClient",
    "ReplicatedStageClient",
    "RpcResult",
    "StageAbilities",
    "StageClient",
    "StageDied",
    "StageOutput",
    "StageUnavailable",
    "StreamingStageClient",
]

#: Every ``OrchError.kind`` the orchestrator produces.
ERROR_KINDS = (
    "aborted",
    "stage_failed",
    "replica_died",
    "stage_unavailable",
    "forward_failed",
    "shutdown",
    "timeout",
)


@dataclass(slots=True)
class StageOutput:
    """One output of one stage for one request, as a stage client returns it.

    ``error`` set means the stage failed this request (terminal for it);
    ``error_kind`` lets a replica pool report ``"replica_died"`` per request.
    ``t_produced`` is an optional monotonic timestamp (benchmarks).
    ``timing``, on a finishing output, is what the worker measured for the
    request: (seconds queued before its batch took it, seconds in the batch).
    """

    request_id: str
    data: Any
    finished: bool = False
    error: str | None = None
    error_kind: str = "stage_failed"
    t_produced: float = 0.0
    timing: tuple[float, float] | None = None


@dataclass(slots=True)
class OrchOutput:
    """An output delivered to the user; ``finished=True`` is the request's terminal.

    ``t_produced`` is copied from the stage output (monotonic clock, where the
    stage produced it) so a consumer can measure dispatch latency.  For a
    resumable (streaming-input) request, ``segment`` is the input segment this
    output answers (0-based) and ``segment_done`` says that it is that
    segment's last output from this stage; ``finished`` stays the request's
    terminal.  These three take no part in equality.
    """

    request_id: str
    stage_id: int
    data: Any
    finished: bool
    t_produced: float = field(default=0.0, compare=False, repr=False)
    segment: int = field(default=0, compare=False, repr=False)
    segment_done: bool = field(default=False, compare=False, repr=False)

    @property
    def terminal(self) -> bool:
        return self.finished


@dataclass(slots=True)
class OrchError:
    """A terminal failure of one request; always the last message for it.

    ``partial``: for a request that had started, what it produced for the user
    before it ended -- final stage -> the ``data`` of each of its outputs, in
    order (``{0: ["Hel", "lo"]}``; the deltas a streaming caller already got,
    and any terminal output still held back) -- so an abort loses nothing;
    None for a request that never started.  It takes no part in equality.
    """

    request_id: str
    stage_id: int | None
    kind: str
    message: str
    partial: dict[int, list[Any]] | None = field(default=None, compare=False, repr=False)

    @property
    def terminal(self) -> bool:
        return True

    @property
    def finished(self) -> bool:
        return True


#: what the user receives: an output, or an error terminal
Message = OrchOutput | OrchError


@dataclass(frozen=True, slots=True)
class RpcResult:
    """One replica's answer to a collective RPC: ``value``, or ``error`` (None when it succeeded).

    ``replica`` is -1 when the stage as a whole could not be asked (no live
    replica, a client that takes no RPC).
    """

    stage_id: int
    replica: int
    value: Any
    error: str | None


class StageDied(RuntimeError):
    """A stage is dead.

    A stage client's ``receive`` raises it when its stage is dead (a replica
    pool: once every replica is dead for good), and the orchestrator's reader
    hands it to the dispatcher as the stage's last event -- wrapping any other
    exception the client raised as its ``cause`` -- so the death is ordered
    after the outputs delivered before it.
    """

    def __init__(self, message: str = "", *, cause: BaseException | None = None) -> None:
        super().__init__(message or (str(cause) if cause is not None else "stage died"))
        self.cause = cause

    @classmethod
    def of(cls, exc: BaseException) -> StageDied:
        """``exc`` itself if it is a StageDied, else a StageDied caused by it."""
        return exc if isinstance(exc, StageDied) else cls(cause=exc)

    def describe(self, stage_id: int) -> str:
        """The message every shell reports for this death."""
        why = self.cause if self.cause is not None else self
        return f"stage {stage_id} died: {type(why).__name__}: {why}"


class StageUnavailable(RuntimeError):
    """Raised by a stage client's ``submit`` when it has no live replica."""


@runtime_checkable
class StageClient(Protocol):
    """What the orchestrator talks to (scripted stage, ZMQ client, replica pool)."""

    async def submit(self, request_id: str, payload: Any) -> None: ...

    async def abort(self, request_ids: list[str]) -> None: ...

    async def receive(self) -> list[StageOutput]:
        """Wait for at least one output; raise when the stage is dead."""
        ...

    async def aclose(self) -> None: ...


@runtime_checkable
class StreamingStageClient(StageClient, Protocol):
    """A stage client that takes more input for a request it already has (resumable requests).

    The orchestrator calls ``submit(..., resumable=True)`` for the first
    segment of a resumable request (keep it after the segment finished) and
    ``update(request_id, payload, final=...)`` for each later segment, in
    order; ``final=True`` marks the last one.  Each submit or update opens one
    segment; an output with ``finished=True`` closes the oldest open one.
    """

    async def submit(self, request_id: str, payload: Any, *, resumable: bool = False) -> None: ...

    async def update(self, request_id: str, payload: Any, *, final: bool = False) -> None: ...


@runtime_checkable
class PushStageClient(StageClient, Protocol):
    """Optional fast path: a stage client that pushes its outputs.

    ``pump(deliver)`` calls ``deliver(batch)`` synchronously for every batch
    of outputs as it arrives (from the task or callback that receives them)
    and returns or raises when the stage is dead.  The orchestrator's reader
    for such a stage awaits ``pump`` instead of looping on ``receive``,
    which removes one task hop per batch.
    """

    async def pump(self, deliver: Callable[[list[StageOutput]], None]) -> None: ...


@runtime_checkable
class NowaitSubmitClient(StageClient, Protocol):
    """Optional: a stage client that can take a submit synchronously.

    ``submit_nowait(request_id, payload, **options)`` takes the same
    arguments as ``submit`` and returns True once it did what ``submit``
    would (or raised as it would), or False having done nothing -- the
    orchestrator then awaits ``submit``.  A shell starting a burst of
    requests sends their submits back to back this way, with one checkpoint
    after the batch instead of one per submit: the stage's next step sees
    the whole burst (an asyncio shell gets this for free, since awaiting a
    send that completes at once does not suspend).
    """

    def submit_nowait(self, request_id: str, payload: Any, **options: Any) -> bool: ...


@runtime_checkable
class ReplicatedStageClient(StageClient, Protocol):
    """Optional: a stage client over several replicas that says how many are ready.

    ``replica_counts()`` is ``(live, total)``: replicas that can take new
    requests now, and replica slots.  ``watch_replicas(callback)`` has
    ``callback(live, total)`` called synchronously, in the orchestrator's
    thread, the moment either changes (a replica died, became ready, left or
    came back), so availability and admission bounds never lag behind.
    """

    def replica_counts(self) -> tuple[int, int]: ...

    def watch_replicas(self, callback: Callable[[int, int], None]) -> None: ...


#: what a replica answers to a collective call or an acknowledged abort: (replica, value, error)
ReplicaAnswer = tuple[int, Any, "str | None"]


@runtime_checkable
class ControlledStageClient(StageClient, Protocol):
    """Optional: a stage client that takes collective calls (``collective_rpc``, ``pause("keep")``).

    ``rpc`` calls ``method(*args, **kwargs)`` on every live replica, each
    under ``timeout``, and answers one ``(replica, value, error)`` per replica.
    """

    async def rpc(self, method: str, args: Any = (), kwargs: Any = None,
                  timeout: float = 5.0) -> list[ReplicaAnswer]: ...


@runtime_checkable
class ConfirmingStageClient(StageClient, Protocol):
    """Optional: a stage client whose replicas confirm an abort (``Orchestrator.abort`` waits for it).

    ``confirm_abort`` aborts like ``abort`` and answers one ``(replica, ids
    it stopped, error)`` per replica that held one, each under ``timeout``.
    """

    async def confirm_abort(self, request_ids: list[str], timeout: float = 5.0) -> list[ReplicaAnswer]: ...


@runtime_checkable
class PrioritizedStageClient(StageClient, Protocol):
    """Optional: a stage client that orders its work by priority and deadline.

    It takes ``priority=`` and ``deadline_in=`` (seconds left) with a submit
    (see ``core.actions.stage_io_options``); ``accepts_priority`` is True.
    """

    accepts_priority: bool


@runtime_checkable
class JoinableStageClient(StageClient, Protocol):
    """Optional: a stage whose replicas may join at runtime (a replica pool behind a registrar).

    The orchestrator sets ``join_gate`` to its
    :class:`~trio_orch.shell.join_gate.JoinGate` when it starts, so every join
    runs under the routing core's membership rules.
    """

    join_gate: Any


@runtime_checkable
class ObservedStageClient(StageClient, Protocol):
    """Optional: a stage client that reports on its replicas (``/health``, ``/metrics``, timings).

    ``replica_states()`` one mapping per replica slot; ``in_flight()``
    requests per replica; ``queue_seconds``/``compute_seconds`` the
    worker-reported histograms; ``transfer_seconds`` the hand-offs from the
    stage before (its finishing output -> the submit here) and
    ``input_bytes`` the bytes of the inputs sent to this stage's workers;
    ``timing_of(request_id)`` a recent request's stage timing (None if unknown).
    """

    queue_seconds: Histogram
    compute_seconds: Histogram
    transfer_seconds: Histogram

    @property
    def input_bytes(self) -> int: ...

    def replica_states(self) -> list[dict[str, Any]]: ...

    def in_flight(self) -> list[int]: ...

    def timing_of(self, request_id: str) -> Any: ...


@dataclass(frozen=True, slots=True)
class StageAbilities:
    """What one stage client declared it can do, read once when the orchestrator takes it.

    Each field is one of the optional protocols above; the shell reads the
    record instead of asking the client, so no path probes a client's
    attributes.
    """

    push: bool = False  #: :class:`PushStageClient`
    submit_nowait: bool = False  #: :class:`NowaitSubmitClient`
    priority: bool = False  #: :class:`PrioritizedStageClient`
    rpc: bool = False  #: :class:`ControlledStageClient`
    confirm_abort: bool = False  #: :class:`ConfirmingStageClient`
    replicated: bool = False  #: :class:`ReplicatedStageClient`
    joinable: bool = False  #: :class:`JoinableStageClient`
    observed: bool = False  #: :class:`ObservedStageClient`

    @classmethod
    def of(cls, stage: object) -> StageAbilities:
        """The abilities ``stage`` declares (the protocols it implements)."""
        return cls(push=isinstance(stage, PushStageClient),
                   submit_nowait=isinstance(stage, NowaitSubmitClient),
                   priority=isinstance(stage, PrioritizedStageClient) and bool(stage.accepts_priority),
                   rpc=isinstance(stage, ControlledStageClient),
                   confirm_abort=isinstance(stage, ConfirmingStageClient),
                   replicated=isinstance(stage, ReplicatedStageClient),
                   joinable=isinstance(stage, JoinableStageClient),
                   observed=isinstance(stage, ObservedStageClient))
