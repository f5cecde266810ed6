"""Each Qwen2.5-Omni part, one sequence at a time, computed as ``generate()`` computes it.

``Qwen2_5OmniForConditionalGeneration.generate()`` runs the thinker's
``generate()``, frames its hidden states for the talker, runs the talker's
``generate()`` and hands the codes to token2wav.  The runners here do the same
arithmetic one forward pass at a time, so that a stage can interleave the
steps of many requests and stop after any of them:

- :class:`ThinkerRunner` -- the prefill computes the multimodal rope index
  once (``get_rope_index``: 3-D positions for image patches) and passes the
  positions explicitly (the model's own forward keeps the rope delta on the
  module, which two interleaved sequences would overwrite); a decode step's
  positions are the cache length plus the request's delta.  With ``rows`` it
  also returns, per position, the last layer's hidden state plus the input
  embedding (zeroed at image/audio placeholders in the prompt) -- what the
  talker reads;
- :class:`TalkerRunner` -- the talker's prompt (codec mask codes under the
  thinker's prompt, then pad and start codes whose embeddings are added to the
  last two rows), then per generated code its embedding plus the next row of
  the text track (:class:`stages.hf.omni.forwarding.TalkerTrack`);
- :class:`Token2WavRunner` -- the DiT's flow-matching solve from noise drawn
  with the request's seed (``generate()`` draws it from the global generator:
  ``torch.manual_seed(s)`` before it gives the noise of seed ``s``), one ODE
  interval at a time (:class:`MelSolve`: a worker answers between them), then
  BigVGAN, whole or in chunks with enough mel context on each side that every
  chunk's samples are the whole waveform's (:func:`vocoder_context`).

Every tensor crossing a stage boundary is float32 numpy; a part in bf16
converts on the way in and out (exactly: bf16 -> float32 -> bf16 is lossless).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from stages.hf.omni.checkpoint import OmniConfig

__all__ = ["MelSolve", "TalkerInput", "TalkerRunner", "TalkerSequence", "ThinkerRunner", "ThinkerSequence",
           "Token2WavRunner", "vocoder_context"]

#: processor outputs the thinker's prefill consumes, and those the rope index reads
MEDIA_INPUTS = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw", "input_features",
                "feature_attention_mask", "video_second_per_grid")


def _ones(n: int, device: torch.device) -> torch.Tensor:
    return torch.ones((1, n), dtype=torch.long, device=device)


def _decode_positions(start: int, n: int, delta: torch.Tensor, device: torch.device) -> torch.Tensor:
    """[3, 1, n] positions of ``n`` tokens after ``start`` cached ones: the same on all three rope axes."""
    pos = torch.arange(n, device=device).view(1, -1) + (start + delta.to(device))
    return pos.unsqueeze(0).expand(3, -1, -1)


# ---------------------------------------------------------------------------- the thinker
@dataclass(slots=True)
class ThinkerSequence:
    """One request's thinker state: its tokens, KV cache, rope delta and (until the prefill) its media."""

    media: dict[str, torch.Tensor]
    use_audio_in_video: bool = False
    ids: torch.Tensor | None = None  # [1, n]: every token the model has seen
    cache: Any = None
    delta: torch.Tensor | None = None


