"""Building blocks of the torch stage models: a KV-cached decoder, a conv upsampler, slots.

:class:`TinyDecoder` is a pre-norm causal transformer whose KV cache holds a
fixed number of *slots* (one per active request), so one batched step can
advance requests of different lengths.  :class:`SlotModel` is the shared
bookkeeping of slot-based stage models.  :class:`Upsampler` turns speech
codes into a waveform with transposed convolutions.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from stages.base import ReqState, StageModel

__all__ = ["SlotModel", "TinyDecoder", "Upsampler"]


class TinyDecoder(nn.Module):
    """Pre-norm causal transformer with a slot-based KV cache.

    The cache holds ``slots`` sequences of up to ``max_len`` positions (the
    context); a request owns one slot for its life.  The cache starts short and
    grows as longer sequences come (:meth:`reserve`), so a long context costs
    memory only when it is used.  :meth:`step` advances a batch of slots by one
    position each (different lengths are masked).  ``drawn_positions``: how many
    rows of the position table come from the global seeded stream, the rest
    from one of their own -- a model that grows its context keeps every weight
    it had (and so its answers).
    """

    def __init__(self, d_model: int, layers: int, heads: int, max_len: int, slots: int,
                 drawn_positions: int | None = None) -> None:
        super().__init__()
        if d_model % heads:
            raise ValueError(f"d_model ({d_model}) must be divisible by heads ({heads})")
        self.h, self.dh, self.max_len = heads, d_model // heads, max_len
        drawn = max_len if drawn_positions is None else min(drawn_positions, max_len)
        self.pos = nn.Embedding(drawn, d_model)
        self.ln1 = nn.ModuleList(nn.LayerNorm(d_model) for _ in range(layers))
        self.qkv = nn.ModuleList(nn.Linear(d_model, 3 * d_model) for _ in range(layers))
        self.proj = nn.ModuleList(nn.Linear(d_model, d_model) for _ in range(layers))
        self.ln2 = nn.ModuleList(nn.LayerNorm(d_model) for _ in range(layers))
        self.mlp = nn.ModuleList(nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(),
                                               nn.Linear(4 * d_model, d_model)) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d_model)
        if drawn < max_len:  # the other positions from a stream of their own: the weights above stay
            rest = torch.randn(max_len - drawn, d_model,
                               generator=torch.Generator().manual_seed(int(torch.initial_seed()) + drawn))
            self.pos = nn.Embedding.from_pretrained(torch.cat([self.pos.weight.detach(), rest]), freeze=False)
        self.cache_shape = (layers, slots, heads, self.dh)
        cap = min(max_len, self.FIRST_CACHE)
        self.register_buffer("k_cache", torch.zeros(*self.cache_shape[:3], cap, self.dh), persistent=False)
        self.register_buffer("v_cache", torch.zeros(*self.cache_shape[:3], cap, self.dh), persistent=False)

    #: positions the KV cache holds at first; it doubles (up to ``max_len``) when a longer sequence comes
    FIRST_CACHE = 256

    def reserve(self, n: int) -> None:
        """Make the cache hold ``n`` positions per slot (grown by doubling; a long context costs
        memory only once a request is that long)."""
        if n > self.max_len:
            raise ValueError(f"{n} positions do not fit a context of {self.max_len}")
        cap = self.k_cache.shape[3]
        if n <= cap:
            return
        while cap < n:
            cap = min(self.max_len, cap * 2)
        for name in ("k_cache", "v_cache"):
            old = getattr(self, name)
            grown = old.new_zeros(*old.shape[:3], cap, old.shape[4])
            grown[:, :, :, :old.shape[3]] = old
            setattr(self, name, grown)

    def step(self, x: torch.Tensor, slots: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """``x`` [B, d] at positions ``pos`` [B] of ``slots`` [B] -> hidden [B, d]."""
        B = x.shape[0]
        x = x + self.pos(pos)
        L = int(pos.max()) + 1
        self.reserve(L)
        mask = (torch.arange(L, device=x.device)[None, :] <= pos[:, None])[:, None, None, :]
        for i in range(len(self.qkv)):
            q, k, v = self.qkv[i](self.ln1[i](x)).view(B, 3, self.h, self.dh).unbind(1)
            self.k_cache[i, slots, :, pos] = k
            self.v_cache[i, slots, :, pos] = v
            K = self.k_cache[i, slots, :, :L]
            V = self.v_cache[i, slots, :, :L]
            a = F.scaled_dot_product_attention(q[:, :, None], K, V, attn_mask=mask)
            x = x + self.proj[i](a.reshape(B, -1))
            x = x + self.mlp[i](self.ln2[i](x))
        return self.ln_f(x)

    def prefill(self, x: torch.Tensor, slot: int) -> torch.Tensor:
        """Fill one slot with a whole prompt ``x`` [T, d]; return the last hidden state [d]."""
        return self.ln_f(self._causal(x, slot)[-1])

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """Every hidden state [T, d] of a whole sequence ``x`` [T, d], the cache untouched (an encoder)."""
        return self.ln_f(self._causal(x, None))

    def _causal(self, x: torch.Tensor, slot: int | None) -> torch.Tensor:
        T = x.shape[0]
        x = x + self.pos(torch.arange(T, device=x.device))
        if slot is not None:
            self.reserve(T)
        for i in range(len(self.qkv)):
            q, k, v = self.qkv[i](self.ln1[i](x)).view(T, 3, self.h, self.dh).permute(1, 2, 0, 3)
            if slot is not None:
                self.k_cache[i, slot, :, :T] = k
                self.v_cache[i, slot, :, :T] = v
            a = F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True)[0]
            x = x + self.proj[i](a.permute(1, 0, 2).reshape(T, -1))
            x = x + self.mlp[i](self.ln2[i](x))
        return x

    def extend(self, x: torch.Tensor, slot: int, start: int) -> None:
        """Append ``x`` [T, d] to one slot's cache at positions ``start .. start+T-1``.

        The new positions attend to everything the slot holds before them
        (the conversation so far) and causally to each other: the cached
        context is reused, not recomputed.
        """
        T = x.shape[0]
        self.reserve(start + T)
        pos = torch.arange(start, start + T, device=x.device)
        x = x + self.pos(pos)
        mask = torch.arange(start + T, device=x.device)[None, :] <= pos[:, None]  # [T, start+T]
        for i in range(len(self.qkv)):
            q, k, v = self.qkv[i](self.ln1[i](x)).view(T, 3, self.h, self.dh).permute(1, 2, 0, 3)
            self.k_cache[i, slot, :, start:start + T] = k
            self.v_cache[i, slot, :, start:start + T] = v
            K = self.k_cache[i, slot, :, :start + T]
            V = self.v_cache[i, slot, :, :start + T]
            a = F.scaled_dot_product_attention(q[None], K[None], V[None], attn_mask=mask)[0]
            x = x + self.proj[i](a.permute(1, 0, 2).reshape(T, -1))
            x = x + self.mlp[i](self.ln2[i](x))


class SlotModel(StageModel):
    """Shared slot bookkeeping for the torch models."""

    def __init__(self, slots: int, device: str, seed: int) -> None:
        self.device = torch.device(device)
        self.free = list(range(slots))[::-1]
        self.gen = torch.Generator(device="cpu").manual_seed(seed)

    def _slot(self, req: ReqState) -> int:
        """The request's cache slot, taken at its first step (the worker admits <= slots)."""
        if req.model["slot"] is None:
            if not self.free:
                raise RuntimeError("no free cache slot: more active requests than slots")
            req.model["slot"] = self.free.pop()
        return req.model["slot"]

    def _warm(self, payload: Any) -> None:
        """Run one throwaway request through a few steps (first torch calls are slow)."""
        req = ReqState("__warmup__", payload)
        self.admit(req)
        for _ in range(3):
            if not self.runnable(req) or any(r.finished for r in self.step([req])):
                break
        self.release(req)

    def release(self, req: ReqState) -> None:
        if req.model is not None and req.model.get("slot") is not None:
            self.free.append(req.model["slot"])
            req.model["slot"] = None


