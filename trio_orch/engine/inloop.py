"""The engine API served from inside the orchestrator's own Trio run: no thread, no hop.

:class:`InLoopEngine` is the thread bridge's :class:`~trio_orch.engine.bridge.Engine`
-- the same admission policy (bounded waiting, shedding, the ``shedding``
hint), the same per-request streams, update forwarding and metrics -- with
the thread taken out.  It runs as a task of the caller's Trio run
(``await nursery.start(engine.run)``), so an ASGI app on AnyIO's Trio
backend calls it directly: a request is admitted by a plain function call,
and each dispatcher batch wakes the waiting task by setting a
:class:`trio.Event` (one scheduler pass, no wakeup socket, no second event
loop).  ``trio-orch serve --loop trio`` serves the HTTP app this way under
hypercorn's Trio worker (:mod:`trio_orch.serve.hypercorn_front`).

Calls from another thread (tests, a debugger) still work: they go through
the Trio token as the thread bridge does.  Blocking sync calls
(``add_request``, ``stats``, ``run_in_trio``) are for other threads only.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from typing import Any

import trio

from trio_orch.engine.base import EngineClosed, EngineStartupError, EngineStatistics, collect_stats, unwrap
from trio_orch.engine.bridge import Engine
from trio_orch.engine.demux import TrioStream

__all__ = ["InLoopEngine"]


class InLoopEngine(Engine):
    """:class:`Engine` run as a task of the current Trio run; see the module docstring.

    Lifecycle: ``await nursery.start(engine.run)`` returns once the
    orchestrator accepts requests (``EngineStartupError`` if the pipeline
    could not start); :meth:`request_stop` (any thread) begins the shutdown,
    with a drain if asked; ``run`` returns once the pipeline is stopped.
    Cancelling ``run`` is the hard stop: every open request still gets its
    ``shutdown`` terminal.
    """

    _thread_ident: int | None = None
    _task_status: Any = None

    def start(self) -> Engine:
        raise RuntimeError("an InLoopEngine runs in the caller's Trio run: await nursery.start(engine.run)")

    async def run(self, *, task_status: trio.TaskStatus[InLoopEngine] = trio.TASK_STATUS_IGNORED) -> None:
        """Run the pipeline and the orchestrator until stopped (the thread bridge's thread body)."""
        if self._thread_ident is not None:
            raise RuntimeError("InLoopEngine.run() called twice")
        self._thread_ident = threading.get_ident()
        self._task_status = task_status
        reason = None
        try:
            await self._trio_main()
        except BaseException as exc:
            if not self._ready.is_set() and not isinstance(exc, trio.Cancelled):
                inner = unwrap(exc)
                self._failure = inner
                what = f"{type(inner).__name__}: {inner}"
                raise EngineStartupError(f"engine failed to start: {what}") from inner
            if isinstance(exc, (trio.Cancelled, KeyboardInterrupt)):
                raise
            inner = unwrap(exc)
            self._failure = inner
            reason = f"its orchestrator crashed: {type(inner).__name__}: {inner}"
        finally:
            self._mark_dead(reason or ("the engine was closed" if self._stop_flag
                                       else "its orchestrator stopped"))
            self._updates.close(self._dead or "its orchestrator stopped")
            if not self._ready.is_set():
                self._ready.set()
                if self._failure is None:  # stopped before it was ready: not a failure of the caller's
                    self._task_status.started(self)

    def _set_ready(self) -> None:
        super()._set_ready()
        self._task_status.started(self)

    def request_stop(self, drain: float | None = None) -> None:
        """Stop accepting; let in-flight requests finish for up to ``drain`` s; then stop (any thread)."""
        if self._closing is None:
            self._closing = "the engine was closed"
        self._request_stop(drain)

    def close(self, drain: float | None = None) -> None:
        """:meth:`request_stop` (``run`` returns once the pipeline stopped; await that, not this)."""
        self.request_stop(drain)

    # ------------------------------------------------------------------ no hop in the run
    def _in_run(self) -> bool:
        return threading.get_ident() == self._thread_ident

    def _post(self, fn: Any, *args: Any) -> None:
        if not self._in_run():
            super()._post(fn, *args)
            return
        if self._dead is not None:
            raise EngineClosed(self._closed_message())
        fn(*args)

    def _post_quiet(self, fn: Any, *args: Any) -> None:
        if not self._in_run():
            super()._post_quiet(fn, *args)
            return
        fn(*args)

    def _open_async(self, prompt: Any, request_id: str | None, final_stage_id: int | None,
                    request_timeout: float | None, resumable: bool, **kw: Any) -> Any:
        return self._open(TrioStream, prompt, request_id, final_stage_id, request_timeout, resumable, **kw)

    async def update_request_async(self, request_id: str, segment: Any, *, final: bool = False) -> None:
        """As :meth:`Engine.update_request_async`, awaited as a Trio task."""
        fut: Future[None] = Future()
        done = trio.Event()
        fut.add_done_callback(lambda f: done.set())  # settled in this run (the update forwarder)
        self._post(self._update_cb, request_id, segment, bool(final), fut)
        try:
            await done.wait()
        except trio.Cancelled:
            fut.cancel()  # not yet taken up: withdrawn; taken up: it still applies
            raise
        fut.result()

    async def stats_async(self, timeout: float = 5.0) -> EngineStatistics:
        await trio.lowlevel.checkpoint()
        if self._dead is not None or self._orch is None:
            return collect_stats(None, self._demux, 0, False)
        return self._stats_now()
