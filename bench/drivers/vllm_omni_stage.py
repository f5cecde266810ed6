"""The stage side of the ``vllm-omni`` implementations: fake engine-core clients vLLM-Omni's pool drives.

vLLM-Omni's ``StagePool`` and ``Orchestrator`` talk to one engine-core
client per stage replica.  :class:`FedEngineClient` offers that surface
(``add_request_async``, ``get_output_async``, ``abort_requests_async``,
``collective_rpc_async``, ``process_engine_inputs``, a synchronous
``shutdown``, ``client_addresses``, the ``stage_type`` / ``final_output``
flags) and records what it saw the way the project's scripted stages do
(:class:`trio_orch.testing.StageRecord`), so the comparison's scenarios read
it like any other stage.  It is fed from the benchmark's side: an emitted
batch becomes one ``EngineCoreOutputs``, awaited by ``get_output_async`` as
vLLM's own client awaits its output queue.

Faults are translated into what vLLM's client would show, never invented:

* a dead stage (``fail_nowait``) and a connection closed under the reader
  (``close_under_reader``) make ``get_output_async`` raise vLLM's
  ``EngineDeadError`` -- vLLM's ``AsyncMPClient`` turns a cancelled socket
  read and a dead engine core into exactly that;
* :class:`~trio_orch.testing.Misbehaviour`: ``swallow_cancel_once`` and
  ``cancel_error`` act on ``get_output_async``'s cancellation, ``hang_abort``
  on ``abort_requests_async``, ``helper_per_submit`` on ``add_request_async``;
  vLLM's client ``shutdown()`` is synchronous, so ``aclose_delay`` blocks the
  calling thread and ``aclose_error`` is raised from it (``hang_aclose``
  would block the loop thread for good: the driver refuses it).

:class:`FedDiffusionClient` is the same for a diffusion stage, the only
kind to which vLLM-Omni's orchestrator hands CFG companions' outputs: it
polls such a stage without waiting (``get_diffusion_output_nowait``) and
builds its input with the stage's ``custom_process_input_func`` from the
parent's output and its companions' (the benchmark's forward function).

:class:`PassThroughOutputProcessor` is the pool's output processor: one
request output per engine-core output, the benchmark's data untouched (in a
deployment vLLM's ``OutputProcessor`` detokenises there; every
implementation's stages hand over finished data instead).
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from bench.refs.testing import misbehaving_get
from trio_orch.testing import Misbehaviour, StageRecord
from trio_orch.types import StageOutput

__all__ = ["FedDiffusionClient", "FedEngineClient", "FedRequestOutput", "PassThroughOutputProcessor",
           "RawOutput"]


@dataclass(slots=True)
class RawOutput:
    """One engine-core output as the orchestrator reads it (request id, no raw finish: see below).

    ``finish_reason`` stays None: the finish travels on the processed output,
    as a stage that reports it through its output processor does.
    """

    request_id: str
    data: Any
    finished: bool
    error: str | None = None
    finish_reason: None = None
    kv_transfer_params: None = None
    new_token_ids: list[int] = field(default_factory=list)


@dataclass(slots=True)
class FedRequestOutput:
    """A processed (request-level) output: what reaches the serving thread in an ``OutputMessage``."""

    request_id: str
    data: Any
    finished: bool
    error: str | None = None
    final_output_type: str = "text"
    outputs: list[Any] = field(default_factory=list)
    prompt_token_ids: list[int] = field(default_factory=list)


@dataclass(slots=True)
class Processed:
    request_outputs: list[FedRequestOutput]
    reqs_to_abort: list[str]


class PassThroughOutputProcessor:
    """The stage pool's output processor: engine-core outputs -> request outputs, data untouched."""

    tokenizer = None

    def add_request(self, request: Any, prompt: Any = None, parent_req: Any = None, request_index: int = 0,
                    queue: Any = None) -> None:
        """Nothing to prepare: no detokeniser state."""

    def remove_request(self, request_id: str) -> None:
        pass

    def abort_requests(self, request_ids: list[str], internal: bool) -> list[str]:
        """The engine-core ids to abort: the same ids (no internal ids are made on this side)."""
        return list(request_ids)

    def process_outputs(self, outputs: list[RawOutput], timestamp: Any = None,
                        iteration_stats: Any = None) -> Processed:
        return Processed([FedRequestOutput(o.request_id, o.data, o.finished, o.error) for o in outputs], [])

    def update_scheduler_stats(self, stats: Any) -> None:
        pass


