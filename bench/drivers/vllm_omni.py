"""The real vLLM-Omni orchestrator behind a thread-side :class:`~bench.drivers.base.Driver`.

Runs ``vllm_omni.engine.orchestrator.Orchestrator`` -- the installed
package's own code, nothing copied -- the way vLLM-Omni's engine runs it: a
thread with its own asyncio loop, three janus queues (requests, bounded at
256; outputs; RPC results), the serving thread putting messages on the
request queue's sync side and taking outputs one ``sync_q.get`` at a time.
Its stage pools are vLLM-Omni's own ``StagePool`` too.  What this module
supplies is the stage side, the part a benchmark fakes on every
implementation:

* :class:`FedEngineClient` -- one engine-core client per stage, the surface
  the pool and the orchestrator call (``add_request_async``,
  ``get_output_async``, ``abort_requests_async``, ``process_engine_inputs``,
  ``shutdown``, ``client_addresses``, the ``stage_type`` / ``final_output``
  flags).  The benchmark's ``emit_batch`` becomes one engine-core output
  batch, awaited by ``get_output_async`` as vLLM's own client awaits its
  output queue.
* :class:`PassThroughOutputProcessor` -- the pool's output processor: one
  request output per engine-core output, carrying the benchmark's data.  In
  a real deployment vLLM's ``OutputProcessor`` (detokenisation, logprobs)
  runs there; the stages of every implementation in the benchmark hand over
  finished data instead, so it is left out on this side too.

``event_driven`` picks the orchestration loop: ``True`` one reader task per
replica awaiting ``get_output_async`` (what vLLM-Omni enables for qwen3-tts
and with ``VLLM_OMNI_EVENT_DRIVEN_ORCH=1``), ``False`` the 1 ms polling loop
(its default for the other pipelines).  The environment variable, when set,
overrides both, as in vLLM-Omni.

Importing this module does not import vLLM; starting a driver does (a few
seconds).  :func:`available` says whether the package is installed here.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import importlib.util
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from bench.drivers.base import Driver, Unsupported
from trio_orch.types import Message, OrchError, OrchOutput, StageOutput

__all__ = ["FedEngineClient", "PassThroughOutputProcessor", "VllmOmniDriver", "available", "missing_reason"]

REQUEST_QUEUE_SIZE = 256  #: vLLM-Omni's engine bounds its request queue at this


def available() -> bool:
    """Whether vLLM-Omni is installed in this interpreter (without importing it)."""
    return importlib.util.find_spec("vllm_omni") is not None


def missing_reason() -> str:
    """Why the ``vllm-omni`` implementations are skipped here, and how to get them."""
    return ("vLLM-Omni is not installed in this interpreter; install it with "
            "`bash bench/setup_vllm_omni.sh` and run the command with "
            "`.venv-vllm/bin/python -m trio_orch.cli`")


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


class FedEngineClient:
    """One stage replica's engine-core client, fed by the benchmark (see the module docstring)."""

    stage_type = "llm"
    final_output_type = "text"
    custom_process_input_func = None
    requires_multimodal_data = False

    def __init__(self, stage_id: int, final_output: bool,
                 on_submit: Callable[[int, str], None]) -> None:
        self.stage_id = stage_id
        self.final_output = final_output
        self.client_addresses = {"input_address": f"inproc://bench-stage-{stage_id}"}
        self.on_submit = on_submit
        self.submissions: list[tuple[str, Any]] = []
        self.aborts: list[str] = []
        self._outputs: asyncio.Queue[Any] | None = None
        self._shutting_down = False

    def _queue(self) -> asyncio.Queue[Any]:
        if self._outputs is None:  # bound to the orchestrator's loop on first use
            self._outputs = asyncio.Queue()
        return self._outputs

    # -- what the pool and the orchestrator call
    async def add_request_async(self, request: Any, **kwargs: Any) -> None:
        rid = request.request_id
        self.submissions.append((rid, request))
        self.on_submit(self.stage_id, rid)

    async def get_output_async(self) -> Any:
        return await self._queue().get()

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        self.aborts.extend(request_ids)

    def process_engine_inputs(self, source_outputs: list[Any], prompt: Any, **kwargs: Any) -> list[Any]:
        """The next stage's input from the previous stage's outputs: token ids, as a talker gets them."""
        return [{"prompt_token_ids": [1]} for _ in source_outputs]

    def shutdown(self) -> None:
        self._shutting_down = True

    # -- the benchmark's side (in the orchestrator's loop)
    def emit_batch_nowait(self, outputs: list[StageOutput]) -> None:
        """One engine-core output batch, as a worker's step returns it."""
        from vllm.v1.engine import EngineCoreOutputs

        raw = [RawOutput(o.request_id, o.data, o.finished, o.error) for o in outputs]
        self._queue().put_nowait(EngineCoreOutputs(outputs=raw, timestamp=time.monotonic()))


