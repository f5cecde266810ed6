"""``POST /v1/audio/speech``: OpenAI's text-to-speech route over the pipeline's audio stage.

Request: ``input`` (the text, 1..4096 characters), ``voice`` (a speaker of the
pipeline's: ``stages.sampling_params.VOICES`` for the built-in vocoder, a
checkpoint's own for Qwen2.5-Omni), ``response_format`` (``"wav"``, the
default here, or ``"pcm"``: 16-bit little-endian mono at the pipeline's rate,
24 kHz for the built-in vocoder, as OpenAI's), ``speed`` (0.25..4: the audio
is resampled, so its pitch moves with it), ``stream_format`` (``"audio"``:
the file's bytes; ``"sse"``: ``speech.audio.delta`` events of base64 pcm, then
``speech.audio.done`` with usage), ``model`` (optional; if given, a served
name), and the ``seed`` and ``stage_sampling`` extensions.  ``instructions``
and the other formats (mp3, opus, aac, flac) are 400s naming the field.

How the input reaches the speech stages depends on the pipeline:

- a pipeline that begins with a stage reading text tokens to make speech
  codes (a talker first: ``talker -> code2wav``) gets the input's tokens as
  its input, as if a thinker had just said them: the input is spoken word for
  word, and nothing generates text;
- a pipeline whose first stage can be told what to say (``StageSpec.says``:
  the built-in thinker of the speech pipeline, a checkpoint's thinker) has it
  *say* the input (its ``say`` payload: forced decoding, the input's tokens
  as its answer), so the talker and vocoder speak the input word for word,
  through every stage of the pipeline; an input longer than the thinker's
  cache holds (``max_say`` in its info) is a 400 naming ``input``;
- another text stage first (a plug-in) runs on the input as its prompt, with
  a token budget as long as the input, and what it says is spoken.

``pcm`` streams as the vocoder makes it (a chunked body, one piece per
dispatcher batch; a request that fails midway ends its body early, and says
so in the log); ``wav`` is sent whole (its header holds its length).  A
pipeline without an audio stage answers 400 naming ``model``.
"""

from __future__ import annotations

import base64
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Annotated, Any, ClassVar, Literal

import numpy as np
from msgspec import Meta
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from stages.registry import as_audio, says, text_stage
from trio_orch.engine import AsyncRequestHandle, Engine
from trio_orch.http import openai_sampling
from trio_orch.http.generation import OpenAIRoute
from trio_orch.http.limits import HTTPLimits
from trio_orch.http.metrics import FrontMetrics
from trio_orch.http.openai_chat import pcm16, wav_bytes
from trio_orch.http.schemas import BadRequest, Scheduled, Seed, ServedModels, Voice, error_body
from trio_orch.http.streaming import sse
from trio_orch.http.tokenizer import TOKENIZERS, prompt_token_count, stage_info
from trio_orch.types import OrchOutput

__all__ = ["FORMATS", "SPEECH", "SpeechRequest", "Speed", "speech_route"]

log = logging.getLogger("trio_orch.http.openai_speech")

SPEECH = "/v1/audio/speech"
#: response_format -> the answer's content type
FORMATS = {"wav": "audio/wav", "pcm": "audio/pcm"}
_MAX_INPUT = 4096  # OpenAI's bound on ``input``


class SpeechRequest(Scheduled, kw_only=True):
    """The body of ``POST /v1/audio/speech`` (the fields this server reads)."""

    input: Annotated[str, Meta(min_length=1, max_length=_MAX_INPUT)]
    model: Annotated[str, Meta(max_length=256)] | None = None
    voice: Voice | None = None
    speed: Annotated[float, Meta(ge=0.25, le=4.0)] = 1.0
    stream_format: Literal["audio", "sse"] = "audio"
    instructions: str | None = None
    seed: Seed | None = None
    stage_sampling: dict[str, Any] | None = None

    response_format: Literal["wav", "pcm"] = "wav"

    #: this route's own table of unsupported values: its ``response_format`` is an audio encoding
    #: (chat's, by the same name, is a text format)
    UNSUPPORTED: ClassVar[dict[str, tuple[Callable[[Any], bool], str]]] = {}

    @classmethod
    def parse(cls, route: OpenAIRoute, raw: bytes) -> tuple[SpeechRequest, str]:
        """The request and its ``response_format`` (BadRequest naming the field that does not fit)."""
        req = route.parse(raw, cls)
        return req, req.response_format

    def check(self, max_chars: int | None, fmt: str) -> None:
        """BadRequest naming the first field this server cannot honour."""
        if not self.input.strip():
            raise BadRequest("'input' must hold some text", "input")
        if max_chars is not None and len(self.input) > max_chars:
            raise BadRequest(f"'input' has {len(self.input)} characters, over the limit of {max_chars}",
                             "input", code="context_length_exceeded")
        if self.stream_format == "sse" and fmt != "pcm":
            raise BadRequest("streamed events carry pcm: use \"response_format\": \"pcm\" with "
                             "\"stream_format\": \"sse\"", "response_format")
        if self.instructions:
            raise BadRequest("'instructions' are not supported: the voice is set by 'voice'", "instructions",
                             code="unsupported_parameter")


