"""Membership rules: replicas that join and leave a running pipeline.

A replica started elsewhere (a headless worker, a Ray actor) *joins* through
a handshake that takes a while (it registers, loads its model, says it is
ready); a member *leaves* gracefully, dies or loses its connection.  The
core decides who may begin a join, whether a finished handshake makes a
member, and what shutdown does to handshakes still in progress; a shell
runs the handshakes and performs the answers.  Identities are single-use: a
member that left (or whose join failed) cannot come back under the same
identity -- a worker that lost its connection registers again as a new
replica, and a stale registration (a replay, a worker that missed its own
eviction) is refused.

Which replicas serve (availability and admission bounds) follows from the
pools' live counts through :meth:`RoutingRules.replicas_changed`; requests
bound to a replica that died end through that replica's ``replica_died``
outputs.
"""

from __future__ import annotations

from trio_orch.core.state import CoreState

__all__ = ["JoinRefused", "join", "joined", "joins_to_cancel", "left", "spend"]

#: how many spent identities are remembered (a stale one older than that is refused as unknown... or
#: accepted as new: ids are random, so an old one coming back this late is a replay of a very old message)
SPENT_MEMORY = 65536


class JoinRefused(ValueError):
    """A join the core refuses; ``reason`` is one of ``stopping``, ``stale``, ``duplicate``, ``bad_stage``."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def join(state: CoreState, stage_id: int, member_id: str) -> None:
    """A replica begins to join ``stage_id`` as ``member_id``; :class:`JoinRefused` if it may not.

    Refused: while stopping (no handshake starts once shutdown began), for
    a stage that does not exist, for an identity already joining or a
    member (duplicate), and for a spent one (stale: it left, died or failed
    to join before).
    """
    if not state.accepting:
        raise JoinRefused("stopping", f"{member_id}: the orchestrator is shutting down")
    if not (isinstance(stage_id, int) and 0 <= stage_id < state.num_stages):
        raise JoinRefused(
            "bad_stage", f"{member_id}: no stage {stage_id!r} (stages are 0..{state.num_stages - 1})"
        )
    if member_id in state.joining or member_id in state.members:
        raise JoinRefused(
            "duplicate",
            f"{member_id} is already {'joining' if member_id in state.joining else 'a member'}",
        )
    if member_id in state.spent_members:
        raise JoinRefused(
            "stale",
            f"{member_id} is a spent identity (it left or was evicted): register again with a new one",
        )
    state.joining[member_id] = stage_id


def joined(state: CoreState, member_id: str) -> bool:
    """A join's handshake completed: True makes it a member (the shell places requests on it).

    False when shutdown began meanwhile, or the join was cancelled: the
    shell must send the replica away, not add it to a pool that is closing.
    """
    stage_id = state.joining.pop(member_id, None)
    if stage_id is None or not state.accepting:
        spend(state, member_id)
        return False
    state.members[member_id] = stage_id
    return True


def left(state: CoreState, member_id: str) -> None:
    """A member (or a joining replica whose handshake failed) is gone; its identity is spent."""
    state.joining.pop(member_id, None)
    state.members.pop(member_id, None)
    spend(state, member_id)


def joins_to_cancel(state: CoreState) -> list[str]:
    """Shutdown began: every handshake still in progress ends now (never waited for).

    Returns the identities whose handshakes the shell must cancel; they
    are spent.
    """
    ids = list(state.joining)
    for member_id in ids:
        left(state, member_id)
    return ids


def spend(state: CoreState, member_id: str) -> None:
    """Remember a used identity (bounded)."""
    state.spent_members[member_id] = None
    while len(state.spent_members) > SPENT_MEMORY:
        state.spent_members.popitem(last=False)
