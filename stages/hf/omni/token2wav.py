"""``omni-token2wav``: token2wav of a Qwen2.5-Omni checkpoint as a stage: codec codes in, a waveform out.

**Normal mode** (the talker's whole answer, :func:`stages.forwarding.codes_input`):
the DiT solves the whole mel at once -- one ODE interval per step, so the
worker answers (heartbeats, aborts) between them -- from noise drawn with the request's
``seed`` (default 0: ``generate()``'s noise after ``torch.manual_seed(0)``),
conditioned on the request's ``voice`` -- and BigVGAN vocodes it
``chunk_frames`` mel frames per step, with enough context on each side that
the pieces join into exactly the whole waveform
(:func:`stages.hf.omni.compute.vocoder_context`): ``generate()``'s waveform,
the first piece out before the rest is vocoded.

**Async-chunk mode** (codes stream in from the talker): the DiT attends
within a few blocks of ``block_size`` mel frames per layer, and the model is
built to be decoded in a sliding window (the Qwen2.5-Omni report's
"sliding-window DiT"): each chunk of ``stream_codes`` codes is solved in a
window that reaches ``past_codes`` back and ``future_codes`` ahead, from that
window's slice of the request's noise, and vocoded with the mel already made
before it and the window's look-ahead after it.  The first audio comes after
``stream_codes + future_codes`` codes instead of after the whole answer; the
waveform is the sliding window's, close to but not the same as the whole
solve's (``generate()`` solves the whole), and ``docs/performance.md``
measures the first-audio latency per chunk size.

An answer of more than ``whole_codes`` codes (1500: 30 s of speech) is
decoded in the sliding window in normal mode too: a whole solve's time and
memory grow with the square of its length (its attention masks are frames x
frames), and ``generate()``'s default talker budget, 4096 codes, would stall
a worker for minutes on a long answer.

Each output is ``{"pcm": float32[samples], "sample_rate": 24000}``; a request
whose talker said nothing ends with one empty piece.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from stages.base import ReqState, StageModel, StepResult
from stages.control import rpc_method
from stages.hf.omni.checkpoint import SAMPLE_RATE, read_omni_config, speakers
from stages.hf.omni.compute import MelSolve, Token2WavRunner
from stages.hf.omni.params import token2wav_params
from stages.hf.omni.parts import load_part, weights_summary
from stages.sampling_params import with_defaults
from stages.schema import NonNegativeInt, PositiveInt

__all__ = ["OmniToken2Wav"]


@dataclass(slots=True)
class _Wave:
    """One request's state (``ReqState.model``)."""

    voice: str
    seed: int
    codes: list[int]
    windowed: bool  # decoded in sliding windows: codes stream in, or too many to solve whole
    solve: MelSolve | None = None  # normal mode: the whole mel's solve, an interval per step
    at: int = 0  # normal mode: the next mel frame to vocode; streamed: the next code to solve
    noise: torch.Generator | None = None  # streamed: the request's noise, drawn as far as needed
    drawn: torch.Tensor | None = None  # [1, frames, mel_dim]
    tail: torch.Tensor | None = None  # streamed: the last mel frames made (the vocoder's left context)


