"""The asyncio twin of :class:`trio_orch.testing.ScriptedStage`.

Same API (``emit``/``emit_nowait``/``emit_batch_nowait``/``fail``/``fail_nowait``/
``hold_submits``/``release_submits``, ``submissions``, ``aborts``, ``on_submit``,
``on_rpc``/``rpc_calls``)
and the same stage-client protocol, on an :class:`asyncio.Queue`, so the asyncio
references are driven by exactly what drives the Trio orchestrator.  The same
:class:`~trio_orch.testing.Misbehaviour` adds the comparison scenarios' faults;
``close_under_reader`` reproduces what pyzmq's asyncio socket does when it is
closed under a pending ``recv``: the waiting coroutine gets ``CancelledError``
although nobody cancelled its task.  :class:`AsyncPushScriptedStage` is the
twin of :class:`trio_orch.testing.PushScriptedStage`: the push fast path, for
the references that have one (``asyncio-taskgroup``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from trio_orch.testing import Misbehaviour, StageRecord, SubmitHook
from trio_orch.types import StageOutput, StageUnavailable

__all__ = ["AsyncPushScriptedStage", "AsyncScriptedStage", "misbehaving_get"]


class _ClosedUnder:
    """Queue marker: the stage's socket was closed under a pending receive."""


_CLOSED_UNDER = _ClosedUnder()

_Item = list[StageOutput] | BaseException | _ClosedUnder


async def misbehaving_get(queue: asyncio.Queue[Any], stage: Any) -> Any:
    """``queue.get()`` as a stage whose ``misbehaviour`` mishandles cancellation does it.

    ``cancel_error``: a cancellation comes out as that exception instead;
    ``swallow_cancel_once``: the first cancellation is ignored (counted in
    ``stage.swallowed_cancels``) and the get goes on.
    """
    mb = stage.misbehaviour
    while True:
        try:
            return await queue.get()
        except asyncio.CancelledError:
            if mb.cancel_error is not None:
                raise mb.cancel_error from None
            if mb.swallow_cancel_once and stage.swallowed_cancels == 0:
                stage.swallowed_cancels += 1
                continue
            raise


class AsyncScriptedStage(StageRecord):
    """A stage client whose outputs are whatever the test tells it to emit (asyncio)."""

    def __init__(self, stage_id: int = 0, *, name: str | None = None,
                 misbehaviour: Misbehaviour | None = None, on_submit: SubmitHook | None = None) -> None:
        self.stage_id = stage_id
        self.name = name or f"asyncio-scripted-stage-{stage_id}"
        self.misbehaviour = misbehaviour or Misbehaviour()
        self.on_submit = on_submit
        super().__init__()
        self.closed = False
        self.swallowed_cancels = 0
        self.helpers: set[asyncio.Task[None]] = set()
        self._queue: asyncio.Queue[_Item] = asyncio.Queue()  # one item per emit: a batch, or the death
        self._dead: BaseException | None = None
        self._submit_gate: asyncio.Event | None = None

    def __repr__(self) -> str:
        return f"<AsyncScriptedStage {self.name}>"

    # ---------------------------------------------------------------- test side
    async def emit(self, request_id: str, data: Any = None, finished: bool = False,
                   error: str | None = None) -> None:
        self.emit_nowait(request_id, data, finished, error)
        await asyncio.sleep(0)

    def emit_nowait(self, request_id: str, data: Any = None, finished: bool = False,
                    error: str | None = None) -> None:
        self.emit_batch_nowait([StageOutput(request_id, data, finished, error,
                                            t_produced=time.perf_counter())])

    def emit_batch_nowait(self, outputs: list[StageOutput]) -> None:
        """Queue ready-made outputs; they come out of one ``receive`` together (a batched step)."""
        if self._dead is not None or self.closed:
            raise RuntimeError(f"{self.name} is closed or dead; cannot emit")
        self._queue.put_nowait(outputs)

    async def fail(self, exc: BaseException | None = None) -> None:
        self.fail_nowait(exc)
        await asyncio.sleep(0)

    def fail_nowait(self, exc: BaseException | None = None) -> None:
        if self._dead is None:
            self._dead = exc or RuntimeError(f"{self.name} died")
            self._queue.put_nowait(self._dead)

    def close_under_reader(self) -> None:
        """The next (or pending) receive raises ``CancelledError``, as pyzmq's does on close."""
        self._queue.put_nowait(_CLOSED_UNDER)

    def hold_submits(self) -> None:
        if self._submit_gate is None:
            self._submit_gate = asyncio.Event()

    def release_submits(self) -> None:
        if self._submit_gate is not None:
            self._submit_gate.set()
            self._submit_gate = None

    @property
    def dead(self) -> bool:
        return self._dead is not None

    # ---------------------------------------------------------------- client protocol
    async def submit(self, request_id: str, payload: Any, *, resumable: bool = False,
                     sampling: Any = None, companion_of: str | None = None) -> None:
        while self._submit_gate is not None:
            await self._submit_gate.wait()
        if self._dead is not None or self.closed:
            raise StageUnavailable(f"{self.name} is not running")
        self.record_submit(request_id, payload, resumable, sampling, companion_of)
        if self.on_submit is not None:
            self.on_submit(self.stage_id, request_id)
        if self.misbehaviour.helper_per_submit:
            task = asyncio.create_task(asyncio.sleep(3600), name=f"{self.name}.heartbeat[{request_id}]")
            self.helpers.add(task)
            task.add_done_callback(self.helpers.discard)
        await asyncio.sleep(0)

    async def update(self, request_id: str, payload: Any, *, final: bool = False,
                     sampling: Any = None) -> None:
        """More input for a request submitted with ``resumable=True`` (recorded in ``updates``)."""
        while self._submit_gate is not None:
            await self._submit_gate.wait()
        if self._dead is not None or self.closed:
            raise StageUnavailable(f"{self.name} is not running")
        self.record_update(request_id, payload, final, sampling)
        await asyncio.sleep(0)

    async def abort(self, request_ids: list[str]) -> None:
        if self._dead is not None or self.closed:
            raise StageUnavailable(f"{self.name} is not running")
        if self.misbehaviour.hang_abort:
            await asyncio.Event().wait()
        self.aborts.extend(request_ids)
        await asyncio.sleep(0)

    async def rpc(self, method: str, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None,
                  timeout: float | None = None) -> list[tuple[int, Any, str | None]]:
        """One replica (0): ``[(0, value, None)]`` or ``[(0, None, error)]``; recorded in ``rpc_calls``."""
        if self._dead is not None or self.closed:
            raise StageUnavailable(f"{self.name} is not running")
        fn, kwargs = self.record_rpc(method, args, kwargs)
        if fn is None:
            await asyncio.sleep(0)
            return [(0, None, f"unknown rpc method {method!r}")]
        try:
            async with asyncio.timeout(timeout):
                value = await fn(*args, **kwargs)
        except TimeoutError:
            return [(0, None, f"timeout: no answer within {timeout}s")]
        except Exception as exc:
            return [(0, None, f"{type(exc).__name__}: {exc}")]
        return [(0, value, None)]

    async def receive(self) -> list[StageOutput]:
        """Wait for at least one output; return everything already emitted."""
        item = await misbehaving_get(self._queue, self)
        batch: list[StageOutput] = []
        while True:
            if isinstance(item, _ClosedUnder):
                if batch:
                    self._requeue_front(item)
                    return batch
                raise asyncio.CancelledError()
            if isinstance(item, BaseException):
                if batch:  # deliver what came before the death first
                    self._requeue_front(item)
                    return batch
                self._queue.put_nowait(item)  # stay dead: every later receive raises too
                raise item
            batch += item
            try:
                item = self._queue.get_nowait()
            except asyncio.QueueEmpty:
                return batch

    def _requeue_front(self, item: BaseException | _ClosedUnder) -> None:
        rest: list[_Item] = [item]
        while not self._queue.empty():
            rest.append(self._queue.get_nowait())
        for x in rest:
            self._queue.put_nowait(x)

    async def aclose(self) -> None:
        self.closed = True
        mb = self.misbehaviour
        if mb.hang_aclose:
            await asyncio.Event().wait()
        if mb.aclose_delay:
            await asyncio.sleep(mb.aclose_delay)
        if mb.aclose_error is not None:
            raise mb.aclose_error
        await asyncio.sleep(0)


