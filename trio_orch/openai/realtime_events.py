"""The OpenAI Realtime protocol's shapes for :mod:`trio_orch.openai.realtime`: client events checked,
server events built.

Kept apart from the session's rules so that each event's fields -- the names
and types the official ``openai`` SDK parses (``openai.types.realtime``) --
are written in one place.  A response has one output item (an assistant
message) with one content part: ``text`` for ``output_modalities: ["text"]``,
``audio`` (its transcript streamed beside it) for ``["audio"]``.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Callable
from typing import Any

import numpy as np

from trio_orch.openai.audio_out import REALTIME_OUT, AudioStream

__all__ = ["AUDIO_FORMAT", "CLIENT_EVENTS", "SAMPLE_RATE", "UNSUPPORTED_EVENTS", "Refused", "Response",
           "check_audio", "check_item", "check_limit", "check_modalities", "error_event", "output_format",
           "parse_frame"]

#: the session's event maker: ``make(type, **fields)`` -> the event, its ``event_id`` assigned
MakeEvent = Callable[..., dict[str, Any]]

#: what a client may send (the ``type`` field)
CLIENT_EVENTS = ("session.update", "conversation.item.create", "conversation.item.retrieve",
                 "conversation.item.delete", "response.create", "response.cancel")
#: OpenAI client events this server knows but cannot honour, and why
UNSUPPORTED_EVENTS = {
    "input_audio_buffer.append": "audio input is not supported: add text with conversation.item.create",
    "input_audio_buffer.commit": "audio input is not supported: add text with conversation.item.create",
    "input_audio_buffer.clear": "audio input is not supported: add text with conversation.item.create",
    "conversation.item.truncate": "items cannot be truncated: the pipeline has heard them already",
    "output_audio_buffer.clear": "output_audio_buffer.clear is for WebRTC/SIP sessions only",
}
SAMPLE_RATE = 24000  # "audio/pcm": base64 16-bit little-endian mono PCM at 24 kHz, the API's only rate
AUDIO_FORMAT = {"type": "audio/pcm", "rate": SAMPLE_RATE}  # the input's (audio input is refused) and default
_PARTS = {"user": ("input_text",), "system": ("input_text",), "assistant": ("output_text", "text")}


class Refused(ValueError):
    """A client event that cannot be applied: becomes an ``error`` event and changes nothing.

    ``code`` says why; ``param`` names the field, as OpenAI's errors do.
    """

    def __init__(self, code: str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.param = param


def parse_frame(frame: str | bytes, max_bytes: int) -> dict[str, Any]:
    """A client frame -> its event (an object with a known ``type``).  Raises :class:`Refused`."""
    if isinstance(frame, bytes | bytearray):
        raise Refused("binary_frame", "binary frames are not supported: send JSON text events")
    size = len(frame) if 4 * len(frame) <= max_bytes else len(frame.encode("utf-8", "replace"))
    if size > max_bytes:
        raise Refused("event_too_large", f"an event of {size} bytes is over the limit of "
                                         f"{max_bytes}")
    try:
        event = json.loads(frame)
    except (json.JSONDecodeError, RecursionError) as exc:
        raise Refused("invalid_json", f"the frame is not JSON: {exc}") from None
    if not isinstance(event, dict):
        raise Refused("invalid_event", f"an event is a JSON object, got {type(event).__name__}")
    kind = event.get("type")
    if not isinstance(kind, str):
        raise Refused("missing_type", "the event has no \"type\" string", "type")
    if kind in UNSUPPORTED_EVENTS:
        raise Refused("unsupported_event", f"{kind}: {UNSUPPORTED_EVENTS[kind]}", "type")
    if kind not in CLIENT_EVENTS:
        raise Refused("unknown_event", f"unknown event type {kind!r} (expected one of "
                                       f"{', '.join(CLIENT_EVENTS)})", "type")
    return event

def output_format(kind: str) -> dict[str, Any]:
    """An output format's object, as the session and response resources show it."""
    return {"type": kind, "rate": SAMPLE_RATE} if kind == "audio/pcm" else {"type": kind}