class ThinkerRunner:
    """The thinker (``model.thinker``) one sequence at a time (see the module's docstring).

    The rows are caught on their way through the text model (its input
    embeddings and its last hidden state, by hooks): asking the model for
    every layer's hidden states would keep them all for the prompt.
    """

    def __init__(self, model: Any, cfg: OmniConfig) -> None:
        self.model = model
        self.cfg = cfg
        self.device = next(model.parameters()).device
        self.vocab_size = cfg.vocab_size
        self.hidden_size = cfg.hidden_size
        self._caught: dict[str, torch.Tensor] | None = None
        model.model.register_forward_pre_hook(self._catch_input, with_kwargs=True)
        model.model.register_forward_hook(self._catch_output)

    def _catch_input(self, module: Any, args: Any, kwargs: dict[str, Any]) -> None:
        if self._caught is not None:
            self._caught["embeds"] = kwargs["inputs_embeds"]

    def _catch_output(self, module: Any, args: Any, output: Any) -> None:
        if self._caught is not None:
            self._caught["last"] = output.last_hidden_state

    def start(self, media: Mapping[str, Any] | None = None, *, use_audio_in_video: bool = False
              ) -> ThinkerSequence:
        """A new sequence; ``media``: the processor's tensors for its images and audio (prefill only)."""
        found = {k: torch.as_tensor(v).to(self.device) for k, v in (media or {}).items()
                 if k in MEDIA_INPUTS and v is not None}
        return ThinkerSequence(found, use_audio_in_video)

    @torch.inference_mode()
    def forward(self, seq: ThinkerSequence, new_ids: list[int], *, rows: bool = False
                ) -> tuple[torch.Tensor, np.ndarray | None]:
        """Run ``new_ids`` on ``seq``: next-token logits (float32 [vocab], CPU) and, with ``rows``, the
        talker's rows of these positions (float32 [len(new_ids), hidden])."""
        from transformers import DynamicCache

        new = torch.tensor([new_ids], dtype=torch.long, device=self.device)
        first = seq.ids is None
        seq.ids = new if first else torch.cat([seq.ids, new], 1)
        mask = torch.ones_like(seq.ids)
        kw: dict[str, Any] = {}
        if first:
            seq.cache = DynamicCache(config=self.model.config.get_text_config())
            m = seq.media
            lengths = m["feature_attention_mask"].sum(1) if "feature_attention_mask" in m else None
            positions, seq.delta = self.model.get_rope_index(
                seq.ids, m.get("image_grid_thw"), m.get("video_grid_thw"), mask, seq.use_audio_in_video,
                lengths, m.get("video_second_per_grid"))
            kw = {k: v for k, v in m.items() if k != "video_second_per_grid"}
        else:
            assert seq.delta is not None
            positions = _decode_positions(seq.cache.get_seq_length(), len(new_ids), seq.delta, self.device)
        self._caught = {} if rows else None
        try:
            out = self.model(input_ids=new, attention_mask=mask, position_ids=positions,
                             past_key_values=seq.cache, use_cache=True, return_dict=True, **kw)
            caught = self._caught
        finally:
            self._caught = None
        seq.cache = out.past_key_values
        logits = out.logits[0, -1].to(dtype=torch.float32, device="cpu")
        if caught is None:
            return logits, None
        embeds = caught["embeds"][0].clone()
        if first:  # generate() hands the talker no image or audio features: zero their placeholders
            for key, medium in (("input_features", "audio"), ("pixel_values", "image"),
                                ("pixel_values_videos", "video")):
                if key in seq.media:
                    embeds[new[0] == self.cfg.media_token(medium)] = 0
        if first:
            seq.media = {}
        found = caught["last"][0] + embeds
        return logits, found.to(dtype=torch.float32, device="cpu").numpy()

    @torch.inference_mode()
    def embed(self, ids: list[int]) -> np.ndarray:
        """The thinker's input embeddings of ``ids`` (float32 [len(ids), hidden])."""
        t = torch.tensor(ids, dtype=torch.long, device=self.device)
        return self.model.get_input_embeddings()(t).to(dtype=torch.float32, device="cpu").numpy()

    def release(self, seq: ThinkerSequence) -> None:
        seq.cache, seq.media = None, {}


