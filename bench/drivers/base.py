"""One thread-side driver for every implementation, so one scenario runs against all of them.

A serving system talks to its orchestrator from another thread; so does the
:class:`Harness`.  Each implementation runs in a background thread with its
own event loop (``trio.run`` for :class:`TrioHarness`; a fresh asyncio loop
for :class:`AsyncioHarness`), and the harness hands calls over the way that
implementation's thread bridge does: the Trio token (``trio.from_thread`` /
``TrioToken.run_sync_soon``) or janus queues plus ``call_soon_threadsafe``.

Outputs come back in batches (one per routing step) and the consumer is woken
once per batch.  Stages are scripted (:class:`bench.trio_stages.TrioScriptedStage`
or :class:`bench.refs.testing.AsyncScriptedStage`, optionally misbehaving)
and driven from the thread with :meth:`Harness.emit`, :meth:`Harness.fail_stage`...

    with make_harness("trio", num_stages=2, final_stage_ids={1}) as h:
        h.add_request("r1", "hi")               # returns once registered + submitted
        h.emit(0, "r1", "x", finished=True)      # stage 0 produces an output
        msg = h.next_output(timeout=2)           # OrchOutput | OrchError
        report = h.shutdown()                    # ShutdownReport(seconds, hung, ...)
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from bench.misbehaviour import Misbehaviour
from trio_orch.types import Message

__all__ = [
    "IMPLEMENTATIONS",
    "EndOfStream",
    "Harness",
    "ShutdownReport",
    "make_harness",
]



class EndOfStream(Exception):
    """The orchestrator stopped and every message was consumed."""


@dataclass(slots=True)
class ShutdownReport:
    """What :meth:`Harness.shutdown` measured."""

    seconds: float  #: from the call to the implementation's run() returning, or to the cut
    hung: bool  #: run() had not returned when the watchdog cut the wait
    run_error: BaseException | None  #: what run() raised, if anything
    tasks_alive_after_run: int | None  #: the implementation's tasks still alive when run() returned


class Harness:
    """Thread-side driver of one implementation (see module docstring).

    ``misbehaviour`` maps a stage index to the faults that stage has.
    ``in_loop_consumer=True`` leaves outputs in the implementation's own
    output channel/queue, for a consumer running inside its loop.
    ``workers`` (a :class:`trio_orch.config.PipelineConfig`, e.g. ``echo_config(2)``)
    replaces the scripted stages by real ``stages.worker`` processes over ZMQ
    (Trio: ``open_pipeline``; asyncio: :func:`bench.refs.transport.open_worker_stages`);
    the config then sets the number of stages, the final stages and async-chunk mode,
    and ``emit``/``fail_stage`` are not available.
    """

    framework = "?"
    impl = "?"

    def __init__(
        self,
        num_stages: int = 3,
        final_stage_ids: Iterable[int] = (2,),
        *,
        async_chunk: bool = False,
        forward_fn: Callable[[int, Any, list[Any]], Any] | None = None,
        prewarm_fn: Callable[[int, Any], Any] | None = None,
        misbehaviour: dict[int, Misbehaviour] | None = None,
        shutdown_grace: float = 2.0,
        request_queue_size: int = 256,
        in_loop_consumer: bool = False,
        workers: Any = None,
    ) -> None:
        if workers is not None:  # real stage workers: the pipeline config decides the shape
            from trio_orch import launcher

            num_stages, final_stage_ids = len(workers.stages), workers.final_stage_ids
            async_chunk = workers.async_chunk
            forward_fn = forward_fn or launcher.forward_fn_for([st.kind for st in workers.stages])
            prewarm_fn = prewarm_fn or launcher.prewarm_fn
        self.workers = workers
        self.worker_pids: list[int] = []
        self.worker_dir: str | None = None  # the workers' private ipc directory
        self.num_stages = num_stages
        self.final_stage_ids = frozenset(final_stage_ids)
        self.async_chunk = async_chunk
        self.forward_fn = forward_fn
        self.prewarm_fn = prewarm_fn
        self.misbehaviour = misbehaviour or {}
        self.shutdown_grace = shutdown_grace
        self.request_queue_size = request_queue_size
        self.in_loop_consumer = in_loop_consumer
        self.stages: list[Any] = []
        self.run_error: BaseException | None = None
        self.tasks_alive_after_run: int | None = None
        self.tasks_pending_at_loop_end: int | None = None
        self.alive_after_run_names: list[str] = []
        self.received: list[Message] = []  # everything next_output returned, in order
        self._thread: threading.Thread | None = None
        self._started = threading.Event()
        self._run_returned = threading.Event()
        self._start_error: BaseException | None = None
        self._pending: collections.deque[Message] = collections.deque()
        self._ended = False

    # ------------------------------------------------------------------ lifecycle
    def start(self, timeout: float = 10.0) -> Harness:
        """Start the implementation's thread; return once it accepts requests.  Idempotent."""
        if self._thread is not None:
            return self
        self._thread = threading.Thread(target=self._thread_main, name=f"orchestrator-{self.impl}",
                                        daemon=True)
        self._thread.start()
        if not self._started.wait(timeout):
            raise TimeoutError(f"{self.impl}: orchestrator did not start within {timeout}s")
        if self._start_error is not None:
            raise RuntimeError(f"{self.impl}: orchestrator failed to start") from self._start_error
        return self

    def __enter__(self) -> Harness:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        if not self._run_returned.is_set():
            self.shutdown(wait=5.0)

    def request_shutdown(self, timeout: float | None = None) -> None:
        """Begin shutting down without waiting (``timeout``: let active requests finish that long)."""
        self._request_shutdown(timeout)

    def shutdown(self, timeout: float | None = None, *, wait: float = 5.0) -> ShutdownReport:
        """Ask for shutdown (drain up to ``timeout``); wait up to ``wait`` s for run() to return."""
        t0 = time.perf_counter()
        if not self._run_returned.is_set():
            try:
                self._request_shutdown(timeout)
            except Exception:  # the loop is already gone
                pass
        ok = self._run_returned.wait(wait)
        seconds = time.perf_counter() - t0
        return ShutdownReport(seconds, not ok, self.run_error, self.tasks_alive_after_run)

    def abandon(self) -> None:
        """After a watchdog cut: stop the loop thread as far as the framework allows (best effort)."""

    def join(self, timeout: float) -> bool:
        """Wait for the implementation's thread to end; True if it did."""
        assert self._thread is not None
        self._thread.join(timeout)
        return not self._thread.is_alive()

    @property
    def stopped(self) -> bool:
        return self._run_returned.is_set()

    # ------------------------------------------------------------------ consuming
    def next_output(self, timeout: float = 5.0) -> Message:
        """Next message in delivery order; TimeoutError, or EndOfStream once all was consumed."""
        deadline = time.monotonic() + timeout
        while not self._pending:  # (a batch may be empty)
            if self._ended:
                raise EndOfStream
            batch = self._next_batch(max(0.0, deadline - time.monotonic()))
            if batch is None:
                self._ended = True
                raise EndOfStream
            self._pending.extend(batch)
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

    # ------------------------------------------------------------------ stage side
    def submissions(self, stage: int) -> list[tuple[str, Any]]:
        return list(self.stages[stage].submissions)

    def aborts(self, stage: int) -> list[str]:
        return list(self.stages[stage].aborts)

    def emit(self, stage: int, request_id: str, data: Any = None, finished: bool = False,
             error: str | None = None) -> None:
        """Make stage ``stage`` produce an output (handed over to the loop thread, in order)."""
        self.call_soon(self.stages[stage].emit_nowait, request_id, data, finished, error)

    def fail_stage(self, stage: int, exc: BaseException | None = None) -> None:
        self.call_soon(self.stages[stage].fail_nowait, exc)

    def close_under_reader(self, stage: int) -> None:
        self.call_soon(self.stages[stage].close_under_reader)

    def hold_submits(self, stage: int) -> None:
        self.call(self.stages[stage].hold_submits)

    def release_submits(self, stage: int) -> None:
        self.call_soon(self.stages[stage].release_submits)

    # ------------------------------------------------------------------ implementation hooks
    def _thread_main(self) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def _request_shutdown(self, timeout: float | None) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def _next_batch(self, timeout: float) -> list[Message] | None:  # pragma: no cover - abstract
        """A batch of messages, None at end of stream; raise TimeoutError."""
        raise NotImplementedError

    def add_request(self, request_id: str, prompt: Any, *, final_stage_id: int | None = None,
                    wait: bool = True, timeout: float = 5.0, deadline: float | None = None) -> None:
        """Accept a request; with ``wait`` return once it is registered and submitted.

        ``timeout`` bounds that wait; ``deadline`` (seconds) is the request's own
        deadline, kept by the orchestrator (terminal ``OrchError(kind="timeout")``).

        Raises ``ValueError`` for bad input or a duplicate active id and
        ``RuntimeError`` once the orchestrator no longer accepts requests.
        """
        raise NotImplementedError

    def abort(self, request_id: str) -> None:
        raise NotImplementedError

    def call(self, fn: Callable[..., Any], *args: Any, timeout: float = 5.0) -> Any:
        """Run a sync ``fn`` in the loop thread and return its result."""
        raise NotImplementedError

    def call_soon(self, fn: Callable[..., Any], *args: Any) -> None:
        """Schedule a sync ``fn`` in the loop thread (FIFO with other handovers)."""
        raise NotImplementedError

    def run_in_loop(self, afn: Callable[..., Any], *args: Any, timeout: float = 10.0) -> Any:
        """Run an async function in the loop thread and return its result."""
        raise NotImplementedError

    @property
    def dropped_outputs(self) -> int:
        return self.call(lambda: self._router().dropped_outputs)

    @property
    def active_requests(self) -> int:
        raise NotImplementedError

    def _router(self) -> Any:
        raise NotImplementedError

    # in-loop consumer support ------------------------------------------------
    async def loop_next_batch(self) -> list[Message] | None:
        """(Call inside the loop.)  Next batch from the implementation's own output queue."""
        raise NotImplementedError


