"""The OpenAI chat-completions shape: strict request parsing and response/chunk building.

No web framework here: :func:`parse_chat_request` turns a decoded JSON body
into a :class:`ChatRequest` or raises :class:`BadRequest` (-> HTTP 400 with
OpenAI's error body); :class:`ChatStream` turns orchestrator messages into
``chat.completion.chunk`` objects and accumulates the non-streaming answer.

Text comes from stage outputs ``{"text": str}`` (or a plain str), audio from
``{"pcm": float32 array, "sample_rate": int}``: from stages whose kind declares
that output modality (:mod:`stages.registry`), or by shape when undeclared.  Audio goes out as OpenAI's
audio output does: streaming ``delta.audio = {id, data}`` with base64 16-bit
little-endian PCM; non-streaming ``message.audio = {id, data, expires_at,
transcript}`` with a base64 WAV (or raw pcm16 if asked).
"""

from __future__ import annotations

import base64
import io
import secrets
import time
import wave
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from stages.registry import as_audio, as_text
from stages.sampling_params import StageParams
from trio_orch import openai_sampling
from trio_orch.types import OrchError, OrchOutput

__all__ = ["BadRequest", "ChatRequest", "ChatStream", "error_body", "map_chat_sampling", "parse_chat_request"]

_FIELDS = {"model", "messages", "stream", "stream_options", "modalities", "audio", "max_tokens",
           "max_completion_tokens", "temperature", "top_p", "seed", "user", "n"} | openai_sampling.FIELDS
_ROLES = {"system", "developer", "user", "assistant"}
_AUDIO_FORMATS = {"wav", "pcm16"}
_VOICES = {"alloy", "ash", "ballad", "coral", "echo", "fable", "nova", "onyx", "sage", "shimmer", "verse"}


class BadRequest(ValueError):
    """A request that does not fit the schema; ``param`` names the offending field."""

    def __init__(self, message: str, param: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.param = param
        self.status = status


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


@dataclass
class ChatRequest:
    model: str
    prompt: str
    stream: bool = False
    audio: bool = False
    audio_format: str = "wav"
    voice: str = "alloy"
    max_tokens: int | None = None
    include_usage: bool = False
    sampling: dict[int, dict[str, Any]] = field(default_factory=dict)  # stage -> its parameters

    def payload(self) -> Any:
        """What stage 0 takes: the prompt (limits and the like travel in ``sampling``)."""
        return self.prompt


def _type_name(v: Any) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}.get(
        type(v), "number" if isinstance(v, (int, float)) else type(v).__name__)


def _expect(value: Any, types: tuple[type, ...], param: str, what: str) -> Any:
    ok = isinstance(value, types) and not (isinstance(value, bool) and bool not in types)
    if not ok:
        raise BadRequest(f"'{param}' must be {what}, got {_type_name(value)}", param)
    return value