# ---------------------------------------------------------------------------- the talker
@dataclass(frozen=True)
class TalkerInput:
    """What the talker's prefill reads (:meth:`stages.hf.omni.forwarding.TalkerTrack.prefill` builds it).

    ``embeds``: [L+2, H], the prompt's rows, the speaker's start embedding, the
    first reply token's row; ``text_ids``: the thinker's prompt ids, the
    speaker's start id, the first reply id (the rope index reads them); the
    grids and audio lengths of the prompt's media.
    """

    embeds: np.ndarray
    text_ids: np.ndarray
    image_grid_thw: np.ndarray | None = None
    video_grid_thw: np.ndarray | None = None
    audio_feature_lengths: np.ndarray | None = None
    video_second_per_grid: np.ndarray | None = None
    use_audio_in_video: bool = False

    @classmethod
    def from_payload(cls, payload: Mapping[str, Any]) -> TalkerInput:
        def arr(key: str, dtype: Any) -> np.ndarray | None:
            v = payload.get(key)
            return None if v is None else np.asarray(v, dtype=dtype)

        embeds, text = arr("embeds", np.float32), arr("text_ids", np.int64)
        if embeds is None or text is None or embeds.ndim != 2:
            raise ValueError("a talker input has 'embeds' [L+2, H] and 'text_ids' [L+2]")
        if len(text) != len(embeds):
            raise ValueError(f"talker input: {len(text)} text ids for {len(embeds)} rows")
        return cls(embeds, text, arr("image_grid_thw", np.int64), arr("video_grid_thw", np.int64),
                   arr("audio_feature_lengths", np.int64), arr("video_second_per_grid", np.float32),
                   bool(payload.get("use_audio_in_video", False)))


@dataclass(slots=True)
class TalkerSequence:
    """One request's talker state: its KV cache and rope delta."""

    cache: Any
    delta: torch.Tensor


class TalkerRunner:
    """The talker (``model.talker``) one sequence at a time (see the module's docstring)."""

    def __init__(self, model: Any, cfg: OmniConfig) -> None:
        self.model = model
        self.cfg = cfg
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.vocab_size = cfg.codec_vocab
        self.codec = cfg.codec

    def _t(self, a: np.ndarray | None, dtype: torch.dtype | None = None) -> torch.Tensor | None:
        return None if a is None else torch.from_numpy(np.ascontiguousarray(a)).to(self.device, dtype)

    @torch.inference_mode()
    def start(self, inp: TalkerInput) -> tuple[TalkerSequence, torch.Tensor]:
        """The talker's prefill: its sequence and the first code's logits (float32 [vocab], CPU)."""
        from transformers import DynamicCache

        n = len(inp.text_ids)
        mask = _ones(n, self.device)
        second = self._t(inp.video_second_per_grid)
        positions, delta = self.model.get_rope_index(
            self._t(inp.text_ids)[None], self._t(inp.image_grid_thw), self._t(inp.video_grid_thw), mask,
            inp.use_audio_in_video, self._t(inp.audio_feature_lengths), second)
        embeds = self._t(inp.embeds, self.dtype)[None].clone()
        table = self.model.get_input_embeddings()
        codes = torch.tensor([self.codec["start"], self.codec["pad"]], dtype=torch.long, device=self.device)
        start, pad = table(codes)
        embeds[:, -1, :] += start
        embeds[:, -2, :] += pad
        cache = DynamicCache(config=self.model.config)
        out = self.model(inputs_embeds=embeds, attention_mask=mask, position_ids=positions,
                         past_key_values=cache, use_cache=True, return_dict=True)
        logits = out.logits[0, -1].to(dtype=torch.float32, device="cpu")
        return TalkerSequence(out.past_key_values, delta), logits

    @torch.inference_mode()
    def forward(self, seq: TalkerSequence, code: int, row: np.ndarray) -> torch.Tensor:
        """Feed the code just generated with its text-track ``row`` [H]: the next code's logits."""
        table = self.model.get_input_embeddings()
        text = self._t(row, self.dtype).view(1, 1, -1)
        step = table(torch.tensor([[code]], dtype=torch.long, device=self.device)) + text
        past = seq.cache.get_seq_length()
        out = self.model(inputs_embeds=step, attention_mask=_ones(past + 1, self.device),
                         position_ids=_decode_positions(past, 1, seq.delta, self.device),
                         past_key_values=seq.cache, use_cache=True, return_dict=True)
        seq.cache = out.past_key_values
        return out.logits[0, -1].to(dtype=torch.float32, device="cpu")

    def release(self, seq: TalkerSequence) -> None:
        seq.cache = None