class VllmOmniDriver(Driver):
    """Drive the installed vLLM-Omni ``Orchestrator`` from a thread (see the module docstring)."""

    framework = "asyncio"

    def __init__(self, *args: Any, event_driven: bool = True, **kwargs: Any) -> None:
        kwargs.pop("push", None)  # no push path over there
        super().__init__(*args, **kwargs)
        if self.workers is not None or self.misbehaviour or self.in_loop_consumer or self.async_chunk:
            raise Unsupported(f"{self.name}: only in-process fed stages")
        self.event_driven = event_driven
        self.loop: asyncio.AbstractEventLoop | None = None
        self.orch: Any = None
        self.request_queue: Any = None
        self.output_queue: Any = None
        self._sampling: list[Any] = []
        self._submitted: dict[str, threading.Event] = {}

    @property
    def startup_timeout(self) -> float:
        """The first start imports vLLM (and torch): seconds, more on a loaded machine."""
        return 180.0

    # ------------------------------------------------------------------ the loop thread
    def thread_main(self) -> None:
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        self.loop = loop
        try:
            loop.run_until_complete(self._amain())
        except BaseException as exc:
            if self.run_error is None:
                self.run_error = exc
        finally:
            try:
                pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
                for t in pending:
                    t.cancel()
                if pending:
                    loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            finally:
                asyncio.set_event_loop(None)
                loop.close()
                self.set_started()
                self.set_returned()

    async def _amain(self) -> None:
        try:
            import janus
            from vllm import SamplingParams
            from vllm_omni.engine.orchestrator import Orchestrator
            from vllm_omni.engine.stage_pool import StagePool

            self.request_queue = janus.Queue(maxsize=min(self.request_queue_size, REQUEST_QUEUE_SIZE))
            self.output_queue = janus.Queue()
            rpc_queue: janus.Queue[Any] = janus.Queue()
            self.stages = [FedEngineClient(k, k in self.final_stage_ids, self._on_submit)
                           for k in range(self.num_stages)]
            stage_config = _StageConfig()
            pools = [StagePool(k, [c], output_processor=PassThroughOutputProcessor(),
                               stage_vllm_config=stage_config) for k, c in enumerate(self.stages)]
            self._sampling = [SamplingParams(max_tokens=16, detokenize=False) for _ in self.stages]
            self.orch = Orchestrator(self.request_queue.async_q, self.output_queue.async_q, rpc_queue.async_q,
                                     pools, event_driven_orch_default=self.event_driven)
        except BaseException as exc:
            self.set_started(exc)
            return
        self.set_started()
        me = asyncio.current_task()
        try:
            await self.orch.run()
        except BaseException as exc:
            self.run_error = exc
        finally:
            self.output_queue.shutdown()
            alive = [t for t in asyncio.all_tasks() if t is not me and not t.done()]
            self.tasks_alive_after_run = len(alive)
            self.alive_after_run_names = [t.get_name() for t in alive]
            self.set_returned()

    def _on_submit(self, stage_id: int, request_id: str) -> None:
        self.record_submission(stage_id, request_id)
        if stage_id == 0:
            ev = self._submitted.pop(request_id, None)
            if ev is not None:
                ev.set()

    # ------------------------------------------------------------------ the serving thread
    def _message(self, request_id: str, final_stage_id: int | None) -> Any:
        """An add as vLLM-Omni's engine builds it in the caller's thread (stage-0 request ready to submit)."""
        from vllm_omni.engine.messages import StageSubmissionMessage
        from vllm_omni.engine.orchestrator import build_engine_core_request_from_tokens

        final = max(self.final_stage_ids) if final_stage_id is None else final_stage_id
        outputs = sorted(k for k in self.final_stage_ids if k <= final)
        prompt = {"prompt_token_ids": [1]}
        request = build_engine_core_request_from_tokens(request_id, prompt, self._sampling[0])
        request.external_req_id = request_id
        now = time.time()
        return StageSubmissionMessage(
            type="add_request", request_id=request_id, prompt=request, original_prompt=prompt,
            output_prompt_text=None, sampling_params_list=self._sampling, final_stage_id=final,
            preprocess_ms=0.0, request_timestamp=now, enqueue_ts=time.perf_counter(),
            final_output_stage_ids=outputs)

    def post_request(self, request_id: str, prompt: Any, final_stage_id: int | None = None) -> None:
        """Put the add on the request queue's sync side (blocks while 256 are queued, as there)."""
        self.request_queue.sync_q.put(self._message(request_id, final_stage_id))

    def add_request(self, request_id: str, prompt: Any, *, final_stage_id: int | None = None,
                    wait: bool = True, timeout: float = 5.0, deadline: float | None = None,
                    **options: Any) -> None:
        if options or deadline is not None:
            raise Unsupported(f"{self.name}: add_request options {sorted(options)} / deadline")
        ev = self._submitted.setdefault(request_id, threading.Event()) if wait else None
        self.post_request(request_id, prompt, final_stage_id)
        if ev is not None and not ev.wait(timeout):
            raise TimeoutError(f"request {request_id!r} was not submitted within {timeout}s")

    def abort(self, request_id: str) -> None:
        from vllm_omni.engine.messages import AbortRequestMessage

        self.request_queue.sync_q.put(AbortRequestMessage(request_ids=[request_id]))

    def send_shutdown(self, timeout: float | None) -> None:
        from vllm_omni.engine.messages import ShutdownRequestMessage

        self.request_queue.sync_q.put(ShutdownRequestMessage())

    def take_batch(self, timeout: float) -> list[Message] | None:
        """One message per ``sync_q.get``, as vLLM-Omni's serving side takes them; metrics-only skipped."""
        import janus

        deadline = time.monotonic() + timeout
        while True:
            try:
                msg = self.output_queue.sync_q.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise TimeoutError(f"no output within {timeout}s") from None
            except janus.SyncQueueShutDown:
                return None
            out = _to_message(msg)
            if out is not None:
                return [out]

    def call(self, fn: Callable[..., Any], *args: Any, timeout: float = 5.0) -> Any:
        assert self.loop is not None
        fut: concurrent.futures.Future[Any] = concurrent.futures.Future()

        def run() -> None:
            try:
                fut.set_result(fn(*args))
            except BaseException as exc:
                fut.set_exception(exc)

        self.loop.call_soon_threadsafe(run)
        return fut.result(timeout)

    def call_soon(self, fn: Callable[..., Any], *args: Any) -> None:
        assert self.loop is not None
        self.loop.call_soon_threadsafe(fn, *args)

    @property
    def active_requests(self) -> int:
        return len(self.orch.request_states) if self.orch is not None else 0


@dataclass(slots=True)
class _ModelConfig:
    max_model_len: int = 4096
    model_stage: str | None = None


@dataclass(slots=True)
class _StageConfig:
    """The fields of a stage's vLLM config the orchestrator reads on this path."""

    model_config: _ModelConfig = field(default_factory=_ModelConfig)
    kv_transfer_config: None = None


def _to_message(msg: Any) -> Message | None:
    """vLLM-Omni's output-queue message -> the benchmark's message; None for metrics-only ones."""
    kind = getattr(msg, "type", None)
    if kind == "output":
        eo = msg.engine_outputs
        return OrchOutput(msg.request_id, msg.stage_id, getattr(eo, "data", None), bool(msg.finished))
    if kind == "error":
        return OrchError(msg.request_id or "", msg.stage_id, msg.error_type or "stage_failed", msg.error)
    return None
