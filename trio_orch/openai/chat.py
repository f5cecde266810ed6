"""The OpenAI chat-completions shape: the request (:mod:`trio_orch.openai.protocol`) and the answer's chunks.

No web framework here: :func:`read_chat_request` is the one check of a
request -- :func:`parse_chat_request` turns a decoded body into a
:class:`ChatRequest`, then the pipeline's own checks (its final stage, the
sampling fields on its stages) -- and raises :class:`BadRequest` (-> HTTP
4xx with OpenAI's error body naming the field).  The shape and ranges are the
schema's (:class:`~trio_orch.openai.protocol.ChatCompletionRequest`: unknown
fields ignored and logged, known ones this server cannot honour refused);
what the schema cannot say (the messages carry text, audio formats fit
streaming, the prompt's length, the model is one served here: else 404) is
checked here, so nothing a client sends can fail later on the wire.  The
prompt is the messages rendered by the chat template
(:class:`~trio_orch.openai.chat_template.ChatTemplate`, ``serve
--chat-template``); image and audio parts are placeholders there and are
decoded (:mod:`trio_orch.openai.media`) into arrays that go beside the prompt
to the pipeline's encoder stages -- refused naming the part when the
pipeline has no encoder for them.  A remote image URL (``serve
--allowed-media-domains``) is checked here but fetched after, by
:meth:`ChatRequest.fetch_media` (async: the loop never blocks on a remote
host); so a request refused for anything else, and ``/tokenize``, which only
counts the prompt, fetch nothing.
:class:`ChatStream` turns orchestrator messages into ``chat.completion.chunk``
objects and accumulates the non-streaming answer.

Text comes from stage outputs ``{"text": str}`` (or a plain str), audio from
``{"pcm": float32 array, "sample_rate": int}``: from stages whose kind declares
that output modality (:mod:`stages.registry`), or by shape when undeclared.  Audio goes out as OpenAI's
audio output does: streaming ``delta.audio = {id, data}`` with base64 16-bit
little-endian PCM; non-streaming ``message.audio = {id, data, expires_at,
transcript}`` with a base64 file in ``audio.format`` (:mod:`trio_orch.openai.audio_out`:
``wav``, the default, ``flac``, ``opus``, ``mp3``, ``aac`` or raw ``pcm16``).  For an audio
request each streamed text piece is also in ``delta.audio.transcript``, as
OpenAI's audio streaming puts it.  ``model`` in every answer is the first
served model name, never an echo of the request's.
"""

from __future__ import annotations

import base64
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from stages.registry import as_audio, as_text, text_stage
from stages.sampling_params import StageParams
from stages.validation import type_name
from trio_orch.engine.api import EngineClient
from trio_orch.openai import sampling as openai_sampling
from trio_orch.openai.audio_out import check_audio_format, encode_audio, pcm16
from trio_orch.openai.chat_template import ChatInput
from trio_orch.openai.media import (
    AudioClip,
    MediaPolicy,
    check_remote_url,
    decode_audio,
    decode_image,
    fetch_remote_images,
    image_pixels,
    is_remote,
)
from trio_orch.openai.protocol import MAX_TOKENS, ChatCompletionRequest, ContentPart, ServedModels
from trio_orch.openai.tokenizer import check_context, prompt_token_count
from trio_orch.openai.validation import BadRequest, decode
from trio_orch.types import OrchOutput

__all__ = ["ChatRequest", "ChatStream", "check_max_tokens", "final_stage_for", "map_chat_sampling",
           "parse_chat_request", "read_chat_request"]