# ---------------------------------------------------------------------------- token2wav
def vocoder_context(bigvgan: Mapping[str, Any]) -> int:
    """Mel frames of context on each side that make a chunk's samples the whole waveform's.

    A bound on BigVGAN's receptive field, one side, layer by layer in the
    samples of each layer's rate, turned into frames: the input convolution
    (kernel 7), each transposed convolution (``ceil(kernel / rate)`` inputs),
    each residual block (per dilated pair: two anti-aliased activations of 6
    samples each -- 12-tap filters at twice the rate -- and the two
    convolutions; the widest of the parallel blocks), the last activation and
    the output convolution (kernel 7); one frame more for rounding.
    """
    rates = list(bigvgan.get("upsample_rates", (5, 3, 2, 2, 2, 2)))
    kernels = list(bigvgan.get("upsample_kernel_sizes", (11, 7, 4, 4, 4, 4)))
    res_kernels = list(bigvgan.get("resblock_kernel_sizes", (3, 7, 11)))
    dilations = [list(d) for d in bigvgan.get("resblock_dilation_sizes", ((1, 3, 5),) * 3)]
    act = 6
    block = max(sum(act + (k - 1) * d // 2 + act + (k - 1) // 2 for d in ds)
                for k, ds in zip(res_kernels, dilations, strict=True))
    frames, per_frame = 3.0, 1
    for rate, kernel in zip(rates, kernels, strict=True):
        frames += math.ceil(kernel / rate) / per_frame
        per_frame *= rate
        frames += block / per_frame
    frames += (act + 3) / per_frame
    return math.ceil(frames) + 1


@dataclass(slots=True)
class MelSolve:
    """One request's DiT solve in progress: its inputs, the ODE's time points and where it is."""

    code: torch.Tensor
    speaker: torch.Tensor
    ref: torch.Tensor
    y: torch.Tensor  # [1, frames, mel_dim]: the noise, then the state after each interval
    times: torch.Tensor
    guidance: float
    at: int = 0  # intervals done

    @property
    def done(self) -> bool:
        return self.at >= len(self.times) - 1

    @property
    def mel(self) -> torch.Tensor:
        """The solved mel, [1, mel_dim, frames]."""
        return self.y.permute(0, 2, 1)


class Token2WavRunner:
    """token2wav (``model.token2wav``): codes -> mel (DiT) -> waveform (BigVGAN), float32."""

    def __init__(self, model: Any, cfg: OmniConfig) -> None:
        self.model = model
        self.cfg = cfg
        self.device = next(model.parameters()).device
        self.dit = model.code2wav_dit_model
        self.vocoder = model.code2wav_bigvgan_model
        self.hop = cfg.hop
        self.context = vocoder_context(cfg.token2wav.get("bigvgan_config") or {})

    def start(self, codes: np.ndarray, cond: torch.Tensor, ref_mel: torch.Tensor, *, seed: int | None = None,
              y0: torch.Tensor | None = None, num_steps: int = 10, guidance_scale: float = 0.5,
              sway_coefficient: float = -1.0) -> MelSolve:
        """The DiT's solve of ``codes`` for a speaker, to be advanced one ODE interval at a time
        (:meth:`advance`): what ``sample()`` computes, from noise ``y0`` [1, frames, mel_dim], or drawn
        as ``sample()`` draws it after ``torch.manual_seed(seed)`` (the global generator is left as it was).
        """
        code = torch.as_tensor(np.asarray(codes, dtype=np.int64), device=self.device)[None]
        ref = ref_mel.to(self.device).float()
        frames = code.shape[1] * self.dit.repeats
        if y0 is None:
            devices = [self.device] if self.device.type == "cuda" else []
            with torch.random.fork_rng(devices=devices):
                torch.manual_seed(0 if seed is None else seed)
                y0 = torch.randn([1, frames, self.dit.mel_dim], dtype=ref.dtype, device=self.device)
        speaker = cond.to(self.device).float().unsqueeze(1).repeat(1, frames, 1)
        times = torch.linspace(0, 1, num_steps, device=self.device, dtype=speaker.dtype)
        if sway_coefficient is not None:
            times += sway_coefficient * (torch.cos(torch.pi / 2 * times) - 1 + times)
        return MelSolve(code, speaker, ref, y0.to(self.device), times, guidance_scale)

    def _velocity(self, s: MelSolve, t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        if s.guidance < 1e-5:
            return self.dit(hidden_states=x, speaker_embedding=s.speaker, condition_vector=s.ref,
                            quantized_code=s.code, time_step=t, apply_cfg=False)
        out = self.dit(hidden_states=x, quantized_code=s.code, speaker_embedding=s.speaker,
                       condition_vector=s.ref, time_step=t, apply_cfg=True)
        guided, null = torch.chunk(out, 2, dim=0)
        return guided + (guided - null) * s.guidance

    @torch.inference_mode()
    def advance(self, s: MelSolve) -> bool:
        """One interval of the solve (a Runge-Kutta 4 step: four DiT passes); True once it is solved.

        The arithmetic of ``transformers``' ``RungeKutta4ODESolver``, in its order, so the mel is
        ``sample()``'s; a worker steps a long solve an interval at a time, so it answers between.
        """
        if s.done:
            return True
        t0, t1 = s.times[s.at], s.times[s.at + 1]
        dt = t1 - t0
        y = s.y
        k1 = self._velocity(s, t0, y)
        k2 = self._velocity(s, t0 + dt * (1 / 3), y + dt * k1 * (1 / 3))
        k3 = self._velocity(s, t0 + dt * (2 / 3), y + dt * (k2 - k1 * (1 / 3)))
        k4 = self._velocity(s, t1, y + dt * (k1 - k2 + k3))
        s.y = y + (k1 + 3 * (k2 + k3) + k4) * dt / 8
        s.at += 1
        return s.done

    def mel(self, codes: np.ndarray, cond: torch.Tensor, ref_mel: torch.Tensor, seed: int, *,
            num_steps: int = 10) -> torch.Tensor:
        """The whole solve at once: the DiT's mel [1, mel_dim, frames] of ``codes``, noise of ``seed``."""
        s = self.start(codes, cond, ref_mel, seed=seed, num_steps=num_steps)
        while not self.advance(s):
            pass
        return s.mel

    def noise(self, seed: int) -> torch.Generator:
        """A request's noise source for windows (async-chunk mode): a CPU generator seeded with ``seed``."""
        return torch.Generator(device="cpu").manual_seed(seed)

    @torch.inference_mode()
    def waveform(self, mel: torch.Tensor) -> np.ndarray:
        """The whole waveform of ``mel`` (float32 [samples])."""
        return self.vocoder(mel).reshape(-1).float().cpu().numpy()

    @torch.inference_mode()
    def waveform_piece(self, mel: torch.Tensor, a: int, b: int) -> np.ndarray:
        """The samples of mel frames ``a..b`` (float32 [(b-a) * hop]), computed from those frames and
        :func:`vocoder_context` frames on each side: the whole waveform's samples there."""
        total = mel.shape[-1]
        lo, hi = max(0, a - self.context), min(total, b + self.context)
        wav = self.vocoder(mel[..., lo:hi]).reshape(-1)
        return wav[(a - lo) * self.hop:(b - lo) * self.hop].float().cpu().numpy()

    def waveform_chunks(self, mel: torch.Tensor, frames: int) -> Iterator[np.ndarray]:
        """The waveform of ``mel`` in pieces of ``frames`` mel frames: joined, they are :meth:`waveform`."""
        step = max(1, frames)
        for a in range(0, mel.shape[-1], step):
            yield self.waveform_piece(mel, a, min(mel.shape[-1], a + step))
