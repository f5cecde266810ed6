"""The engine API for Trio code: the same ``generate`` as the thread bridge, without a thread.

``async with open_trio_engine(factory) as engine`` runs the pipeline and the
orchestrator in the caller's Trio run; ``async for out in
engine.generate(prompt)`` waits (as a Trio task) while the request channel is
full, and leaving the iteration early or being cancelled aborts the request.
A resumable request (``generate(..., resumable=True)``) takes more input with
``await engine.update_request(request_id, segment, final=...)``.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from time import perf_counter
from typing import Any

import trio

from stages.sampling_params import StageParams
from trio_orch.engine.base import (
    EngineClosed,
    EngineStatistics,
    Overloaded,
    PipelineFactory,
    as_spec,
    collect_stats,
)
from trio_orch.engine.control import TrioControl
from trio_orch.engine.demux import ADMITTED, DONE, PENDING, Demux, TrioStream
from trio_orch.shell.orchestrator import Orchestrator
from trio_orch.types import Message, OrchError, RpcResult, StageClient

__all__ = ["TrioEngine", "open_trio_engine"]



class TrioEngine(TrioControl):
    """The bridge's API for Trio code running in the orchestrator's own thread.

    The control plane (collective RPC, pause, sleep, weight sync, profiling)
    comes from :class:`~trio_orch.engine.control.TrioControl`.
    """

    def __init__(self, orch: Orchestrator, demux: Demux,
                 stage_params: Sequence[StageParams] | None = None,
                 admission_timeout: float | None = None) -> None:
        self.orchestrator = orch
        #: each stage's name and sampling parameters, as the pipeline declared them (None: none)
        self.stage_params = stage_params
        self.admission_timeout = admission_timeout
        self._demux = demux
        self._ids = itertools.count()
        self._closed: str | None = None
        self._admitting: dict[str, trio.Event] = {}  # ids whose generate waits for admission

    @property
    def stages(self) -> list[StageClient]:
        return list(self.orchestrator.stages)

    @property
    def latency(self) -> Any:
        return self._demux.latency

    async def generate(self, prompt: Any, *, request_id: str | None = None,
                       final_stage_id: int | None = None, request_timeout: float | None = None,
                       sampling: Any = None, resumable: bool = False) -> AsyncIterator[Message]:
        """Like :meth:`Engine.generate`; waits (as a Trio task) while the request channel is full.

        ``sampling``: per-stage sampling parameters (a list indexed by stage, or a
        mapping stage -> parameters); a bad one raises ValueError, nothing submitted.
        The request is registered when the iteration starts: a task that sends
        a resumable request's updates must start after that (e.g. from the
        iterating task, or once the first output came).

        With an ``admission_timeout``, a request that found no room within it
        is shed: :class:`~trio_orch.engine.base.Overloaded`, nothing registered.
        """
        orch = self.orchestrator
        if self._closed is not None or not orch.running:
            raise EngineClosed(f"the engine is closed: {self._closed or 'its orchestrator stopped'}")
        rid = request_id if request_id is not None else f"req-trio-{next(self._ids)}"
        s = TrioStream(rid, prompt, final_stage_id, request_timeout, resumable=resumable)
        self._demux.register(s)
        admitting = self._admitting[rid] = trio.Event()
        wait = self.admission_timeout
        try:
            with trio.move_on_after(math.inf if wait is None else wait) as admission:
                await orch.add_request(rid, prompt, final_stage_id=final_stage_id, timeout=request_timeout,
                                       sampling=sampling, resumable=resumable, wait_start=False)
        except RuntimeError as exc:  # it stopped while we waited for room: a terminal, like the others
            self._demux.end(s, OrchError(rid, None, "shutdown", str(exc)))
        except BaseException:
            if s.state != DONE and not orch.router.is_live(rid):
                self._demux.unregister(s)  # never accepted
            else:
                s.detached = True  # accepted: its abort's terminal will free the id
            raise
        finally:
            admitting.set()
            if self._admitting.get(rid) is admitting:
                del self._admitting[rid]
        if admission.cancelled_caught:  # a cancelled send did not send: nothing was registered
            self._demux.unregister(s)
            self._demux.count_shed("overloaded")
            raise Overloaded(f"overloaded: no room within {wait:g}s; retry later")
        if s.state == PENDING:
            s.state = ADMITTED
            self._demux.admitted += 1
        observe = self._demux.latency.observe
        ended = False
        try:
            while True:
                t, msgs = await s.next_item()
                observe(perf_counter() - t)
                for m in msgs:
                    if m.finished:
                        ended = True
                    yield m
                if ended:
                    return
        finally:
            if not ended:
                s.detached = True
                orch.abort_nowait(rid)

    async def update_request(self, request_id: str, segment: Any, *, final: bool = False) -> None:
        """One more input segment for a live resumable request (``final``: the last one).

        Waits while the request itself still waits for admission; then as
        :meth:`Orchestrator.update_request` (``ValueError`` for an unknown or
        ended id, a request not added with ``resumable=True``, or after its
        final segment; :class:`EngineClosed` once the engine is closed).
        """
        if self._closed is not None:
            raise EngineClosed(f"the engine is closed: {self._closed}")
        admitting = self._admitting.get(request_id)
        if admitting is not None:
            await admitting.wait()
        try:
            await self.orchestrator.update_request(request_id, segment, final=final)
        except RuntimeError as exc:
            raise EngineClosed(f"the engine is closed: {exc}") from None

    async def abort(self, request_id: str, timeout: float | None = None) -> list[RpcResult]:
        """Abort and wait for the stages that held it to confirm (see :meth:`Orchestrator.abort`)."""
        return await self.orchestrator.abort(request_id, timeout)

    def stats(self) -> EngineStatistics:
        return collect_stats(self.orchestrator, self._demux, 0, self._closed is None)


@asynccontextmanager
async def open_trio_engine(pipeline: PipelineFactory, *, request_queue_size: int = 256,
                           shutdown_grace: float = 2.0, admission_timeout: float | None = None
                           ) -> AsyncIterator[TrioEngine]:
    """``async with open_trio_engine(factory) as engine``: the Trio API, no thread.

    Leaving the block shuts the orchestrator down (no drain); every request
    still open gets its ``shutdown`` terminal.  ``admission_timeout``: see
    :meth:`TrioEngine.generate`.
    """
    demux = Demux()
    async with pipeline() as raw:
        spec = as_spec(raw)
        opts = {"request_queue_size": request_queue_size, "shutdown_grace": shutdown_grace, **spec.options}
        orch = Orchestrator(spec.stages, spec.final_stage_ids, output_sink=demux.sink, **opts)
        engine = TrioEngine(orch, demux, spec.stage_params, admission_timeout)
        try:
            async with trio.open_nursery() as nursery:
                await nursery.start(orch.run)
                try:
                    yield engine
                finally:
                    engine._closed = "the engine was closed"
                    orch.request_shutdown()
        finally:
            engine._closed = engine._closed or "its orchestrator stopped"
            demux.sweep("shutdown", f"the engine stopped: {engine._closed}")
