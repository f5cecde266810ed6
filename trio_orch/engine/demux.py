"""Per-request output streams: the engine's demultiplexer.

The orchestrator calls :meth:`Demux.sink` once per dispatcher batch, in the
Trio thread.  The sink groups the batch by request and hands each waiting
consumer *one* item per batch: ``(t_handover, [messages])``.  A consumer is
one of three kinds, each woken the cheapest way its world allows:

* :class:`SyncStream` -- a plain thread blocked on a ``queue.SimpleQueue``;
* :class:`AsyncioStream` -- an asyncio task awaiting a future; the sink
  wakes each event loop at most once per batch (``call_soon_threadsafe``
  with the list of streams to wake) and not at all when the task is busy;
* :class:`TrioStream` -- a task in the orchestrator's own Trio run.

No lock on the hot path: ``deque.append``/``popleft`` and dict get/set are
atomic under the GIL, and the asyncio wake protocol (the consumer publishes
its waiter, then re-checks its buffer; the producer appends, then reads the
waiter) can only produce a spurious wake, never a lost one.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections import deque
from collections.abc import Callable
from time import perf_counter
from typing import Any

import trio

from trio_orch.histogram import REQUEST_TIME_BUCKETS, Histogram
from trio_orch.types import Message, OrchError, OrchOutput

__all__ = ["ACK", "WITHDRAWN", "AsyncioStream", "Demux", "Stream", "SyncStream", "TrioStream"]

ACK = "<accepted>"  # admission acknowledged (sync callers only)
WITHDRAWN = "<withdrawn>"  # admission withdrawn after the caller's timeout

PENDING, ADMITTED, DONE = 0, 1, 2


class Stream:
    """One request as its consumer sees it.

    ``state`` (Trio thread only, except the sink's final DONE): PENDING until
    the orchestrator accepted it, ADMITTED, DONE at the terminal.
    ``detached``: the consumer is gone (cancelled, closed early); the sink
    drops its messages but keeps the id reserved until its terminal.
    ``withdrawn``: a sync caller gave up waiting for admission.
    ``resumable``: the request takes more input segments (``update_request``).
    ``t_open`` (``perf_counter``) is when the caller asked; ``seen`` has bit k
    set once stage k's first output went out (time to first output);
    ``timings``, for a stream opened with ``want_timings``, is filled at its
    terminal with each stage's :class:`~trio_orch.cluster.pool.StageTiming` (None
    for a stage that did not run it or does not time requests).
    """

    __slots__ = ("companions", "detached", "final_stage_id", "priority", "prompt", "request_id", "resumable",
                 "sampling", "seen", "state", "t_open", "timeout", "timings", "want_ack", "want_timings",
                 "withdrawn")

    def __init__(self, request_id: str, prompt: Any, final_stage_id: int | None,
                 timeout: float | None, want_ack: bool = False, sampling: Any = None,
                 resumable: bool = False, want_timings: bool = False, companions: Any = None,
                 priority: int = 0) -> None:
        self.request_id = request_id
        self.priority = priority  # lower starts first (checked when opened)
        self.prompt = prompt
        self.companions = companions  # {id: stage-0 prompt} of its companion requests (CFG), or None
        self.final_stage_id = final_stage_id
        self.timeout = timeout
        self.sampling = sampling  # per-stage sampling parameters, checked when the request is accepted
        self.want_ack = want_ack
        self.resumable = resumable
        self.want_timings = want_timings
        self.timings: tuple[Any, ...] | None = None
        self.state = PENDING
        self.detached = False
        self.withdrawn = False
        self.t_open = perf_counter()
        self.seen = 0

    def put(self, item: Any) -> bool:
        """Hand ``item`` to the consumer; True when the caller must wake an asyncio loop."""
        raise NotImplementedError


class SyncStream(Stream):
    __slots__ = ("q",)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.q: queue.SimpleQueue[Any] = queue.SimpleQueue()

    def put(self, item: Any) -> bool:
        self.q.put(item)
        return False


class AsyncioStream(Stream):
    __slots__ = ("buf", "loop", "waiter")

    def __init__(self, *args: Any, loop: asyncio.AbstractEventLoop, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.loop = loop
        self.buf: deque[Any] = deque()
        self.waiter: asyncio.Future[None] | None = None

    def put(self, item: Any) -> bool:
        self.buf.append(item)
        return self.waiter is not None

    async def next_item(self) -> Any:
        """The next buffered item, waiting (without blocking the loop) when there is none."""
        buf = self.buf
        while not buf:
            fut = self.loop.create_future()
            self.waiter = fut
            if buf:  # the producer may have appended before it could see the waiter
                self.waiter = None
                break
            try:
                await fut
            finally:
                self.waiter = None
        return buf.popleft()


def _wake_asyncio(streams: list[AsyncioStream]) -> None:
    """Runs on the event loop: resolve the waiters of every stream in one go."""
    for s in streams:
        w = s.waiter
        if w is not None and not w.done():
            w.set_result(None)


class TrioStream(Stream):
    """A consumer task in the engine's own Trio run, parked on the stream itself.

    Its one waiting task is rescheduled by :meth:`put` directly -- no
    ``trio.Event`` (and its parking lot) built and set per wait, as the
    dispatcher's inbox does it.
    """

    __slots__ = ("buf", "waiter")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.buf: deque[Any] = deque()
        self.waiter: trio.lowlevel.Task | None = None

    def put(self, item: Any) -> bool:
        self.buf.append(item)
        task = self.waiter
        if task is not None:
            self.waiter = None
            trio.lowlevel.reschedule(task)
        return False

    async def next_item(self) -> Any:
        """The next buffered item; parks (cancellably) while there is none.  One consumer task only."""
        buf = self.buf
        while not buf:
            if self.waiter is not None:
                raise trio.BusyResourceError(f"another task already waits on request {self.request_id!r}")
            self.waiter = trio.lowlevel.current_task()
            await trio.lowlevel.wait_task_rescheduled(self._abort)
        return buf.popleft()

    def _abort(self, _: object) -> trio.lowlevel.Abort:
        self.waiter = None
        return trio.lowlevel.Abort.SUCCEEDED


def wake(by_loop: dict[asyncio.AbstractEventLoop, list[AsyncioStream]]) -> None:
    """One ``call_soon_threadsafe`` per event loop."""
    for loop, streams in by_loop.items():
        try:
            loop.call_soon_threadsafe(_wake_asyncio, streams)
        except RuntimeError:  # the loop is closed: nobody is waiting there any more
            pass


class Demux:
    """Routes each batch of orchestrator messages to the per-request streams.

    Also the engine's request-level measurements, taken where each message is
    handed over: time to the first output of each stage, end-to-end duration
    by terminal kind, and the admitted and shed counts.  ``timings_of(rid)``,
    if set, gives the per-stage timings stored on a stream at its terminal.
    """

    def __init__(self) -> None:
        self.streams: dict[str, Stream] = {}
        self.latency = Histogram()
        self.first_output: dict[int, Histogram] = {}  # stage -> seconds from the request to its first output
        self.duration: dict[str, Histogram] = {}  # terminal kind -> seconds from the request to it
        self.terminals_by_kind: dict[str, int] = {}
        self.errors_by_kind: dict[str, int] = {}
        self.admitted = 0  # requests the orchestrator accepted (they get a terminal)
        self.shed_by_reason: dict[str, int] = {}  # requests refused without being accepted
        self.unrouted = 0  # messages for ids no stream was registered for
        self.timings_of: Callable[[str], tuple[Any, ...]] | None = None
        self._sweep_lock = threading.Lock()

    def count_shed(self, reason: str) -> None:
        self.shed_by_reason[reason] = self.shed_by_reason.get(reason, 0) + 1

    def put(self, s: Stream, item: Any) -> None:
        """Hand ``item`` to ``s``'s consumer, waking its event loop if it waits."""
        if s.put(item):
            wake({s.loop: [s]})  # type: ignore[attr-defined]

    def _first_output(self, s: Stream, m: Message, now: float) -> None:
        if type(m) is OrchOutput and m.data is not None:
            bit = 1 << m.stage_id
            if not s.seen & bit:
                s.seen |= bit
                h = self.first_output.get(m.stage_id)
                if h is None:
                    h = self.first_output[m.stage_id] = Histogram(REQUEST_TIME_BUCKETS)
                h.observe(now - s.t_open)

    def register(self, stream: Stream) -> None:
        """Reserve the request id for ``stream``; ValueError if a live stream holds it."""
        if self.streams.setdefault(stream.request_id, stream) is not stream:
            raise ValueError(f"duplicate request id {stream.request_id!r}: a request with this id is active")

    def unregister(self, stream: Stream) -> None:
        stream.state = DONE
        if self.streams.get(stream.request_id) is stream:
            del self.streams[stream.request_id]

    def _terminal(self, s: Stream, m: Message) -> None:
        self.unregister(s)
        kinds = self.terminals_by_kind
        if type(m) is OrchError:
            kind = m.kind
            errs = self.errors_by_kind
            errs[kind] = errs.get(kind, 0) + 1
        else:
            kind = "finished"
        kinds[kind] = kinds.get(kind, 0) + 1
        h = self.duration.get(kind)
        if h is None:
            h = self.duration[kind] = Histogram(REQUEST_TIME_BUCKETS)
        h.observe(perf_counter() - s.t_open)
        if s.want_timings and self.timings_of is not None:
            s.timings = self.timings_of(s.request_id)

    def sink(self, msgs: list[Message]) -> None:
        """The orchestrator's ``output_sink``: called once per dispatcher batch."""
        streams = self.streams
        now = perf_counter()
        if len(msgs) == 1:  # the common case, without the grouping dict
            m = msgs[0]
            s = streams.get(m.request_id)
            if s is None:
                self.unrouted += 1
                return
            self._first_output(s, m, now)
            if m.finished:
                self._terminal(s, m)
            if not s.detached and s.put((now, msgs)):
                wake({s.loop: [s]})  # type: ignore[attr-defined]
            return
        groups: dict[Stream, list[Message]] = {}
        for m in msgs:
            s = streams.get(m.request_id)
            if s is None:
                self.unrouted += 1
                continue
            self._first_output(s, m, now)
            if m.finished:
                self._terminal(s, m)
            lst = groups.get(s)
            if lst is None:
                groups[s] = [m]
            else:
                lst.append(m)
        by_loop: dict[asyncio.AbstractEventLoop, list[AsyncioStream]] = {}
        for s, lst in groups.items():
            if not s.detached and s.put((now, lst)):
                by_loop.setdefault(s.loop, []).append(s)  # type: ignore[attr-defined]
        if by_loop:
            wake(by_loop)

    def fail(self, s: Stream, exc: BaseException) -> None:
        """End ``s`` with an exception its consumer raises (an admission that failed)."""
        self.unregister(s)
        if not s.detached and s.put(exc):
            wake({s.loop: [s]})  # type: ignore[attr-defined]

    def end(self, s: Stream, err: OrchError) -> None:
        """End ``s`` with a terminal produced by the engine itself (not the orchestrator)."""
        self._terminal(s, err)
        if not s.detached and s.put((perf_counter(), [err])):
            wake({s.loop: [s]})  # type: ignore[attr-defined]

    def sweep(self, kind: str, message: str) -> int:
        """Give every registered stream a terminal ``OrchError``; return how many.

        The fatal drain: called once the orchestrator can no longer deliver.
        Idempotent, and safe against registrations racing it (a caller
        registers, then checks that the engine is alive).
        """
        n = 0
        by_loop: dict[asyncio.AbstractEventLoop, list[AsyncioStream]] = {}
        with self._sweep_lock:
            while True:
                try:
                    rid, s = self.streams.popitem()
                except KeyError:
                    break
                n += 1
                err = OrchError(rid, None, kind, message)
                self._terminal(s, err)
                if not s.detached and s.put((perf_counter(), [err])):
                    by_loop.setdefault(s.loop, []).append(s)  # type: ignore[attr-defined]
        wake(by_loop)
        return n
