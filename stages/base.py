"""The model interface a stage worker drives, and the torch-free ``echo`` model.

A worker runs continuous batching over a :class:`StageModel`: each step it
admits new requests (``admit``), runs ONE batched ``step`` over every active
request that is ``runnable``, emits what each produced and retires the
finished ones.  Inputs arrive either whole with the submit (normal mode) or
piece by piece through ``feed`` (async-chunk mode: chunks of the previous
stage, streamed over the connector).  A resumable request takes more input
segments while it runs: ``extend`` starts each one on the request's existing
model state (see :mod:`stages.segments`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from stages.schema import PositiveInt

__all__ = ["EchoModel", "ReqState", "StageModel", "StepResult"]


@dataclass(slots=True)
class ReqState:
    """What the worker and the model know about one active request."""

    request_id: str
    payload: Any = None
    downstream: int = -1  # replica index of the next stage (async-chunk), -1: none
    inputs: list[Any] = field(default_factory=list)  # fed chunks not consumed yet
    upstream: bool = False  # inputs arrive as chunks from the previous stage's worker
    input_done: bool = True  # False while upstream chunks are still expected
    steps: int = 0
    model: Any = None  # model-private state
    #: this stage's sampling parameters for the request, checked against the kind's
    #: (``StageSpec.sampling``) and normalised: only the keys the client gave
    sampling: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class StepResult:
    """What one step produced for one request.

    ``data`` goes to the orchestrator (None: nothing this step), ``chunk`` to
    the next stage's worker in async-chunk mode (None: nothing), ``finished``
    retires the request.
    """

    data: Any = None
    finished: bool = False
    chunk: Any = None


class StageModel:
    """Base class of every stage model: override ``step``, and ``admit``/``runnable`` as needed.

    The worker calls these in one thread, never concurrently: ``warmup`` once
    before it reports ready; then per request ``admit`` (once), ``feed`` (each
    upstream chunk, async-chunk mode), ``runnable`` (before every step), ``step``
    (batched, one result per request, in order) and ``release`` (once, when the
    request leaves: finished, aborted or failed); ``extend`` (a resumable
    request's next input segment, after its previous one finished); ``info`` for the ready handshake
    and the ``stats`` RPC.  The constructor's keyword parameters are the model
    options of the pipeline config (``[stages.model]``); ``device``, ``seed`` and
    ``slots`` are filled in by the worker when the constructor declares them.
    What a kind means to the orchestrator (output modality, forward function) is
    a :class:`stages.registry.StageSpec`: a row of the registry for a built-in
    kind, the ``stage_spec`` class attribute for a plug-in (docs/plugins.md).
    """

    kind = "base"

    def admit(self, req: ReqState) -> None:
        """Validate ``req.payload`` and set up ``req.model``; raise ValueError to refuse."""

    def feed(self, req: ReqState, data: Any, end: bool) -> None:
        """An upstream chunk arrived (``data`` may be None when ``end`` alone)."""
        if data is not None:
            req.inputs.append(data)
        if end:
            req.input_done = True

    def runnable(self, req: ReqState) -> bool:
        return bool(req.inputs) or req.input_done

    def step(self, reqs: list[ReqState]) -> list[StepResult]:
        raise NotImplementedError

    def extend(self, req: ReqState, payload: Any) -> None:
        """Start the next input segment of a resumable request whose previous segment finished.

        Continue from the state the request has (a KV cache, a phase), not from
        scratch; the step that finishes the segment reports ``finished`` again.
        In async-chunk mode (``req.upstream``) the segment's input streams in
        through ``feed``, so by default only ``input_done`` is reset; a model
        that takes whole payloads must override this (ValueError refuses the
        segment and fails the request).
        """
        if not req.upstream:
            raise ValueError(f"the {self.kind} model takes no more input for a running request")
        req.input_done = False

    def warmup(self) -> None:
        """Called once before the ready handshake (torch models run a dummy step)."""

    def release(self, req: ReqState) -> None:
        """The request left the batch (finished, aborted or failed)."""

    def info(self) -> dict[str, Any]:
        return {"kind": self.kind}


class EchoModel(StageModel):
    """Echo: returns the payload ``outputs`` times, one output per step.

    With upstream chunks (async-chunk) it echoes every chunk once, passing it
    downstream too, and finishes when the upstream ends.  No torch: benchmark
    and fault-test pipelines start in a fraction of a second.
    """

    kind = "echo"

    def __init__(self, outputs: PositiveInt = 1) -> None:
        if outputs < 1:
            raise ValueError(f"echo: outputs must be >= 1, got {outputs}")
        self.outputs = outputs

    def extend(self, req: ReqState, payload: Any) -> None:
        """The next segment: echo the new payload ``outputs`` times (or its upstream chunks)."""
        if req.upstream:
            req.input_done = False
            return
        req.payload = payload
        req.steps = 0

    def step(self, reqs: list[ReqState]) -> list[StepResult]:
        results = []
        for req in reqs:
            if req.upstream:  # echo each upstream chunk, end with the upstream
                data = req.inputs.pop(0) if req.inputs else None
                fin = req.input_done and not req.inputs
                results.append(StepResult(data, fin, data))
                continue
            req.steps += 1
            fin = req.steps >= self.outputs
            results.append(StepResult(req.payload, fin, req.payload))
        return results

    def info(self) -> dict[str, Any]:
        return {"kind": self.kind, "outputs": self.outputs}