class OmniToken2Wav(StageModel):
    """token2wav of the checkpoint in directory ``checkpoint`` (see the module's docstring).

    Options: ``chunk_frames``: normal mode, mel frames vocoded per step (100 a
    second of audio); ``stream_codes``, ``past_codes``, ``future_codes``:
    async-chunk mode, the codes per chunk and the window's reach back and
    ahead (0: the DiT's block, in codes, times 3, 2 and 1); ``whole_codes``:
    the most codes normal mode solves whole; ``num_steps``: the DiT's ODE
    steps (``generate()``'s 10).
    """

    kind = "omni-token2wav"

    def __init__(self, checkpoint: str, chunk_frames: PositiveInt = 50, stream_codes: NonNegativeInt = 0,
                 past_codes: NonNegativeInt = 0, future_codes: NonNegativeInt = 0,
                 whole_codes: PositiveInt = 1500, num_steps: PositiveInt = 10, device: str = "cpu") -> None:
        self.cfg = read_omni_config(checkpoint)
        self.runner = Token2WavRunner(load_part(checkpoint, "token2wav", device=device), self.cfg)
        self.speakers = speakers(checkpoint)
        self.schema = token2wav_params(list(self.speakers))
        self.chunk = chunk_frames
        self.rep = self.cfg.mel_per_code
        dit = self.cfg.token2wav.get("dit_config") or {}
        block = max(1, int(dit.get("block_size", 24)) // self.rep)  # the DiT's block, in codes
        self.mel_dim = int(dit.get("mel_dim", 80))
        self.stream = stream_codes or 3 * block
        self.past = past_codes or 2 * block
        self.future = future_codes or block
        self.whole = whole_codes
        self.num_steps = num_steps

    def admit(self, req: ReqState) -> None:
        req.model = self._wave(req, req.payload)

    def extend(self, req: ReqState, payload: Any) -> None:
        """A conversation's next answer: its codes decoded afresh."""
        self.release(req)
        req.model = self._wave(req, payload)
        if req.upstream:
            req.input_done = False

    def _wave(self, req: ReqState, payload: Any) -> _Wave:
        sp = with_defaults(self.schema, req.sampling)
        seed = 0 if sp["seed"] is None else int(sp["seed"])
        if req.upstream:  # codes stream in from the talker (feed)
            return self._windowed(sp["voice"], seed, [])
        codes = payload.get("codes") if isinstance(payload, dict) else None
        if codes is None:
            raise ValueError("omni-token2wav: the payload is {'codes': int[n]} (the talker's codes)")
        found = self._check(codes)
        if len(found) > self.whole:  # a whole solve grows with the square of its length: slide instead
            return self._windowed(sp["voice"], seed, found)
        return _Wave(sp["voice"], seed, found, False)

    def _windowed(self, voice: str, seed: int, codes: list[int]) -> _Wave:
        return _Wave(voice, seed, codes, True, noise=self.runner.noise(seed),
                     drawn=torch.zeros(1, 0, self.mel_dim))

    def _check(self, codes: Any) -> list[int]:
        arr = np.asarray(codes).reshape(-1)
        if len(arr) and (not np.issubdtype(arr.dtype, np.integer) or arr.min() < 0
                         or arr.max() >= self.cfg.codec_vocab):
            raise ValueError(f"omni-token2wav: codes must be integers below {self.cfg.codec_vocab}")
        return arr.astype(np.int64).tolist()

    def feed(self, req: ReqState, data: Any, end: bool) -> None:
        if isinstance(data, dict) and data.get("codes") is not None:
            req.model.codes += self._check(data["codes"])
        if end:
            req.input_done = True

    def runnable(self, req: ReqState) -> bool:
        w: _Wave = req.model
        return not w.windowed or req.input_done or len(w.codes) >= w.at + self.stream + self.future

    @torch.inference_mode()
    def step(self, reqs: list[ReqState]) -> list[StepResult]:
        return [self._window(r.model, r.input_done) if r.model.windowed else self._whole(r.model)
                for r in reqs]

    def _whole(self, w: _Wave) -> StepResult:
        if not w.codes:
            return StepResult(self._pcm(np.zeros(0, np.float32)), True, None)
        if w.solve is None:
            spk = self.speakers[w.voice]
            w.solve = self.runner.start(np.asarray(w.codes), spk["cond"], spk["ref_mel"], seed=w.seed,
                                        num_steps=self.num_steps)
        if not w.solve.done:  # one ODE interval per step: the worker answers between them
            self.runner.advance(w.solve)
            return StepResult(None, False, None)
        mel = w.solve.mel
        b = min(mel.shape[-1], w.at + self.chunk)
        piece = self.runner.waveform_piece(mel, w.at, b)
        w.at = b
        return StepResult(self._pcm(piece), w.at >= mel.shape[-1], None)

    def _window(self, w: _Wave, done: bool) -> StepResult:
        n, a = len(w.codes), w.at
        b = min(n, a + self.stream)
        if b <= a:  # the input ended on a chunk boundary (or had no codes)
            return StepResult(self._pcm(np.zeros(0, np.float32)), True, None)
        lo, hi = max(0, a - self.past), min(n, b + self.future)
        rep = self.rep
        assert w.noise is not None and w.drawn is not None
        while w.drawn.shape[1] < hi * rep:  # the request's noise, one window's worth more at a time
            more = torch.randn(1, max(hi * rep - w.drawn.shape[1], self.stream * rep), self.mel_dim,
                               generator=w.noise)
            w.drawn = torch.cat([w.drawn, more], 1)
        spk = self.speakers[w.voice]
        window = self.runner.start(np.asarray(w.codes[lo:hi]), spk["cond"], spk["ref_mel"],
                                   y0=w.drawn[:, lo * rep:hi * rep], num_steps=self.num_steps)
        while not self.runner.advance(window):
            pass
        mel = window.mel
        chunk = mel[..., (a - lo) * rep:(b - lo) * rep]
        ahead = mel[..., (b - lo) * rep:(b - lo) * rep + self.runner.context]
        left = w.tail if w.tail is not None else chunk[..., :0]
        joined = torch.cat([left, chunk, ahead], -1)
        piece = self.runner.waveform_piece(joined, left.shape[-1], left.shape[-1] + chunk.shape[-1])
        w.tail = torch.cat([left, chunk], -1)[..., -self.runner.context:]
        w.at = b
        return StepResult(self._pcm(piece), done and b >= n, None)

    @staticmethod
    def _pcm(samples: np.ndarray) -> dict[str, Any]:
        return {"pcm": np.ascontiguousarray(samples, dtype=np.float32), "sample_rate": SAMPLE_RATE}

    def release(self, req: ReqState) -> None:
        if isinstance(req.model, _Wave):
            req.model.solve = req.model.drawn = req.model.tail = None

    @rpc_method("weights")
    def weights(self) -> dict[str, Any]:
        """The ``weights`` RPC: the names, count and bytes of the tensors this worker holds."""
        return weights_summary("token2wav", self.runner.model)

    def info(self) -> dict[str, Any]:
        return {"kind": self.kind, "checkpoint": str(self.cfg.path), "voices": list(self.speakers),
                "chunk_frames": self.chunk, "context_frames": self.runner.context,
                "stream_codes": self.stream, "past_codes": self.past, "future_codes": self.future,
                "device": str(self.runner.device)}
