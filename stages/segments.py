"""Resumable requests inside a worker: input segments, one after the other, on one model state.

A request submitted with ``resumable=True`` takes more input while it runs:
each ``Update`` message is one more input *segment*.  The worker keeps the
request (its cache slot, its model state) when a segment finishes and
reports that segment ``finished``; it retires the request only when the
segment it finished was the last (its update said ``final``).  Segments run
strictly one after the other on a replica:

- an update that arrives while a segment still runs waits here, and starts
  (``StageModel.extend``) once that segment finished;
- between segments the request is *parked*: it stays active (it holds its
  slot) but takes no step, so a model never reports a segment it was not given;
- in async-chunk mode a segment's input streams from the previous stage's
  worker, each chunk tagged with its segment; chunks of a segment that has
  not started here are held and fed, in order, when it starts;
- a segment whose payload is None is *empty* ("no new input", e.g. a final
  segment that only closes the input): the worker closes it without a model
  step, with a finished output whose data is None.  (In async-chunk mode a
  downstream stage learns of it from the upstream's end chunk as usual.)

:class:`SegmentTracker` holds this bookkeeping for the worker loop
(``stages.worker``), which asks it what to do at each event.  Nothing here
does I/O.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from stages.base import ReqState, StageModel

__all__ = ["SegmentTracker", "Session"]

log = logging.getLogger("stages.segments")


@dataclass(slots=True)
class Session:
    """One resumable request on this worker."""

    current: int = 0  #: the segment running (or, while parked, the one that just finished)
    parked: bool = False  #: ``current`` finished; the next one has not started
    empty: bool = False  #: ``current`` is an empty segment: close it without a model step
    final: bool = False  #: the final segment was received
    updates: deque[Any] = field(default_factory=deque)  #: received segments not started yet, in order
    held: dict[int, list[tuple[Any, bool]]] = field(default_factory=dict)  #: their early chunks


class SegmentTracker:
    """The resumable requests of one worker, keyed by request id."""

    def __init__(self, model: StageModel) -> None:
        self.model = model
        self.sessions: dict[str, Session] = {}
        self.late_chunks = 0  # chunks of a segment that had already finished here (dropped)

    def open(self, req: ReqState) -> None:
        """``req`` was submitted with ``resumable=True`` (its first segment is its payload)."""
        self.sessions[req.request_id] = Session()

    def forget(self, request_id: str) -> None:
        """The request left the worker (retired, aborted, failed)."""
        self.sessions.pop(request_id, None)

    def resumable(self, request_id: str) -> bool:
        return request_id in self.sessions

    def parked(self, request_id: str) -> bool:
        s = self.sessions.get(request_id)
        return s is not None and s.parked

    def empty(self, request_id: str) -> bool:
        s = self.sessions.get(request_id)
        return s is not None and s.empty and not s.parked

    def segment(self, request_id: str) -> int:
        """The segment the request's outputs (and downstream chunks) belong to now."""
        s = self.sessions.get(request_id)
        return s.current if s is not None else 0

    # ------------------------------------------------------------------ events
    def update(self, req: ReqState, payload: Any, final: bool) -> None:
        """One more input segment; starts at once if the request is parked.

        Raises ``ValueError`` (the caller fails the request) after the final
        segment, or when the model refuses the new input.
        """
        s = self.sessions[req.request_id]
        if s.final:
            raise ValueError("an update after the final segment")
        s.final = final
        s.updates.append(payload)
        if s.parked:
            self._start_next(req, s)

    def segment_finished(self, req: ReqState) -> bool:
        """``req`` finished its current segment: True if that was its last (retire it).

        Otherwise it parks, or starts the next segment at once if that one
        already arrived.  Raises ``ValueError`` if the model refuses it.
        """
        s = self.sessions[req.request_id]
        s.empty = False
        if s.final and not s.updates:
            return True
        s.parked = True
        if s.updates:
            self._start_next(req, s)
        return False

    def route_chunk(self, req: ReqState, data: Any, end: bool, segment: int) -> bool:
        """An upstream chunk: True if the model takes it now, False if held (or dropped as late)."""
        s = self.sessions[req.request_id]
        if segment == s.current and not s.parked:
            return True
        if segment > s.current:
            s.held.setdefault(segment, []).append((data, end))
        else:
            self.late_chunks += 1
            log.warning("dropped a chunk of %r for segment %d, which already finished here",
                        req.request_id, segment)
        return False

    def _start_next(self, req: ReqState, s: Session) -> None:
        s.current += 1
        s.parked = False
        payload = s.updates.popleft()
        if payload is None and not req.upstream:
            s.empty = True
            return
        self.model.extend(req, payload)
        for data, end in s.held.pop(s.current, ()):
            self.model.feed(req, data, end)
