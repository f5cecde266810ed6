"""The one thread-side driver every bench job uses: :class:`Driver`.

A serving system talks to its orchestrator from another thread; so does a
driver.  Each implementation runs in a background thread with its own event
loop and the driver hands calls over the way that implementation's thread
bridge does (the Trio token, janus queues plus ``call_soon_threadsafe``, the
production ``ThreadEngine``), so the comparison and the benchmark both measure an
implementation as a serving front sees it.

The stages are scripted in-process stage clients
(:class:`trio_orch.testing.ScriptedStage` or its asyncio twin
:class:`bench.refs.testing.AsyncScriptedStage`), optionally misbehaving
(``misbehaviour``: the comparison's faulty stages) or pushing (``push``: the
Trio side's fast path, as a replica pool has it), or real ``stages.worker``
processes (``workers``: a pipeline config)::

    with make_driver("trio", num_stages=2, final_stage_ids={1}) as d:
        d.add_request("r1", "hi")               # returns once registered + submitted
        d.emit(0, "r1", "x", finished=True)      # stage 0 produces an output
        msg = d.next_output(timeout=2)           # OrchOutput | OrchError
        report = d.shutdown()                    # ShutdownReport(seconds, hung, ...)

Two ways in: :meth:`Driver.add_request` (waits, reports errors) and
:meth:`Driver.post_request` (the benchmark's: hands the add over and returns).
Two ways out: :meth:`Driver.next_output` (one message, kept in ``received``)
and :meth:`Driver.next_batch` (a batch as the bridge delivered it).  Not every
implementation offers everything: :mod:`bench.implementations` says which
supports what, and an unsupported call raises :class:`Unsupported`.
"""

from __future__ import annotations

import asyncio
import collections
import queue
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import sniffio

from stages.config import PipelineConfig
from trio_orch.testing import Misbehaviour
from trio_orch.types import Message, RpcResult, StageOutput

__all__ = ["Driver", "EndOfStream", "ShutdownReport", "Unsupported", "thread_cpu_seconds"]


class EndOfStream(Exception):
    """The orchestrator stopped and every message was consumed."""


class Unsupported(NotImplementedError):
    """The implementation behind this driver does not offer the call (see bench.implementations)."""


@dataclass(slots=True)
class ShutdownReport:
    """What :meth:`Driver.shutdown` measured."""

    seconds: float  #: from the call to the implementation's run() returning, or to the cut
    hung: bool  #: run() had not returned when the watchdog cut the wait
    run_error: BaseException | None  #: what run() raised, if anything
    tasks_alive_after_run: int | None  #: the implementation's tasks still alive when run() returned


def thread_cpu_seconds(thread: threading.Thread | None) -> float:
    """CPU time consumed so far by ``thread`` (Linux: its pthread CPU clock)."""
    ident = thread.ident if thread is not None else None
    if ident is None:
        return 0.0
    try:
        return time.clock_gettime(time.pthread_getcpuclockid(ident))
    except (OSError, AttributeError):  # thread gone, or not Linux
        return 0.0


