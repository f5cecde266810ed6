"""The control plane: collective RPC, pause, sleep, weight sync, profiling, acknowledged aborts.

Written once.  The recipes are Trio functions of an
:class:`~trio_orch.shell.orchestrator.Orchestrator`; :class:`ControlPlane`
makes them awaitable calls of the engine (:class:`~trio_orch.engine.trio_engine.TrioEngine`:
``await engine.sleep_async()``, the names of :class:`~trio_orch.engine.api.EngineClient`).
The thread adapter (:class:`~trio_orch.engine.bridge.ThreadEngine`) derives
its two forms from those by name (:mod:`trio_orch.engine.derived`):
``engine.sleep()`` from a plain thread, ``await engine.sleep_async()`` on an
asyncio loop.

``collective_rpc`` returns every replica's answer and never raises for a
replica's error.  The recipes raise :class:`ControlError` (with every
replica's answer in ``results``) when a replica failed, after putting the
pipeline back where it can serve when they can:

- ``update_weights(path, stage_ids)``: the quiesce recipe.  ``pause("wait")``
  (nothing new starts; the requests in flight finish on the old weights),
  ``reload_weights(path, check_only=True)`` on every replica of those stages
  (a file that does not fit is refused before any replica changes), then
  ``reload_weights(path)`` on every replica, then ``resume()``.  Every
  request either finished before the new weights or starts after them.
- ``sleep(level)``: ``pause("wait")``, then ``sleep(level)`` on every replica
  (weights and caches freed); the engine stays paused (``add_request``
  waits) until ``wake_up()`` restores them and resumes.
- ``start_profile(dir)`` / ``stop_profile()``: every replica writes a
  ``torch.profiler`` trace of its steps in between into ``dir``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import trio

from trio_orch.engine.api import ControlError, EngineClosed, StageIds
from trio_orch.shell.orchestrator import Orchestrator
from trio_orch.types import RpcResult

__all__ = ["ControlPlane", "sleep", "start_profile", "stop_profile", "update_weights", "wake_up"]

Seconds = float | None


def _failed(results: Sequence[RpcResult]) -> bool:
    return any(r.error is not None for r in results)


async def _drain(orch: Orchestrator, drain_timeout: float | None) -> None:
    """``pause("wait")``, bounded: past ``drain_timeout`` the pause is lifted and TimeoutError raised."""
    if orch.paused == "keep":
        raise ValueError("the engine is paused with mode 'keep' (requests frozen in place): resume first")
    with trio.move_on_after(float("inf") if drain_timeout is None else drain_timeout) as scope:
        await orch.pause("wait")
    if scope.cancelled_caught:
        await orch.resume()
        raise TimeoutError(f"the requests in flight did not finish within {drain_timeout:g}s; resumed, "
                           "nothing changed")


async def update_weights(orch: Orchestrator, path: str, stage_ids: StageIds = None,
                         timeout: Seconds = None, drain_timeout: Seconds = None) -> list[RpcResult]:
    """Load the weights in ``path`` into every replica of ``stage_ids`` at a quiesce boundary.

    Returns each replica's ``reload_weights`` answer.  Raises ValueError for
    bad stage ids, TimeoutError when the requests in flight do not finish
    within ``drain_timeout``, and ControlError when a replica refused the file
    (nothing changed) or failed to load it (the others hold the new weights).
    The engine resumes in every case, unless it was paused before the call.
    """
    targets = orch.router.check_stage_ids(stage_ids)
    was_paused = orch.paused is not None
    await _drain(orch, drain_timeout)
    try:
        checked = await orch.collective_rpc("reload_weights", [path], {"check_only": True}, targets, timeout)
        if _failed(checked):
            raise ControlError("weights refused, nothing changed", checked)
        loaded = await orch.collective_rpc("reload_weights", [path], None, targets, timeout)
        if _failed(loaded):
            raise ControlError("weights reloaded on some replicas only", loaded)
        return loaded
    finally:
        if not was_paused:
            await orch.resume()


async def sleep(orch: Orchestrator, level: int = 1, stage_ids: StageIds = None,
                timeout: Seconds = None, drain_timeout: Seconds = None) -> list[RpcResult]:
    """Pause (requests in flight finish), then free the weights and caches of ``stage_ids``' replicas.

    The engine stays paused until :func:`wake_up`.  If a replica fails to
    sleep, the others are woken again, the engine resumes and ControlError is
    raised.
    """
    targets = orch.router.check_stage_ids(stage_ids)
    await _drain(orch, drain_timeout)
    results = await orch.collective_rpc("sleep", [level], None, targets, timeout)
    if _failed(results):
        slept = sorted({r.stage_id for r in results if r.error is None})
        if slept:  # best effort: a replica of those stages that did not sleep answers "not asleep"
            await orch.collective_rpc("wake_up", (), None, slept, timeout)
        await orch.resume()
        raise ControlError("sleep failed; the replicas that slept were woken and the engine resumed", results)
    return results


async def wake_up(orch: Orchestrator, stage_ids: StageIds = None,
                  timeout: Seconds = None) -> list[RpcResult]:
    """Restore the weights of ``stage_ids``' replicas, then resume.  ControlError: still paused."""
    results = await orch.collective_rpc("wake_up", (), None, orch.router.check_stage_ids(stage_ids), timeout)
    if _failed(results):
        raise ControlError("wake_up failed on some replicas; the engine stays paused", results)
    await orch.resume()
    return results


