"""The OpenAI chat-completions shape: strict request parsing and response/chunk building.

No web framework here: :func:`parse_json_body` decodes the body (invalid
UTF-8, NaN/Infinity, integers too long to convert, nesting deeper than a
bound and lone surrogates anywhere are client errors, never a traceback),
:func:`parse_chat_request` turns it into a :class:`ChatRequest` or raises
:class:`BadRequest` (-> HTTP 4xx with OpenAI's error body naming the field);
every value that reaches a stage is range-checked here, so nothing a client
sends can fail later on the wire.  :class:`ChatStream` turns orchestrator
messages into ``chat.completion.chunk`` objects and accumulates the
non-streaming answer.

Text comes from stage outputs ``{"text": str}`` (or a plain str), audio from
``{"pcm": float32 array, "sample_rate": int}``: from stages whose kind declares
that output modality (:mod:`stages.registry`), or by shape when undeclared.  Audio goes out as OpenAI's
audio output does: streaming ``delta.audio = {id, data}`` with base64 16-bit
little-endian PCM; non-streaming ``message.audio = {id, data, expires_at,
transcript}`` with a base64 WAV (or raw pcm16 if asked).  For an audio
request each streamed text piece is also in ``delta.audio.transcript``, as
OpenAI's audio streaming puts it.  ``model`` in every answer is the served
model's name, never an echo of the request's.
"""

from __future__ import annotations

import base64
import io
import json
import secrets
import time
import wave
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from stages.registry import as_audio, as_text
from stages.sampling_params import StageParams
from trio_orch.http import openai_sampling
from trio_orch.types import OrchError, OrchOutput

__all__ = ["MAX_TOKENS", "BadRequest", "ChatRequest", "ChatStream", "check_max_tokens", "error_body",
           "map_chat_sampling", "parse_chat_request", "parse_json_body"]

_FIELDS = {"model", "messages", "stream", "stream_options", "modalities", "audio", "max_tokens",
           "max_completion_tokens", "temperature", "top_p", "seed", "user", "n"} | openai_sampling.FIELDS
_ROLES = {"system", "developer", "user", "assistant"}
_AUDIO_FORMATS = {"wav", "pcm16"}
_VOICES = {"alloy", "ash", "ballad", "coral", "echo", "fable", "nova", "onyx", "sage", "shimmer", "verse"}

#: the largest token budget a request may ask for (a 32-bit count: the stages' own caps apply below it)
MAX_TOKENS = 2**31 - 1
_INT64 = (-(2**63), 2**63 - 1)
_MAX_MODEL_NAME = 256


class BadRequest(ValueError):
    """A request that does not fit the schema; ``param`` names the offending field."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None
                 ) -> None:
        super().__init__(message)
        self.param = param
        self.status = status
        self.code = code


def check_max_tokens(value: Any, param: str = "max_tokens") -> int:
    """A token budget: an int in 1..MAX_TOKENS (BadRequest naming ``param`` otherwise)."""
    _expect(value, (int,), param, "an integer")
    if not 1 <= value <= MAX_TOKENS:
        raise BadRequest(f"'{param}' must be between 1 and {MAX_TOKENS}", param)
    return value


def _no_constant(name: str) -> Any:
    raise BadRequest(f"{name} is not a JSON number: send a finite number")


def parse_json_body(raw: bytes, max_depth: int = 32) -> Any:
    """Decode a request body; every way it can be malformed is a :class:`BadRequest`."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BadRequest(f"the request body is not valid UTF-8: {exc}", code="invalid_json") from None
    try:
        body = json.loads(text, parse_constant=_no_constant)
    except BadRequest:
        raise
    except json.JSONDecodeError as exc:
        raise BadRequest(f"malformed JSON in the request body: {exc}", code="invalid_json") from None
    except RecursionError:
        raise BadRequest(f"the request body nests deeper than {max_depth} levels",
                         code="invalid_json") from None
    except ValueError as exc:  # e.g. an integer literal too long to convert
        raise BadRequest(f"malformed JSON in the request body: {exc}", code="invalid_json") from None
    _check_tree(body, max_depth)
    return body


