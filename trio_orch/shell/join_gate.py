"""The Trio shell's side of membership: joins run under the core's rules and die with shutdown.

A replica's join is a handshake that takes a while (registration, model
load, the ready handshake).  :meth:`JoinGate.join` asks the core whether it
may begin (:meth:`~trio_orch.core.membership.MembershipRules.join`), runs the
handshake in the caller's task inside a cancel scope the gate keeps, and
asks the core again when it completes
(:meth:`~trio_orch.core.membership.MembershipRules.joined`).  When the
orchestrator stops, :meth:`JoinGate.stop` cancels every handshake still in
progress at once (the core's ``joins_to_cancel``): shutdown never waits for
a join, and no join completes into a pool that is closing.  A member that
leaves or dies is reported with :meth:`JoinGate.left` (its identity is spent).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

import trio

from trio_orch.core import JoinRefused, Router

__all__ = ["JoinGate"]

log = logging.getLogger("trio_orch.shell.join_gate")

T = TypeVar("T")


class JoinGate:
    """Runs replica joins under one orchestrator's core (see the module docstring)."""

    def __init__(self, router: Router) -> None:
        self.router = router
        self._scopes: dict[str, trio.CancelScope] = {}
        self.cancelled_at_shutdown = 0

    @property
    def joining(self) -> int:
        """Handshakes in progress."""
        return len(self._scopes)

    async def join(self, stage_id: int, member_id: str, handshake: Callable[[], Awaitable[T]]) -> T:
        """Run ``handshake()`` as ``member_id``'s join of stage ``stage_id``; return its result.

        Raises :class:`JoinRefused` when the core refuses the join (before the
        handshake starts, or when it completes after shutdown began) and when
        shutdown cancelled the handshake; whatever the handshake raises
        otherwise propagates.  Either way the identity is spent.
        """
        self.router.join(stage_id, member_id)
        scope = trio.CancelScope()
        self._scopes[member_id] = scope
        try:
            with scope:
                result = await handshake()
        except BaseException:
            self.router.left(member_id)
            raise
        finally:
            self._scopes.pop(member_id, None)
        if scope.cancelled_caught:
            self.router.left(member_id)
            raise JoinRefused("stopping", f"{member_id}: the orchestrator shut down during the handshake")
        if not self.router.joined(member_id):
            raise JoinRefused("stopping", f"{member_id}: the orchestrator is shutting down")
        return result

    def left(self, member_id: str) -> None:
        """A member left or died: its identity is spent."""
        self.router.left(member_id)

    def stop(self) -> None:
        """Shutdown began: cancel every handshake in progress (the core says which)."""
        for member_id in self.router.joins_to_cancel():
            scope = self._scopes.get(member_id)
            if scope is not None:
                scope.cancel()
                self.cancelled_at_shutdown += 1
                log.info("join of %s cancelled: the orchestrator is shutting down", member_id)