def _load() -> dict[str, type[Harness]]:
    from bench.drivers.asyncio import (
        OmniEventHarness,
        OmniPollingHarness,
        TaskGroupHarness,
    )
    from bench.drivers.trio import TrioHarness

    return {h.impl: h for h in (TrioHarness, OmniEventHarness, OmniPollingHarness, TaskGroupHarness)}


#: implementation name -> what it is (the order of the comparison's columns)
IMPLEMENTATIONS: dict[str, str] = {
    "trio": "trio_orch.Orchestrator: one nursery, memory channels, Trio token bridge",
    "omni-event": "vLLM-Omni style: thread + loop, janus, create_task, readers -> ready queue -> dispatcher, "
                  "cancel-all + gather + all_tasks sweep",
    "omni-poll": "vLLM-Omni legacy polling loop: each stage polled with a 1 ms wait, 1 ms sleep when idle",
    "asyncio-taskgroup": "modern asyncio: the same under asyncio.TaskGroup + asyncio.timeout, no sweep",
}


def make_harness(impl: str, *args: Any, **kwargs: Any) -> Harness:
    """A (not yet started) harness for implementation ``impl`` (a key of IMPLEMENTATIONS)."""
    classes = _load()
    if impl not in classes:
        raise ValueError(f"unknown implementation {impl!r}: choose from {', '.join(IMPLEMENTATIONS)}")
    return classes[impl](*args, **kwargs)
