"""What a caller holds for one request: its handle (sync or async), and the async message loop.

A handle takes the items its request's stream receives (message batches,
the terminal, an exception) and hands them out one message at a time or a
batch at a time; leaving it before the terminal aborts the request.  The
engine (:class:`~trio_orch.engine.trio_engine.TrioEngine`) opens the
streams; handles and :func:`stream_batches` only read them, so the engine
and its thread adapter (:class:`~trio_orch.engine.bridge.ThreadEngine`) share one
``generate`` loop and one ``add_request_async``, each with its own kind of
stream (a Trio one in the run, an asyncio one through the adapter).  A
handle knows its engine only by the :class:`Host` protocol.
"""

from __future__ import annotations

import queue
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterator
from contextlib import aclosing
from time import monotonic, perf_counter
from typing import Any, Protocol

from trio_orch.engine.demux import ACK, WITHDRAWN, AsyncioStream, Demux, Stream, SyncStream, TrioStream
from trio_orch.types import Message, OrchError

__all__ = ["AsyncHost", "AsyncRequestHandle", "HandleBase", "Host", "RequestHandle", "SyncHost", "messages",
           "observe_latency", "open_accepted", "stream_batches"]

AsyncStream = AsyncioStream | TrioStream


class Host(Protocol):
    """The engine a handle reads for: its streams' demux, and how to abort or leave a request."""

    @property
    def demux(self) -> Demux: ...

    def abort(self, request_id: str) -> None: ...

    def client_gone(self, s: Stream) -> None: ...


class SyncHost(Host, Protocol):
    def update_request(self, request_id: str, segment: Any, *, final: bool = False,
                       timeout: float | None = None) -> None: ...


class AsyncHost(Host, Protocol):
    async def update_request_async(self, request_id: str, segment: Any, *, final: bool = False) -> None: ...


def observe_latency(observe: Callable[[float], None], t_handover: float, msgs: list[Message]) -> None:
    """Dispatch latency of each message the consumer just took (see docs/design.md).

    From the stage's production timestamp (``OrchOutput.t_produced``, the
    system-wide monotonic clock, so a worker's stamp compares) when there is
    one; from the dispatcher's hand-over otherwise (errors, unstamped stages).
    """
    now = perf_counter()
    for m in msgs:
        tp = getattr(m, "t_produced", 0.0)
        observe(now - (tp if tp else t_handover))


class HandleBase:
    """What both handles share: the stream they read, the messages taken but not yet handed out."""

    def __init__(self, engine: Host, stream: Any) -> None:
        self._engine: Any = engine
        self._s = stream
        self._msgs: deque[Message] = deque()
        self._ended = False  # the terminal (or an exception) reached the handle
        self.finished = False  # the caller has taken the terminal

    @property
    def request_id(self) -> str:
        return self._s.request_id

    @property
    def ended(self) -> bool:
        """The terminal (or an exception) reached the handle; the caller may not have taken it yet."""
        return self._ended

    def take(self, item: Any) -> bool:
        """Absorb one item of the request's stream; True once the request ended.

        An exception item is raised (the request ended with it); a batch of
        messages is kept, its dispatch latency observed.
        """
        if item is ACK or item is WITHDRAWN:
            return self._ended
        if isinstance(item, BaseException):
            self._ended = self.finished = True
            raise item
        t, msgs = item
        observe_latency(self._engine.demux.latency.observe, t, msgs)
        self._msgs.extend(msgs)
        if msgs[-1].finished:
            self._ended = True
        return self._ended

    def _next_message(self) -> Message:
        m = self._msgs.popleft()
        if m.finished:
            self.finished = True
        return m

    def abort(self) -> None:
        """Abort the request; iterating on yields its ``aborted`` terminal."""
        self._engine.abort(self.request_id)

    def close(self) -> None:
        """Stop listening; aborts the request if it has not ended."""
        if not self._ended:
            self._ended = self.finished = True
            self._engine.client_gone(self._s)


