"""``diffusion``: a whole-request, fixed-step denoising stage (seeded dummy weights).

A request is a text encoding (``cond``), optionally the encoding of a
negative prompt (``uncond``, from a companion request), and image options.
Its latent (``channels`` x height/8 x width/8, drawn from the request's
seed) is denoised for ``steps`` DDIM steps by a small DiT -- patch tokens,
adaLN conditioning on the timestep and the pooled prompt, cross-attention
to the prompt's tokens -- then a small VAE-like decoder turns it into RGB
and the worker encodes a PNG.

Classifier-free guidance, when ``uncond`` is there: both encodings go
through the DiT in the same forward pass and
``eps = eps_uncond + guidance_scale * (eps_cond - eps_uncond)``.  Without
``uncond`` the prompt alone conditions (no guidance).

Every step reports ``{"progress": {"step": i, "steps": n}}`` (a non-final
output: a client can draw a progress bar); the last one carries the PNG.
Requests of the same image size share one DiT forward pass per worker step,
each row at its own timestep, so concurrent requests batch whatever step
they are at.
"""

from __future__ import annotations

import io
import math
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from stages.base import ReqState, StageModel, StepResult
from stages.schema import NonNegativeFloat, PositiveInt

__all__ = ["DiT", "Diffusion", "VaeDecoder", "guided_eps"]

VAE_FACTOR = 8  # image pixels per latent pixel, each way
TRAIN_STEPS = 1000  # the noise schedule's length (timesteps are drawn from it)


def guided_eps(eps_cond: torch.Tensor, eps_uncond: torch.Tensor, scale: torch.Tensor | float) -> torch.Tensor:
    """Classifier-free guidance: move from the unconditional prediction towards the conditional one."""
    return eps_uncond + scale * (eps_cond - eps_uncond)


def _timestep_embedding(t: torch.Tensor, dim: int) -> torch.Tensor:
    half = dim // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, device=t.device) / half)
    args = t.float()[:, None] * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


def _pos_2d(h: int, w: int, dim: int, device: torch.device) -> torch.Tensor:
    """Fixed 2-D sin-cos position embeddings [h*w, dim]: any image size, nothing learned."""
    q = dim // 4
    freqs = torch.exp(-math.log(10000.0) * torch.arange(q, device=device) / q)
    ys, xs = torch.meshgrid(torch.arange(h, device=device), torch.arange(w, device=device), indexing="ij")
    ay, ax = ys.reshape(-1, 1).float() * freqs, xs.reshape(-1, 1).float() * freqs
    return torch.cat([torch.sin(ay), torch.cos(ay), torch.sin(ax), torch.cos(ax)], dim=-1)