def _check_tree(body: Any, max_depth: int) -> None:
    """Depth bound, and no string (key or value) that is not valid Unicode text (a lone surrogate).

    A too-deep value is reported by its top-level field; a bad string by its full path.
    """
    stack: list[tuple[Any, str, str, int]] = [(body, "", "", 0)]
    while stack:
        value, path, top, depth = stack.pop()
        if isinstance(value, (dict, list)) and depth >= max_depth:
            raise BadRequest(f"the request body nests deeper than {max_depth} levels", top or None)
        if isinstance(value, dict):
            for k, v in value.items():
                sub = f"{path}.{k}" if path else str(k)
                _check_text(k, sub)
                stack.append((v, sub, top or sub, depth + 1))
        elif isinstance(value, list):
            stack.extend((v, f"{path}[{i}]", top, depth + 1) for i, v in enumerate(value))
        elif isinstance(value, str):
            _check_text(value, path)


def _check_text(value: str, param: str) -> None:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        shown = param.encode("utf-8", "backslashreplace").decode()
        raise BadRequest(f"'{shown}' is not valid Unicode text (it holds a lone surrogate such as \\ud800)",
                         shown) from None


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


def parse_chat_request(body: Any, model_name: str, max_prompt_chars: int | None = None) -> ChatRequest:
    """Validate a decoded JSON body; unknown fields, wrong types and out-of-range values are errors.

    ``model_name`` is the served model (what answers carry); ``max_prompt_chars``
    bounds the prompt built from the messages (400 ``context_length_exceeded``).
    """
    if not isinstance(body, dict):
        raise BadRequest(f"the request body must be a JSON object, got {_type_name(body)}")
    unknown = sorted(set(body) - _FIELDS)
    if unknown:
        raise BadRequest(f"unknown field{'s' if len(unknown) > 1 else ''}: {', '.join(map(repr, unknown))} "
                         f"(supported: {', '.join(sorted(_FIELDS))})", unknown[0])
    _expect(body.get("model", model_name), (str,), "model", "a string")
    if len(body.get("model", "")) > _MAX_MODEL_NAME:
        raise BadRequest(f"'model' is longer than {_MAX_MODEL_NAME} characters", "model")
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
    field_name = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    max_tokens = body.get(field_name)
    if max_tokens is not None:
        check_max_tokens(max_tokens, field_name)
    for name, lo, hi in (("temperature", 0.0, 2.0), ("top_p", 0.0, 1.0)):
        if name in body:
            v = _expect(body[name], (int, float), name, "a number")
            if not lo <= v <= hi:
                raise BadRequest(f"'{name}' must be between {lo} and {hi}", name)
    if "seed" in body:
        seed = _expect(body["seed"], (int,), "seed", "an integer")
        if not _INT64[0] <= seed <= _INT64[1]:
            raise BadRequest("'seed' must fit in a signed 64-bit integer", "seed")
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
    if max_prompt_chars is not None and len(prompt) > max_prompt_chars:
        raise BadRequest(f"the messages make a prompt of {len(prompt)} characters, over the limit of "
                         f"{max_prompt_chars}", "messages", code="context_length_exceeded")
    return ChatRequest(model_name, prompt, stream, want_audio, fmt, voice, max_tokens, include_usage)