#: the one-character prompts a thinker told what to say may start from, the first its tokenizer reads
PROMPTS = (" ", ".", "a", "\n")


class Speed:
    """Audio played ``factor`` times as fast, chunk by chunk: linear resampling, continuous across chunks."""

    def __init__(self, factor: float) -> None:
        self.factor = factor
        self.pos = 0.0  # where the next output sample falls, counted from the last sample kept
        self.last: np.ndarray | None = None  # the previous chunk's last sample

    def __call__(self, pcm: np.ndarray) -> np.ndarray:
        if self.factor == 1.0 or not len(pcm):
            return pcm
        x = pcm if self.last is None else np.concatenate([self.last, pcm])
        span = len(x) - 1
        n = int((span - self.pos) // self.factor) + 1 if span >= self.pos else 0
        at = self.pos + self.factor * np.arange(n)
        self.pos += n * self.factor - span
        self.last = x[-1:]
        return np.interp(at, np.arange(len(x)), x).astype(np.float32)


@dataclass
class Speech:
    """One request's audio: pcm16 pieces at the pipeline's rate, after the speed change."""

    outputs: Sequence[str] | None
    speed: Speed
    front: FrontMetrics
    sample_rate: int = 24000
    pieces: list[bytes] = field(default_factory=list)
    chunks: int = 0

    def add(self, m: OrchOutput) -> bytes:
        """Absorb one output; its audio as pcm16 (b"" if it carries none)."""
        if m.finished:
            self.front.count_finished("stop")
        modality = self.outputs[m.stage_id] if self.outputs is not None else "data"
        audio = as_audio(modality, m.data)
        if audio is None or not len(audio[0]):
            return b""
        pcm, self.sample_rate = audio
        data = pcm16(self.speed(pcm))
        self.chunks += 1
        self.pieces.append(data)
        return data


def speech_route(engine: Engine, *, models: ServedModels, outputs: Sequence[str] | None,
                 limits: HTTPLimits, front: FrontMetrics) -> Route:
    """``POST /v1/audio/speech`` over ``engine`` (``models``: the names it answers to)."""
    route = OpenAIRoute(engine, SPEECH, front, limits)
    finals = sorted(engine.final_stage_ids)
    audio_finals = [k for k in finals if outputs is None or outputs[k] in ("audio", "data")]
    kinds = [p.name for p in engine.stage_params] if engine.stage_params is not None else None
    # the input's tokens go straight to stage 0 when it reads a thinker's tokens to make speech codes
    first = TOKENIZERS.get(kinds[0]) if kinds and outputs is not None and outputs[0] == "codes" else None
    text_k = text_stage(finals, outputs) if first is None else None

    def input_tokens(text: str) -> int:
        """The input's length in the tokens the pipeline reads it in (the thinker's own tokenizer, a
        configured tokenizer.json too); its UTF-8 bytes where no tokenizer is known."""
        if first is not None:
            return len(first.encode(text))
        n = prompt_token_count(engine, outputs, text)
        return n if n is not None else len(text.encode())

    def say_prompt() -> tuple[str, int]:
        """The thinker's prompt when it is told what to say, and its length in tokens: one character
        that its tokenizer reads as a token (a word-level tokenizer reads a lone space as nothing, and
        the thinker cannot start from an empty prompt)."""
        for text in PROMPTS:
            n = prompt_token_count(engine, outputs, text)
            if n is None or n > 0:
                return text, n or 1
        raise BadRequest("this pipeline's tokenizer reads none of " + ", ".join(map(repr, PROMPTS))
                         + " as a token: the thinker cannot be told what to say", "model")

    def request_for(req: SpeechRequest, n_in: int) -> tuple[Any, dict[int, dict[str, Any]]]:
        """Stage 0's input and the per-stage parameters (SamplingError for a field no stage takes)."""
        fields = {f: v for f, v in (("voice", req.voice), ("seed", req.seed),
                                    (openai_sampling.EXTENSION, req.stage_sampling)) if v is not None}
        if first is not None:
            payload: Any = {"tokens": np.asarray(first.encode(req.input), dtype=np.int32)}
        elif kinds is not None and says(kinds[0]):
            prompt, n_prompt = say_prompt()
            limit = stage_info(engine, 0).get("max_say")  # its cache's room after a one-token prompt
            room = limit + 1 - n_prompt if isinstance(limit, int) else None
            if room is not None and n_in > room:  # the thinker counts 'say' in its tokens
                raise BadRequest(f"'input' is {n_in} tokens: this pipeline speaks at most {room} per "
                                 "request", "input", code="context_length_exceeded")
            payload = {"text": prompt, "say": req.input}
        else:
            payload = req.input
            stages = engine.stage_params
            if text_k is not None and stages is not None and "max_tokens" in stages[text_k].schema:
                fields["max_tokens"] = len(req.input.encode())  # about as long as the input
        sampling = openai_sampling.map_sampling(fields, engine.stage_params, text_stage=text_k,
                                                last_stage=audio_finals[-1], voice_field="voice")
        return payload, sampling

    def failure(code: str, message: str) -> bytes:
        return sse({"type": "error", **error_body(message, "server_error", code=code)})

    async def events(sp: Speech, handle: AsyncRequestHandle, input_tokens: int) -> AsyncIterator[bytes]:
        def render(m: OrchOutput) -> bytes:
            data = sp.add(m)
            out = b""
            if data:
                out = sse({"type": "speech.audio.delta", "audio": base64.b64encode(data).decode()})
            if m.finished:
                out += sse({"type": "speech.audio.done", "usage": {
                    "input_tokens": input_tokens, "output_tokens": sp.chunks,
                    "total_tokens": input_tokens + sp.chunks}})
            return out

        async for chunk in route.pieces(handle, render, failure):
            yield chunk

    def cut(code: str, message: str) -> bytes:
        log.warning("a pcm stream ended early (%s): %s", code, message)
        return b""

    async def audio(sp: Speech, handle: AsyncRequestHandle) -> AsyncIterator[bytes]:
        async for chunk in route.pieces(handle, sp.add, cut):
            yield chunk

    async def whole(fmt: str, sp: Speech, handle: AsyncRequestHandle) -> Any:
        err = await route.collect(handle, sp.add)
        if err is not None:
            return err
        raw = b"".join(sp.pieces)
        body = wav_bytes(raw, sp.sample_rate) if fmt == "wav" else raw
        return Response(body, media_type=FORMATS[fmt])

    async def handle(request: Request) -> Response:
        try:
            req, fmt = SpeechRequest.parse(route, await request.body())
            model = models.resolve(req.model)
            if not audio_finals:
                raise BadRequest(f"model {model!r} makes no audio: serve a speech pipeline "
                                 "(trio-orch serve --pipeline speech)", "model")
            req.check(limits.max_prompt_chars, fmt)
            n_in = input_tokens(req.input)
            if n_in == 0:
                raise BadRequest("'input' holds no token of this pipeline's tokenizer: there is nothing to "
                                 "say", "input")
            payload, sampling = request_for(req, n_in)
        except BadRequest as exc:
            return route.bad(exc)
        except openai_sampling.SamplingError as exc:
            return route.error(400, str(exc), param=exc.param)
        admitted = await route.admit(payload, final_stage_id=audio_finals[-1], sampling=sampling,
                                     priority=req.priority)
        if isinstance(admitted, Response):
            return admitted
        front.count_tokens(n_in, {})
        sp = Speech(outputs, Speed(req.speed), front)
        if req.stream_format == "sse":
            return route.stream(events(sp, admitted, n_in))
        if fmt == "pcm":
            return route.stream(audio(sp, admitted), FORMATS["pcm"])
        answer = await route.wait(partial(whole, fmt, sp, admitted), request)
        return answer if answer.status_code != 200 else route.ok(answer)

    return Route(SPEECH, handle, methods=["POST"])
