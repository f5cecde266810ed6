"""``omni-thinker``: the thinker of a Qwen2.5-Omni checkpoint as a stage: text, images and audio in, text out.

It is :class:`stages.hf.decoder.DecoderStage` -- the continuous-batching loop
of the checkpoint text stages: requests join and leave between steps, each
has its own KV cache and its own forward pass, text is detokenized
incrementally and stops where ``generate()`` stops -- over
:class:`OmniThinkerAdapter` (:class:`stages.hf.omni.compute.ThinkerRunner`:
the multimodal prefill, the 3-D rope positions).  What differs:

- the prompt is the checkpoint's processor's: the payload is the prompt the
  chat template made (its image and audio placeholders in it) with the media
  beside it (:mod:`stages.media`: ``{"text", "images": [uint8[h, w, 3]],
  "audios": [{"pcm", "sample_rate"}]}``); each placeholder is expanded to its
  media's length and the media encoded by the thinker's own vision and audio
  towers;
- every output also carries ``rows`` (float32 [k, H]: per position run, the
  last hidden state plus the input embedding, zero at media placeholders)
  and the first one ``talker`` (the prompt ids, the speaker's start id and
  the embeddings that frame the talker's input, the media grids): what the
  talker reads (:mod:`stages.hf.omni.forwarding`).  The ``voice`` parameter
  picks the speaker.  With ``speak = false`` (a thinker that is the whole
  pipeline) they are left out.

Its forward function (the registry's) frames these for the talker; in
async-chunk mode the outputs stream to the talker as they come.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from stages.base import ReqState
from stages.control import rpc_method
from stages.hf.checkpoint import load_checkpoint
from stages.hf.decoder import DecoderStage, Decoding, Forward
from stages.hf.omni.checkpoint import read_omni_config, speaker_ids
from stages.hf.omni.compute import ThinkerRunner, ThinkerSequence
from stages.hf.omni.params import thinker_params
from stages.hf.omni.parts import load_part, load_processor, quiet_transformers, weights_summary
from stages.hf.tokenizer import checkpoint_tokenizer
from stages.sampling_params import with_defaults
from stages.schema import PositiveInt

__all__ = ["OmniForward", "OmniThinker", "OmniThinkerAdapter"]

#: ``generation_config.json`` fields that are sampling defaults (as the causal LM kind reads them)
_DEFAULTS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
             "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


@dataclass(slots=True)
class OmniForward(Forward):
    """A forward pass with the talker's rows of its positions (None: not asked)."""

    rows: np.ndarray | None = None


@dataclass(slots=True)
class _Sequence:
    runner_seq: ThinkerSequence
    speak: bool


class OmniThinkerAdapter:
    """The decoder loop's model adapter over :class:`ThinkerRunner`; a sequence starts with its media."""

    def __init__(self, runner: ThinkerRunner) -> None:
        self.runner = runner
        self.vocab_size = runner.vocab_size
        self.hidden_size = runner.hidden_size

    def start(self, media: dict[str, Any] | None = None, speak: bool = False) -> _Sequence:
        return _Sequence(self.runner.start(media), speak)

    def forward(self, state: _Sequence, new_ids: list[int], *, hidden: bool) -> OmniForward:
        logits, rows = self.runner.forward(state.runner_seq, new_ids, rows=state.speak)
        return OmniForward(logits, None, rows)

    def release(self, state: _Sequence) -> None:
        self.runner.release(state.runner_seq)