class AsyncPushScriptedStage(AsyncScriptedStage):
    """An :class:`AsyncScriptedStage` with the push fast path (``pump(deliver)``).

    Once the orchestrator pumps it, ``emit_batch_nowait`` (run in the loop,
    e.g. by a ``call_soon_threadsafe`` callback) hands the batch straight to
    the orchestrator, as :class:`trio_orch.testing.PushScriptedStage` does on
    the Trio side.  Faults that live in ``receive`` do not apply once pumped.
    """

    def __init__(self, stage_id: int = 0, **kwargs: Any) -> None:
        super().__init__(stage_id, **kwargs)
        self._deliver: Callable[[list[StageOutput]], None] | None = None
        self._ended = asyncio.Event()

    def emit_batch_nowait(self, outputs: list[StageOutput]) -> None:
        deliver = self._deliver
        if deliver is None or self.dead or self.closed:
            super().emit_batch_nowait(outputs)
        else:
            deliver(outputs)

    def submit_nowait(self, request_id: str, payload: Any, *, resumable: bool = False,
                      sampling: Any = None, companion_of: str | None = None) -> bool:
        """:meth:`submit` without its suspension, as the Trio side's push stage offers it; False while
        gated (or with a helper task per submit): the shell awaits ``submit`` then."""
        if self._submit_gate is not None or self.misbehaviour.helper_per_submit:
            return False
        if self._dead is not None or self.closed:
            raise StageUnavailable(f"{self.name} is not running")
        self.record_submit(request_id, payload, resumable, sampling, companion_of)
        if self.on_submit is not None:
            self.on_submit(self.stage_id, request_id)
        return True

    def fail_nowait(self, exc: BaseException | None = None) -> None:
        super().fail_nowait(exc)
        self._ended.set()

    async def pump(self, deliver: Callable[[list[StageOutput]], None]) -> None:
        """Deliver what was emitted before, then every batch at once; raise when the stage dies."""
        while True:
            try:
                item = self._queue.get_nowait()
            except asyncio.QueueEmpty:
                break
            if isinstance(item, BaseException):
                raise item
            if isinstance(item, list):
                deliver(item)
        self._deliver = deliver
        try:
            await self._ended.wait()
        finally:
            self._deliver = None
        raise self._dead or RuntimeError(f"{self.name} died")
