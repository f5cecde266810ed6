"""Admission, the one path of every engine: admitted at once, after a bounded wait, or shed.

Runs in the engine's Trio run.  A request (opened in the run, or posted from
a serving thread) is *admitted* when the orchestrator accepted it into its bounded request
channel (from then on it gets exactly one terminal).  The channel fills
when the routing core says the stages are at their bound (``max_inflight``);
requests that find it full wait here, in FIFO order -- at most
``max_waiting`` of them, each for at most ``timeout`` seconds.  Past either
bound the request is *shed*: its caller gets :class:`Overloaded` and
nothing was registered, so there is no terminal to deliver.  A request
whose path has a stage with no live replica is refused at once with the
``stage_unavailable`` terminal the core would give it later, rather than
queue behind requests it could never follow.

Once it sheds, ``shedding_until`` (a plain float, readable from any thread)
stays in the future until the request channel has room again (watched every
``room_poll`` seconds while it sheds, at most ``shed_hint_max`` seconds in
all): an HTTP front may refuse a new request at once while it is, before
reading or parsing it, so that under a flood its own CPU goes to the
requests it admitted.  The hint ends the moment room appears, so it never
turns away a request the core would have taken for longer than one poll.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable

import trio

from trio_orch.engine.api import Overloaded
from trio_orch.engine.demux import ACK, ADMITTED, DONE, PENDING, WITHDRAWN, Demux, Stream
from trio_orch.shell.orchestrator import Orchestrator
from trio_orch.types import OrchError

__all__ = ["Admitter"]

log = logging.getLogger("trio_orch.engine")


class _Sending:
    """The one request whose hand-over to the request channel the admitter is waiting on."""

    __slots__ = ("aborted", "scope", "stream")

    def __init__(self, stream: Stream, scope: trio.CancelScope) -> None:
        self.stream = stream
        self.scope = scope
        self.aborted = False  # the caller aborted or withdrew while we waited


class Admitter:
    """The engine's admission policy (in the engine's run only); see the module docstring.

    ``timeout``: seconds a request may wait for room (None: as long as it
    takes); ``max_waiting``: how many may wait (None: no bound);
    ``retry_after``: the seconds suggested to shed callers.  ``on_admitted(rid)``
    and ``on_dropped(rid, why)`` tell whoever holds a request's early input
    updates whether they may follow it (the engine's update forwarder).
    """

    def __init__(self, demux: Demux, *, timeout: float | None = None, max_waiting: int | None = None,
                 retry_after: float = 1.0, shed_hint_max: float = 1.0, room_poll: float = 0.002) -> None:
        if timeout is not None and timeout < 0:
            raise ValueError(f"admission timeout must be >= 0 seconds, got {timeout!r}")
        if max_waiting is not None and max_waiting < 0:
            raise ValueError(f"max_waiting must be >= 0, got {max_waiting!r}")
        self.demux = demux
        self.timeout = timeout
        self.max_waiting = max_waiting
        self.retry_after = retry_after
        self.shed_hint_max = shed_hint_max
        self.room_poll = room_poll
        self.shedding_until = 0.0  # time.monotonic(): a request now would most likely be shed
        self._shed_started = trio.Event()  # wakes the room watcher
        self.orch: Orchestrator | None = None
        self.on_admitted: Callable[[str], None] = lambda rid: None
        self.on_dropped: Callable[[str, str], None] = lambda rid, why: None
        self.waiting = 0
        self._send, self._recv = trio.open_memory_channel[tuple[Stream, float]](math.inf)
        self._sending: _Sending | None = None

    @property
    def waiting_bound(self) -> float:
        """How many requests may wait here for room (any thread)."""
        if self.timeout == 0:
            return 0
        return math.inf if self.max_waiting is None else self.max_waiting

    async def run(self, orch: Orchestrator) -> None:
        """Admit, in FIFO order, the requests that found the request channel full; end the shedding
        hint when room appears."""
        self.orch = orch
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._watch_room, orch)
            await self._admit_waiting(orch)
            nursery.cancel_scope.cancel()

    async def _watch_room(self, orch: Orchestrator) -> None:
        """While shedding: end the hint as soon as the request channel has room (poll, no hook on
        the hot path); asleep otherwise."""
        while True:
            await self._shed_started.wait()
            self._shed_started = trio.Event()
            while time.monotonic() < self.shedding_until:
                if orch.has_room():
                    self.shedding_until = 0.0
                    break
                await trio.sleep(self.room_poll)

    async def _admit_waiting(self, orch: Orchestrator) -> None:
        async for s, admit_by in self._recv:
            try:
                if s.state != PENDING:
                    continue  # aborted or withdrawn while waiting
                if self._unavailable(s):
                    continue
                with trio.CancelScope(deadline=admit_by) as cs:
                    sending = self._sending = _Sending(s, cs)
                    try:
                        await orch.add_request(s.request_id, s.prompt, final_stage_id=s.final_stage_id,
                                               timeout=s.timeout, sampling=s.sampling, resumable=s.resumable,
                                               companions=s.companions, wait_start=False,
                                               priority=s.priority)
                    except Exception as exc:
                        self.refused(s, exc)
                        continue
                    finally:
                        self._sending = None
                if not cs.cancelled_caught:  # in the channel: it gets its terminal from now on
                    self.admitted(s)
                    if sending.aborted:
                        orch.abort_nowait(s.request_id)
                elif sending.aborted:
                    self.ended_unadmitted(s)
                else:
                    self.shed(s, f"no room within {self.timeout:g}s: the stages are at their bound")
            finally:
                self.waiting -= 1

    # ------------------------------------------------------------------ callbacks (Trio thread)
    def admit(self, s: Stream) -> None:
        """A request just posted: admit at once if there is room and nobody waits, else queue or shed."""
        try:
            if s.state != PENDING:
                return
            if s.detached:
                self.demux.unregister(s)
                return
            orch = self.orch
            assert orch is not None
            if self._unavailable(s):
                return
            if self.waiting == 0:
                try:
                    orch.add_request_nowait(s.request_id, s.prompt, final_stage_id=s.final_stage_id,
                                            timeout=s.timeout, sampling=s.sampling, resumable=s.resumable,
                                            companions=s.companions, priority=s.priority)
                except trio.WouldBlock:
                    pass
                except Exception as exc:
                    self.refused(s, exc)
                    return
                else:
                    self.admitted(s)
                    return
            if self.max_waiting is not None and self.waiting >= self.max_waiting:
                self.shed(s, f"{self.waiting} requests already wait for room")
                return
            if self.timeout == 0:
                self.shed(s, "every stage of the pipeline is at its bound")
                return
            self.waiting += 1
            admit_by = math.inf if self.timeout is None else trio.current_time() + self.timeout
            self._send.send_nowait((s, admit_by))
        except BaseException as exc:  # never let a callback kill the Trio run
            log.exception("admission of %r failed", s.request_id)
            self.demux.fail(s, exc)

    def abort(self, s: Stream) -> None:
        """Abort a request that is still waiting for admission (state PENDING)."""
        sending = self._sending
        if sending is not None and sending.stream is s:
            sending.aborted = True
            sending.scope.cancel()  # run() sorts out whether it got in before the cancel
        else:
            self.ended_unadmitted(s)  # still in the queue: run() will skip it

    # ------------------------------------------------------------------ outcomes
    def _unavailable(self, s: Stream) -> bool:
        """End ``s`` at once if a stage of its path has no live replica; True if it did."""
        router = self.orch.router  # type: ignore[union-attr]
        k = router.unavailable_stage(router.resolve_final_stage(s.request_id, s.final_stage_id))
        if k is None:
            return False
        self.on_dropped(s.request_id, f"stage {k} has no live replica")
        self.demux.count_shed("stage_unavailable")
        self.demux.end(s, OrchError(s.request_id, k, "stage_unavailable", f"stage {k} has no live replica"))
        return True

    def shed(self, s: Stream, why: str) -> None:
        self.on_dropped(s.request_id, f"it was shed: {why}")
        self.shedding_until = time.monotonic() + self.shed_hint_max  # until room appears (_watch_room)
        self._shed_started.set()
        self.demux.count_shed("overloaded")
        self.demux.fail(s, Overloaded(f"overloaded: request not accepted ({why}); retry later",
                                      retry_after=self.retry_after))

    def refused(self, s: Stream, exc: Exception) -> None:
        self.on_dropped(s.request_id, f"it was refused: {exc}")
        if isinstance(exc, RuntimeError):  # the orchestrator stopped accepting: a terminal, not a raise
            self.demux.end(s, OrchError(s.request_id, None, "shutdown", str(exc)))
        else:
            self.demux.fail(s, exc)

    def admitted(self, s: Stream) -> None:
        if s.state == PENDING:
            s.state = ADMITTED
            self.demux.admitted += 1
            self.on_admitted(s.request_id)
            if s.want_ack:
                self.demux.put(s, ACK)

    def ended_unadmitted(self, s: Stream) -> None:
        if s.state == DONE:
            return
        self.on_dropped(s.request_id, "it ended before it was admitted")
        if s.withdrawn:
            self.demux.unregister(s)
            s.put(WITHDRAWN)
        else:
            self.demux.end(s, OrchError(s.request_id, None, "aborted",
                                        "aborted while waiting for room in the request channel"))