class Driver:
    """Thread-side driver of one implementation (see the module docstring).

    ``name`` is the implementation's name in :mod:`bench.implementations`.
    ``misbehaviour`` maps a stage index to the faults its scripted stage has.
    ``push``: scripted stages offer the push fast path where the implementation
    has one.  ``in_loop_consumer=True`` leaves outputs in the implementation's
    own output channel/queue, for a consumer running inside its loop.
    ``workers`` (a :class:`~stages.config.PipelineConfig`, e.g.
    ``echo_config(2)``) replaces the scripted stages by real worker processes;
    the config then sets the number of stages, the final stages and
    async-chunk mode, and the stage-side calls are not available.

    Subclasses run the implementation in :meth:`thread_main` and call
    :meth:`set_started` once it accepts requests (or failed to start) and
    :meth:`set_returned` once its run() returned.
    """

    framework = "?"

    def __init__(
        self,
        num_stages: int = 3,
        final_stage_ids: Iterable[int] = (2,),
        *,
        name: str = "?",
        async_chunk: bool = False,
        forward_fn: Callable[[int, Any, list[Any]], Any] | None = None,
        prewarm_fn: Callable[[int, Any], Any] | None = None,
        misbehaviour: dict[int, Misbehaviour] | None = None,
        push: bool = False,
        shutdown_grace: float = 2.0,
        request_queue_size: int = 256,
        in_loop_consumer: bool = False,
        workers: PipelineConfig | None = None,
    ) -> None:
        if workers is not None:  # real stage workers: the pipeline config decides the shape
            from trio_orch.cluster import launcher
            num_stages, final_stage_ids = len(workers.stages), workers.final_stage_ids
            async_chunk = workers.async_chunk
            forward_fn = forward_fn or launcher.forward_fn_for(workers.kinds(), workers.roles())
            prewarm_fn = prewarm_fn or launcher.prewarm_fn
        self.name = name
        self.workers = workers
        self.worker_pids: list[int] = []
        self.worker_dir: str | None = None  # the workers' private ipc directory
        self.num_stages = num_stages
        self.final_stage_ids = frozenset(final_stage_ids)
        self.async_chunk = async_chunk
        self.forward_fn = forward_fn
        self.prewarm_fn = prewarm_fn
        self.misbehaviour = misbehaviour or {}
        self.push = push
        self.shutdown_grace = shutdown_grace
        self.request_queue_size = request_queue_size
        self.in_loop_consumer = in_loop_consumer
        self.stages: list[Any] = []
        self.thread: threading.Thread | None = None  # the implementation's loop thread
        self.run_error: BaseException | None = None
        self.tasks_alive_after_run: int | None = None
        self.tasks_pending_at_loop_end: int | None = None
        self.alive_after_run_names: list[str] = []
        self.received: list[Message] = []  # everything next_output returned, in order
        self.rpc_hangs_ended: list[tuple[int, str]] = []  # hung RPC handlers given up on (see on_rpc)
        #: (stage, request id, perf_counter) per submit to a scripted stage, in submit order
        self.submitted: queue.SimpleQueue[tuple[int, str, float]] = queue.SimpleQueue()
        self._started = threading.Event()
        self._returned = threading.Event()
        self._start_error: BaseException | None = None
        self._pending: collections.deque[Message] = collections.deque()
        self._ended = False

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name}>"

    @property
    def startup_timeout(self) -> float:
        """How long :meth:`start` waits: worker processes may load torch models first."""
        return 10.0 if self.workers is None else self.workers.startup_timeout + 10.0

    # ------------------------------------------------------------------ lifecycle
    def start(self, timeout: float | None = None) -> Driver:
        """Start the implementation's thread; return once it accepts requests.  Idempotent."""
        if self.thread is not None:
            return self
        timeout = self.startup_timeout if timeout is None else timeout
        self.thread = threading.Thread(target=self.thread_main, name=f"orchestrator-{self.name}",
                                       daemon=True)
        self.thread.start()
        if not self._started.wait(timeout):
            raise TimeoutError(f"{self.name}: orchestrator did not start within {timeout}s")
        if self._start_error is not None:
            raise RuntimeError(f"{self.name}: orchestrator failed to start") from self._start_error
        return self

    def __enter__(self) -> Driver:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        if not self._returned.is_set():
            self.shutdown(wait=5.0)

    def request_shutdown(self, timeout: float | None = None) -> None:
        """Begin shutting down without waiting (``timeout``: let active requests finish that long)."""
        self.send_shutdown(timeout)

    def shutdown(self, timeout: float | None = None, *, wait: float = 5.0) -> ShutdownReport:
        """Ask for shutdown (drain up to ``timeout``); wait up to ``wait`` s for run() to return."""
        t0 = time.perf_counter()
        if not self._returned.is_set():
            try:
                self.send_shutdown(timeout)
            except Exception:  # the loop is already gone
                pass
        ok = self._returned.wait(wait)
        seconds = time.perf_counter() - t0
        return ShutdownReport(seconds, not ok, self.run_error, self.tasks_alive_after_run)

    def close(self, wait: float = 30.0) -> None:
        """Shut down and join the thread; RuntimeError if it does not end within ``wait`` s."""
        t_end = time.monotonic() + wait
        self.shutdown(wait=wait)
        if not self.join(max(0.0, t_end - time.monotonic())):
            raise RuntimeError(f"{self.name}: thread did not stop within {wait:.0f} s")

    def abandon(self) -> None:
        """After a watchdog cut: stop the loop thread as far as the framework allows (best effort)."""

    def join(self, timeout: float) -> bool:
        """Wait for the implementation's thread to end; True if it did."""
        if self.thread is None:
            return True
        self.thread.join(timeout)
        return not self.thread.is_alive()

    @property
    def stopped(self) -> bool:
        return self._returned.is_set()

    def cpu_seconds(self) -> float:
        """CPU time of the implementation's loop thread so far."""
        return thread_cpu_seconds(self.thread)

    # ------------------------------------------------------------------ for subclasses
    def set_started(self, error: BaseException | None = None) -> None:
        """(Loop thread.)  The implementation accepts requests now, or failed to start."""
        if error is not None and self._start_error is None:
            self._start_error = error
        self._started.set()

    def set_returned(self) -> None:
        """(Loop thread.)  The implementation's run() returned."""
        self._returned.set()

    def record_submission(self, stage_id: int, request_id: str) -> None:
        """A scripted stage's ``on_submit`` hook: timestamp the submit for :meth:`wait_submission`."""
        self.submitted.put((stage_id, request_id, time.perf_counter()))

    def thread_main(self) -> None:
        """(Loop thread.)  Run the implementation until it stops."""
        raise Unsupported(f"{self.name} has no loop thread of its own")

    def send_shutdown(self, timeout: float | None) -> None:
        """Hand the implementation's request_shutdown over to its loop."""
        raise Unsupported(f"{self.name}: shutdown")

    def take_batch(self, timeout: float) -> list[Message] | None:
        """The next batch from the bridge, None at end of stream; raise TimeoutError."""
        raise Unsupported(f"{self.name}: outputs")

    # ------------------------------------------------------------------ consuming
    def next_batch(self, timeout: float = 10.0) -> list[Message]:
        """The next batch of messages as the bridge delivered it; TimeoutError or EndOfStream."""
        if self._ended:
            raise EndOfStream
        batch = self.take_batch(timeout)
        if batch is None:
            self._ended = True
            raise EndOfStream
        return batch

    def next_output(self, timeout: float = 5.0) -> Message:
        """Next message in delivery order; TimeoutError, or EndOfStream once all was consumed."""
        deadline = time.monotonic() + timeout
        while not self._pending:  # (a batch may be empty)
            self._pending.extend(self.next_batch(max(0.0, deadline - time.monotonic())))
        msg = self._pending.popleft()
        self.received.append(msg)
        return msg

    def collect(self, n: int, timeout: float = 5.0) -> list[Message]:
        """Exactly ``n`` messages (TimeoutError if they do not come within ``timeout`` overall)."""
        deadline = time.monotonic() + timeout
        return [self.next_output(max(0.0, deadline - time.monotonic())) for _ in range(n)]

    def drain(self, timeout: float = 5.0) -> tuple[list[Message], bool]:
        """Messages until end of stream; ``(messages, reached_end)``."""
        deadline = time.monotonic() + timeout
        out: list[Message] = []
        while True:
            try:
                out.append(self.next_output(max(0.0, deadline - time.monotonic())))
            except EndOfStream:
                return out, True
            except TimeoutError:
                return out, False

    def wait_until(self, predicate: Callable[[], bool], timeout: float = 5.0) -> bool:
        deadline = time.monotonic() + timeout
        while not predicate():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.001)
        return True

    # ------------------------------------------------------------------ requests
    def add_request(self, request_id: str, prompt: Any, *, final_stage_id: int | None = None,
                    wait: bool = True, timeout: float = 5.0, deadline: float | None = None,
                    **options: Any) -> None:
        """Accept a request; with ``wait`` return once it is registered and submitted.

        ``timeout`` bounds that wait; ``deadline`` (seconds) is the request's own
        deadline, kept by the orchestrator (terminal ``OrchError(kind="timeout")``).
        ``options`` go to the implementation's ``add_request`` as they are
        (``resumable``, ``sampling``, ``companions``).

        Raises ``ValueError`` for bad input or a duplicate active id and
        ``RuntimeError`` once the orchestrator no longer accepts requests.
        """
        raise Unsupported(f"{self.name}: add_request")

    def update_request(self, request_id: str, segment: Any, *, final: bool = False,
                       timeout: float = 5.0) -> None:
        """One more input segment for a resumable request; returns once it was handled.

        Raises what the implementation raises (``ValueError`` for a bad update).
        """
        raise Unsupported(f"{self.name}: update_request")

    def post_request(self, request_id: str, prompt: Any, final_stage_id: int | None = None) -> None:
        """Hand an add over to the loop and return at once (the benchmark's way in).

        Never waits for the orchestrator (a full request queue is the loop's
        business where the bridge allows it); errors are not reported back.
        """
        raise Unsupported(f"{self.name}: post_request")

    def abort(self, request_id: str) -> None:
        raise Unsupported(f"{self.name}: abort")

    def collective_rpc(self, method: str, args: Sequence[Any] = (), kwargs: Mapping[str, Any] | None = None,
                       stage_ids: Iterable[int] | None = None, timeout: float = 5.0) -> list[RpcResult]:
        """Call ``method`` on every stage's replicas the implementation's way; blocks for the answers.

        Raises ``ValueError`` for invalid stage ids.
        """
        raise Unsupported(f"{self.name}: collective_rpc")

    # ------------------------------------------------------------------ the loop thread
    def call(self, fn: Callable[..., Any], *args: Any, timeout: float = 5.0) -> Any:
        """Run a sync ``fn`` in the loop thread and return its result."""
        raise Unsupported(f"{self.name}: call")

    def call_soon(self, fn: Callable[..., Any], *args: Any) -> None:
        """Schedule a sync ``fn`` in the loop thread (FIFO with other handovers)."""
        raise Unsupported(f"{self.name}: call_soon")

    def run_in_loop(self, afn: Callable[..., Any], *args: Any, timeout: float = 10.0) -> Any:
        """Run an async function in the loop thread and return its result."""
        raise Unsupported(f"{self.name}: run_in_loop")

    async def loop_next_batch(self) -> list[Message] | None:
        """(Call inside the loop.)  Next batch from the implementation's own output queue."""
        raise Unsupported(f"{self.name}: loop_next_batch")

    def loop_emit(self, stage: int, outputs: list[StageOutput]) -> None:
        """(Call inside the loop.)  Stage ``stage`` produces ``outputs`` now (no thread hand-off)."""
        self.stages[stage].emit_batch_nowait(outputs)

    def loop_add(self, request_id: str, prompt: Any, final_stage_id: int | None = None) -> None:
        """(Call inside the loop.)  Accept a request without waiting (the channel has room)."""
        raise Unsupported(f"{self.name}: loop_add")

    @property
    def router(self) -> Any:
        """The implementation's routing core (:class:`trio_orch.core.Router`)."""
        raise Unsupported(f"{self.name}: router")

    @property
    def active_requests(self) -> int:
        """Accepted requests without their terminal yet (read from this thread, as a gauge)."""
        return int(self.router.live_count)

    @property
    def dropped_outputs(self) -> int:
        return int(self.call(lambda: self.router.dropped_outputs))

    # ------------------------------------------------------------------ membership
    def attach_replica(self, stage_id: int, member_id: str, handshake_s: float) -> None:
        """Begin a replica's join of ``stage_id`` whose handshake takes ``handshake_s`` seconds.

        Returns at once; the outcome (``joined`` or ``refused:<reason>``, or
        ``cancelled``) lands in :meth:`join_outcomes` when the join ends.
        """
        raise Unsupported(f"{self.name}: attach_replica")

    def join_outcomes(self) -> dict[str, str]:
        """How each join begun with :meth:`attach_replica` ended so far (member id -> outcome)."""
        raise Unsupported(f"{self.name}: join_outcomes")

    # ------------------------------------------------------------------ stage side
    def submissions(self, stage: int) -> list[tuple[str, Any]]:
        return list(self.stages[stage].submissions)

    def aborts(self, stage: int) -> list[str]:
        return list(self.stages[stage].aborts)

    def updates(self, stage: int) -> list[tuple[str, Any]]:
        return list(self.stages[stage].updates)

    def stage_record(self, stage: int, what: str) -> list[Any]:
        """Any list a scripted stage records (``sampling``, ``companions``, ``final_updates``...)."""
        return list(getattr(self.stages[stage], what))

    def wait_submission(self, timeout: float = 10.0) -> tuple[int, str, float]:
        """The next submit a scripted stage saw: ``(stage, request id, perf_counter)``."""
        try:
            return self.submitted.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"{self.name}: no submission within {timeout}s") from None

    def emit(self, stage: int, request_id: str, data: Any = None, finished: bool = False,
             error: str | None = None) -> None:
        """Make stage ``stage`` produce an output (handed over to the loop thread, in order)."""
        self.call_soon(self.stages[stage].emit_nowait, request_id, data, finished, error)

    def emit_batch(self, stage: int, outputs: list[StageOutput]) -> None:
        """Hand ready-made outputs to stage ``stage`` in one loop wakeup (the benchmark's hand-over)."""
        self.call_soon(self.stages[stage].emit_batch_nowait, outputs)

    def fail_stage(self, stage: int, exc: BaseException | None = None) -> None:
        self.call_soon(self.stages[stage].fail_nowait, exc)

    def close_under_reader(self, stage: int) -> None:
        self.call_soon(self.stages[stage].close_under_reader)

    def hold_submits(self, stage: int) -> None:
        self.call(self.stages[stage].hold_submits)

    def on_rpc(self, stage: int, method: str, value: Any = None, *, hang: bool = False) -> None:
        """Make stage ``stage`` answer RPC ``method`` with ``value`` -- or never (``hang``).

        A hung call ends only when the implementation gives up on it (its
        deadline, a shutdown); ``(stage, method)`` is then appended to
        :attr:`rpc_hangs_ended`, so a scenario can tell what happened before that.
        """
        async def answer(*args: Any, **kwargs: Any) -> Any:
            if hang:  # whichever loop runs the stage
                try:
                    if sniffio.current_async_library() == "trio":
                        import trio

                        await trio.sleep_forever()
                    else:
                        await asyncio.Event().wait()
                finally:
                    self.rpc_hangs_ended.append((stage, method))
            return value

        self.call(self.stages[stage].on_rpc, method, answer)

    def release_submits(self, stage: int) -> None:
        self.call_soon(self.stages[stage].release_submits)
