"""The real vLLM-Omni orchestrator behind a thread-side :class:`~bench.drivers.base.Driver`.

Runs ``vllm_omni.engine.orchestrator.Orchestrator`` -- the installed
package's own code, nothing copied -- the way vLLM-Omni's engine runs it: a
thread with its own asyncio loop, three janus queues (requests, bounded at
256; outputs; RPC results), the serving thread putting vLLM-Omni's own
messages (``vllm_omni.engine.messages``) on the request queue's sync side
and taking outputs one ``sync_q.get`` at a time.  Its stage pools are
vLLM-Omni's own ``StagePool`` too; the stage clients are the benchmark's
(:mod:`bench.drivers.vllm_omni_stage`), fed from the thread like every
implementation's stages.

The serving-thread calls do what vLLM-Omni's engine does: ``add_request``
and ``update_request`` put a message and return (the driver waits only to
let a scenario look: until the submit reached the stage, the message was
taken, or the orchestrator is gone); ``abort`` is fire-and-forget and a
no-op once shutdown was asked for; shutdown puts ``ShutdownRequestMessage``
and the request queue is closed once the orchestrator returned;
``collective_rpc`` waits on the RPC queue for its result, raising
``TimeoutError`` past its timeout.  What vLLM-Omni has no counterpart for
(:attr:`VllmOmniDriver.LACKS`) makes the comparison's cell ``n/a``.

A consumer inside the orchestrator's loop (``in_loop_consumer``) awaits
the output queue's async side there (:meth:`VllmOmniDriver.loop_next_batch`),
the queue vLLM-Omni's orchestrator puts on; the serving thread's
``sync_q.get`` stays for whatever the scenario leaves.  ``async_chunk`` is
vLLM-Omni's own mode (``Orchestrator(async_chunk=True)``): its orchestrator
prewarms the later stages when stage 0 took a request and forwards nothing
itself, the chunks travelling through stage connectors the benchmark's fed
stages stand in for.  A forward function (``forward_fn``) makes the stages
after stage 0 diffusion stages whose ``custom_process_input_func`` it is:
the only stages to which vLLM-Omni bundles CFG companions' outputs, so
``add_request(companions=...)`` is vLLM-Omni's ``AddCompanionRequestMessage``
per companion, put after the parent's as its engine puts them.

``event_driven`` picks the orchestration loop: ``True`` one reader task per
replica awaiting ``get_output_async`` (what vLLM-Omni enables for qwen3-tts
and with ``VLLM_OMNI_EVENT_DRIVEN_ORCH=1``), ``False`` the 1 ms polling loop
(its default for the other pipelines).  The environment variable, when set,
overrides both, as in vLLM-Omni.

An application that owns a vLLM-Omni orchestrator itself (the comparison's
model rows) has two ways here: :meth:`VllmOmniDriver.cancel_run` cancels
the task the driver's loop thread runs ``run()`` in, as an application
owning that thread would; :func:`build_orchestrator` builds another
orchestrator over given stage clients, in a loop :func:`run_in_own_loop`
gives it -- a loop of its own, since its ``run()`` ends by cancelling every
other task of the loop it runs in.  The loop thread ends as vLLM-Omni's
engine ends its orchestrator thread: the remaining tasks cancelled and
gathered, then its async generators and its default executor (joining the
executor's threads) shut down.

Importing this module does not import vLLM; starting a driver does (a few
seconds).  :func:`available` says whether the package is installed here.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import importlib.util
import itertools
import logging
import queue
import threading
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from bench.drivers.asyncio import AsyncioLoopDriver
from bench.drivers.base import Unsupported
from bench.drivers.vllm_omni_stage import FedDiffusionClient, FedEngineClient, PassThroughOutputProcessor
from trio_orch.types import Message, OrchError, OrchOutput, RpcResult

__all__ = ["OmniParts", "VllmOmniDriver", "available", "build_orchestrator", "missing_reason",
           "run_in_own_loop"]

REQUEST_QUEUE_SIZE = 256  #: vLLM-Omni's engine bounds its request queue at this
#: what vLLM-Omni's orchestrator logs (WARNING) for each output of a request it holds no state for
DROPPED_OUTPUT_LOG = "[Orchestrator] Dropping output for unknown req"
CFG_ROLE = "cfg_text"  #: the role vLLM-Omni's prompt expansion gives a negative-prompt companion


def available() -> bool:
    """Whether vLLM-Omni is installed in this interpreter (without importing it)."""
    return importlib.util.find_spec("vllm_omni") is not None


def missing_reason() -> str:
    """Why the ``vllm-omni`` implementations are skipped here, and how to get them."""
    return ("vLLM-Omni is not installed in this interpreter; install it with "
            "`bash bench/setup_vllm_omni.sh` and run the command with "
            "`.venv-vllm/bin/python -m trio_orch.cli`")


def _end_loop(loop: asyncio.AbstractEventLoop) -> None:
    """The end of vLLM-Omni's orchestrator thread (``_bootstrap_orchestrator``), before the loop closes.

    The loop's other tasks cancelled and gathered, then its async generators
    and its default executor shut down -- the last waits for the executor's
    threads.  Best effort, as there: nothing it raises escapes.
    """
    try:
        pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
        for t in pending:
            t.cancel()
        if pending:
            loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.run_until_complete(loop.shutdown_default_executor())
    except BaseException:
        pass


@dataclass(slots=True)
class OmniParts:
    """A vLLM-Omni orchestrator and what its engine hands it: three janus queues, per-stage sampling."""

    orch: Any
    request_queue: Any
    output_queue: Any
    rpc_queue: Any
    sampling: list[Any]


def build_orchestrator(clients: Sequence[FedEngineClient], *, event_driven: bool, async_chunk: bool = False,
                       queue_size: int = REQUEST_QUEUE_SIZE) -> OmniParts:
    """(In a running loop.)  vLLM-Omni's ``Orchestrator`` over a ``StagePool`` per client, as its engine does.

    The queues are janus queues bound to the running loop; the request
    queue is bounded as the engine's.  ``event_driven`` picks the
    orchestration loop (:class:`VllmOmniDriver`).
    """
    import janus
    from vllm import SamplingParams
    from vllm_omni.engine.orchestrator import Orchestrator
    from vllm_omni.engine.stage_pool import StagePool
    from vllm_omni.inputs.data import OmniDiffusionSamplingParams

    request_queue, output_queue, rpc_queue = janus.Queue(maxsize=queue_size), janus.Queue(), janus.Queue()
    stage_config = _StageConfig()
    pools = [StagePool(k, [c], output_processor=PassThroughOutputProcessor(), stage_vllm_config=stage_config)
             for k, c in enumerate(clients)]
    sampling = [OmniDiffusionSamplingParams() if c.stage_type == "diffusion"
                else SamplingParams(max_tokens=16, detokenize=False) for c in clients]
    orch = Orchestrator(request_queue.async_q, output_queue.async_q, rpc_queue.async_q, pools,
                        async_chunk=async_chunk, event_driven_orch_default=event_driven)
    return OmniParts(orch, request_queue, output_queue, rpc_queue, sampling)


def run_in_own_loop(afn: Callable[[], Awaitable[Any]], timeout: float, end_wait: float = 2.0
                    ) -> tuple[Any, bool]:
    """Run ``afn()`` in a new thread with a new loop, as vLLM-Omni's engine runs its orchestrator.

    For an application that owns a vLLM-Omni orchestrator in its loop:
    ``run()`` ends by cancelling and gathering every other task of the loop
    it runs in, so it gets a loop of its own (here, as in the engine, a
    thread's).  The thread ends as the engine's (:func:`_end_loop`).

    Returns what ``afn`` returned (or raises what it raised; ``TimeoutError``
    if it had not ended within ``timeout`` s) and whether the loop then
    ended by itself within ``end_wait`` s.  One that did not -- its tasks
    waiting on each other -- is stopped, as the comparison's watchdog stops
    a hung loop (its pending tasks are left unfinished).
    """
    result: concurrent.futures.Future[Any] = concurrent.futures.Future()
    ended = threading.Event()
    loops: list[asyncio.AbstractEventLoop] = []

    async def runner() -> None:
        try:
            result.set_result(await afn())
        except BaseException as exc:  # handed to the caller's thread
            result.set_exception(exc)

    def main() -> None:
        loop = asyncio.new_event_loop()
        loops.append(loop)
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(runner())
        except BaseException as exc:
            if not result.done():
                result.set_exception(exc)
        finally:
            try:
                _end_loop(loop)
            finally:
                asyncio.set_event_loop(None)
                loop.close()
                ended.set()

    thread = threading.Thread(target=main, name="vllm-omni-application", daemon=True)
    thread.start()
    try:
        value = result.result(timeout)
    except concurrent.futures.TimeoutError:
        _stop(loops, thread)
        raise TimeoutError(f"the application had not returned within {timeout}s") from None
    except BaseException:
        if not ended.wait(end_wait):
            _stop(loops, thread)
        raise
    by_itself = ended.wait(end_wait)
    if not by_itself:
        _stop(loops, thread)
    return value, by_itself


def _stop(loops: list[asyncio.AbstractEventLoop], thread: threading.Thread) -> None:
    """Stop a loop that does not end (what it was awaiting stays unfinished); give its thread a second."""
    for loop in loops:
        with contextlib.suppress(RuntimeError):  # closed meanwhile
            loop.call_soon_threadsafe(loop.stop)
    thread.join(1.0)


class VllmOmniDriver(AsyncioLoopDriver):
    """Drive the installed vLLM-Omni ``Orchestrator`` from a thread (see the module docstring)."""

    #: what the comparison's scenarios may need that this implementation has no counterpart for, and why
    LACKS: ClassVar[dict[str, str]] = {
        "deadline": "vLLM-Omni's orchestrator keeps no per-request deadline (its add_request takes none)",
        "membership": "vLLM-Omni's replicas join through its MembershipController, which needs a "
                      "coordination hub from the start and puts every stage pool in distributed mode "
                      "(requests go only to replicas the hub lists as up), where the fed in-process stages "
                      "cannot serve; without it a register message is ignored",
    }

    def __init__(self, *args: Any, event_driven: bool = True, **kwargs: Any) -> None:
        kwargs.pop("push", None)  # no push path over there
        super().__init__(*args, **kwargs)
        if self.workers is not None:
            raise Unsupported(f"{self.name}: only in-process fed stages")
        if self.forward_fn is not None and any(k > 0 for k in self.misbehaviour):
            raise Unsupported(f"{self.name}: its diffusion stages are polled without an await; no "
                              "cancellation fault to give them")
        if any(m.hang_aclose for m in self.misbehaviour.values()):
            raise Unsupported("vLLM's client shutdown() is synchronous: a hung one would block the loop "
                              "thread for good, past any watchdog")
        self.event_driven = event_driven
        self.loop: asyncio.AbstractEventLoop | None = None
        self.orch: Any = None
        self.request_queue: Any = None
        self.output_queue: Any = None
        self.rpc_queue: Any = None
        self.shutdown_asked = False
        self._sampling: list[Any] = []
        self._submitted: dict[str, threading.Event] = {}
        self._rpc_ids = itertools.count()
        self._rpc_lock = threading.Lock()
        self._drops = _DropCounter()
        self._run_task: asyncio.Task[Any] | None = None
        self.returned_at: float | None = None

    @property
    def startup_timeout(self) -> float:
        """The first start imports vLLM (and torch): seconds, more on a loaded machine."""
        return 180.0

    # ------------------------------------------------------------------ the loop thread
    def thread_main(self) -> None:
        """The engine's orchestrator thread: a new loop; afterwards cancel and await what is left.

        As vLLM-Omni's ``_bootstrap_orchestrator``: the rest of the loop's
        tasks are cancelled and gathered, then its async generators and its
        default executor (whose threads it waits for) are shut down.
        """
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
                _end_loop(loop)
            finally:
                self.tasks_pending_at_loop_end = sum(1 for t in asyncio.all_tasks(loop) if not t.done())
                logging.getLogger("vllm_omni.engine.orchestrator").removeHandler(self._drops)
                asyncio.set_event_loop(None)
                loop.close()
                if self.request_queue is not None:
                    self.request_queue.close()  # as the engine's shutdown does once the thread ended
                self.set_started()
                self.set_returned()

    async def _amain(self) -> None:
        try:
            self._run_task = asyncio.current_task()
            _route_vllm_logs()
            logging.getLogger("vllm_omni.engine.orchestrator").addHandler(self._drops)
            self.stages = [self._stage_client(k) for k in range(self.num_stages)]
            parts = build_orchestrator(self.stages, event_driven=self.event_driven,
                                       async_chunk=self.async_chunk,
                                       queue_size=min(self.request_queue_size, REQUEST_QUEUE_SIZE))
            self.orch, self._sampling = parts.orch, parts.sampling
            self.request_queue, self.output_queue, self.rpc_queue = (
                parts.request_queue, parts.output_queue, parts.rpc_queue)
        except BaseException as exc:
            self.set_started(exc)
            return
        await self.run_orchestrator(self.orch.run, self.output_queue)

    def cancel_run(self) -> bool:
        """Cancel the task that runs the orchestrator, as the application owning its loop would.

        That task is the one the loop thread runs to completion, as vLLM-Omni's
        engine runs its orchestrator: what it awaits is ``Orchestrator.run()``.
        False if there was none left to cancel (it had ended, or the loop had closed).
        """
        task, loop = self._run_task, self.loop
        if task is None or loop is None or task.done():
            return False
        try:
            loop.call_soon_threadsafe(task.cancel)
        except RuntimeError:  # the loop closed meanwhile
            return False
        return True

    def set_returned(self) -> None:
        """Also note when run() first returned (``returned_at``, ``time.perf_counter()``)."""
        if self.returned_at is None:
            self.returned_at = time.perf_counter()
        super().set_returned()

    def _stage_client(self, k: int) -> FedEngineClient:
        """Stage ``k``'s replica: a diffusion stage past stage 0 when a forward function is given."""
        final = k in self.final_stage_ids
        if k > 0 and self.forward_fn is not None:
            return FedDiffusionClient(k, final, self._on_submit, self.forward_fn)
        return FedEngineClient(k, final, self._on_submit, self.misbehaviour.get(k))

    def _on_submit(self, stage_id: int, request_id: str) -> None:
        self.record_submission(stage_id, request_id)
        if stage_id == 0:
            ev = self._submitted.pop(request_id, None)
            if ev is not None:
                ev.set()

    # ------------------------------------------------------------------ the serving thread
    def _message(self, request_id: str, final_stage_id: int | None, *, kind: str = "add_request",
                 resumable: bool = False) -> Any:
        """An add as vLLM-Omni's engine builds it in the caller's thread (stage-0 request ready to submit)."""
        from vllm_omni.engine.messages import StageSubmissionMessage

        final = max(self.final_stage_ids) if final_stage_id is None else final_stage_id
        outputs = sorted(k for k in self.final_stage_ids if k <= final)
        prompt = {"prompt_token_ids": [1]}
        request = self._stage0_request(request_id, resumable)
        now = time.time()
        return StageSubmissionMessage(
            type=kind, request_id=request_id, prompt=request, original_prompt=prompt,
            output_prompt_text=None, sampling_params_list=self._sampling, final_stage_id=final,
            preprocess_ms=0.0, request_timestamp=now, enqueue_ts=time.perf_counter(),
            final_output_stage_ids=outputs)

    def _stage0_request(self, request_id: str, resumable: bool = False) -> Any:
        """The ready-to-submit stage-0 request the engine's input processing makes (one token)."""
        from vllm_omni.engine.orchestrator import build_engine_core_request_from_tokens

        request = build_engine_core_request_from_tokens(request_id, {"prompt_token_ids": [1]},
                                                        self._sampling[0])
        request.external_req_id = request_id
        request.resumable = resumable
        return request

    def _companion(self, parent_id: str, companion_id: str) -> Any:
        """A CFG companion as vLLM-Omni's engine builds it: stage-0 request, the parent's params."""
        from vllm_omni.engine.messages import AddCompanionRequestMessage

        return AddCompanionRequestMessage(
            companion_id=companion_id, parent_id=parent_id, role=CFG_ROLE,
            prompt=self._stage0_request(companion_id), companion_prompt_text=None,
            sampling_params_list=self._sampling)

    def post_request(self, request_id: str, prompt: Any, final_stage_id: int | None = None) -> None:
        """Put the add on the request queue's sync side (blocks while 256 are queued, as there)."""
        self.request_queue.sync_q.put(self._message(request_id, final_stage_id))

    def add_request(self, request_id: str, prompt: Any, *, final_stage_id: int | None = None,
                    wait: bool = True, timeout: float = 5.0, deadline: float | None = None,
                    **options: Any) -> None:
        """The engine's add (put and return); with ``wait``, until stage 0 got it or the orchestrator ended.

        Raises what the put raises once the request queue is closed.
        """
        resumable = bool(options.pop("resumable", False))
        companions = dict(options.pop("companions", None) or {})
        if options or deadline is not None:
            raise Unsupported(f"{self.name}: add_request options {sorted(options)} / deadline")
        if companions and self.forward_fn is None:
            raise Unsupported(f"{self.name}: vLLM-Omni bundles CFG companions only into a diffusion stage's "
                              "input (give the driver a forward function)")
        ev = self._submitted.setdefault(request_id, threading.Event()) if wait else None
        self.request_queue.sync_q.put(self._message(request_id, final_stage_id, resumable=resumable))
        for companion_id in companions:  # the engine puts them after the parent's message
            self.request_queue.sync_q.put(self._companion(request_id, companion_id))
        if ev is None:
            return
        end = time.monotonic() + timeout
        while not ev.wait(0.01):
            if self.stopped:  # taken by a queue nobody reads any more: the engine's call had returned too
                return
            if time.monotonic() > end:
                raise TimeoutError(f"request {request_id!r} was not submitted within {timeout}s")

    def update_request(self, request_id: str, segment: Any, *, final: bool = False,
                       timeout: float = 5.0) -> None:
        """The engine's ``add_streaming_update``; returns once the orchestrator took and handled it."""
        self.request_queue.sync_q.put(self._message(request_id, None, kind="streaming_update",
                                                    resumable=not final))
        end = time.monotonic() + timeout
        while self.request_queue.sync_q.qsize() and not self.stopped:
            if time.monotonic() > end:
                raise TimeoutError(f"update of {request_id!r} was not taken within {timeout}s")
            time.sleep(0.001)
        for _ in range(3):  # the handler runs on: let it finish what it took
            if self.stopped:
                return
            self.call(lambda: None, timeout=max(0.0, end - time.monotonic()))

    def abort(self, request_id: str) -> None:
        """Fire-and-forget, as the engine's ``abort``: nothing once shutdown was asked for."""
        from vllm_omni.engine.messages import AbortRequestMessage

        if self.shutdown_asked:
            return
        self.request_queue.sync_q.put(AbortRequestMessage(request_ids=[request_id]))

    def send_shutdown(self, timeout: float | None) -> None:
        """As the engine's shutdown: the message, put with a bound (it may wait behind a full queue)."""
        from vllm_omni.engine.messages import ShutdownRequestMessage

        self.shutdown_asked = True
        self.request_queue.sync_q.put(ShutdownRequestMessage(), timeout=5.0)

    def collective_rpc(self, method: str, args: Sequence[Any] = (), kwargs: Mapping[str, Any] | None = None,
                       stage_ids: Iterable[int] | None = None, timeout: float = 5.0) -> list[RpcResult]:
        """The engine's ``collective_rpc``: request, then result from the RPC queue or TimeoutError."""
        from vllm_omni.engine.messages import CollectiveRPCRequestMessage

        rpc_id = f"bench-{next(self._rpc_ids)}"
        ids = None if stage_ids is None else list(stage_ids)
        self.request_queue.sync_q.put(CollectiveRPCRequestMessage(
            rpc_id=rpc_id, method=method, timeout=timeout, args=tuple(args), kwargs=dict(kwargs or {}),
            stage_ids=ids), timeout=timeout)
        end = time.monotonic() + timeout
        with self._rpc_lock:
            while True:
                try:
                    msg = self.rpc_queue.sync_q.get(timeout=max(0.0, end - time.monotonic()))
                except queue.Empty:
                    raise TimeoutError(f"collective_rpc timed out after {timeout} seconds") from None
                if getattr(msg, "type", None) == "error":
                    raise RuntimeError(msg.error)
                if getattr(msg, "rpc_id", None) == rpc_id:
                    break
        return [_rpc_result(k, v) for k, v in zip(msg.stage_ids, msg.results, strict=True)]

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

    async def loop_next_batch(self) -> list[Message] | None:
        """(In the loop.)  One message from the output queue's async side; None once it is shut down."""
        import janus

        while True:
            try:
                msg = await self.output_queue.async_q.get()
            except janus.AsyncQueueShutDown:
                return None
            out = _to_message(msg)
            if out is not None:
                return [out]

    def loop_add(self, request_id: str, prompt: Any, final_stage_id: int | None = None) -> None:
        """(In the loop.)  The add message on the request queue's async side, without waiting."""
        self.request_queue.async_q.put_nowait(self._message(request_id, final_stage_id))

    @property
    def router(self) -> Any:
        """vLLM-Omni's request table, read as a scenario reads a routing core's (``requests``)."""
        return RequestTable(self.orch)

    @property
    def dropped_outputs(self) -> int:
        """The outputs vLLM-Omni's orchestrator dropped, as it reports them: one warning each."""
        return self._drops.count

    @property
    def active_requests(self) -> int:
        return len(self.orch.request_states) if self.orch is not None else 0


class _DropCounter(logging.Handler):
    """Counts vLLM-Omni's "dropping output for unknown req" warnings (it keeps no counter of its own)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        if str(record.msg).startswith(DROPPED_OUTPUT_LOG):
            self.count += 1


@dataclass(slots=True)
class RequestView:
    """One ``OrchestratorRequestState`` as a scenario reads a routing core's request."""

    state: Any

    @property
    def finished(self) -> set[int]:
        """The stages that finished the request (``finished_stage_ids``)."""
        return set(self.state.finished_stage_ids)


@dataclass(slots=True)
class RequestTable:
    """The orchestrator's ``request_states``: the requests it holds state for (registered, not ended)."""

    orch: Any

    @property
    def requests(self) -> dict[str, RequestView]:
        states = dict(self.orch.request_states) if self.orch is not None else {}
        return {rid: RequestView(st) for rid, st in states.items()}

    @property
    def live_count(self) -> int:
        return len(self.requests)


def _route_vllm_logs() -> None:
    """Send vLLM's (and vLLM-Omni's) records through the root logger, as every implementation's go.

    vLLM configures its ``vllm`` logger (vLLM-Omni's hang under it) not to
    propagate and to print to stdout itself; the comparison reads warnings at
    the root, so without this what vLLM-Omni reports would count as swallowed.
    """
    import logging

    vllm_logger = logging.getLogger("vllm")
    vllm_logger.propagate = True
    vllm_logger.handlers.clear()


def _rpc_result(stage_id: int, value: Any) -> RpcResult:
    """A replica's answer (the pool reports a failed call as ``{"supported": False, "error": ...}``)."""
    if isinstance(value, dict) and value.get("supported") is False:
        return RpcResult(stage_id, 0, None, str(value.get("error")))
    return RpcResult(stage_id, 0, value, None)


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
