"""The realtime session protocol: one WebSocket session, one resumable request (no I/O here).

``trio-orch serve`` speaks it on ``/v1/realtime`` (the socket side is
:mod:`trio_orch.http.realtime_server`).  Events are JSON text frames shaped like
the OpenAI Realtime API's where they fit: ``{"type": ..., ...}``, with an
optional client ``event_id`` echoed in errors.  The user types into an input
buffer and *commits* it: the first commit starts the session's request, each
later one is the next input segment of that same request, answered in turn
(the thinker continues from what it already said and heard).

Client events: ``session.update`` (``{"session": {"modalities": ["text"] |
["text", "audio"]}}``, before the first commit), ``input_text_buffer.append``
(``text``), ``input_text_buffer.clear``, ``input_text_buffer.commit``
(``final``: the last segment), ``session.finish`` (no more input: the buffer
is the final segment, or an empty one closes the input), ``response.cancel``.

Server events: ``session.created``, ``session.updated``,
``input_text_buffer.committed`` (``segment``), ``input_text_buffer.cleared``,
``response.created``, ``response.text.delta`` / ``response.audio.delta``
(``segment``, ``delta``: text, or base64 16-bit little-endian mono PCM at
24 kHz), ``response.text.done`` / ``response.audio.done`` (one stage finished
the segment), ``response.segment.done`` (every output of the segment was
sent), ``response.done`` (``status``: completed, cancelled or failed; the
last event of the response), ``error`` (``{"error": {"type", "code",
"message", "event_id"}}``: the event was refused and changed nothing; the
session stays usable).

:class:`RealtimeSession` turns frames into server events plus *actions*
(:class:`Start`, :class:`Append`, :class:`Cancel`) for the socket side to
perform, and the request's messages into server events.
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass
from typing import Any

from stages.registry import as_audio, as_text, text_stage
from trio_orch.http.openai_chat import pcm16
from trio_orch.types import Message, OrchError

__all__ = ["CLIENT_EVENTS", "Action", "Append", "Cancel", "RealtimeSession", "Start"]

#: what a client may send (the ``type`` field)
CLIENT_EVENTS = ("session.update", "input_text_buffer.append", "input_text_buffer.clear",
                 "input_text_buffer.commit", "session.finish", "response.cancel")
MODALITIES = (["text"], ["text", "audio"])


@dataclass(frozen=True, slots=True)
class Start:
    """Add the session's request: ``prompt`` is its first segment (``resumable``: more follow)."""

    prompt: str
    resumable: bool
    final_stage_id: int | None


@dataclass(frozen=True, slots=True)
class Append:
    """Update the request with the next input segment (None: an empty one that closes the input)."""

    segment: str | None
    final: bool


@dataclass(frozen=True, slots=True)
class Cancel:
    """Abort the request on every stage."""


Action = Start | Append | Cancel


