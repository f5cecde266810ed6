"""Test doubles: an in-process stage client driven by the test (DESIGN §4)."""

from __future__ import annotations

import math
import time
from collections.abc import Awaitable, Callable
from typing import Any

import trio
import trio.testing

from trio_orch.types import StageOutput, StageUnavailable

__all__ = ["ScriptedStage"]


class ScriptedStage:
    """A stage client whose outputs are whatever the test tells it to emit.

    Records every submission (``submissions``: ``(request_id, payload)`` in
    submit order), every input update of a resumable request (``updates``,
    in order; ``resumable`` and ``final_updates`` list the ids submitted
    resumable and those whose last segment arrived), the sampling parameters
    that came with them (``sampling``) and every aborted id (``aborts``).  ``emit`` delivers any
    output for any request id -- it does not check that the request was ever
    submitted, which is exactly what tests of dropped outputs need.  ``fail``
    makes the next ``receive`` raise, as a dead stage does.  ``hold_submits``
    makes ``submit`` block until ``release_submits`` (backpressure tests).
    """

    def __init__(self, stage_id: int = 0, *, name: str | None = None) -> None:
        self.stage_id = stage_id
        self.name = name or f"scripted-stage-{stage_id}"
        self.submissions: list[tuple[str, Any]] = []
        self.updates: list[tuple[str, Any]] = []
        self.resumable: list[str] = []  # ids submitted with resumable=True (more input follows)
        self.final_updates: list[str] = []  # ids whose last input segment arrived
        self.sampling: list[tuple[str, Any]] = []  # (id, params) of every submit/update that carried them
        self.companions: list[tuple[str, str]] = []  # (companion id, parent id) of companion submits
        self.aborts: list[str] = []
        self.closed = False
        self.rpc_calls: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = []
        self._rpc_handlers: dict[str, Callable[..., Awaitable[Any]]] = {}
        self._send, self._recv = trio.open_memory_channel[StageOutput | BaseException](math.inf)
        self._dead: BaseException | None = None
        self._submit_gate: trio.Event | None = None

    def __repr__(self) -> str:
        return f"<ScriptedStage {self.name}>"

    # ---------------------------------------------------------------- test side
    async def emit(self, request_id: str, data: Any = None, finished: bool = False,
                   error: str | None = None) -> None:
        """Make the stage produce one output (``error`` = per-request failure).

        Returns once every task is blocked again, i.e. once the orchestrator
        has taken and routed the output (and done any forward it caused), so
        a test can emit to the next stage right away.  ``emit_nowait`` only
        queues it.
        """
        self.emit_nowait(request_id, data, finished, error)
        await trio.testing.wait_all_tasks_blocked()

    def emit_nowait(self, request_id: str, data: Any = None, finished: bool = False,
                    error: str | None = None) -> None:
        out = StageOutput(request_id, data, finished, error, t_produced=time.perf_counter())
        try:
            self._send.send_nowait(out)
        except trio.ClosedResourceError:
            raise RuntimeError(f"{self.name} is closed or dead; cannot emit") from None

    async def fail(self, exc: BaseException | None = None) -> None:
        """Kill the stage: its reader's next ``receive`` raises ``exc``.

        Returns once the orchestrator has handled the death (every task blocked).
        """
        self.fail_nowait(exc)
        await trio.testing.wait_all_tasks_blocked()

    def fail_nowait(self, exc: BaseException | None = None) -> None:
        exc = exc or RuntimeError(f"{self.name} died")
        if self._dead is None:
            self._dead = exc
            self._send.send_nowait(exc)
            self._send.close()

    def on_rpc(self, method: str, fn: Callable[..., Awaitable[Any]]) -> None:
        """Answer RPC ``method`` with ``await fn(*args, **kwargs)``: its value, or what it raises.

        ``fn`` may hang, to test deadlines.  A method with no handler yields an
        error result naming it.
        """
        self._rpc_handlers[method] = fn

    def hold_submits(self) -> None:
        """Make ``submit`` block (a saturated or hung stage) until released."""
        if self._submit_gate is None:
            self._submit_gate = trio.Event()

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
        self.submissions.append((request_id, payload))
        if resumable:
            self.resumable.append(request_id)
        if sampling is not None:
            self.sampling.append((request_id, sampling))
        if companion_of is not None:
            self.companions.append((request_id, companion_of))
        await trio.lowlevel.checkpoint()

    async def update(self, request_id: str, payload: Any, *, final: bool = False,
                     sampling: Any = None) -> None:
        """More input for a request submitted with ``resumable=True`` (recorded in ``updates``)."""
        while self._submit_gate is not None:
            await self._submit_gate.wait()
        if self._dead is not None or self.closed:
            raise StageUnavailable(f"{self.name} is not running")
        self.updates.append((request_id, payload))
        if final:
            self.final_updates.append(request_id)
        if sampling is not None:
            self.sampling.append((request_id, sampling))
        await trio.lowlevel.checkpoint()

    async def abort(self, request_ids: list[str]) -> None:
        if self._dead is not None or self.closed:
            raise StageUnavailable(f"{self.name} is not running")
        self.aborts.extend(request_ids)
        await trio.lowlevel.checkpoint()

    async def rpc(self, method: str, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None,
                  timeout: float | None = None) -> list[tuple[int, Any, str | None]]:
        """One replica (0): ``[(0, value, None)]`` or ``[(0, None, error)]``; recorded in ``rpc_calls``."""
        if self._dead is not None or self.closed:
            raise StageUnavailable(f"{self.name} is not running")
        kwargs = dict(kwargs or {})
        self.rpc_calls.append((method, tuple(args), kwargs))
        fn = self._rpc_handlers.get(method)
        if fn is None:
            await trio.lowlevel.checkpoint()
            return [(0, None, f"unknown rpc method {method!r}")]
        try:
            with trio.fail_after(math.inf if timeout is None else timeout):
                value = await fn(*args, **kwargs)
        except trio.TooSlowError:
            return [(0, None, f"timeout: no answer within {timeout}s")]
        except Exception as exc:
            return [(0, None, f"{type(exc).__name__}: {exc}")]
        return [(0, value, None)]

    async def receive(self) -> list[StageOutput]:
        """Wait for at least one output; return everything already emitted."""
        try:
            first = await self._recv.receive()
        except (trio.EndOfChannel, trio.ClosedResourceError):
            raise self._dead or RuntimeError(f"{self.name} is closed") from None
        batch: list[StageOutput] = []
        item: StageOutput | BaseException = first
        while True:
            if isinstance(item, BaseException):
                if batch:  # deliver what came before the death first
                    self._pending_death(item)
                    return batch
                raise item
            batch.append(item)
            try:
                item = self._recv.receive_nowait()
            except (trio.WouldBlock, trio.EndOfChannel):
                return batch

    def _pending_death(self, exc: BaseException) -> None:
        # Re-queue the death on a fresh channel so the next receive raises it.
        send, recv = trio.open_memory_channel[StageOutput | BaseException](math.inf)
        send.send_nowait(exc)
        send.close()
        self._recv = recv

    async def aclose(self) -> None:
        self.closed = True
        self._send.close()
        await trio.lowlevel.checkpoint()
