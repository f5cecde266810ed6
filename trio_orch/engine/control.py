"""The control plane: collective RPC, pause, sleep, weight sync, profiling, acknowledged aborts.

Written once.  The recipes are Trio functions of an
:class:`~trio_orch.shell.orchestrator.Orchestrator`; :class:`ControlPlane`
makes them async methods of the engine (:class:`~trio_orch.engine.trio_engine.TrioEngine`:
``await engine.sleep()``).  The thread adapter (:class:`~trio_orch.engine.bridge.Engine`)
derives its two forms from those methods by name, with the descriptors
:class:`blocking` (``engine.sleep()`` from a plain thread) and
:class:`on_asyncio` (``await engine.sleep_async()`` on an asyncio loop).

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
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from functools import partial
from typing import Any, Concatenate, Generic, ParamSpec, Protocol, TypeVar

import trio

from trio_orch.engine.base import EngineClosed
from trio_orch.shell.orchestrator import Orchestrator
from trio_orch.types import RpcResult

__all__ = ["ControlError", "ControlPlane", "Hosting", "blocking", "on_asyncio", "sleep", "start_profile",
           "stop_profile", "update_weights", "wake_up"]

StageIds = Iterable[int] | None  #: the stages a call goes to (None: every stage)
Seconds = float | None
P = ParamSpec("P")
R = TypeVar("R")


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


class ControlPlane:
    """The control plane, written once: async methods of the engine, run in its Trio run.

    The engine (:class:`~trio_orch.engine.trio_engine.TrioEngine`) provides
    :meth:`control_orchestrator` (the running orchestrator, or EngineClosed)
    and ``abort_confirmed``.  The ``*_async`` names are the same methods, for
    code written against both engines (the HTTP app): on the thread adapter
    they are asyncio forms, here the caller already runs in the Trio run.
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

    async def collective_rpc(self, method: str, args: Sequence[Any] = (),
                             kwargs: Mapping[str, Any] | None = None, stage_ids: StageIds = None,
                             timeout: Seconds = None) -> list[RpcResult]:
        """Every replica's answer to ``method(*args, **kwargs)`` (see :meth:`Orchestrator.collective_rpc`)."""
        return await self.control_orchestrator().collective_rpc(method, args, kwargs, stage_ids, timeout)

    async def pause(self, mode: str = "wait") -> None:
        """:meth:`Orchestrator.pause`: returns once the pause is in effect."""
        await self.control_orchestrator().pause(mode)

    async def resume(self) -> None:
        await self.control_orchestrator().resume()

    async def sleep(self, level: int = 1, stage_ids: StageIds = None, timeout: Seconds = None,
                    drain_timeout: Seconds = None) -> list[RpcResult]:
        """See :func:`sleep`."""
        return await sleep(self.control_orchestrator(), level, stage_ids, timeout, drain_timeout)

    async def wake_up(self, stage_ids: StageIds = None, timeout: Seconds = None) -> list[RpcResult]:
        """See :func:`wake_up`."""
        return await wake_up(self.control_orchestrator(), stage_ids, timeout)

    async def update_weights(self, path: str, stage_ids: StageIds = None, timeout: Seconds = None,
                             drain_timeout: Seconds = None) -> list[RpcResult]:
        """See :func:`update_weights`."""
        return await update_weights(self.control_orchestrator(), path, stage_ids, timeout, drain_timeout)

    async def start_profile(self, dir: str, stage_ids: StageIds = None,
                            timeout: Seconds = None) -> list[RpcResult]:
        """See :func:`start_profile`."""
        return await start_profile(self.control_orchestrator(), dir, stage_ids, timeout)

    async def stop_profile(self, stage_ids: StageIds = None, timeout: Seconds = None) -> list[RpcResult]:
        """See :func:`stop_profile`."""
        return await stop_profile(self.control_orchestrator(), stage_ids, timeout)

    collective_rpc_async = collective_rpc
    pause_async = pause
    resume_async = resume
    sleep_async = sleep
    wake_up_async = wake_up
    update_weights_async = update_weights
    start_profile_async = start_profile
    stop_profile_async = stop_profile


class Hosting(Protocol):
    """What the derived forms need of their host (the thread adapter)."""

    @property
    def engine(self) -> Any: ...

    def run_in_trio(self, async_fn: Callable[..., Awaitable[Any]], *args: Any) -> Any: ...


class blocking(Generic[P, R]):
    """The blocking form of one engine method: ``adapter.name(...)`` runs ``engine.name(...)`` in the
    engine's Trio thread and returns its result (plain threads only)."""

    def __init__(self, method: Callable[Concatenate[Any, P], Awaitable[R]]) -> None:
        self.name = method.__name__
        self.__doc__ = method.__doc__

    def __get__(self, host: Hosting, owner: type | None = None) -> Callable[P, R]:
        name = self.name

        def call(*args: P.args, **kwargs: P.kwargs) -> R:
            return host.run_in_trio(partial(getattr(host.engine, name), *args, **kwargs))

        call.__name__ = name
        call.__doc__ = self.__doc__
        return call


class on_asyncio(Generic[P, R]):
    """The asyncio form of one engine method: ``await adapter.name_async(...)`` runs the blocking form on an
    executor thread, so the event loop never blocks.  Cancelling the awaiting task does not stop the
    call: it runs to its end in the Trio thread, bounded by its own timeouts."""

    def __init__(self, method: Callable[Concatenate[Any, P], Awaitable[R]]) -> None:
        self.name = method.__name__
        self.__doc__ = method.__doc__

    def __get__(self, host: Hosting, owner: type | None = None) -> Callable[P, Awaitable[R]]:
        name = self.name

        async def call(*args: P.args, **kwargs: P.kwargs) -> R:
            host.engine.control_orchestrator()  # EngineClosed at once, not from the executor
            run = partial(host.run_in_trio, partial(getattr(host.engine, name), *args, **kwargs))
            return await asyncio.get_running_loop().run_in_executor(None, run)

        call.__name__ = f"{name}_async"
        call.__doc__ = self.__doc__
        return call