class FedEngineClient(StageRecord):
    """One stage replica's engine-core client, fed by the benchmark (see the module docstring)."""

    stage_type = "llm"
    final_output_type = "text"
    custom_process_input_func = None
    requires_multimodal_data = False

    def __init__(self, stage_id: int, final_output: bool, on_submit: Callable[[int, str], None],
                 misbehaviour: Misbehaviour | None = None) -> None:
        super().__init__()
        self.stage_id = stage_id
        self.name = f"fed-engine-client-{stage_id}"
        self.final_output = final_output
        self.client_addresses = {"input_address": f"inproc://bench-stage-{stage_id}"}
        self.on_submit = on_submit
        self.misbehaviour = misbehaviour or Misbehaviour()
        self.swallowed_cancels = 0
        self.shutdown_calls = 0
        self.helpers: set[asyncio.Task[None]] = set()
        self._outputs: asyncio.Queue[Any] | None = None
        self._dead: BaseException | None = None
        self._submit_gate: asyncio.Event | None = None
        self._shutting_down = False  # vLLM-Omni marks its clients so at shutdown

    def _queue(self) -> asyncio.Queue[Any]:
        if self._outputs is None:  # bound to the orchestrator's loop on first use
            self._outputs = asyncio.Queue()
        return self._outputs

    # -- what the pool and the orchestrator call
    async def add_request_async(self, request: Any, **kwargs: Any) -> None:
        while self._submit_gate is not None:
            await self._submit_gate.wait()
        if self._dead is not None:
            raise self._dead
        rid = request.request_id
        if any(r == rid for r, _ in self.submissions):  # vLLM's streaming input: the same id, added again
            self.record_update(rid, request, not getattr(request, "resumable", False), None)
            return
        self.record_submit(rid, request, bool(getattr(request, "resumable", False)), None, None)
        self.on_submit(self.stage_id, rid)
        if self.misbehaviour.helper_per_submit:
            task = asyncio.create_task(asyncio.sleep(3600), name=f"{self.name}.heartbeat[{rid}]")
            self.helpers.add(task)
            task.add_done_callback(self.helpers.discard)

    async def get_output_async(self) -> Any:
        item = await misbehaving_get(self._queue(), self)
        if isinstance(item, BaseException):
            if item is self._dead:
                self._queue().put_nowait(item)  # a dead engine stays dead: every later read raises too
            raise item
        return item

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        if self.misbehaviour.hang_abort:
            await asyncio.Event().wait()
        self.aborts.extend(request_ids)

    async def collective_rpc_async(self, method: str, timeout: float | None = None,
                                   args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None) -> Any:
        """Answer with the handler given to ``on_rpc``; like vLLM's client, no deadline of its own."""
        fn, kw = self.record_rpc(method, tuple(args), kwargs)
        if fn is None:
            raise RuntimeError(f"unknown rpc method {method!r}")
        return await fn(*args, **kw)

    def process_engine_inputs(self, source_outputs: list[Any], prompt: Any, **kwargs: Any) -> list[Any]:
        """The next stage's input from the previous stage's outputs: token ids, as a talker gets them."""
        return [{"prompt_token_ids": [1]} for _ in source_outputs]

    def shutdown(self) -> None:
        """vLLM's client shutdown: synchronous (it stops the engine-core process)."""
        self.shutdown_calls += 1
        self._shutting_down = True
        if self.misbehaviour.aclose_delay:
            time.sleep(self.misbehaviour.aclose_delay)
        if self.misbehaviour.aclose_error is not None:
            raise self.misbehaviour.aclose_error

    # -- the benchmark's side (in the orchestrator's loop)
    def emit_nowait(self, request_id: str, data: Any = None, finished: bool = False,
                    error: str | None = None) -> None:
        self.emit_batch_nowait([StageOutput(request_id, data, finished, error)])

    def emit_batch_nowait(self, outputs: list[StageOutput]) -> None:
        """One engine-core output batch, as a worker's step returns it."""
        from vllm.v1.engine import EngineCoreOutputs

        raw = [RawOutput(o.request_id, o.data, o.finished, o.error) for o in outputs]
        self._queue().put_nowait(EngineCoreOutputs(outputs=raw, timestamp=time.monotonic()))

    def fail_nowait(self, exc: BaseException | None = None) -> None:
        """The engine core died: reads (and submits) raise ``EngineDeadError``, as vLLM's client does."""
        from vllm.v1.engine.exceptions import EngineDeadError

        if self._dead is None:
            dead = EngineDeadError()
            dead.__cause__ = exc
            self._dead = dead
            self._queue().put_nowait(dead)

    def close_under_reader(self) -> None:
        """The output socket closed under the pending read: vLLM's client reports ``EngineDeadError`` once.

        (Its socket-reader task puts one on the output queue when its read is
        cancelled, then ends; later reads wait.)
        """
        from vllm.v1.engine.exceptions import EngineDeadError

        self._queue().put_nowait(EngineDeadError())

    def hold_submits(self) -> None:
        if self._submit_gate is None:
            self._submit_gate = asyncio.Event()

    def release_submits(self) -> None:
        if self._submit_gate is not None:
            self._submit_gate.set()
            self._submit_gate = None


