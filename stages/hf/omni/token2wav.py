"""``omni-token2wav``: token2wav of a Qwen2.5-Omni checkpoint as a stage: codec codes in, a waveform out.

A request's codes (every code the talker made, :func:`stages.forwarding.codes_input`)
go through the DiT -- a flow-matching solve of the whole mel at once, from
noise drawn with the request's ``seed`` (default 0: ``generate()``'s noise
after ``torch.manual_seed(0)``), conditioned on the request's ``voice`` --
and then through BigVGAN, ``chunk_frames`` mel frames per step with enough
context on each side that the pieces join into exactly the whole waveform
(:func:`stages.hf.omni.compute.vocoder_context`).  Each output is
``{"pcm": float32[samples], "sample_rate": 24000}``; a request whose talker
said nothing ends with one empty piece.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from stages.base import ReqState, StageModel, StepResult
from stages.hf.omni.checkpoint import SAMPLE_RATE, read_omni_config, speakers
from stages.hf.omni.compute import Token2WavRunner
from stages.hf.omni.params import token2wav_params
from stages.hf.omni.parts import load_part
from stages.sampling_params import with_defaults
from stages.schema import PositiveInt

__all__ = ["OmniToken2Wav"]


@dataclass(slots=True)
class _Wave:
    """One request's state: its codes, then its mel and the next frame to vocode."""

    codes: np.ndarray
    voice: str
    seed: int
    mel: torch.Tensor | None = None
    at: int = 0


class OmniToken2Wav(StageModel):
    """token2wav of the checkpoint in directory ``checkpoint`` (see the module's docstring).

    Options: ``checkpoint``; ``chunk_frames``: mel frames vocoded per step and
    sent per output (100 a second of audio; smaller: the first audio sooner,
    more context recomputed); ``num_steps``: the DiT's ODE steps (generate()'s 10).
    """

    kind = "omni-token2wav"

    def __init__(self, checkpoint: str, chunk_frames: PositiveInt = 50, num_steps: PositiveInt = 10,
                 device: str = "cpu") -> None:
        self.cfg = read_omni_config(checkpoint)
        self.runner = Token2WavRunner(load_part(checkpoint, "token2wav", device=device), self.cfg)
        self.speakers = speakers(checkpoint)
        self.schema = token2wav_params(list(self.speakers))
        self.chunk = chunk_frames
        self.num_steps = num_steps

    def admit(self, req: ReqState) -> None:
        if req.upstream:
            raise ValueError("omni-token2wav takes the talker's whole answer (normal mode)")
        p = req.payload
        codes = p.get("codes") if isinstance(p, dict) else None
        if codes is None:
            raise ValueError("omni-token2wav: the payload is {'codes': int[n]} (the talker's codes)")
        arr = np.asarray(codes).reshape(-1)
        if len(arr) and (not np.issubdtype(arr.dtype, np.integer) or arr.min() < 0
                         or arr.max() >= self.cfg.codec_vocab):
            raise ValueError(f"omni-token2wav: codes must be integers below {self.cfg.codec_vocab}")
        sp = with_defaults(self.schema, req.sampling)
        req.model = _Wave(arr.astype(np.int64), sp["voice"], 0 if sp["seed"] is None else int(sp["seed"]))

    @torch.inference_mode()
    def step(self, reqs: list[ReqState]) -> list[StepResult]:
        return [self._step(r.model) for r in reqs]

    def _step(self, w: _Wave) -> StepResult:
        if not len(w.codes):
            return StepResult(self._pcm(np.zeros(0, np.float32)), True, None)
        if w.mel is None:
            spk = self.speakers[w.voice]
            w.mel = self.runner.mel(w.codes, spk["cond"], spk["ref_mel"], w.seed, num_steps=self.num_steps)
        total = w.mel.shape[-1]
        b = min(total, w.at + self.chunk)
        piece = self.runner.waveform_piece(w.mel, w.at, b)
        w.at = b
        return StepResult(self._pcm(piece), w.at >= total, None)

    @staticmethod
    def _pcm(samples: np.ndarray) -> dict[str, Any]:
        return {"pcm": np.ascontiguousarray(samples, dtype=np.float32), "sample_rate": SAMPLE_RATE}

    def release(self, req: ReqState) -> None:
        if isinstance(req.model, _Wave):
            req.model.mel = None

    def info(self) -> dict[str, Any]:
        return {"kind": self.kind, "checkpoint": str(self.cfg.path), "voices": list(self.speakers),
                "chunk_frames": self.chunk, "context_frames": self.runner.context,
                "device": str(self.runner.device)}