def check_item(item: Any) -> tuple[dict[str, Any], str]:
    """A client's message item -> (the item as the server keeps it, its text).  Raises :class:`Refused`."""
    if not isinstance(item, dict):
        raise Refused("invalid_item", "conversation.item.create needs an \"item\" object", "item")
    if item.get("type") != "message":
        raise Refused("invalid_item", f"only message items are supported (got {item.get('type')!r}): no "
                      "function calls, tools or MCP", "item.type")
    role = item.get("role")
    if role not in _PARTS:
        raise Refused("invalid_item", f"role must be one of {', '.join(_PARTS)} (got {role!r})", "item.role")
    content = item.get("content")
    if not isinstance(content, list) or not content:
        raise Refused("invalid_item", "content must be a non-empty list of parts", "item.content")
    parts = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _PARTS[role]:
            raise Refused("invalid_item", f"a {role} message takes {' or '.join(_PARTS[role])} parts (got "
                          f"{kind!r}): audio and image input are not supported", f"item.content[{i}].type")
        if not isinstance(part.get("text"), str):
            raise Refused("invalid_item", "a text part needs a \"text\" string", f"item.content[{i}].text")
        parts.append({"type": kind, "text": part["text"]})
    kept: dict[str, Any] = {"type": "message", "role": role, "content": parts}
    if item.get("id") is not None:
        if not isinstance(item["id"], str) or not 0 < len(item["id"]) <= 64:
            raise Refused("invalid_item", "id must be a string of 1 to 64 characters", "item.id")
        kept["id"] = item["id"]
    return kept, "".join(p["text"] for p in parts)


def check_modalities(mods: Any, *, text: bool, audio: bool, param: str) -> list[str]:
    """``output_modalities``: ``["audio"]`` (audio and its transcript) or ``["text"]``, if the pipeline
    has that output (``text``: a text-only path; ``audio``: an audio output)."""
    if mods == ["text"] and text:
        return ["text"]
    if mods == ["audio"] and audio:
        return ["audio"]
    if mods in (["text"], ["audio"]):
        raise Refused("invalid_value", f"this pipeline has no {mods[0]}-only output", param)
    raise Refused("invalid_value", "output_modalities must be [\"audio\"] (audio and its transcript) or "
                  "[\"text\"]", param)


def check_audio(audio: Any, voice: str | None, fmt: str, param: str) -> tuple[str | None, str]:
    """An ``audio`` setting -> its voice and output format's type (``voice`` and ``fmt`` where unset).
    The formats are :data:`~trio_orch.openai.audio_out.REALTIME_OUT`'s (libsndfile writes G.711 in
    every build, so none is missing here)."""
    if not isinstance(audio, dict):
        raise Refused("invalid_value", "audio must be an object", param)
    out = audio.get("output") or {}
    if not isinstance(out, dict):
        raise Refused("invalid_value", "audio.output must be an object", f"{param}.output")
    given = out.get("format")
    if given is not None:
        kind = given.get("type", "audio/pcm") if isinstance(given, dict) else None
        rate = given.get("rate", SAMPLE_RATE) if isinstance(given, dict) else None
        if kind not in REALTIME_OUT or (kind == "audio/pcm" and rate != SAMPLE_RATE):
            raise Refused("unsupported_value", f"the output audio format {given!r} is not one of "
                          "{\"type\": \"audio/pcm\", \"rate\": 24000} (16-bit PCM), "
                          "{\"type\": \"audio/pcmu\"} (G.711 mu-law, 8 kHz) or "
                          "{\"type\": \"audio/pcma\"} (G.711 A-law, 8 kHz)", f"{param}.output.format")
        fmt = kind
    v = out.get("voice", voice)
    if v is not None and not isinstance(v, str):
        raise Refused("unsupported_value", "voice must be the name of a voice", f"{param}.output.voice")
    return v, fmt


def check_limit(value: Any, param: str) -> int | str:
    """``max_output_tokens``: 1..4096 or ``"inf"``."""
    if value == "inf" or (isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= 4096):
        return value
    raise Refused("invalid_value", "max_output_tokens must be an integer from 1 to 4096 or \"inf\"", param)


def error_event(event_id: str, kind: str, code: str, message: str, param: str | None,
                client_event_id: str | None) -> dict[str, Any]:
    """``error``: the client event (``client_event_id``) was refused, or the session's request failed."""
    return {"type": "error", "event_id": event_id,
            "error": {"type": kind, "code": code, "message": message, "param": param,
                      "event_id": client_event_id}}