class Refused(ValueError):
    """A client event that cannot be applied: becomes an ``error`` event."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class RealtimeSession:
    """The state of one session.  Not thread-safe; the socket side calls it from one task at a time.

    ``final_stage_ids`` and ``outputs`` (each stage's output modality, or None
    to judge outputs by their shape) describe the pipeline.  Limits:
    ``max_event_bytes`` per client frame, ``max_buffer_chars`` in the input
    buffer (both answered with an ``error`` event, nothing dropped silently).
    """

    def __init__(self, session_id: str, *, final_stage_ids: frozenset[int] | set[int],
                 outputs: list[str] | None = None, max_event_bytes: int = 256 * 1024,
                 max_buffer_chars: int = 64 * 1024) -> None:
        self.session_id = session_id
        self.response_id = f"resp_{session_id}"
        self.final_stage_ids = frozenset(final_stage_ids)
        self.outputs = outputs
        self.max_event_bytes = max_event_bytes
        self.max_buffer_chars = max_buffer_chars
        self.text_stage = text_stage(self.final_stage_ids, outputs)
        self.has_audio = any(outputs is None or outputs[k] in ("audio", "data") for k in self.final_stage_ids)
        self.modalities = ["text", "audio"] if self.has_audio else ["text"]
        self.buffer: list[str] = []
        self.buffered = 0
        self.segments = 0  # committed input segments
        self.started = False  # a Start was issued
        self.resumable = True  # the request takes more segments (False: its first was its last)
        self.input_closed = False  # the final segment was committed
        self.ended = False  # response.done was sent
        self.final_stage_id: int | None = None
        self._expected: frozenset[int] = frozenset()  # final stages whose segment_done we wait for
        self._done: dict[int, set[int]] = {}  # segment -> final stages that closed it
        self._text: dict[tuple[int, int], list[str]] = {}  # (segment, stage) -> text pieces

    # ------------------------------------------------------------------ client side
    def opened(self) -> list[dict[str, Any]]:
        """The first event of the session."""
        return [{"type": "session.created", "session": self._describe()}]

    def receive(self, frame: str | bytes) -> tuple[list[dict[str, Any]], list[Action]]:
        """One client frame -> (events to send now, actions to perform, in order)."""
        event_id = None
        try:
            event = self._parse(frame)
            event_id = event.get("event_id") if isinstance(event.get("event_id"), str) else None
            return self._apply(event)
        except Refused as exc:
            return [self.error(exc.code, str(exc), event_id)], []

    def _parse(self, frame: str | bytes) -> dict[str, Any]:
        if isinstance(frame, bytes | bytearray):
            raise Refused("binary_frame", "binary frames are not supported: send JSON text events")
        size = len(frame) if 4 * len(frame) <= self.max_event_bytes else len(frame.encode("utf-8", "replace"))
        if size > self.max_event_bytes:
            raise Refused("event_too_large", f"an event of {size} bytes is over the limit of "
                                             f"{self.max_event_bytes}")
        try:
            event = json.loads(frame)
        except (json.JSONDecodeError, RecursionError) as exc:
            raise Refused("invalid_json", f"the frame is not JSON: {exc}") from None
        if not isinstance(event, dict):
            raise Refused("invalid_event", f"an event is a JSON object, got {type(event).__name__}")
        kind = event.get("type")
        if not isinstance(kind, str):
            raise Refused("missing_type", "the event has no \"type\" string")
        if kind not in CLIENT_EVENTS:
            raise Refused("unknown_event", f"unknown event type {kind!r} (expected one of "
                                           f"{', '.join(CLIENT_EVENTS)})")
        return event

    def _apply(self, event: dict[str, Any]) -> tuple[list[dict[str, Any]], list[Action]]:
        kind = event["type"]
        if kind == "response.cancel":
            if not self.started:
                raise Refused("no_response", "there is no response to cancel: nothing was committed yet")
            if self.ended:
                raise Refused("response_ended", "the response has already ended")
            return [], [Cancel()]
        if self.ended:
            raise Refused("response_ended", f"{kind}: the session's response has ended "
                                            "(one response per session: open a new one)")
        if kind == "session.update":
            return self._update_session(event)
        if self.input_closed:
            raise Refused("input_closed", f"{kind}: the final input segment was already committed")
        if kind == "input_text_buffer.append":
            text = event.get("text")
            if not isinstance(text, str):
                raise Refused("invalid_text", "input_text_buffer.append needs a \"text\" string")
            if self.buffered + len(text) > self.max_buffer_chars:
                raise Refused("input_text_buffer_overflow",
                              f"the input buffer would hold {self.buffered + len(text)} characters, over "
                              f"the limit of {self.max_buffer_chars}: commit it first")
            self.buffer.append(text)
            self.buffered += len(text)
            return [], []
        if kind == "input_text_buffer.clear":
            self.buffer.clear()
            self.buffered = 0
            return [{"type": "input_text_buffer.cleared"}], []
        if kind == "input_text_buffer.commit":
            final = event.get("final", False)
            if not isinstance(final, bool):
                raise Refused("invalid_final", "\"final\" must be true or false")
            if not "".join(self.buffer).strip():
                raise Refused("input_text_buffer_empty", "nothing to commit: append text first")
            return self._commit(final)
        # session.finish
        if self.buffer and "".join(self.buffer).strip():
            return self._commit(True)
        if not self.started:
            raise Refused("input_text_buffer_empty", "nothing to answer: append and commit text first")
        self.input_closed = True
        self.segments += 1
        return [], [Append(None, True)]

    def _commit(self, final: bool) -> tuple[list[dict[str, Any]], list[Action]]:
        text = "".join(self.buffer)
        self.buffer.clear()
        self.buffered = 0
        segment = self.segments
        self.segments += 1
        self.input_closed = final
        events = [{"type": "input_text_buffer.committed", "segment": segment, "final": final}]
        if self.started:
            return events, [Append(text, final)]
        self.started = True
        self.resumable = not final
        return events, [Start(text, not final, self.final_stage_id)]

    def _update_session(self, event: dict[str, Any]) -> tuple[list[dict[str, Any]], list[Action]]:
        if self.started:
            raise Refused("session_active", "session.update: the response has started; "
                                            "settings can change only before the first commit")
        cfg = event.get("session")
        if not isinstance(cfg, dict):
            raise Refused("invalid_session", "session.update needs a \"session\" object")
        unknown = sorted(set(cfg) - {"modalities"})
        if unknown:
            raise Refused("invalid_session", f"unknown session settings {unknown} (supported: modalities)")
        if "modalities" in cfg:
            mods = cfg["modalities"]
            if mods not in MODALITIES:
                raise Refused("invalid_modalities", "modalities must be [\"text\"] or [\"text\", \"audio\"]")
            if mods == ["text"]:
                if self.text_stage is None:
                    raise Refused("invalid_modalities", "this pipeline has no text-only output")
                self.final_stage_id = self.text_stage
            else:
                if not self.has_audio:
                    raise Refused("invalid_modalities", "this pipeline has no audio output")
                self.final_stage_id = None
            self.modalities = list(mods)
        return [{"type": "session.updated", "session": self._describe()}], []

    # ------------------------------------------------------------------ the request's side
    def request_started(self, final_stage_ids: frozenset[int]) -> list[dict[str, Any]]:
        """The Start was accepted; ``final_stage_ids``: the final stages its segments close at."""
        last = self.final_stage_id if self.final_stage_id is not None else max(final_stage_ids, default=0)
        self._expected = frozenset(k for k in final_stage_ids if k <= last)
        return [{"type": "response.created", "response": {"id": self.response_id, "status": "in_progress"}}]

    def request_failed(self, exc: BaseException) -> list[dict[str, Any]]:
        """The Start was refused: the response ends here."""
        self.ended = True
        return [self.error("request_refused", f"the request was refused: {exc}"),
                self._response_done("failed", {"type": "request_refused", "message": str(exc)})]

    def update_failed(self, exc: BaseException) -> list[dict[str, Any]]:
        """An Append was refused (e.g. the request ended meanwhile)."""
        return [self.error("update_refused", f"the input segment was not taken: {exc}")]

    def output(self, m: Message) -> list[dict[str, Any]]:
        """One message of the request -> the events it causes."""
        if self.ended:
            return []
        if isinstance(m, OrchError):
            self.ended = True
            status = "cancelled" if m.kind == "aborted" else "failed"
            return [self._response_done(status, {"type": m.kind, "message": m.message})]
        events: list[dict[str, Any]] = []
        seg, k = m.segment, m.stage_id
        modality = self.outputs[k] if self.outputs is not None else "data"
        base = {"response_id": self.response_id, "segment": seg}
        text = as_text(modality, m.data)
        audio = as_audio(modality, m.data) if text is None else None
        if text:
            self._text.setdefault((seg, k), []).append(text)
            events.append({"type": "response.text.delta", **base, "delta": text})
        elif audio is not None and len(audio[0]) and "audio" in self.modalities:
            events.append({"type": "response.audio.delta", **base,
                           "delta": base64.b64encode(pcm16(audio[0])).decode("ascii")})
        if m.segment_done or (m.finished and not self.resumable):
            if k == self.text_stage or (seg, k) in self._text:
                events.append({"type": "response.text.done", **base,
                               "text": "".join(self._text.pop((seg, k), []))})
            else:
                events.append({"type": "response.audio.done", **base})
            done = self._done.setdefault(seg, set())
            done.add(k)
            if not self.resumable:  # one segment: the terminal closes it on every stage
                for (_, stage), pieces in sorted(self._text.items()):
                    events.insert(-1, {"type": "response.text.done", **base, "text": "".join(pieces)})
                    done.add(stage)
                self._text.clear()
                done |= self._expected
            if done >= self._expected:
                del self._done[seg]
                events.append({"type": "response.segment.done", **base})
        if m.finished:
            self.ended = True
            events.append(self._response_done("completed", None))
        return events

    # ------------------------------------------------------------------ helpers
    def error(self, code: str, message: str, event_id: str | None = None) -> dict[str, Any]:
        return {"type": "error", "error": {"type": "invalid_request_error", "code": code,
                                           "message": message, "event_id": event_id}}

    def _response_done(self, status: str, details: dict[str, Any] | None) -> dict[str, Any]:
        return {"type": "response.done", "response": {
            "id": self.response_id, "status": status, "status_details": details,
            "segments": self.segments}}

    def _describe(self) -> dict[str, Any]:
        return {"id": self.session_id, "modalities": self.modalities,
                "output_audio_format": "pcm16", "sample_rate": 24000,
                "max_event_bytes": self.max_event_bytes, "max_buffer_chars": self.max_buffer_chars}