class _Block(nn.Module):
    """adaLN self-attention, cross-attention to the prompt, adaLN MLP."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.h = heads
        self.norm1 = nn.LayerNorm(d, elementwise_affine=False)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.norm_x = nn.LayerNorm(d)
        self.q = nn.Linear(d, d)
        self.kv = nn.Linear(d, 2 * d)
        self.cproj = nn.Linear(d, d)
        self.norm2 = nn.LayerNorm(d, elementwise_affine=False)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.mod = nn.Linear(d, 6 * d)

    def _heads(self, x: torch.Tensor) -> torch.Tensor:  # [B, N, d] -> [B, h, N, d/h]
        B, N, d = x.shape
        return x.view(B, N, self.h, d // self.h).transpose(1, 2)

    def forward(self, x: Tensor, c: Tensor, ctx: Tensor, mask: Tensor) -> Tensor:
        B, N, d = x.shape
        sh1, sc1, g1, sh2, sc2, g2 = self.mod(F.silu(c))[:, None].chunk(6, dim=-1)
        q, k, v = self.qkv(self.norm1(x) * (1 + sc1) + sh1).chunk(3, dim=-1)
        a = F.scaled_dot_product_attention(self._heads(q), self._heads(k), self._heads(v))
        x = x + g1 * self.proj(a.transpose(1, 2).reshape(B, N, d))
        k, v = self.kv(ctx).chunk(2, dim=-1)
        q = self._heads(self.q(self.norm_x(x)))
        keep = mask[:, None, None, :]
        a = F.scaled_dot_product_attention(q, self._heads(k), self._heads(v), attn_mask=keep)
        x = x + self.cproj(a.transpose(1, 2).reshape(B, N, d))
        return x + g2 * self.mlp(self.norm2(x) * (1 + sc2) + sh2)


class DiT(nn.Module):
    """Latent [B, C, h, w], timestep [B], prompt tokens [B, L, cond_dim] (mask [B, L]) -> noise like z."""

    def __init__(self, channels: int, patch: int, d_model: int, layers: int, heads: int,
                 cond_dim: int) -> None:
        super().__init__()
        if d_model % heads or d_model % 4:
            raise ValueError(f"d_model ({d_model}) must be divisible by heads ({heads}) and by 4")
        self.c, self.p, self.d = channels, patch, d_model
        self.patch_in = nn.Linear(channels * patch * patch, d_model)
        self.t_mlp = nn.Sequential(nn.Linear(d_model, d_model), nn.SiLU(), nn.Linear(d_model, d_model))
        self.cond_in = nn.Linear(cond_dim, d_model)
        self.blocks = nn.ModuleList(_Block(d_model, heads) for _ in range(layers))
        self.norm_out = nn.LayerNorm(d_model, elementwise_affine=False)
        self.mod_out = nn.Linear(d_model, 2 * d_model)
        self.patch_out = nn.Linear(d_model, channels * patch * patch)

    def forward(self, z: Tensor, t: Tensor, ctx: Tensor, mask: Tensor) -> Tensor:
        B, C, H, W = z.shape
        p, h, w = self.p, H // self.p, W // self.p
        x = z.view(B, C, h, p, w, p).permute(0, 2, 4, 1, 3, 5).reshape(B, h * w, C * p * p)
        x = self.patch_in(x) + _pos_2d(h, w, self.d, z.device)
        ctx = self.cond_in(ctx)
        pooled = (ctx * mask[..., None]).sum(1) / mask.sum(1, keepdim=True).clamp(min=1)
        c = self.t_mlp(_timestep_embedding(t, self.d)) + pooled
        for blk in self.blocks:
            x = blk(x, c, ctx, mask)
        shift, scale = self.mod_out(F.silu(c))[:, None].chunk(2, dim=-1)
        x = self.patch_out(self.norm_out(x) * (1 + scale) + shift)
        return x.view(B, h, w, C, p, p).permute(0, 3, 1, 4, 2, 5).reshape(B, C, H, W)


class VaeDecoder(nn.Module):
    """Latent [B, C, h, w] -> RGB [B, 3, 8h, 8w] in [-1, 1]: three (upsample x2, conv) stages."""


    def __init__(self, channels: int, dim: int) -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.Conv2d(channels, dim, 3, padding=1)]
        for _ in range(3):
            layers += [nn.Upsample(scale_factor=2, mode="nearest"), nn.Conv2d(dim, dim, 3, padding=1),
                       nn.SiLU()]
        layers += [nn.Conv2d(dim, 3, 3, padding=1)]
        self.net = nn.Sequential(*layers)

    def forward(self, z: Tensor) -> Tensor:
        # Random weights shrink the signal to a flat grey: normalise each colour channel over the
        # image first, so the picture shows the latent's structure with full contrast.
        y = F.instance_norm(self.net(z))
        return torch.tanh(y)


def encode_png(rgb: np.ndarray) -> bytes:
    """uint8 [H, W, 3] -> PNG bytes (Pillow)."""
    from PIL import Image  # imported where the model runs: the orchestrator never needs it

    buf = io.BytesIO()
    Image.fromarray(rgb, "RGB").save(buf, format="PNG")
    return buf.getvalue()


class Diffusion(StageModel):
    """Text encoding (+ negative prompt's) -> PNG, ``steps`` denoising steps with progress outputs.

    Payload: ``{"cond": float32[L, cond_dim], "uncond": float32[L', cond_dim] (optional),
    "companion": str (who gave uncond), "width": int, "height": int, "steps": int,
    "guidance_scale": float, "seed": int}``.  Width and height are multiples of
    ``8 * patch`` up to ``max_size``.
    """

    kind = "diffusion"

    def __init__(self, channels: PositiveInt = 4, patch: PositiveInt = 2, d_model: PositiveInt = 64,
                 layers: PositiveInt = 2, heads: PositiveInt = 4, cond_dim: PositiveInt = 128,
                 vae_dim: PositiveInt = 32, default_size: PositiveInt = 64, default_steps: PositiveInt = 8,
                 max_steps: PositiveInt = 100, default_guidance: NonNegativeFloat = 4.0,
                 max_size: PositiveInt = 512, device: str = "cpu", seed: int = 0) -> None:
        if not 1 <= default_steps <= max_steps:
            raise ValueError(f"diffusion: need 1 <= default_steps <= max_steps, "
                             f"got {default_steps}, {max_steps}")
        self.device = torch.device(device)
        torch.manual_seed(seed + 3)
        self.channels, self.cond_dim, self.align = channels, cond_dim, VAE_FACTOR * patch
        self.default_size, self.default_steps, self.max_steps = default_size, default_steps, max_steps
        self.default_guidance, self.max_size = default_guidance, max_size
        self._check_side("default_size", default_size)
        self.dit = DiT(channels, patch, d_model, layers, heads, cond_dim).to(self.device).eval()
        self.vae = VaeDecoder(channels, vae_dim).to(self.device).eval()
        betas = torch.linspace(1e-4, 0.02, TRAIN_STEPS, dtype=torch.float64)
        self.alphas = torch.cumprod(1 - betas, 0).float()  # cumulative alpha per timestep (CPU)
        self.forwards = 0  # DiT forward passes so far
        self.max_rows = 0  # the most latents one forward pass denoised (batched requests, x2 with guidance)
        self.guided = 0  # requests finished with classifier-free guidance

    # ------------------------------------------------------------------ admission
    def _check_side(self, name: str, v: Any) -> int:
        if isinstance(v, bool) or not isinstance(v, int) or not self.align <= v <= self.max_size \
                or v % self.align:
            raise ValueError(f"{name} must be a multiple of {self.align} from {self.align} to "
                             f"{self.max_size}, got {v!r}")
        return v

    def _encoding(self, name: str, v: Any) -> torch.Tensor:
        arr = np.asarray(v) if v is not None else None
        if arr is None or arr.ndim != 2 or arr.shape[0] < 1 or arr.shape[1] != self.cond_dim \
                or arr.dtype.kind != "f":
            shape = None if arr is None else f"{arr.dtype}{list(arr.shape)}"
            raise ValueError(f"{name} must be a float array [tokens, {self.cond_dim}] (the encoder's "
                             f"d_model must equal the diffusion cond_dim), got {shape}")
        return torch.tensor(arr, dtype=torch.float32, device=self.device)

    def admit(self, req: ReqState) -> None:
        if req.upstream:
            raise ValueError("diffusion denoises whole requests, not streamed chunks: run its pipeline "
                             "in normal mode (no async-chunk)")
        p = req.payload
        if not isinstance(p, dict):
            raise ValueError("diffusion payload must be a dict with a 'cond' encoding")
        cond = self._encoding("cond", p.get("cond"))
        uncond = self._encoding("uncond", p["uncond"]) if p.get("uncond") is not None else None
        width = self._check_side("width", p.get("width", self.default_size))
        height = self._check_side("height", p.get("height", self.default_size))
        steps = p.get("steps", self.default_steps)
        if isinstance(steps, bool) or not isinstance(steps, int) or not 1 <= steps <= self.max_steps:
            raise ValueError(f"steps must be an integer from 1 to {self.max_steps}, got {steps!r}")
        g = p.get("guidance_scale", self.default_guidance)
        if isinstance(g, bool) or not isinstance(g, int | float) or not math.isfinite(g) or not 0 <= g <= 100:
            raise ValueError(f"guidance_scale must be a number from 0 to 100, got {g!r}")
        seed = p.get("seed", 0)
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
            raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
        gen = torch.Generator(device="cpu").manual_seed(seed)
        z = torch.randn(self.channels, height // VAE_FACTOR, width // VAE_FACTOR, generator=gen)
        ts = torch.linspace(TRAIN_STEPS - 1, 0, steps).round().long()
        req.model = {"z": z.to(self.device), "cond": cond, "uncond": uncond, "g": float(g), "ts": ts,
                     "i": 0, "size": (width, height), "companion": p.get("companion") if uncond is not None
                     else None}

    def runnable(self, req: ReqState) -> bool:
        return True

    # ------------------------------------------------------------------ stepping
    @torch.inference_mode()
    def step(self, reqs: list[ReqState]) -> list[StepResult]:
        groups: dict[tuple[int, int], list[int]] = {}
        for i, r in enumerate(reqs):
            groups.setdefault(tuple(r.model["z"].shape[1:]), []).append(i)
        done: list[int] = []
        for idx in groups.values():
            self._denoise([reqs[i] for i in idx])
            done += [i for i in idx if reqs[i].model["i"] == len(reqs[i].model["ts"])]
        pngs = self._decode({i: reqs[i] for i in done})
        results = []
        for i, r in enumerate(reqs):
            m = r.model
            progress = {"step": m["i"], "steps": len(m["ts"])}
            if i not in pngs:
                results.append(StepResult({"progress": progress}, False, None))
                continue
            width, height = m["size"]
            self.guided += m["uncond"] is not None
            results.append(StepResult({"progress": progress, "png": pngs[i], "width": width, "height": height,
                                       "steps": len(m["ts"]), "guidance_scale": m["g"],
                                       "guided_by": m["companion"]}, True, None))
        return results

    def _denoise(self, reqs: list[ReqState]) -> None:
        """One DDIM step for requests of one latent size: one DiT pass over every row they need."""
        rows: list[tuple[torch.Tensor, torch.Tensor, int]] = []  # (latent, prompt tokens, timestep)
        for r in reqs:
            m = r.model
            t = int(m["ts"][m["i"]])
            rows.append((m["z"], m["cond"], t))
            if m["uncond"] is not None:
                rows.append((m["z"], m["uncond"], t))
        L = max(c.shape[0] for _, c, _ in rows)
        ctx = torch.zeros(len(rows), L, self.cond_dim, device=self.device)
        mask = torch.zeros(len(rows), L, dtype=torch.bool, device=self.device)
        for j, (_, c, _) in enumerate(rows):
            ctx[j, : c.shape[0]] = c
            mask[j, : c.shape[0]] = True
        z = torch.stack([z for z, _, _ in rows])
        t = torch.tensor([t for _, _, t in rows], device=self.device)
        eps = self.dit(z, t, ctx, mask)
        self.forwards += 1
        self.max_rows = max(self.max_rows, len(rows))
        j = 0
        for r in reqs:
            m = r.model
            e = eps[j]
            if m["uncond"] is not None:
                e = guided_eps(e, eps[j + 1], m["g"])
            j += 2 if m["uncond"] is not None else 1
            m["z"] = self._ddim(m["z"], e, m["ts"], m["i"])
            m["i"] += 1

    def _ddim(self, z: torch.Tensor, eps: torch.Tensor, ts: torch.Tensor, i: int) -> torch.Tensor:
        """Deterministic DDIM update from timestep ``ts[i]`` to the next one (to x0 after the last)."""
        a = self.alphas[int(ts[i])].item()
        a_prev = self.alphas[int(ts[i + 1])].item() if i + 1 < len(ts) else 1.0
        x0 = ((z - math.sqrt(1 - a) * eps) / math.sqrt(a)).clamp(-4.0, 4.0)
        return math.sqrt(a_prev) * x0 + math.sqrt(1 - a_prev) * eps

    def _decode(self, done: dict[int, ReqState]) -> dict[int, bytes]:
        """Finished latents -> PNG bytes, one VAE pass per image size (keys: positions in the step)."""
        by_size: dict[tuple[int, int], list[int]] = {}
        for i, r in done.items():
            by_size.setdefault(tuple(r.model["z"].shape[1:]), []).append(i)
        pngs: dict[int, bytes] = {}
        for idx in by_size.values():
            rgb = self.vae(torch.stack([done[i].model["z"] for i in idx]))
            pixels = ((rgb + 1) * 127.5).round().clamp(0, 255).to(torch.uint8)
            pixels = pixels.permute(0, 2, 3, 1).cpu().numpy()
            for i, img in zip(idx, pixels, strict=True):
                pngs[i] = encode_png(np.ascontiguousarray(img))
        return pngs

    # ------------------------------------------------------------------ the rest of the interface
    def warmup(self) -> None:
        cond = np.zeros((2, self.cond_dim), np.float32)
        req = ReqState("__warmup__", {"cond": cond, "uncond": cond, "width": self.align, "height": self.align,
                                      "steps": 2})
        self.admit(req)
        while not self.step([req])[0].finished:
            pass
        self.guided = 0

    def info(self) -> dict[str, Any]:
        return {"kind": self.kind, "device": str(self.device), "cond_dim": self.cond_dim,
                "max_size": self.max_size, "forwards": self.forwards, "max_rows": self.max_rows,
                "guided": self.guided}
