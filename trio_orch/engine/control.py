"""The control plane on the engines: collective RPC, pause, sleep, weight sync, profiling, aborts.

The recipes are Trio functions of an :class:`~trio_orch.shell.orchestrator.Orchestrator`,
so the three engine flavours share them: :class:`TrioControl` (mixed into
:class:`~trio_orch.engine.trio_engine.TrioEngine`: ``await engine.sleep()``) calls
them directly; :class:`EngineControl` (mixed into the thread bridge
:class:`~trio_orch.engine.bridge.Engine`) runs them in the engine's Trio thread, from
plain threads (``engine.sleep()``, blocking) or from asyncio
(``await engine.sleep_async()``, on an executor thread, never blocking the loop).

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

import asyncio
from collections.abc import Callable, Iterable, Mapping, Sequence
from functools import partial
from typing import Any

import trio

from trio_orch.engine.base import EngineClosed
from trio_orch.shell.orchestrator import Orchestrator
from trio_orch.types import RpcResult

__all__ = ["ControlError", "EngineControl", "TrioControl", "sleep", "start_profile", "stop_profile",
           "update_weights", "wake_up"]

StageIds = Iterable[int] | None  #: the stages a call goes to (None: every stage)
Seconds = float | None


class ControlError(RuntimeError):
    """A control recipe failed on at least one replica; ``results`` holds every replica's answer."""

    def __init__(self, message: str, results: Sequence[RpcResult]) -> None:
        bad = [f"stage {r.stage_id} replica {r.replica}: {r.error}" for r in results if r.error is not None]
        super().__init__(f"{message}: {'; '.join(bad)}" if bad else message)
        self.results = list(results)


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


async def _rpc(orch: Orchestrator, method: str, args: Sequence[Any], kwargs: Mapping[str, Any] | None,
               stage_ids: Iterable[int] | None, timeout: float | None) -> list[RpcResult]:
    return await orch.collective_rpc(method, args, kwargs, stage_ids, timeout)


async def _pause(orch: Orchestrator, mode: str) -> None:
    await orch.pause(mode)


async def _resume(orch: Orchestrator) -> None:
    await orch.resume()


class TrioControl:
    """The control plane for Trio code (mixed into ``TrioEngine``, which sets ``orchestrator``)."""

    orchestrator: Orchestrator

    @property
    def paused(self) -> str | None:
        """The pause mode in effect (None: not paused)."""
        return self.orchestrator.paused

    async def collective_rpc(self, method: str, args: Sequence[Any] = (),
                             kwargs: Mapping[str, Any] | None = None, stage_ids: StageIds = None,
                             timeout: Seconds = None) -> list[RpcResult]:
        """:meth:`Orchestrator.collective_rpc`: every replica's answer, errors included."""
        return await _rpc(self.orchestrator, method, args, kwargs, stage_ids, timeout)

    async def pause(self, mode: str = "wait") -> None:
        await self.orchestrator.pause(mode)

    async def resume(self) -> None:
        await self.orchestrator.resume()

    async def sleep(self, level: int = 1, stage_ids: StageIds = None, timeout: Seconds = None,
                    drain_timeout: Seconds = None) -> list[RpcResult]:
        return await sleep(self.orchestrator, level, stage_ids, timeout, drain_timeout)

    async def wake_up(self, stage_ids: StageIds = None, timeout: Seconds = None
                      ) -> list[RpcResult]:
        return await wake_up(self.orchestrator, stage_ids, timeout)

    async def update_weights(self, path: str, stage_ids: StageIds = None,
                             timeout: Seconds = None, drain_timeout: Seconds = None
                             ) -> list[RpcResult]:
        return await update_weights(self.orchestrator, path, stage_ids, timeout, drain_timeout)

    async def start_profile(self, dir: str, stage_ids: StageIds = None,
                            timeout: Seconds = None) -> list[RpcResult]:
        return await start_profile(self.orchestrator, dir, stage_ids, timeout)

    async def stop_profile(self, stage_ids: StageIds = None, timeout: Seconds = None
                           ) -> list[RpcResult]:
        return await stop_profile(self.orchestrator, stage_ids, timeout)