class RequestHandle(HandleBase):
    """A sync caller's view of one request: iterate it to get its messages, terminal last.

    Leaving the iteration early (``break``, an exception, ``close()``) aborts
    the request in the orchestrator.
    """

    _s: SyncStream

    def __init__(self, engine: SyncHost, stream: SyncStream) -> None:
        super().__init__(engine, stream)

    def get(self, timeout: float | None = None) -> Message:
        """The next message; ``TimeoutError`` after ``timeout`` seconds without one."""
        if not self._msgs:
            if self.finished:
                raise RuntimeError(f"request {self.request_id!r} already delivered its terminal")
            q = self._s.q
            deadline = None if timeout is None else monotonic() + timeout
            while not self._msgs:
                if deadline is None:
                    item = q.get()
                else:
                    try:
                        item = q.get(timeout=max(0.0, deadline - monotonic()))
                    except queue.Empty:
                        raise TimeoutError(f"no output for request {self.request_id!r} "
                                           f"within {timeout}s") from None
                self.take(item)
        return self._next_message()

    def __iter__(self) -> Iterator[Message]:
        try:
            while not self.finished:
                yield self.get()
        finally:
            self.close()

    def update(self, segment: Any, *, final: bool = False, timeout: float | None = None) -> None:
        """More input for this resumable request: :meth:`ThreadEngine.update_request`."""
        self._engine.update_request(self.request_id, segment, final=final, timeout=timeout)

    def __enter__(self) -> RequestHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncRequestHandle(HandleBase):
    """An async caller's view of one accepted request (``add_request_async`` of either engine).

    ``async for m in handle``: its messages, terminal last (:meth:`batches`:
    one list per dispatcher batch).  ``await handle.update(segment)`` sends
    more input to a resumable request.  Leaving an ``async with handle`` block
    (or :meth:`close`) before the terminal aborts the request.  ``rejection``
    is the terminal error of a request the engine ended before admitting it;
    ``t_open`` when it was asked for (``time.perf_counter``); ``timings`` each
    stage's timing, once the terminal was taken (asked for with ``want_timings``).
    """

    def __init__(self, engine: AsyncHost, stream: AsyncStream) -> None:
        super().__init__(engine, stream)
        self.rejection: OrchError | None = None

    @property
    def t_open(self) -> float:
        return self._s.t_open

    @property
    def timings(self) -> tuple[Any, ...] | None:
        return self._s.timings

    async def wait_accepted(self) -> None:
        """Wait for the admission acknowledgement (or an early end, whose terminal is kept)."""
        while True:
            item = await self._s.next_item()
            if item is ACK:
                return
            if self.take(item):
                if len(self._msgs) == 1 and isinstance(self._msgs[0], OrchError):
                    self.rejection = self._msgs[0]  # ended before anything else: refused at admission
                return

    async def batches(self) -> AsyncGenerator[list[Message], None]:
        """The messages, one list per dispatcher batch, the terminal last; leaving early aborts."""
        try:
            while not self.finished:
                while not self._msgs:
                    self.take(await self._s.next_item())
                batch = list(self._msgs)
                self._msgs.clear()
                self.finished = batch[-1].finished
                yield batch
        finally:
            self.close()

    def __aiter__(self) -> AsyncRequestHandle:
        return self

    async def __anext__(self) -> Message:
        if self.finished:
            raise StopAsyncIteration
        while not self._msgs:
            self.take(await self._s.next_item())
        return self._next_message()

    async def update(self, segment: Any, *, final: bool = False) -> None:
        """More input for this resumable request: :meth:`EngineClient.update_request_async`."""
        await self._engine.update_request_async(self.request_id, segment, final=final)

    async def __aenter__(self) -> AsyncRequestHandle:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()


async def stream_batches(host: Host, open_stream: Callable[[], AsyncStream]
                         ) -> AsyncGenerator[list[Message], None]:
    """The loop behind every engine's ``generate_batches``: open the request when the iteration
    starts, yield one list of messages per dispatcher batch (the terminal last), abort if left early."""
    s = open_stream()
    observe = host.demux.latency.observe
    ended = False
    try:
        while not ended:
            item = await s.next_item()
            if isinstance(item, BaseException):
                ended = True
                raise item
            t, msgs = item
            observe_latency(observe, t, msgs)
            ended = msgs[-1].finished
            yield msgs
    finally:
        if not ended:
            host.client_gone(s)


async def messages(batches: AsyncGenerator[list[Message], None]) -> AsyncIterator[Message]:
    """``generate``: the batches flattened; leaving early closes them now (the request is aborted at once)."""
    async with aclosing(batches):
        async for msgs in batches:
            for m in msgs:
                yield m


async def open_accepted(host: AsyncHost, s: AsyncStream) -> AsyncRequestHandle:
    """``add_request_async``: the handle of ``s`` (opened with ``want_ack``) once it was accepted.

    Cancelled (or failing) while it waits, the request is aborted or never registered.
    """
    handle = AsyncRequestHandle(host, s)
    try:
        await handle.wait_accepted()
    except BaseException:
        handle.close()
        raise
    return handle
