"""Test doubles and checks shared by the test suite and bench/.

* :class:`ScriptedStage` -- an in-process stage client driven by the test
  (it emits what it is told), optionally misbehaving as a :class:`Misbehaviour`
  says (the cancellation comparison's faulty stages); :class:`PushScriptedStage`
  is the same with the push fast path (the benchmark's stages).  The asyncio
  twin of both is ``bench.refs.testing.AsyncScriptedStage``.
* :class:`TerminalLedger` -- checks "exactly one terminal per accepted request,
  and it is the last message for it" over a run.
* :class:`LeakProbe`, :func:`child_pids` -- what a run left behind: child
  processes, file descriptors, private directories.

Torch-free, like the rest of the orchestrator side.
"""

from __future__ import annotations

import glob
import math
import os
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio
import trio.testing

from trio_orch.types import Message, StageOutput, StageUnavailable

__all__ = [
    "LeakProbe",
    "Misbehaviour",
    "PushScriptedStage",
    "ScriptedStage",
    "StageRecord",
    "SubmitHook",
    "TerminalLedger",
    "child_pids",
    "fd_count",
    "processes_naming",
    "worker_alive",
]

#: ``on_submit(stage_id, request_id)``: called synchronously in ``submit`` (a benchmark's timestamp)
SubmitHook = Callable[[int, str], None]


@dataclass(slots=True)
class Misbehaviour:
    """What a scripted stage does wrong; the default does nothing wrong.

    The comparison scenarios need stage clients that misbehave the way real
    ones do; the Trio and the asyncio scripted stages read the same
    description, so a scenario states the fault once and every
    implementation gets the same stage.
    """

    #: receive() catches the framework's cancellation once and waits again.
    swallow_cancel_once: bool = False
    #: receive() raises this instead of the cancellation when it is cancelled.
    cancel_error: BaseException | None = None
    #: abort() never returns (it waits forever; it can be cancelled).
    hang_abort: bool = False
    #: aclose() never returns (it waits forever; it can be cancelled).
    hang_aclose: bool = False
    #: aclose() takes this long (seconds) before closing.
    aclose_delay: float = 0.0
    #: aclose() raises this.
    aclose_error: BaseException | None = None
    #: every submit() starts a background helper task (a heartbeat that sleeps for an hour).
    helper_per_submit: bool = False


class StageRecord:
    """What a scripted stage saw, kept the same way by the Trio and the asyncio scripted stages.

    ``submissions`` (``(request_id, payload)`` in submit order), ``updates``
    of resumable requests (in order; ``resumable`` and ``final_updates`` list
    the ids submitted resumable and those whose last segment arrived), the
    ``sampling`` parameters and ``companions`` that came with them, every
    aborted id (``aborts``) and every RPC call (``rpc_calls``), answered by
    the handlers given to :meth:`on_rpc`.
    """

    def __init__(self) -> None:
        self.submissions: list[tuple[str, Any]] = []
        self.updates: list[tuple[str, Any]] = []
        self.resumable: list[str] = []  # ids submitted with resumable=True (more input follows)
        self.final_updates: list[str] = []  # ids whose last input segment arrived
        self.sampling: list[tuple[str, Any]] = []  # (id, params) of every submit/update that carried them
        self.companions: list[tuple[str, str]] = []  # (companion id, parent id) of companion submits
        self.aborts: list[str] = []
        self.rpc_calls: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = []
        self.rpc_handlers: dict[str, Callable[..., Awaitable[Any]]] = {}

    def on_rpc(self, method: str, fn: Callable[..., Awaitable[Any]]) -> None:
        """Answer RPC ``method`` with ``await fn(*args, **kwargs)``: its value, or what it raises.

        ``fn`` may hang, to test deadlines.  A method with no handler yields an
        error result naming it.
        """
        self.rpc_handlers[method] = fn

    def record_submit(self, request_id: str, payload: Any, resumable: bool, sampling: Any,
                      companion_of: str | None) -> None:
        self.submissions.append((request_id, payload))
        if resumable:
            self.resumable.append(request_id)
        if sampling is not None:
            self.sampling.append((request_id, sampling))
        if companion_of is not None:
            self.companions.append((request_id, companion_of))

    def record_update(self, request_id: str, payload: Any, final: bool, sampling: Any) -> None:
        self.updates.append((request_id, payload))
        if final:
            self.final_updates.append(request_id)
        if sampling is not None:
            self.sampling.append((request_id, sampling))

    def record_rpc(self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any] | None,
                   ) -> tuple[Callable[..., Awaitable[Any]] | None, dict[str, Any]]:
        """Record a call; return its handler (None: unknown method) and the keyword arguments."""
        kw = dict(kwargs or {})
        self.rpc_calls.append((method, tuple(args), kw))
        return self.rpc_handlers.get(method), kw