def check_max_tokens(value: Any, param: str = "max_tokens") -> int:
    """A token budget: an int in 1..MAX_TOKENS (BadRequest naming ``param`` otherwise)."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise BadRequest(f"'{param}' must be an integer, got {type_name(value)}", param)
    if not 1 <= value <= MAX_TOKENS:
        raise BadRequest(f"'{param}' must be between 1 and {MAX_TOKENS}", param)
    return value


@dataclass
class ChatRequest:
    model: str
    prompt: str
    stream: bool = False
    audio: bool = False
    audio_format: str = "wav"  #: a key of :data:`~trio_orch.openai.audio_out.AUDIO_OUT` (pcm16: "pcm")
    voice: str = "alloy"
    max_tokens: int | None = None
    include_usage: bool = False
    priority: int = 0  #: lower values are served first
    #: the sampling fields given (OpenAI's names; ``audio.voice`` under ``audio``), mapped to stages
    fields: dict[str, Any] = field(default_factory=dict)
    sampling: dict[int, dict[str, Any]] = field(default_factory=dict)  # stage -> its parameters
    #: where the request stops: the text stage for a text-only answer (None: every final stage)
    final_stage_id: int | None = None
    #: the decoded image parts (``uint8[h, w, 3]``) and audio parts, in the order the messages had them
    images: list[np.ndarray] = field(default_factory=list)
    audios: list[AudioClip] = field(default_factory=list)
    #: the prompt's length in the text stage's tokens (None: its UTF-8 bytes, the byte tokenizer's)
    prompt_tokens: int | None = None
    #: remote images not fetched yet (``defer_remote``): (index in ``images``, url, the part's param)
    remote: list[tuple[int, str, str]] = field(default_factory=list)
    media: MediaPolicy = field(default_factory=MediaPolicy)  #: the bounds the remote images are fetched in

    async def fetch_media(self) -> None:
        """Fetch and decode the remote images into ``images`` (BadRequest naming a part that fails)."""
        if not self.remote:
            return
        blobs = await fetch_remote_images([(url, p) for _, url, p in self.remote], self.media)
        for (k, _, p), blob in zip(self.remote, blobs, strict=True):
            self.images[k] = image_pixels(blob, self.media, p)
        self.remote = []

    def payload(self) -> Any:
        """What stage 0 takes: the prompt, with its media beside it (:mod:`stages.media`) if any.

        Limits and the like travel in ``sampling``.
        """
        if self.remote:
            raise RuntimeError("the request's remote images are not fetched yet: await fetch_media() first")
        if not self.images and not self.audios:
            return self.prompt
        out: dict[str, Any] = {"text": self.prompt}
        if self.images:
            out["images"] = list(self.images)
        if self.audios:
            out["audios"] = [a.payload() for a in self.audios]
        return out


def _content_parts(content: list[ContentPart], param: str, chat: ChatInput, req: ChatRequest,
                   defer_remote: bool) -> list[dict[str, Any]]:
    """A content list as the template sees it; each image or audio part decoded into ``req``
    (an allowed remote image only noted in ``req.remote`` when ``defer_remote``)."""
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        p = f"{param}[{j}]"
        if part.type == "text":
            if part.text is None:
                raise BadRequest(f"'{p}': a text part needs 'text', a string", p)
            parts.append({"type": "text", "text": part.text})
            continue
        medium = {"image_url": "image", "input_audio": "audio"}.get(part.type)
        if medium is None:
            raise BadRequest(f"'{p}': a part is {{'type': 'text', 'text': ...}}, {{'type': 'image_url', "
                             "'image_url': {'url': ...}} or {'type': 'input_audio', 'input_audio': "
                             f"{{'data': ..., 'format': 'wav'}}}}, got type {part.type!r}", p)
        if medium not in chat.accepts:
            raise BadRequest(f"'{p}': this pipeline takes no {medium} input: it has no {medium}-encoder "
                             "stage (serve --pipeline omni-in takes images and audio)", p)
        if len(req.images) + len(req.audios) >= chat.media.max_parts:
            raise BadRequest(f"'{p}': more than {chat.media.max_parts} image and audio parts", p)
        if medium == "image":
            url = part.image_url.get("url") if isinstance(part.image_url, dict) else None
            if defer_remote and is_remote(url):
                check_remote_url(url, chat.media, p)
                req.remote.append((len(req.images), url, p))
                req.images.append(np.zeros((0, 0, 3), np.uint8))  # its pixels once fetch_media has run
            else:
                req.images.append(decode_image(url, chat.media, p))
        else:
            req.audios.append(decode_audio(part.input_audio, chat.media, p))
        parts.append({"type": medium})
    return parts


def _says_something(content: str | list[dict[str, Any]] | None) -> bool:
    if isinstance(content, str):
        return bool(content.strip())
    return any(p["type"] != "text" or p["text"].strip() for p in content or [])


def parse_chat_request(body: Any, models: ServedModels, max_prompt_chars: int | None = None,
                       chat: ChatInput | None = None, *, add_generation_prompt: bool = True,
                       defer_remote: bool = False) -> ChatRequest:
    """Validate a decoded JSON body against the schema and what it cannot say.

    ``models``: the served names (a request naming another model is a 404;
    answers carry the first name); ``max_prompt_chars`` bounds the prompt
    built from the messages (400 ``context_length_exceeded``); ``chat``: the
    chat template that builds it and the media the pipeline takes (default:
    the default template, no media).  ``defer_remote``: an ``http(s)`` image
    URL on an allowed host is checked and left for :meth:`ChatRequest.fetch_media`
    (the chat route awaits it; ``/tokenize`` needs only the prompt); without
    it such a URL is a 400.
    """
    chat = chat if chat is not None else ChatInput()
    r = decode(body, ChatCompletionRequest, what="a chat completion request")
    model = models.resolve(r.model)
    req = ChatRequest(model, "", priority=r.priority, media=chat.media)
    messages: list[dict[str, Any]] = []
    said = False
    for i, msg in enumerate(r.messages):
        param = f"messages[{i}].content"
        if msg.content is None and msg.role != "assistant":
            raise BadRequest(f"'{param}' must be a string or an array of content parts, got null", param)
        content: str | list[dict[str, Any]] | None = (
            msg.content if msg.content is None or isinstance(msg.content, str)
            else _content_parts(msg.content, param, chat, req, defer_remote))
        said = said or _says_something(content)
        messages.append({"role": msg.role, "content": content,
                         **({"name": msg.name} if msg.name is not None else {})})
    if not said:
        raise BadRequest("'messages' carry no text", "messages")
    modalities = r.modalities if r.modalities is not None else ["text"]
    if not modalities or any(m not in ("text", "audio") for m in modalities) or "text" not in modalities:
        raise BadRequest("'modalities' must be [\"text\"] or [\"text\", \"audio\"]", "modalities")
    want_audio = "audio" in modalities
    voice = (r.audio.voice if r.audio is not None else None) or "alloy"
    fmt = (r.audio.format if r.audio is not None else None) or ("pcm16" if r.stream else "wav")
    if r.stream and want_audio and fmt != "pcm16":
        raise BadRequest("streamed audio is 16-bit PCM: use \"audio\": {\"format\": \"pcm16\"} with stream",
                         "audio.format")
    fmt = check_audio_format(fmt, "audio.format", pcm="pcm16") if want_audio else "wav"
    prompt = chat.template.render(messages, add_generation_prompt=add_generation_prompt)
    if max_prompt_chars is not None and len(prompt) > max_prompt_chars:
        raise BadRequest(f"the messages make a prompt of {len(prompt)} characters, over the limit of "
                         f"{max_prompt_chars}", "messages", code="context_length_exceeded")
    fields = r.sampling_fields()
    if r.audio is not None and r.audio.voice is not None:
        fields["audio"] = {"voice": r.audio.voice}
    max_tokens = r.max_completion_tokens if r.max_completion_tokens is not None else r.max_tokens
    req.prompt, req.stream, req.audio, req.audio_format, req.voice = prompt, r.stream, want_audio, fmt, voice
    req.max_tokens, req.include_usage, req.fields = max_tokens, r.include_usage, fields
    return req


def final_stage_for(req: ChatRequest, final_stage_ids: frozenset[int], outputs: Sequence[str] | None
                    ) -> int | None:
    """Where ``req`` stops on a pipeline with these final stages: its text stage for a text-only answer,
    every final stage (None) for audio.  BadRequest when the pipeline cannot answer it that way."""
    answers = sorted({outputs[k] for k in final_stage_ids}) if outputs is not None else []
    if answers and not set(answers) & {"text", "audio", "data"}:  # e.g. text2image: neither hint fits
        route = " (POST /v1/images/generations)" if "image" in answers else ""
        raise BadRequest(f"this pipeline answers with {' and '.join(answers)}{route}, not chat: it has "
                         "no text or audio output for any modalities", "model")
    if req.audio:
        if outputs is not None and not any(outputs[k] in ("audio", "data") for k in final_stage_ids):
            raise BadRequest("this pipeline has no audio output: ask for modalities [\"text\"]",
                             "modalities")
        return None
    text = text_stage(final_stage_ids, outputs)
    if text is None:
        raise BadRequest("this pipeline has no text-only output: "
                         "ask for modalities [\"text\", \"audio\"]", "modalities")
    return text  # text only: the request stops after the stage that gives text


async def read_chat_request(body: Any, models: ServedModels, *, engine: EngineClient,
                            outputs: Sequence[str] | None, chat: ChatInput,
                            max_prompt_chars: int | None) -> ChatRequest:
    """The one check of a chat completion request, cheapest first; BadRequest naming what does not fit.

    The schema and what it cannot say (:func:`parse_chat_request`), then what
    the pipeline can answer (:func:`final_stage_for`) and honour (each
    sampling field on the stages it concerns: :func:`map_chat_sampling`),
    then the remote images fetched; the prompt counted in the pipeline's
    tokens for ``usage`` and checked against the model's context (400 in vLLM's words).
    """
    req = parse_chat_request(body, models, max_prompt_chars, chat, defer_remote=True)
    req.final_stage_id = final_stage_for(req, engine.final_stage_ids, outputs)
    map_chat_sampling(req, engine.stage_params, final_stage_ids=engine.final_stage_ids, outputs=outputs,
                      final_stage_id=req.final_stage_id)
    await req.fetch_media()  # remote images (--allowed-media-domains), without blocking the loop
    req.prompt_tokens = prompt_token_count(engine, outputs, req.prompt)
    check_context(engine, outputs, req.prompt_tokens, req.max_tokens, "messages")
    return req


def map_chat_sampling(req: ChatRequest, stages: Sequence[StageParams] | None, *,
                      final_stage_ids: Sequence[int] | frozenset[int], outputs: Sequence[str] | None,
                      final_stage_id: int | None) -> None:
    """Set ``req.sampling`` from its sampling fields (:mod:`trio_orch.openai.sampling`).

    BadRequest when a field cannot be honoured by the stages this request runs.
    """
    try:
        req.sampling = openai_sampling.chat_sampling(
            req.fields, audio=req.audio, stages=stages, final_stage_ids=final_stage_ids, outputs=outputs,
            final_stage_id=final_stage_id)
    except openai_sampling.SamplingError as exc:
        raise BadRequest(str(exc), exc.param) from None


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
    tokens_by_stage: dict[int, int] = field(default_factory=dict)  #: text outputs (tokens) by stage
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
            self.tokens_by_stage[m.stage_id] = self.tokens_by_stage.get(m.stage_id, 0) + 1
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
             "compute_ms": dur(tm.compute_s), "retried_from": tm.retried_from}
            for k, tm in enumerate(stages or ()) if tm is not None]
        return out

    def last_chunk(self) -> dict[str, Any]:
        return self._chunk({}, self.finish_reason())

    def usage(self) -> dict[str, Any]:
        prompt_tokens = self.req.prompt_tokens
        if prompt_tokens is None:
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
            data = encode_audio(b"".join(self.audio), self.sample_rate, self.req.audio_format)
            message["audio"] = {"id": self.audio_id, "data": base64.b64encode(data).decode("ascii"),
                                "expires_at": self.created + 3600, "transcript": text}
        return {"id": self.id, "object": "chat.completion", "created": self.created, "model": self.req.model,
                "choices": [{"index": 0, "message": message, "logprobs": None,
                             "finish_reason": self.finish_reason()}],
                "usage": self.usage(), **({"timings": timings} if timings is not None else {})}
