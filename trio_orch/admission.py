"""Admission bookkeeping of the Trio orchestrator: which requests are accepted and live.

Synchronous and small on purpose (the httpcore pattern): every check and
state change for a new request happens here before the first checkpoint of
``add_request``, and is undone in one call if the request never got into the
request channel.  A request is *live* from acceptance until its terminal has
been delivered; it is *queued* while it waits for the request handler.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import trio

from trio_orch.deadlines import DeadlineKeeper
from trio_orch.router import Router

__all__ = ["Admission", "Admissions"]


class Admission:
    """A request accepted by ``add_request`` and waiting for the request handler."""

    __slots__ = ("cancelled", "done", "final_stage_id", "prompt", "request_id")

    def __init__(self, request_id: str, prompt: Any, final_stage_id: int | None,
                 done: trio.Event | None) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.final_stage_id = final_stage_id
        self.done = done
        self.cancelled = False  # aborted or expired while queued: the handler skips it


class Admissions:
    """Live and queued requests, and their deadlines."""

    def __init__(self, router: Router, request_timeout: float | None) -> None:
        self.router = router
        self.request_timeout = request_timeout
        self.live: set[str] = set()  # accepted, no terminal yet (queued or routed)
        self.queued: dict[str, Admission] = {}  # accepted, not yet taken by the handler
        self.deadlines = DeadlineKeeper()

    def admit(self, request_id: str, prompt: Any, final_stage_id: int | None,
              done: trio.Event | None, timeout: float | None) -> Admission:
        """Check and register a new request (raises ValueError, registers nothing, if bad)."""
        self.router.resolve_final_stage(request_id, final_stage_id)
        if request_id in self.live:
            raise ValueError(f"duplicate request id {request_id!r}: a request with this id is active")
        timeout = self.request_timeout if timeout is None else timeout
        if timeout is not None and not timeout > 0:
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
        adm = Admission(request_id, prompt, final_stage_id, done)
        self.live.add(request_id)
        self.queued[request_id] = adm
        if timeout is not None:
            self.deadlines.set(request_id, timeout)
        return adm

    def unadmit(self, adm: Admission) -> None:
        """Undo :meth:`admit` for a request that never entered the request channel."""
        self.live.discard(adm.request_id)
        self.deadlines.discard(adm.request_id)
        if self.queued.get(adm.request_id) is adm:
            del self.queued[adm.request_id]

    def take(self, adm: Admission) -> None:
        """The request handler picked the request up."""
        if self.queued.get(adm.request_id) is adm:
            del self.queued[adm.request_id]

    def cancel_queued(self, request_id: str) -> Admission | None:
        """Take a still-queued request out (abort or deadline before the handler saw it)."""
        adm = self.queued.pop(request_id, None)
        if adm is not None:
            adm.cancelled = True
        return adm

    def ended(self, request_ids: Iterable[str]) -> None:
        """These requests had their terminal delivered."""
        live = self.live
        deadlines = self.deadlines
        for rid in request_ids:
            live.discard(rid)
            if deadlines:
                deadlines.discard(rid)