class ScriptedStage(StageRecord):
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

    ``misbehaviour`` adds faults (see :class:`Misbehaviour`); a stage cannot
    start a task nobody owns, so ``helper_per_submit`` needs the nursery of
    whoever owns the stage (``helper_nursery``).  ``on_submit`` is called on
    every accepted submit.
    """

    def __init__(self, stage_id: int = 0, *, name: str | None = None,
                 misbehaviour: Misbehaviour | None = None, helper_nursery: trio.Nursery | None = None,
                 on_submit: SubmitHook | None = None) -> None:
        self.stage_id = stage_id
        self.name = name or f"scripted-stage-{stage_id}"
        self.misbehaviour = misbehaviour or Misbehaviour()
        self.helper_nursery = helper_nursery
        self.on_submit = on_submit
        super().__init__()
        self.closed = False
        self.swallowed_cancels = 0  # cancellations receive() swallowed (Misbehaviour.swallow_cancel_once)
        # one item per emit: a batch of outputs, or the death
        self._send, self._recv = trio.open_memory_channel[list[StageOutput] | BaseException](math.inf)
        self._dead: BaseException | None = None
        self._submit_gate: trio.Event | None = None

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name}>"

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
        self.emit_batch_nowait([out])

    def emit_batch_nowait(self, outputs: list[StageOutput]) -> None:
        """Queue ready-made outputs; they come out of one ``receive`` together (a batched step)."""
        try:
            self._send.send_nowait(outputs)
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

    def close_under_reader(self) -> None:
        """A blocked or later receive fails, as a Trio socket or channel closed under it does."""
        self._recv.close()

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
        self._take_submit(request_id, payload, resumable, sampling, companion_of)
        if self.misbehaviour.helper_per_submit and self.helper_nursery is not None:
            self.helper_nursery.start_soon(trio.sleep, 3600, name=f"{self.name}.heartbeat[{request_id}]")
        await trio.lowlevel.checkpoint()

    def _take_submit(self, request_id: str, payload: Any, resumable: bool, sampling: Any,
                     companion_of: str | None) -> None:
        if self._dead is not None or self.closed:
            raise StageUnavailable(f"{self.name} is not running")
        self.record_submit(request_id, payload, resumable, sampling, companion_of)
        if self.on_submit is not None:
            self.on_submit(self.stage_id, request_id)

    async def update(self, request_id: str, payload: Any, *, final: bool = False,
                     sampling: Any = None) -> None:
        """More input for a request submitted with ``resumable=True`` (recorded in ``updates``)."""
        while self._submit_gate is not None:
            await self._submit_gate.wait()
        if self._dead is not None or self.closed:
            raise StageUnavailable(f"{self.name} is not running")
        self.record_update(request_id, payload, final, sampling)
        await trio.lowlevel.checkpoint()

    async def abort(self, request_ids: list[str]) -> None:
        if self._dead is not None or self.closed:
            raise StageUnavailable(f"{self.name} is not running")
        if self.misbehaviour.hang_abort:
            await trio.sleep_forever()
        self.aborts.extend(request_ids)
        await trio.lowlevel.checkpoint()

    async def confirm_abort(self, request_ids: list[str], timeout: float | None = None
                            ) -> list[tuple[int, Any, str | None]]:
        """An acknowledged abort: ``[(0, request_ids, None)]`` once recorded in ``aborts``.

        With ``Misbehaviour.hang_abort`` it never confirms: ``[(0, None, timeout error)]``
        after ``timeout`` seconds.
        """
        with trio.move_on_after(math.inf if timeout is None else timeout):
            await self.abort(request_ids)
            return [(0, list(request_ids), None)]
        return [(0, None, f"timeout: abort not confirmed within {timeout}s")]

    async def rpc(self, method: str, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None,
                  timeout: float | None = None) -> list[tuple[int, Any, str | None]]:
        """One replica (0): ``[(0, value, None)]`` or ``[(0, None, error)]``; recorded in ``rpc_calls``."""
        if self._dead is not None or self.closed:
            raise StageUnavailable(f"{self.name} is not running")
        fn, kwargs = self.record_rpc(method, args, kwargs)
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
        item = await self._wait_item()
        batch: list[StageOutput] = []
        while True:
            if isinstance(item, BaseException):
                if batch:  # deliver what came before the death first
                    self._pending_death(item)
                    return batch
                raise item
            batch += item
            try:
                item = self._recv.receive_nowait()
            except (trio.WouldBlock, trio.EndOfChannel):
                return batch

    async def _wait_item(self) -> list[StageOutput] | BaseException:
        mb = self.misbehaviour
        while True:
            try:
                return await self._recv.receive()
            except (trio.EndOfChannel, trio.ClosedResourceError):
                raise self._dead or RuntimeError(f"{self.name} is closed") from None
            except trio.Cancelled:
                if mb.cancel_error is not None:
                    raise mb.cancel_error from None
                if mb.swallow_cancel_once and self.swallowed_cancels == 0:
                    self.swallowed_cancels += 1
                    continue
                raise

    def _pending_death(self, exc: BaseException) -> None:
        # Re-queue the death on a fresh channel so the next receive raises it.
        send, recv = trio.open_memory_channel[list[StageOutput] | BaseException](math.inf)
        send.send_nowait(exc)
        send.close()
        self._recv = recv

    async def aclose(self) -> None:
        self.closed = True
        self._send.close()
        mb = self.misbehaviour
        if mb.hang_aclose:
            await trio.sleep_forever()
        if mb.aclose_delay:
            await trio.sleep(mb.aclose_delay)
        if mb.aclose_error is not None:
            raise mb.aclose_error
        await trio.lowlevel.checkpoint()


class PushScriptedStage(ScriptedStage):
    """A :class:`ScriptedStage` with the push fast path (:class:`~trio_orch.types.PushStageClient`).

    Once the orchestrator pumps it, ``emit_batch_nowait`` (run in the Trio
    thread, e.g. by a token callback) hands the batch straight to the
    orchestrator's dispatcher, as a replica pool does: one task hop less than
    ``receive``.  The benchmark feeds its stages this way.  Faults that live in
    ``receive`` do not apply once pumped.
    """

    def __init__(self, stage_id: int = 0, **kwargs: Any) -> None:
        super().__init__(stage_id, **kwargs)
        self._deliver: Callable[[list[StageOutput]], None] | None = None

    def submit_nowait(self, request_id: str, payload: Any, *, resumable: bool = False,
                      sampling: Any = None, companion_of: str | None = None) -> bool:
        """:meth:`submit` without its checkpoint, as a replica pool offers it; False while gated."""
        if self._submit_gate is not None or self.misbehaviour.helper_per_submit:
            return False
        self._take_submit(request_id, payload, resumable, sampling, companion_of)
        return True

    def emit_batch_nowait(self, outputs: list[StageOutput]) -> None:
        deliver = self._deliver
        if deliver is None or self._dead is not None or self.closed:
            super().emit_batch_nowait(outputs)
        else:
            deliver(outputs)

    async def pump(self, deliver: Callable[[list[StageOutput]], None]) -> None:
        """Deliver what was emitted before, then every batch at once; raise when the stage dies."""
        while True:
            try:
                item = self._recv.receive_nowait()
            except (trio.WouldBlock, trio.EndOfChannel):
                break
            if isinstance(item, BaseException):
                raise item
            deliver(item)
        self._deliver = deliver
        try:
            while True:  # only a death (or the close) comes this way now
                item = await self._wait_item()
                if isinstance(item, BaseException):
                    raise item
                deliver(item)
        finally:
            self._deliver = None


class TerminalLedger:
    """Checks "exactly one terminal per request, and it is the last message for it".

    ``record`` every message a consumer receives; add to ``accepted`` every
    request id the orchestrator accepted.  ``without_terminal()``,
    ``duplicates`` and ``after_terminal`` must all be zero after a run.
    """

    def __init__(self) -> None:
        self.accepted: set[str] = set()
        self.terminal: dict[str, str] = {}  # rid -> "ok" or the error kind
        self.duplicates = 0
        self.after_terminal = 0
        self.messages = 0
        self.t_last_ok = 0.0

    def record(self, msg: Message) -> None:
        self.messages += 1
        rid = msg.request_id
        if rid in self.terminal:
            if msg.finished:
                self.duplicates += 1
            else:
                self.after_terminal += 1
            return
        if msg.finished:
            kind = getattr(msg, "kind", None) or "ok"
            self.terminal[rid] = kind
            if kind == "ok":
                self.t_last_ok = time.monotonic()

    def without_terminal(self) -> int:
        return len(self.accepted - self.terminal.keys())

    def by_kind(self) -> dict[str, int]:
        """Terminals of accepted requests by kind (``ok`` for a finished output)."""
        out: dict[str, int] = {}
        for rid, kind in self.terminal.items():
            if rid in self.accepted:
                out[kind] = out.get(kind, 0) + 1
        return dict(sorted(out.items()))


def child_pids(pid: int | None = None) -> set[int]:
    """Live (or zombie) child processes of ``pid`` (default: this process), from /proc."""
    pids: set[int] = set()
    for path in glob.glob(f"/proc/{pid or os.getpid()}/task/*/children"):
        try:
            with open(path) as f:
                pids.update(int(x) for x in f.read().split())
        except OSError:
            pass
    return pids


def processes_naming(text: str | Path) -> list[int]:
    """Live processes whose command line contains ``text`` (e.g. the TMPDIR a run's workers put their
    ipc directory under: every worker of that run names it), from /proc."""
    needle = str(text).encode()
    out = []
    for d in Path("/proc").iterdir():
        try:
            if d.name.isdigit() and needle in (d / "cmdline").read_bytes():
                out.append(int(d.name))
        except OSError:
            continue
    return out


def fd_count() -> int:
    """Open file descriptors of this process (0 where /proc is missing)."""
    try:
        return len(os.listdir(f"/proc/{os.getpid()}/fd"))
    except OSError:  # pragma: no cover - not Linux
        return 0


def worker_alive(pid: int) -> bool:
    """A stage worker process with this pid still exists (a zombie counts: nobody reaped it)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read()
    except OSError:
        return False
    return b"stages.worker" in cmd or cmd == b""


class LeakProbe:
    """Snapshot before a run; :meth:`leaks` after it says what the run left behind."""

    def __init__(self) -> None:
        self.children = child_pids()
        self.fds = fd_count()
        self.dirs: set[str] = set()
        self.pids_seen: set[int] = set()

    def saw_dir(self, path: str) -> None:
        """Remember a run's private directory (ipc sockets, logs): it must be gone after the run."""
        self.dirs.add(path)

    def saw(self, pids: Iterable[int | None]) -> None:
        """Remember worker pids started during the run (they must all be gone after it)."""
        self.pids_seen.update(p for p in pids if p)

    def leaks(self) -> dict[str, int]:
        """``processes`` (children or seen workers still alive), ``fds`` (net growth), ``ipc_files``."""
        alive = (child_pids() - self.children) | {p for p in self.pids_seen if worker_alive(p)}
        ipc = 0
        for d in self.dirs:
            if os.path.exists(d):
                ipc += max(1, len(os.listdir(d))) if os.path.isdir(d) else 1
        return {"processes": len(alive), "fds": max(0, fd_count() - self.fds), "ipc_files": ipc}