class Upsampler(nn.Module):
    def __init__(self, codebooks: int, codebook_size: int, dim: int, factors: list[int]) -> None:
        super().__init__()
        self.emb = nn.Embedding(codebooks * codebook_size, dim)
        self.offsets = nn.Parameter(torch.arange(codebooks) * codebook_size, requires_grad=False)
        self.pre = nn.Conv1d(dim, dim, 3, padding=1)
        ups, ch = [], dim
        for f in factors:
            nxt = max(8, ch // 2)
            ups += [nn.ConvTranspose1d(ch, nxt, 2 * f, stride=f, padding=f // 2 + f % 2,
                                       output_padding=f % 2), nn.GELU()]
            ch = nxt
        self.ups = nn.Sequential(*ups)
        self.post = nn.Conv1d(ch, 1, 7, padding=3)

    def forward(self, codes: torch.Tensor, cond: torch.Tensor | None = None) -> torch.Tensor:
        """``codes`` [B, T, C] (and a conditioning vector [B, dim] per sequence) -> [B, T * hop]."""
        x = self.emb(codes.long() + self.offsets).sum(2)
        if cond is not None:
            x = x + cond[:, None, :]
        x = x.transpose(1, 2)
        x = self.ups(F.gelu(self.pre(x)))
        return torch.tanh(self.post(x))[:, 0]