class EngineControl:
    """The control plane on the thread bridge: blocking methods and ``*_async`` ones for asyncio.

    The host class provides ``run_in_trio(async_fn, *args)``,
    ``control_orchestrator()`` (the running orchestrator, or EngineClosed) and
    ``confirmed_abort(request_id, timeout)`` (Trio side of an acknowledged abort).
    An asyncio caller cancelled while a recipe runs does not stop it (it runs
    to its end in the Trio thread, bounded by its timeouts).
    """

    def run_in_trio(self, async_fn: Callable[..., Any], *args: Any) -> Any:
        raise NotImplementedError

    def control_orchestrator(self) -> Orchestrator:
        raise NotImplementedError

    async def confirmed_abort(self, request_id: str, timeout: float | None) -> list[RpcResult]:
        raise NotImplementedError

    def _control(self, fn: Callable[..., Any], *args: Any) -> Any:
        return self.run_in_trio(partial(fn, self.control_orchestrator(), *args))

    async def _control_async(self, fn: Callable[..., Any], *args: Any) -> Any:
        self.control_orchestrator()  # EngineClosed at once, not from the executor
        return await asyncio.get_running_loop().run_in_executor(None, partial(self._control, fn, *args))

    @property
    def paused(self) -> str | None:
        """The pause mode in effect (None: not paused, or not running)."""
        try:
            return self.control_orchestrator().paused
        except EngineClosed:
            return None

    # -- blocking (plain threads)
    def collective_rpc(self, method: str, args: Sequence[Any] = (), kwargs: Mapping[str, Any] | None = None,
                       stage_ids: StageIds = None, timeout: Seconds = None) -> list[RpcResult]:
        """Every replica's answer to ``method(*args, **kwargs)`` (see :meth:`Orchestrator.collective_rpc`)."""
        return self._control(_rpc, method, args, kwargs, stage_ids, timeout)

    def abort_confirmed(self, request_id: str, timeout: Seconds = None) -> list[RpcResult]:
        """Abort and wait until every stage that held the request confirmed it stopped.

        As :meth:`Orchestrator.abort`: the consumer gets the ``aborted``
        terminal (with ``partial``) at once; the result lists each replica's
        confirmation or its error.
        """
        self.control_orchestrator()
        return self.run_in_trio(self.confirmed_abort, request_id, timeout)

    def pause(self, mode: str = "wait") -> None:
        """:meth:`Orchestrator.pause`: returns once the pause is in effect."""
        self._control(_pause, mode)

    def resume(self) -> None:
        self._control(_resume)

    def sleep(self, level: int = 1, stage_ids: StageIds = None, timeout: Seconds = None,
              drain_timeout: Seconds = None) -> list[RpcResult]:
        return self._control(sleep, level, stage_ids, timeout, drain_timeout)

    def wake_up(self, stage_ids: StageIds = None, timeout: Seconds = None) -> list[RpcResult]:
        return self._control(wake_up, stage_ids, timeout)

    def update_weights(self, path: str, stage_ids: StageIds = None, timeout: Seconds = None,
                       drain_timeout: Seconds = None) -> list[RpcResult]:
        return self._control(update_weights, path, stage_ids, timeout, drain_timeout)

    def start_profile(self, dir: str, stage_ids: StageIds = None,
                      timeout: Seconds = None) -> list[RpcResult]:
        return self._control(start_profile, dir, stage_ids, timeout)

    def stop_profile(self, stage_ids: StageIds = None, timeout: Seconds = None
                     ) -> list[RpcResult]:
        return self._control(stop_profile, stage_ids, timeout)

    # -- asyncio
    async def collective_rpc_async(self, method: str, args: Sequence[Any] = (),
                                   kwargs: Mapping[str, Any] | None = None,
                                   stage_ids: StageIds = None,
                                   timeout: Seconds = None) -> list[RpcResult]:
        return await self._control_async(_rpc, method, args, kwargs, stage_ids, timeout)

    async def abort_confirmed_async(self, request_id: str, timeout: Seconds = None) -> list[RpcResult]:
        self.control_orchestrator()
        return await asyncio.get_running_loop().run_in_executor(
            None, self.abort_confirmed, request_id, timeout)

    async def pause_async(self, mode: str = "wait") -> None:
        await self._control_async(_pause, mode)

    async def resume_async(self) -> None:
        await self._control_async(_resume)

    async def sleep_async(self, level: int = 1, stage_ids: StageIds = None,
                          timeout: Seconds = None, drain_timeout: Seconds = None) -> list[RpcResult]:
        return await self._control_async(sleep, level, stage_ids, timeout, drain_timeout)

    async def wake_up_async(self, stage_ids: StageIds = None, timeout: Seconds = None
                            ) -> list[RpcResult]:
        return await self._control_async(wake_up, stage_ids, timeout)

    async def update_weights_async(self, path: str, stage_ids: StageIds = None,
                                   timeout: Seconds = None, drain_timeout: Seconds = None
                                   ) -> list[RpcResult]:
        return await self._control_async(update_weights, path, stage_ids, timeout,
                                         drain_timeout)

    async def start_profile_async(self, dir: str, stage_ids: StageIds = None,
                                  timeout: Seconds = None) -> list[RpcResult]:
        return await self._control_async(start_profile, dir, stage_ids, timeout)

    async def stop_profile_async(self, stage_ids: StageIds = None, timeout: Seconds = None
                                 ) -> list[RpcResult]:
        return await self._control_async(stop_profile, stage_ids, timeout)
