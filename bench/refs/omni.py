"""The vLLM-Omni-style asyncio reference, in its two loop variants.

Built the way ``vllm_omni/engine/orchestrator.py`` is: ``run()`` starts the
request handler and the output handler with ``asyncio.create_task`` and waits
for them; shutdown is "set the shutdown event, cancel every task, gather them
with ``return_exceptions=True`` (errors ignored), clean up, then sweep
``asyncio.all_tasks()`` -- cancel whatever is still pending and gather it".
The output handler, as in the source, treats its own cancellation as a normal
return.

- :class:`OmniEventDriven`: one reader task per stage replica feeding a ready
  queue; a dispatcher that waits on ``{ready_q.get(), shutdown}`` with
  ``asyncio.wait(FIRST_COMPLETED)`` and routes one reader batch per round.
  Readers route their own failure to the dispatcher (``except BaseException``,
  cancellation re-raised).
- :class:`OmniPolling`: the legacy loop: every stage polled in turn with a
  1 ms wait (``asyncio.wait_for(stage.receive(), 0.001)``), 1 ms sleep when a
  whole round found nothing.

Both drive :class:`trio_orch.core.Router` through :class:`AsyncioOrchestrator`,
with one deliberate difference, reproduced so the comparison can measure it:
an input update for an id the orchestrator does not hold (never added, or
already ended) becomes a brand-new request, as in the source
(:meth:`_OmniBase.handle_update`).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from bench.refs.orchestrator import AsyncioOrchestrator, UpdateMsg
from trio_orch.types import StageClient, StageDied

__all__ = ["OmniEventDriven", "OmniPolling"]

log = logging.getLogger("bench.refs.omni")


class _OmniBase(AsyncioOrchestrator):
    """``run()`` with create_task + cancel-all + gather + all_tasks sweep."""

    async def run(self) -> None:
        request_task = asyncio.create_task(self.request_handler(), name="orchestrator-request-handler")
        output_task = asyncio.create_task(self._output_handler(), name="orchestrator-stage-output-handler")
        stop_task = asyncio.create_task(self.wait_stop_requested(), name="orchestrator-stop-waiter")
        tasks = (request_task, output_task, stop_task)
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for t in done:
                if t is not stop_task and not t.cancelled():
                    t.result()  # a crashed handler is fatal: re-raise it
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("[Orchestrator] Fatal error in orchestrator tasks")
            raise
        finally:
            self.stopping.set()
            for t in tasks:
                if not t.done():
                    t.cancel()
            try:
                await asyncio.gather(*tasks, return_exceptions=True)
            except Exception:
                pass
            await self.finish()
            loop = asyncio.get_running_loop()
            me = asyncio.current_task()
            pending = [t for t in asyncio.all_tasks(loop) if t is not me and not t.done()]
            for t in pending:
                t.cancel()
            if pending:
                await asyncio.gather(*pending, return_exceptions=True)

    async def handle_update(self, msg: UpdateMsg) -> None:
        """The source's ``streaming_update``: an unknown id falls back to ``add_request``.

        An update for an id that is neither queued nor running -- never added,
        or just aborted, timed out or finished -- is started as a new,
        non-resumable request whose prompt is the segment; the caller gets no
        error (the source logs a warning).  Updates for live requests go
        through the core as in every reference.
        """
        rid = msg.request_id
        if rid in self.router or self.router.is_queued(rid):
            await super().handle_update(msg)
            return
        log.warning("[Orchestrator] streaming_update for unknown req=%s, falling back to add_request", rid)
        try:
            with self.lock:
                actions = self.router.start(self.router.accept(rid, msg.segment))
            await self.perform(actions)
        except (ValueError, RuntimeError) as exc:  # not accepting any more: the source logs and moves on
            log.warning("[Orchestrator] fallback add_request for req=%s failed: %s", rid, exc)
        finally:
            if msg.done is not None:
                msg.done.set()

    async def _output_handler(self) -> None:
        try:
            await self._output_loop()
        except asyncio.CancelledError:
            log.debug("[Orchestrator] output handler cancelled")
            return

    async def _output_loop(self) -> None:  # pragma: no cover - abstract
        raise NotImplementedError


class OmniEventDriven(_OmniBase):
    """Reader per replica -> ready queue -> one dispatcher (vLLM-Omni's event-driven loop)."""

    variant = "omni-event"
    description = ("vLLM-Omni style: thread + loop, janus, create_task, readers -> ready queue -> "
                   "dispatcher, cancel-all + gather + all_tasks sweep")

    async def _output_loop(self) -> None:
        ready_q: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
        readers = [asyncio.create_task(self.reader(k, s, ready_q), name=f"orchestrator-reader-{k}")
                   for k, s in enumerate(self.stages)]
        shutdown_task = asyncio.create_task(self.stopping.wait(), name="orchestrator-dispatch-shutdown")
        pending_get: asyncio.Task[tuple[int, Any]] | None = None
        try:
            while not self.stopping.is_set():
                if pending_get is None:
                    pending_get = asyncio.create_task(ready_q.get(), name="orch-dispatch-get")
                done, _ = await asyncio.wait({pending_get, shutdown_task},
                                             return_when=asyncio.FIRST_COMPLETED)
                if pending_get not in done:
                    break
                stage_id, item = pending_get.result()
                pending_get = None
                await self.perform(self.route(stage_id, item))
        finally:
            rest = [t for t in (*readers, shutdown_task, pending_get) if t is not None]
            for t in rest:
                t.cancel()
            await asyncio.gather(*rest, return_exceptions=True)

    async def reader(self, stage_id: int, stage: StageClient, ready_q: asyncio.Queue[Any]) -> None:
        try:
            while not self.stopping.is_set():
                outs = await stage.receive()
                await ready_q.put((stage_id, outs))
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # routed to the dispatcher, as in the source
            await ready_q.put((stage_id, StageDied.of(exc)))


class OmniPolling(_OmniBase):
    """Legacy loop: poll each stage with a 1 ms wait; sleep 1 ms when idle."""

    variant = "omni-poll"
    description = "vLLM-Omni legacy polling loop: each stage polled with a 1 ms wait, 1 ms sleep when idle"
    poll_timeout = 0.001
    idle_sleep = 0.001

    async def _output_loop(self) -> None:
        router = self.router
        while not self.stopping.is_set():
            idle = True
            for stage_id, stage in enumerate(self.stages):
                if self.stopping.is_set():
                    return
                if not router.available[stage_id]:
                    continue
                try:
                    outs = await asyncio.wait_for(stage.receive(), self.poll_timeout)
                except TimeoutError:
                    continue
                except asyncio.CancelledError:
                    raise
                except Exception as exc:
                    await self.perform(self.route(stage_id, StageDied.of(exc)))
                    idle = False
                    continue
                await self.perform(self.route(stage_id, outs))
                idle = False
            await asyncio.sleep(self.idle_sleep if idle else 0)