class FedDiffusionClient(FedEngineClient):
    """A diffusion stage replica's client: vLLM-Omni's diffusion surface, fed like the LLM one.

    vLLM-Omni submits to it with ``add_request_async(request_id, prompt,
    sampling_params, **kwargs)`` -- the prompt being what
    ``custom_process_input_func`` built -- and polls it with
    ``get_diffusion_output_nowait`` (one request output or None).
    ``forward`` is the benchmark's forward function ``(stage, prompt, outputs,
    companions)``; it is called as that hook, with the parent's output data
    and ``{companion id: [its output data]}`` (None when none came).
    Cancellation faults act on a read, and this stage is never read with an
    await: the driver refuses them here.
    """

    stage_type = "diffusion"
    final_output_type = "image"

    def __init__(self, stage_id: int, final_output: bool, on_submit: Callable[[int, str], None],
                 forward: Callable[..., Any]) -> None:
        super().__init__(stage_id, final_output, on_submit)
        self.engine_input_source = [stage_id - 1]
        self.request_address = f"inproc://bench-diffusion-stage-{stage_id}"
        self._ready: collections.deque[Any] = collections.deque()
        self._forward = forward
        self.custom_process_input_func = self._process_input

    def _process_input(self, source_outputs: list[Any], prompt: Any, requires_multimodal_data: bool) -> Any:
        """vLLM-Omni's ``custom_process_input_func``: ``[parent, *companions]`` -> the stage's input."""
        parent, *companions = source_outputs
        bundle = {c.request_id: [c.data] for c in companions} or None
        return self._forward(self.stage_id - 1, prompt, [parent.data], bundle)

    async def add_request_async(self, request_id: str, prompt: Any = None, sampling_params: Any = None,
                                **kwargs: Any) -> None:  # type: ignore[override]
        while self._submit_gate is not None:
            await self._submit_gate.wait()
        if self._dead is not None:
            raise self._dead
        if any(r == request_id for r, _ in self.submissions):
            self.record_update(request_id, prompt, True, sampling_params)
            return
        self.record_submit(request_id, prompt, False, sampling_params, None)
        self.on_submit(self.stage_id, request_id)

    def get_diffusion_output_nowait(self) -> Any:
        if self._dead is not None:
            raise self._dead
        return self._ready.popleft() if self._ready else None

    async def get_output_async(self) -> Any:
        raise RuntimeError("a diffusion stage is polled (get_diffusion_output_nowait), never awaited")

    def emit_batch_nowait(self, outputs: list[StageOutput]) -> None:
        """Each output becomes one ready diffusion request output, as a finished generation does."""
        self._ready.extend(FedRequestOutput(o.request_id, o.data, o.finished, o.error,
                                            final_output_type=self.final_output_type) for o in outputs)

    def fail_nowait(self, exc: BaseException | None = None) -> None:
        from vllm.v1.engine.exceptions import EngineDeadError

        if self._dead is None:
            dead = EngineDeadError()
            dead.__cause__ = exc
            self._dead = dead

    def close_under_reader(self) -> None:
        raise RuntimeError("a diffusion stage has no pending read to close")
