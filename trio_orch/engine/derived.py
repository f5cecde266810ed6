"""The thread adapter's forms of the engine's calls, derived from the engine by name, never written again.

The thread adapter (:class:`~trio_orch.engine.bridge.ThreadEngine`) hosts a
:class:`~trio_orch.engine.trio_engine.TrioEngine` (``host.engine``) in a Trio
run of its own thread.  Each of its attributes that is no more than the
engine's is one of these descriptors, given the engine's attribute:

- :class:`passthrough`: the engine's attribute itself, read on each access
  (state that is safe to read from any thread; calls that post to the run);
- :class:`blocking`: an awaitable call ``X_async`` run in the engine's run
  and waited for, under the name without the suffix (``X``: plain threads);
- :class:`on_asyncio`: the same call awaited on an asyncio loop without
  blocking it, under the engine's name (``X_async``).

Each derived callable carries the engine method's signature and docstring,
so ``help()`` and ``inspect.signature`` read the engine's.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any, Concatenate, Generic, ParamSpec, Protocol, TypeVar

__all__ = ["Hosting", "blocking", "on_asyncio", "passthrough"]

P = ParamSpec("P")
R = TypeVar("R")


class Hosting(Protocol):
    """What the derived forms need of their host (the thread adapter)."""

    @property
    def engine(self) -> Any: ...

    def run_in_trio(self, async_fn: Callable[..., Awaitable[Any]], *args: Any) -> Any: ...


def _bound_signature(fn: Callable[..., Any]) -> inspect.Signature:
    """``fn``'s signature without its first parameter (``self``)."""
    sig = inspect.signature(fn)
    return sig.replace(parameters=list(sig.parameters.values())[1:])


class passthrough:
    """``host.name`` is ``host.engine.name``: the engine's property or method, read on each access."""

    def __init__(self, attr: property | Callable[..., Any]) -> None:
        fn = attr.fget if isinstance(attr, property) else attr
        assert fn is not None
        self.name = fn.__name__
        self.__doc__ = fn.__doc__

    def __get__(self, host: Hosting | None, owner: type | None = None) -> Any:
        if host is None:
            return self
        return getattr(host.engine, self.name)


class blocking(Generic[P, R]):
    """The blocking form of an engine call ``X_async``: ``host.X(...)`` runs ``engine.X_async(...)`` in the
    engine's Trio run and returns its result (plain threads only)."""

    def __init__(self, method: Callable[Concatenate[Any, P], Awaitable[R]]) -> None:
        self.target = method.__name__
        self.__doc__ = method.__doc__
        self.__signature__ = _bound_signature(method)

    def __get__(self, host: Hosting, owner: type | None = None) -> Callable[P, R]:
        target = self.target

        def call(*args: P.args, **kwargs: P.kwargs) -> R:
            return host.run_in_trio(partial(getattr(host.engine, target), *args, **kwargs))

        call.__name__ = target.removesuffix("_async")
        call.__doc__ = self.__doc__
        call.__signature__ = self.__signature__  # type: ignore[attr-defined]
        return call


class on_asyncio(Generic[P, R]):
    """The asyncio form of an engine call: ``await host.X_async(...)`` runs the blocking form on an
    executor thread, so the event loop never blocks.  Cancelling the awaiting task does not stop the
    call: it runs to its end in the Trio thread, bounded by its own timeouts."""

    def __init__(self, method: Callable[Concatenate[Any, P], Awaitable[R]]) -> None:
        self.target = method.__name__
        self.__doc__ = method.__doc__
        self.__signature__ = _bound_signature(method)

    def __get__(self, host: Hosting, owner: type | None = None) -> Callable[P, Awaitable[R]]:
        target = self.target

        async def call(*args: P.args, **kwargs: P.kwargs) -> R:
            host.engine.control_orchestrator()  # EngineClosed at once, not from the executor
            run = partial(host.run_in_trio, partial(getattr(host.engine, target), *args, **kwargs))
            return await asyncio.get_running_loop().run_in_executor(None, run)

        call.__name__ = target
        call.__doc__ = self.__doc__
        call.__signature__ = self.__signature__  # type: ignore[attr-defined]
        return call
