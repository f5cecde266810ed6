"""``image-encoder`` and ``audio-encoder``: images and sounds to feature rows for the thinker.

Each is a small torch model with seeded dummy weights (nothing downloaded),
run as a worker stage in front of the thinker: a vision tower and an audio
tower in vLLM-Omni's sense, in their own processes so their compute batches
and scales apart from the thinker's decoding.  The payload and what an
encoder hands on are :mod:`stages.media`'s.

- ``image-encoder``: the image resized to ``image_size`` square, cut into
  ``patch`` x ``patch`` patches, each patch's pixels projected to ``dim``,
  plus a position embedding, through an MLP block: ``(image_size/patch)**2``
  rows per image.
- ``audio-encoder``: the clip resampled to ``sample_rate``, framed (``frame``
  samples every ``hop``), a Hann-windowed log-magnitude spectrum per frame,
  pooled to at most ``max_frames`` rows, projected to ``dim`` through an MLP.

Both emit one output per request, in one step: ``{"features":
float32[rows, dim], "encoded": [...]}`` -- the rows it was given first.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from stages.base import ReqState, StageModel, StepResult
from stages.media import FEATURE_DIM, features_of, media_of
from stages.schema import PositiveInt

__all__ = ["AudioEncoder", "ImageEncoder"]


class _Encoder(StageModel):
    """What both encoders share: the payload's checks, the hand-on of earlier features, the one step."""

    medium = ""
    dim = 0

    def _setup(self, dim: int, device: str, seed: int, salt: int) -> None:
        self.dim = dim
        self.device = torch.device(device)
        torch.manual_seed(seed + salt)

    def _check(self, item: Any) -> Any:
        raise NotImplementedError

    def _encode(self, item: Any) -> torch.Tensor:
        raise NotImplementedError

    def admit(self, req: ReqState) -> None:
        p = req.payload
        if not isinstance(p, str | dict):
            raise ValueError(f"{self.kind} payload must be a prompt string or a dict with "
                             f"'{self.medium}s'")
        prior = features_of(p)
        if prior is not None and (prior.ndim != 2 or prior.shape[1] != self.dim):
            raise ValueError(f"{self.kind}: features of shape {prior.shape} given, "
                             f"rows of {self.dim} expected")
        req.model = {"items": [self._check(x) for x in media_of(p, self.medium)], "prior": prior,
                     "encoded": list(p.get("encoded", ())) if isinstance(p, dict) else []}

    @torch.inference_mode()
    def step(self, reqs: list[ReqState]) -> list[StepResult]:
        results = []
        for r in reqs:  # one short forward per item: sizes differ
            m = r.model
            rows = [m["prior"]] if m["prior"] is not None else []
            rows += [self._encode(x).float().cpu().numpy() for x in m["items"]]
            feats = np.concatenate(rows, axis=0) if rows else np.zeros((0, self.dim), np.float32)
            encoded = sorted({*m["encoded"], self.medium})
            results.append(StepResult({"features": feats.astype(np.float32), "encoded": encoded}, True, None))
        return results

    def info(self) -> dict[str, Any]:
        return {"kind": self.kind, "dim": self.dim, "device": str(self.device)}