def map_chat_sampling(body: dict[str, Any], req: ChatRequest, stages: Sequence[StageParams] | None, *,
                      final_stage_ids: Sequence[int] | frozenset[int], outputs: Sequence[str] | None,
                      final_stage_id: int | None) -> None:
    """Set ``req.sampling`` from the body's sampling fields (:mod:`trio_orch.http.openai_sampling`).

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
    ``token_limit``: the text stage's own cap on generated tokens (its ready info's
    ``max_new_tokens``), so an answer it cut short ends with ``finish_reason: "length"``.
    Times (``time.perf_counter``) of the first text and first and last audio are kept
    for the timings extension and the real-time factor.
    """

    req: ChatRequest
    outputs: Sequence[str] | None = None
    token_limit: int | None = None
    id: str = field(default_factory=lambda: "chatcmpl-" + secrets.token_hex(12))
    created: int = field(default_factory=lambda: int(time.time()))
    audio_id: str = field(default_factory=lambda: "audio_" + secrets.token_hex(12))
    text: list[str] = field(default_factory=list)
    audio: list[bytes] = field(default_factory=list)
    sample_rate: int = 24000
    text_outputs: int = 0
    reason: str | None = None  # the finish reason the text stage reported, if it did
    audio_samples: int = 0
    t_first_text: float | None = None
    t_first_audio: float | None = None
    t_last_audio: float | None = None

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
                if self.t_first_text is None:
                    self.t_first_text = time.perf_counter()
                self.text.append(text)
                if self.req.audio:
                    return self._chunk({"content": text, "audio": {"id": self.audio_id, "transcript": text}})
                return self._chunk({"content": text})
            return None
        audio = as_audio(modality, m.data)
        if audio is not None and self.req.audio:
            pcm, self.sample_rate = audio
            if not len(pcm):
                return None
            self.t_last_audio = time.perf_counter()
            if self.t_first_audio is None:
                self.t_first_audio = self.t_last_audio
            self.audio_samples += len(pcm)
            data = pcm16(pcm)
            self.audio.append(data)
            delta: dict[str, Any] = {"id": self.audio_id, "data": base64.b64encode(data).decode("ascii")}
            if len(self.audio) == 1:
                delta["expires_at"] = self.created + 3600
            return self._chunk({"audio": delta})
        return None

    def finish_reason(self) -> str:
        """The text stage's reported reason; else "length" when the text reached the request's or
        the stage's token limit, "stop" otherwise."""
        if self.reason is not None:
            return self.reason
        limits = [n for n in (self.req.max_tokens, self.token_limit) if n is not None]
        return "length" if limits and len(self.text) >= min(limits) else "stop"

    def real_time_factor(self, t_open: float) -> float | None:
        """Seconds from the request to its last audio per second of audio (None: no audio)."""
        if not self.audio_samples or self.t_last_audio is None:
            return None
        return (self.t_last_audio - t_open) / (self.audio_samples / self.sample_rate)

    def timings(self, t_open: float, t_end: float, stages: Sequence[Any] | None) -> dict[str, Any]:
        """The ``timings`` extension of a non-streamed answer (milliseconds after the request came).

        ``stages``: each stage's :class:`~trio_orch.cluster.pool.StageTiming` (or None).
        """
        def ms(t: float | None) -> float | None:
            return None if t is None else round((t - t_open) * 1000, 3)

        def dur(s: float | None) -> float | None:
            return None if s is None else round(s * 1000, 3)

        out: dict[str, Any] = {"total_ms": ms(t_end), "time_to_first_token_ms": ms(self.t_first_text)}
        if self.req.audio:
            out["time_to_first_audio_ms"] = ms(self.t_first_audio)
            rtf = self.real_time_factor(t_open)
            out["real_time_factor"] = None if rtf is None else round(rtf, 4)
        out["stages"] = [
            {"stage": k, "replica": tm.replica, "submitted_ms": ms(tm.t_submit),
             "first_output_ms": ms(tm.t_first), "finished_ms": ms(tm.t_done), "queue_ms": dur(tm.queue_s),
             "compute_ms": dur(tm.compute_s)}
            for k, tm in enumerate(stages or ()) if tm is not None]
        return out

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

    def completion(self, timings: dict[str, Any] | None = None) -> dict[str, Any]:
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
                "usage": self.usage(), **({"timings": timings} if timings is not None else {})}


def orch_error_status(err: OrchError) -> int:
    """HTTP status for a request that ended in ``err`` before anything was sent."""
    return {"timeout": 504, "shutdown": 503, "stage_unavailable": 503, "replica_died": 503,
            "aborted": 499}.get(err.kind, 500)
