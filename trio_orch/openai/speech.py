"""OpenAI's text-to-speech request over the pipeline's audio stage: how it enters, what comes back.

The request (:class:`~trio_orch.openai.protocol.SpeechRequest`): ``input``
(the text, 1..4096 characters), ``voice`` (a speaker of the pipeline's:
``stages.sampling_params.VOICES`` for the built-in vocoder, a checkpoint's own
for Qwen2.5-Omni), ``response_format`` (``"wav"``, the
default here; ``"pcm"``: 16-bit little-endian mono at the pipeline's rate,
24 kHz for the built-in vocoder, as OpenAI's; ``"flac"``, ``"opus"`` (Ogg),
``"mp3"`` and ``"aac"``, encoded by :mod:`trio_orch.openai.audio_out`; one
whose encoder is not installed is a 400 naming the field and the format), ``speed`` (0.25..4: the audio
is resampled, so its pitch moves with it), ``stream_format`` (``"audio"``:
the file's bytes; ``"sse"``: ``speech.audio.delta`` events of base64 pcm, then
``speech.audio.done`` with usage), ``model`` (optional; if given, a served
name), and the ``seed`` and ``stage_sampling`` extensions.  ``instructions``
is a 400 naming the field.

How the input reaches the speech stages depends on the pipeline
(:class:`SpeechPlan`, decided once from its stages as the stage registry
describes them):

- a pipeline that begins with a stage reading token ids to make speech codes
  (a talker first: ``talker -> code2wav``) gets the input's tokens as its
  input, as if a thinker had just said them: the input is spoken word for
  word, and nothing generates text;
- a pipeline whose first stage can be told what to say (the built-in
  thinker of the speech pipeline, the Qwen2.5-Omni thinker) has it *say* the input (its ``say`` payload:
  forced decoding, the input's tokens as its answer), so the talker and
  vocoder speak the input word for word, through every stage of the
  pipeline; an input longer than the thinker's cache holds (``max_say`` in
  its info) is a 400 naming ``input``;
- another text stage first (a plug-in) runs on the input as its prompt, with
  a token budget as long as the input, and what it says is spoken.

A pipeline without an audio stage answers 400 naming ``model``.  No web
framework here: the route is :mod:`trio_orch.http.routes.speech`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from stages.registry import as_audio, says, text_stage
from trio_orch.engine.api import EngineClient
from trio_orch.openai import sampling as openai_sampling
from trio_orch.openai.audio_out import Resampler, pcm16
from trio_orch.openai.protocol import ServedModels, SpeechRequest
from trio_orch.openai.tokenizer import prompt_token_count, stage_tokenizer
from trio_orch.openai.validation import BadRequest
from trio_orch.types import OrchOutput

__all__ = ["PROMPTS", "Speech", "SpeechPlan", "Speed"]

#: the one-character prompts a thinker told what to say may start from, the first its tokenizer reads
PROMPTS = (" ", ".", "a", "\n")


class Speed:
    """Audio played ``factor`` times as fast, chunk by chunk (its pitch moves with it): resampled by the
    factor with the one :class:`~trio_orch.openai.audio_out.Resampler`, so continuous across chunks and
    low-pass filtered when sped up; :meth:`flush` gives its last samples once the audio has ended."""

    def __init__(self, factor: float) -> None:
        self.factor = factor
        self.resampler = Resampler(factor, 1.0) if factor != 1.0 else None

    def __call__(self, pcm: np.ndarray) -> np.ndarray:
        return pcm if self.resampler is None else self.resampler.feed(pcm)

    def flush(self) -> np.ndarray:
        return np.zeros(0, np.float32) if self.resampler is None else self.resampler.flush()


@dataclass
class Speech:
    """One request's audio: pcm16 pieces at the pipeline's rate, after the speed change."""

    outputs: Sequence[str] | None
    speed: Speed
    sample_rate: int = 24000
    pieces: list[bytes] = field(default_factory=list)
    chunks: int = 0

    def add(self, m: OrchOutput) -> bytes:
        """Absorb one output; its audio as pcm16 (b"" if it carries none), and, on the request's last
        output, the speed change's last samples."""
        modality = self.outputs[m.stage_id] if self.outputs is not None else "data"
        audio = as_audio(modality, m.data)
        data = b""
        if audio is not None and len(audio[0]):
            pcm, self.sample_rate = audio
            data = pcm16(self.speed(pcm))
            self.chunks += 1
        if m.finished:
            data += pcm16(self.speed.flush())
        if data:
            self.pieces.append(data)
        return data