class ImageEncoder(_Encoder):
    """Images -> ``(image_size // patch) ** 2`` feature rows each."""

    kind = "image-encoder"
    medium = "image"

    def __init__(self, image_size: PositiveInt = 32, patch: PositiveInt = 8, dim: PositiveInt = FEATURE_DIM,
                 device: str = "cpu", seed: int = 0) -> None:
        if image_size % patch:
            raise ValueError(f"image-encoder: image_size {image_size} is not a multiple of patch {patch}")
        self._setup(dim, device, seed, 11)
        self.size, self.patch = image_size, patch
        n = (image_size // patch) ** 2
        self.proj = nn.Linear(3 * patch * patch, dim).to(self.device)
        self.pos = (torch.randn(n, dim) * 0.02).to(self.device)
        self.mlp = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, dim), nn.GELU(),
                                 nn.Linear(dim, dim)).to(self.device).eval()

    def _check(self, item: Any) -> np.ndarray:
        a = np.asarray(item)
        if a.ndim != 3 or a.shape[2] != 3 or a.dtype != np.uint8 or not a.size:
            raise ValueError("image-encoder: an image is uint8[height, width, 3], "
                             f"got {a.dtype}{list(a.shape)}")
        return a.copy()  # arrays from the wire are read-only views of its frames

    def _encode(self, item: np.ndarray) -> torch.Tensor:
        x = torch.from_numpy(np.ascontiguousarray(item)).to(self.device)
        x = x.permute(2, 0, 1)[None].float() / 255.0
        x = F.interpolate(x, size=(self.size, self.size), mode="bilinear", align_corners=False,
                          antialias=True)
        patches = F.unfold(x * 2.0 - 1.0, self.patch, stride=self.patch)[0].T  # [n, 3 * patch * patch]
        h = self.proj(patches) + self.pos
        return h + self.mlp(h)

    def warmup(self) -> None:
        req = ReqState("__warmup__", {"images": [np.zeros((self.size, self.size, 3), np.uint8)]})
        self.admit(req)
        self.step([req])


class AudioEncoder(_Encoder):
    """Sounds -> up to ``max_frames`` feature rows each (fewer for a clip shorter than that many frames)."""

    kind = "audio-encoder"
    medium = "audio"

    def __init__(self, sample_rate: PositiveInt = 16000, frame: PositiveInt = 400, hop: PositiveInt = 160,
                 max_frames: PositiveInt = 16, dim: PositiveInt = FEATURE_DIM, device: str = "cpu",
                 seed: int = 0) -> None:
        self._setup(dim, device, seed, 13)
        self.rate, self.frame, self.hop, self.max_frames = sample_rate, frame, hop, max_frames
        bins = frame // 2 + 1
        self.window = torch.hann_window(frame).to(self.device)
        self.proj = nn.Linear(bins, dim).to(self.device)
        self.mlp = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, dim), nn.GELU(),
                                 nn.Linear(dim, dim)).to(self.device).eval()

    def _check(self, item: Any) -> tuple[np.ndarray, int]:
        if not isinstance(item, dict) or item.get("pcm") is None:
            raise ValueError("audio-encoder: a clip is {'pcm': float32[samples], 'sample_rate': int}")
        pcm = np.array(item["pcm"], dtype=np.float32).reshape(-1)  # a copy: wire arrays are read-only
        rate = item.get("sample_rate", self.rate)
        if not isinstance(rate, int | np.integer) or rate < 1 or not len(pcm):
            raise ValueError("audio-encoder: a clip needs samples and a positive integer sample_rate")
        return pcm, int(rate)

    def _encode(self, item: tuple[np.ndarray, int]) -> torch.Tensor:
        pcm, rate = item
        if rate != self.rate:  # linear resampling: enough for dummy features
            n = max(1, round(len(pcm) * self.rate / rate))
            pcm = np.interp(np.linspace(0, len(pcm) - 1, n), np.arange(len(pcm)), pcm).astype(np.float32)
        x = torch.from_numpy(np.ascontiguousarray(pcm)).to(self.device)
        if len(x) < self.frame:
            x = F.pad(x, (0, self.frame - len(x)))
        frames = x.unfold(0, self.frame, self.hop) * self.window  # [t, frame]
        spec = torch.log1p(torch.fft.rfft(frames).abs())  # [t, bins]
        t = min(self.max_frames, len(spec))
        pooled = F.adaptive_avg_pool1d(spec.T[None], t)[0].T  # [t, bins]
        h = self.proj(pooled)
        return h + self.mlp(h)

    def warmup(self) -> None:
        req = ReqState("__warmup__", {"audios": [{"pcm": np.zeros(self.rate // 10, np.float32),
                                                  "sample_rate": self.rate}]})
        self.admit(req)
        self.step([req])
