"""Message types shared by the routing core, the Trio shell and the stage clients.

Plain slotted classes with no I/O or event-loop dependency, so that the
routing core, the Trio orchestrator and the asyncio references in ``bench/``
all speak the same vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

__all__ = [
    "ERROR_KINDS",
    "Message",
    "NowaitSubmitClient",
    "OrchError",
    "OrchOutput",
    "PushStageClient",
    "ReplicatedStageClient",
    "RpcResult",
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