class OmniThinker(DecoderStage):
    """The thinker of the checkpoint in directory ``checkpoint`` (see the module's docstring).

    Options: ``checkpoint``, ``max_model_len`` (at most the thinker's
    context), ``dtype`` (auto: the checkpoint's), ``speak`` (send the talker's
    rows; false: a text-only pipeline).
    """

    kind = "omni-thinker"

    def __init__(self, checkpoint: str, max_model_len: PositiveInt | None = None, dtype: str = "auto",
                 speak: bool = True, device: str = "cpu", seed: int = 0) -> None:
        ckpt = load_checkpoint(checkpoint)
        self.cfg = read_omni_config(checkpoint)
        self.processor = load_processor(checkpoint)
        self.runner = ThinkerRunner(load_part(checkpoint, "thinker", device=device, dtype=dtype), self.cfg)
        self.speakers = speaker_ids(checkpoint)
        self.schema = thinker_params(list(self.speakers))
        self.speak = speak
        given = {k: v for k, v in ckpt.generation.items() if not isinstance(v, bool)}
        defaults = {name: given[key] for key, name in _DEFAULTS.items()
                    if isinstance(given.get(key), int | float)}
        with quiet_transformers():  # a default Omni config is built on the way, and warns of its ids
            tokenizer = checkpoint_tokenizer(str(ckpt.path))
        super().__init__(OmniThinkerAdapter(self.runner), tokenizer,
                         max_model_len=ckpt.context(max_model_len), eos_ids=self.cfg.eos_token_ids,
                         defaults=defaults, seed=seed)
        self.rate = int(self.processor.feature_extractor.sampling_rate)

    def admit(self, req: ReqState) -> None:
        if req.upstream:
            raise ValueError("omni-thinker takes a whole prompt, not streamed chunks: make it stage 0")
        p = req.payload
        text = self._text(p, "prompt")
        images = list(p.get("images") or []) if isinstance(p, dict) else []
        audios = [self._audio(a) for a in (p.get("audios") or [])] if isinstance(p, dict) else []
        self._check_placeholders(text, len(images), len(audios))
        inputs = self.processor(text=[text], images=images or None, audio=audios or None,
                                return_tensors="pt")
        ids = inputs["input_ids"][0].tolist()
        self.begin(req, ids)
        m: Decoding = req.model
        m.state = self.adapter.start(dict(inputs), self.speak)
        if self.speak:
            voice = with_defaults(self.schema, req.sampling)["voice"]
            bos = self.speakers[voice]
            tts = self.cfg.tts_text
            head: dict[str, Any] = {"prompt_ids": np.asarray(ids, dtype=np.int64), "speaker_id": bos,
                                    "frame": self.runner.embed([bos, tts["end"], tts["pad"]])}
            if "image_grid_thw" in inputs:
                head["image_grid_thw"] = inputs["image_grid_thw"].numpy()
            if "feature_attention_mask" in inputs:
                head["audio_feature_lengths"] = inputs["feature_attention_mask"].sum(1).numpy()
            m.extra["talker"] = head

    def _check_placeholders(self, text: str, images: int, audios: int) -> None:
        """The prompt has one placeholder per image and audio the payload carries (the chat template's)."""
        for token, n, medium in ((self.processor.image_token, images, "image"),
                                 (self.processor.audio_token, audios, "audio")):
            found = text.count(token)
            if found != n:
                raise ValueError(f"omni-thinker: the prompt has {found} {medium} placeholder(s) {token} for "
                                 f"{n} {medium}(s): the checkpoint's chat template writes one per part")
        if self.processor.video_token in text:
            raise ValueError("omni-thinker: video input is not served")

    def _audio(self, clip: Any) -> np.ndarray:
        """An audio payload (``{"pcm", "sample_rate"}``) at the feature extractor's rate (linear
        interpolation when it differs)."""
        if not isinstance(clip, dict) or clip.get("pcm") is None:
            raise ValueError("omni-thinker: an audio is {'pcm': float32[n], 'sample_rate': int}")
        pcm = np.asarray(clip["pcm"], dtype=np.float32).reshape(-1)
        rate = int(clip.get("sample_rate", self.rate))
        if rate == self.rate or not len(pcm):
            return pcm
        at = np.arange(int(len(pcm) * self.rate / rate)) * (rate / self.rate)
        return np.interp(at, np.arange(len(pcm)), pcm).astype(np.float32)

    def extend(self, req: ReqState, payload: Any) -> None:
        """A resumable request's next segment (a realtime session's next turn): text only, after the
        conversation in the cache.  The talker then speaks the new answer from the whole conversation:
        the segment's first output carries every row so far (``history``) and every id."""
        if isinstance(payload, dict) and (payload.get("images") or payload.get("audios")):
            raise ValueError("omni-thinker: a later segment of a conversation takes text only")
        super().extend(req, payload)
        m: Decoding = req.model
        head = m.extra.get("first")
        if not self.speak or head is None:
            return
        seq: _Sequence = m.state
        ids = seq.runner_seq.ids
        done = ids[0].tolist() if ids is not None else []
        history = m.extra.get("rows", [])
        m.extra["talker"] = {**head, "prompt_ids": np.asarray([*done, *m.feed], dtype=np.int64),
                             "history": np.concatenate(history) if history else None}

    def step_fields(self, m: Decoding, run: Forward) -> dict[str, Any]:
        rows = run.rows if isinstance(run, OmniForward) else None
        if rows is None:
            return {}
        m.extra.setdefault("rows", []).append(rows)  # a later segment's talker reads the whole conversation
        fields: dict[str, Any] = {"rows": rows}
        if "talker" in m.extra:
            fields["talker"] = m.extra.pop("talker")
            m.extra.setdefault("first", fields["talker"])
        return fields

    @rpc_method("weights")
    def weights(self) -> dict[str, Any]:
        """The ``weights`` RPC: the names, count and bytes of the tensors this worker holds."""
        return weights_summary("thinker", self.runner.model)

    def info(self) -> dict[str, Any]:
        return {**super().info(), "kind": self.kind, "checkpoint": str(self.cfg.path),
                "tokenizer": str(self.cfg.path),
                "voices": list(self.speakers), "speak": self.speak, "device": str(self.runner.device)}