async def start_profile(orch: Orchestrator, dir: str, stage_ids: StageIds = None,
                        timeout: Seconds = None) -> list[RpcResult]:
    """Every replica of ``stage_ids`` starts a ``torch.profiler`` trace, written to ``dir`` on stop."""
    results = await orch.collective_rpc("start_profile", [dir], None, stage_ids, timeout)
    if _failed(results):
        raise ControlError("start_profile failed", results)
    return results


async def stop_profile(orch: Orchestrator, stage_ids: StageIds = None,
                       timeout: Seconds = None) -> list[RpcResult]:
    """Stop the traces; each result's value names the trace file written."""
    results = await orch.collective_rpc("stop_profile", (), None, stage_ids, timeout)
    if _failed(results):
        raise ControlError("stop_profile failed", results)
    return results


class ControlPlane:
    """The control plane, written once: awaitable calls of the engine, run in its Trio run.

    The engine (:class:`~trio_orch.engine.trio_engine.TrioEngine`) provides
    :meth:`control_orchestrator` (the running orchestrator, or EngineClosed).
    """

    def control_orchestrator(self) -> Orchestrator:
        raise NotImplementedError

    @property
    def paused(self) -> str | None:
        """The pause mode in effect (None: not paused, or not running)."""
        try:
            return self.control_orchestrator().paused
        except EngineClosed:
            return None

    async def collective_rpc_async(self, method: str, args: Sequence[Any] = (),
                                   kwargs: Mapping[str, Any] | None = None, stage_ids: StageIds = None,
                                   timeout: Seconds = None) -> list[RpcResult]:
        """Every replica's answer to ``method(*args, **kwargs)`` (see :meth:`Orchestrator.collective_rpc`)."""
        return await self.control_orchestrator().collective_rpc(method, args, kwargs, stage_ids, timeout)

    async def pause_async(self, mode: str = "wait") -> None:
        """:meth:`Orchestrator.pause`: returns once the pause is in effect."""
        await self.control_orchestrator().pause(mode)

    async def resume_async(self) -> None:
        """:meth:`Orchestrator.resume`: requests start again."""
        await self.control_orchestrator().resume()

    async def sleep_async(self, level: int = 1, stage_ids: StageIds = None, timeout: Seconds = None,
                          drain_timeout: Seconds = None) -> list[RpcResult]:
        """See :func:`sleep`."""
        return await sleep(self.control_orchestrator(), level, stage_ids, timeout, drain_timeout)

    async def wake_up_async(self, stage_ids: StageIds = None, timeout: Seconds = None) -> list[RpcResult]:
        """See :func:`wake_up`."""
        return await wake_up(self.control_orchestrator(), stage_ids, timeout)

    async def update_weights_async(self, path: str, stage_ids: StageIds = None, timeout: Seconds = None,
                                   drain_timeout: Seconds = None) -> list[RpcResult]:
        """See :func:`update_weights`."""
        return await update_weights(self.control_orchestrator(), path, stage_ids, timeout, drain_timeout)

    async def start_profile_async(self, dir: str, stage_ids: StageIds = None,
                                  timeout: Seconds = None) -> list[RpcResult]:
        """See :func:`start_profile`."""
        return await start_profile(self.control_orchestrator(), dir, stage_ids, timeout)

    async def stop_profile_async(self, stage_ids: StageIds = None,
                                 timeout: Seconds = None) -> list[RpcResult]:
        """See :func:`stop_profile`."""
        return await stop_profile(self.control_orchestrator(), stage_ids, timeout)