class Response:
    """One response in progress: its ids, what it has streamed, which stages closed its segment."""

    def __init__(self, response_id: str, item_id: str, segment: int, modalities: list[str],
                 extras: dict[str, Any], previous_item_id: str | None,
                 audio_format: str = "audio/pcm") -> None:
        self.id = response_id
        self.previous_item_id = previous_item_id  # the conversation's last item when the response began
        self.item_id = item_id
        self.segment = segment  # the input segment of the session's request this response answers
        self.modalities = modalities
        self.extras = extras  # conversation_id, output_modalities, audio, max_output_tokens, metadata
        self.text: list[str] = []
        self.text_stages: set[int] = set()
        self.closed: set[int] = set()  # final stages that finished the segment
        self.text_done = False
        self.audio_done = modalities != ["audio"]
        self.audio_format = audio_format  # a key of REALTIME_OUT
        self.stream: AudioStream | None = None  # the audio's encoder, from the first audio

    @property
    def audio(self) -> bool:
        return self.modalities == ["audio"]

    def resource(self, status: str, details: dict[str, Any] | None = None,
                 output: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        """The response resource (``response.created`` / ``response.done``)."""
        return {"object": "realtime.response", "id": self.id, "status": status, "status_details": details,
                "output": output or [], **self.extras, "usage": None}

    def _part(self) -> dict[str, Any]:
        text = "".join(self.text)
        return {"type": "audio", "transcript": text} if self.audio else {"type": "text", "text": text}

    def item(self, status: str) -> dict[str, Any]:
        """The assistant message this response adds to the conversation."""
        text = "".join(self.text)
        content = ([{"type": "output_audio", "transcript": text}] if self.audio
                   else [{"type": "output_text", "text": text}])
        return {"id": self.item_id, "object": "realtime.item", "type": "message", "role": "assistant",
                "status": {"in_progress": "in_progress", "completed": "completed"}.get(status, "incomplete"),
                "content": content if status != "in_progress" else []}

    def _where(self) -> dict[str, Any]:
        return {"response_id": self.id, "item_id": self.item_id, "output_index": 0, "content_index": 0}

    def created(self, make: MakeEvent) -> list[dict[str, Any]]:
        """The events that open the response, before any output."""
        item = self.item("in_progress")
        return [make("response.created", response=self.resource("in_progress")),
                make("response.output_item.added", response_id=self.id, output_index=0, item=item),
                make("conversation.item.added", previous_item_id=self.previous_item_id, item=item),
                make("response.content_part.added", **self._where(), part=self._part())]

    def text_delta(self, make: MakeEvent, stage: int, text: str) -> dict[str, Any]:
        self.text.append(text)
        self.text_stages.add(stage)
        kind = "response.output_audio_transcript.delta" if self.audio else "response.output_text.delta"
        return make(kind, **self._where(), delta=text)

    def audio_delta(self, make: MakeEvent, pcm: np.ndarray, sample_rate: int) -> list[dict[str, Any]]:
        """Float samples in [-1, 1] -> the ``output_audio.delta`` of what they complete in the response's
        format (none where they complete no sample yet: G.711's 8 kHz takes three of 24 kHz's)."""
        if self.stream is None:
            self.stream = AudioStream(REALTIME_OUT[self.audio_format], sample_rate)
        return self._audio(make, self.stream.encode(pcm))

    def _audio(self, make: MakeEvent, data: bytes) -> list[dict[str, Any]]:
        return [make("response.output_audio.delta", **self._where(),
                     delta=base64.b64encode(data).decode("ascii"))] if data else []

    def _text_done(self, make: MakeEvent) -> list[dict[str, Any]]:
        if self.text_done:
            return []
        self.text_done = True
        text = "".join(self.text)
        if self.audio:
            return [make("response.output_audio_transcript.done", **self._where(), transcript=text)]
        return [make("response.output_text.done", **self._where(), text=text)]

    def _audio_done(self, make: MakeEvent) -> list[dict[str, Any]]:
        if self.audio_done:
            return []
        self.audio_done = True
        tail = self._audio(make, self.stream.flush()) if self.stream is not None else []
        return [*tail, make("response.output_audio.done", **self._where())]

    def stage_done(self, make: MakeEvent, stage: int, text_stage: bool) -> list[dict[str, Any]]:
        """A final stage finished the segment: the text (or the audio) of the response is complete."""
        self.closed.add(stage)
        if text_stage or stage in self.text_stages:
            return self._text_done(make)
        return self._audio_done(make)

    def done(self, make: MakeEvent, status: str, details: dict[str, Any] | None) -> list[dict[str, Any]]:
        """The events that close the response (``status``: completed, cancelled or failed), last
        ``response.done``."""
        item = self.item(status)
        return [*self._audio_done(make), *self._text_done(make),
                make("response.content_part.done", **self._where(), part=self._part()),
                make("response.output_item.done", response_id=self.id, output_index=0, item=item),
                make("conversation.item.done", previous_item_id=self.previous_item_id, item=item),
                make("response.done", response=self.resource(status, details, [item]))]