@dataclass(frozen=True)
class Admission:
    """A speech request, checked: stage 0's input, the per-stage parameters, where it stops, its size."""

    payload: Any
    sampling: dict[int, dict[str, Any]]
    final_stage_id: int
    input_tokens: int


class SpeechPlan:
    """How speech requests enter ``engine``'s pipeline (``outputs``: each stage's output modality)."""

    def __init__(self, engine: EngineClient, outputs: Sequence[str] | None) -> None:
        self.engine = engine
        self.outputs = outputs
        finals = sorted(engine.final_stage_ids)
        self.audio_finals = [k for k in finals if outputs is None or outputs[k] in ("audio", "data")]
        kinds = engine.stage_kinds
        self.kinds = kinds
        # the input's tokens go straight to stage 0 when it reads a text stage's tokens to make speech codes
        self.first = (stage_tokenizer(engine, 0) if kinds and outputs is not None and outputs[0] == "codes"
                      else None)
        self.text_stage = text_stage(finals, outputs) if self.first is None else None

    def read(self, req: SpeechRequest, models: ServedModels, max_prompt_chars: int | None) -> Admission:
        """The one check of a speech request (BadRequest naming the field that does not fit)."""
        model = models.resolve(req.model)
        if not self.audio_finals:
            raise BadRequest(f"model {model!r} makes no audio: serve a speech pipeline "
                             "(trio-orch serve --pipeline speech)", "model")
        req.check(max_prompt_chars)
        n_in = self.input_tokens(req.input)
        if n_in == 0:
            raise BadRequest("'input' holds no token of this pipeline's tokenizer: there is nothing to "
                             "say", "input")
        try:
            payload, sampling = self._request_for(req, n_in)
        except openai_sampling.SamplingError as exc:
            raise BadRequest(str(exc), exc.param) from None
        return Admission(payload, sampling, self.audio_finals[-1], n_in)

    def input_tokens(self, text: str) -> int:
        """The input's length in the tokens the pipeline reads it in (the thinker's own tokenizer, a
        configured tokenizer.json too); its UTF-8 bytes where no tokenizer is known."""
        if self.first is not None:
            return len(self.first.encode(text))
        n = prompt_token_count(self.engine, self.outputs, text)
        return n if n is not None else len(text.encode())

    def _say_prompt(self) -> tuple[str, int]:
        """The thinker's prompt when it is told what to say, and its length in tokens: one character
        that its tokenizer reads as a token (a word-level tokenizer reads a lone space as nothing, and
        the thinker cannot start from an empty prompt)."""
        for text in PROMPTS:
            n = prompt_token_count(self.engine, self.outputs, text)
            if n is None or n > 0:
                return text, n or 1
        raise BadRequest("this pipeline's tokenizer reads none of " + ", ".join(map(repr, PROMPTS))
                         + " as a token: the thinker cannot be told what to say", "model")

    def _request_for(self, req: SpeechRequest, n_in: int) -> tuple[Any, dict[int, dict[str, Any]]]:
        """Stage 0's input and the per-stage parameters (SamplingError for a field no stage takes)."""
        fields = {f: v for f, v in (("voice", req.voice), ("seed", req.seed),
                                    (openai_sampling.EXTENSION, req.stage_sampling)) if v is not None}
        engine, kinds = self.engine, self.kinds
        if self.first is not None:
            payload: Any = {"tokens": np.asarray(self.first.encode(req.input), dtype=np.int32)}
        elif kinds is not None and says(kinds[0]):
            prompt, n_prompt = self._say_prompt()
            limit = engine.stage_info(0).get("max_say")  # its cache's room after a one-token prompt
            room = limit + 1 - n_prompt if isinstance(limit, int) else None
            if room is not None and n_in > room:  # the thinker counts 'say' in its tokens
                raise BadRequest(f"'input' is {n_in} tokens: this pipeline speaks at most {room} per "
                                 "request", "input", code="context_length_exceeded")
            payload = {"text": prompt, "say": req.input}
        else:
            payload = req.input
            stages = engine.stage_params
            k = self.text_stage
            if k is not None and stages is not None and "max_tokens" in stages[k].schema:
                fields["max_tokens"] = len(req.input.encode())  # about as long as the input
        sampling = openai_sampling.map_sampling(fields, engine.stage_params, text_stage=self.text_stage,
                                                last_stage=self.audio_finals[-1], voice_field="voice")
        return payload, sampling