def _content_text(content: Any, param: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for i, part in enumerate(content):
            p = f"{param}[{i}]"
            _expect(part, (dict,), p, "an object")
            if part.get("type") != "text" or set(part) - {"type", "text"}:
                raise BadRequest(f"'{p}': only text parts {{'type': 'text', 'text': ...}} are supported", p)
            parts.append(_expect(part.get("text"), (str,), f"{p}.text", "a string"))
        return "".join(parts)
    raise BadRequest(f"'{param}' must be a string or an array of text parts, got {_type_name(content)}",
                     param)


def parse_chat_request(body: Any, default_model: str) -> ChatRequest:
    """Validate a decoded JSON body; unknown fields and wrong types are errors."""
    if not isinstance(body, dict):
        raise BadRequest(f"the request body must be a JSON object, got {_type_name(body)}")
    unknown = sorted(set(body) - _FIELDS)
    if unknown:
        raise BadRequest(f"unknown field{'s' if len(unknown) > 1 else ''}: {', '.join(map(repr, unknown))} "
                         f"(supported: {', '.join(sorted(_FIELDS))})", unknown[0])
    model = body.get("model", default_model)
    _expect(model, (str,), "model", "a string")
    messages = body.get("messages")
    if messages is None:
        raise BadRequest("'messages' is required", "messages")
    _expect(messages, (list,), "messages", "an array")
    if not messages:
        raise BadRequest("'messages' must not be empty", "messages")
    lines = []
    for i, msg in enumerate(messages):
        p = f"messages[{i}]"
        _expect(msg, (dict,), p, "an object")
        extra = sorted(set(msg) - {"role", "content", "name"})
        if extra:
            raise BadRequest(f"'{p}': unknown field {extra[0]!r}", f"{p}.{extra[0]}")
        role = msg.get("role")
        if role not in _ROLES:
            raise BadRequest(f"'{p}.role' must be one of {sorted(_ROLES)}, got {role!r}", f"{p}.role")
        if "name" in msg:
            _expect(msg["name"], (str,), f"{p}.name", "a string")
        content = msg.get("content")
        if content is None and role == "assistant":
            continue
        lines.append(f"{role}: {_content_text(content, f'{p}.content')}")
    if not any(line.split(":", 1)[1].strip() for line in lines):
        raise BadRequest("'messages' carry no text", "messages")
    stream = _expect(body.get("stream", False), (bool,), "stream", "a boolean")
    modalities = _expect(body.get("modalities", ["text"]), (list,), "modalities", "an array")
    if not modalities or any(m not in ("text", "audio") for m in modalities) or "text" not in modalities:
        raise BadRequest("'modalities' must be [\"text\"] or [\"text\", \"audio\"]", "modalities")
    want_audio = "audio" in modalities
    audio = _expect(body.get("audio", {}), (dict,), "audio", "an object")
    extra = sorted(set(audio) - {"voice", "format"})
    if extra:
        raise BadRequest(f"'audio': unknown field {extra[0]!r}", f"audio.{extra[0]}")
    voice = _expect(audio.get("voice", "alloy"), (str,), "audio.voice", "a string")
    if voice not in _VOICES:
        raise BadRequest(f"'audio.voice' must be one of {sorted(_VOICES)}", "audio.voice")
    fmt = _expect(audio.get("format", "pcm16" if stream else "wav"), (str,), "audio.format", "a string")
    if fmt not in _AUDIO_FORMATS:
        raise BadRequest(f"'audio.format' must be one of {sorted(_AUDIO_FORMATS)}", "audio.format")
    if stream and want_audio and fmt != "pcm16":
        raise BadRequest("streamed audio is 16-bit PCM: use \"audio\": {\"format\": \"pcm16\"} with stream",
                         "audio.format")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is not None:
        _expect(max_tokens, (int,), "max_tokens", "an integer")
        if max_tokens < 1:
            raise BadRequest("'max_tokens' must be >= 1", "max_tokens")
    for name, lo, hi in (("temperature", 0.0, 2.0), ("top_p", 0.0, 1.0)):
        if name in body:
            v = _expect(body[name], (int, float), name, "a number")
            if not lo <= v <= hi:
                raise BadRequest(f"'{name}' must be between {lo} and {hi}", name)
    if "seed" in body:
        _expect(body["seed"], (int,), "seed", "an integer")
    if "user" in body:
        _expect(body["user"], (str,), "user", "a string")
    if body.get("n", 1) != 1 or isinstance(body.get("n", 1), bool):
        raise BadRequest("only 'n': 1 is supported", "n")
    include_usage = False
    if "stream_options" in body:
        so = _expect(body["stream_options"], (dict,), "stream_options", "an object")
        if set(so) - {"include_usage"}:
            raise BadRequest("'stream_options' supports only 'include_usage'", "stream_options")
        include_usage = _expect(so.get("include_usage", False), (bool,), "stream_options.include_usage",
                                "a boolean")
    prompt = "\n".join(lines) + "\nassistant:"
    return ChatRequest(model, prompt, stream, want_audio, fmt, voice, max_tokens, include_usage)


def map_chat_sampling(body: dict[str, Any], req: ChatRequest, stages: Sequence[StageParams] | None, *,
                      final_stage_ids: Sequence[int] | frozenset[int], outputs: Sequence[str] | None,
                      final_stage_id: int | None) -> None:
    """Set ``req.sampling`` from the body's sampling fields (:mod:`trio_orch.openai_sampling`).

    BadRequest when a field cannot be honoured by the stages this request runs.
    """
    try:
        req.sampling = openai_sampling.chat_sampling(
            body, audio=req.audio, stages=stages, final_stage_ids=final_stage_ids, outputs=outputs,
            final_stage_id=final_stage_id)
    except openai_sampling.SamplingError as exc:
        raise BadRequest(str(exc), exc.param) from None


def pcm16(pcm: np.ndarray) -> bytes:
    return (np.clip(pcm, -1.0, 1.0) * 32767).astype("<i2").tobytes()


def wav_bytes(pcm16_data: bytes, sample_rate: int) -> bytes:
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(sample_rate)
        w.writeframes(pcm16_data)
    return buf.getvalue()


@dataclass
class ChatStream:
    """Turns one request's messages into chunks (streaming) or one completion (non-streaming).

    ``outputs``: each stage's output modality (None: every stage's outputs are judged by shape).
    """

    req: ChatRequest
    outputs: Sequence[str] | None = None
    id: str = field(default_factory=lambda: "chatcmpl-" + secrets.token_hex(12))
    created: int = field(default_factory=lambda: int(time.time()))
    audio_id: str = field(default_factory=lambda: "audio_" + secrets.token_hex(12))
    text: list[str] = field(default_factory=list)
    audio: list[bytes] = field(default_factory=list)
    sample_rate: int = 24000
    text_outputs: int = 0
    reason: str | None = None  # the finish reason the text stage reported, if it did

    def _chunk(self, delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        return {"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                "model": self.req.model,
                "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}

    def first_chunk(self) -> dict[str, Any]:
        return self._chunk({"role": "assistant", "content": ""})

    def add(self, m: OrchOutput) -> dict[str, Any] | None:
        """Absorb one output; return its streaming chunk (None if it carries nothing)."""
        modality = self.outputs[m.stage_id] if self.outputs is not None else "data"
        text = as_text(modality, m.data)
        if text is not None:
            self.text_outputs += 1
            if isinstance(m.data, dict) and isinstance(m.data.get("finish_reason"), str):
                self.reason = m.data["finish_reason"]
            if text:
                self.text.append(text)
                return self._chunk({"content": text})
            return None
        audio = as_audio(modality, m.data)
        if audio is not None and self.req.audio:
            pcm, self.sample_rate = audio
            if not len(pcm):
                return None
            data = pcm16(pcm)
            self.audio.append(data)
            delta: dict[str, Any] = {"id": self.audio_id, "data": base64.b64encode(data).decode("ascii")}
            if len(self.audio) == 1:
                delta["expires_at"] = self.created + 3600
            return self._chunk({"audio": delta})
        return None

    def finish_reason(self) -> str:
        if self.reason is not None:
            return self.reason
        mt = self.req.max_tokens
        return "length" if mt is not None and self.text_outputs >= mt else "stop"

    def last_chunk(self) -> dict[str, Any]:
        return self._chunk({}, self.finish_reason())

    def usage(self) -> dict[str, Any]:
        prompt_tokens = len(self.req.prompt.encode())
        completion = self.text_outputs
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
                "total_tokens": prompt_tokens + completion}

    def usage_chunk(self) -> dict[str, Any]:
        return {"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                "model": self.req.model, "choices": [], "usage": self.usage()}

    def completion(self) -> dict[str, Any]:
        text = "".join(self.text)
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if self.req.audio:
            raw = b"".join(self.audio)
            data = wav_bytes(raw, self.sample_rate) if self.req.audio_format == "wav" else raw
            message["audio"] = {"id": self.audio_id, "data": base64.b64encode(data).decode("ascii"),
                                "expires_at": self.created + 3600, "transcript": text}
        return {"id": self.id, "object": "chat.completion", "created": self.created, "model": self.req.model,
                "choices": [{"index": 0, "message": message, "logprobs": None,
                             "finish_reason": self.finish_reason()}],
                "usage": self.usage()}


def orch_error_status(err: OrchError) -> int:
    """HTTP status for a request that ended in ``err`` before anything was sent."""
    return {"timeout": 504, "shutdown": 503, "stage_unavailable": 503, "replica_died": 503,
            "aborted": 499}.get(err.kind, 500)
