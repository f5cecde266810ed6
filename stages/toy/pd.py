"""Prefill/decode disaggregation: the thinker split over two stages.

The ``prefill`` role runs a request's prompt through the thinker once,
filling its KV cache, and hands the cache -- every layer's keys and
values, as numpy arrays that travel as zero-copy frames -- with the last
hidden state straight to the decode replica the orchestrator's pool chose
for the request (the async-chunk data plane, :mod:`stages.connector`).  It
reports only a receipt to the orchestrator.  The ``decode`` role installs
that cache in a slot of its own and generates from it exactly as the
unsplit thinker would: the first token is sampled from the handed-over
hidden state, the rest token by token.  Both roles take the thinker's
options and are built with one seed (same weights), so the split changes
nothing but where the work runs.
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import torch

from stages.base import ReqState, StepResult
from stages.toy.models import Thinker

__all__ = ["DecodeThinker", "PrefillThinker"]

_KV_KEYS = ("k", "v", "hidden", "prompt_ids", "max_new")


class PrefillThinker(Thinker):
    """Role ``prefill``: prompt -> KV cache, sent to the request's decode replica; one step."""

    def admit(self, req: ReqState) -> None:
        if req.downstream < 0:
            raise ValueError("a prefill replica hands each KV cache to a decode replica, and none was "
                             "named: put a stage with role 'decode' right after this one")
        super().admit(req)

    def runnable(self, req: ReqState) -> bool:
        return True

    @torch.inference_mode()
    def step(self, reqs: list[ReqState]) -> list[StepResult]:
        results = []
        for r in reqs:
            kv = self._handoff(r)
            receipt = {"prefilled": len(kv["prompt_ids"]), "kv_bytes": kv["k"].nbytes + kv["v"].nbytes}
            results.append(StepResult(receipt, True, kv))
        return results

    def _handoff(self, req: ReqState) -> dict[str, Any]:
        hidden = self._prefill(req)
        m = req.model
        slot, n = m["slot"], m["pos"]
        return {"k": self.dec.k_cache[:, slot, :, :n].contiguous().cpu().numpy(),
                "v": self.dec.v_cache[:, slot, :, :n].contiguous().cpu().numpy(),
                "hidden": hidden.float().cpu().numpy(), "prompt_ids": np.asarray(m["prompt"], np.int32),
                "max_new": m["max_new"]}

    def warmup(self) -> None:
        req = ReqState("__warmup__", "warm up")
        Thinker.admit(self, req)
        with torch.inference_mode():
            self._handoff(req)
        self.release(req)


class DecodeThinker(Thinker):
    """Role ``decode``: waits for its request's KV cache from the prefill stage, then generates."""

    def admit(self, req: ReqState) -> None:
        if not req.upstream:
            raise ValueError("a decode replica takes KV caches from a prefill stage: put a stage with "
                             "role 'prefill' right before this one")
        req.input_done = False
        req.model = {"slot": None, "pos": None, "kv": None}  # the rest comes with the KV cache

    def feed(self, req: ReqState, data: Any, end: bool) -> None:
        """The KV cache arrived (one chunk): set the request up for its prompt, as the unsplit
        thinker's admission does (limits, stop conditions, sampler).  A malformed cache is
        refused (ValueError: that request fails)."""
        if data is not None:
            kv = self._checked(data)
            self._start(req, [int(t) for t in kv["prompt_ids"]], int(kv["max_new"]))
            req.model["kv"] = kv
        if end:
            req.input_done = True

    def runnable(self, req: ReqState) -> bool:
        return req.model["pos"] is not None or req.model["kv"] is not None

    def _checked(self, kv: Any) -> dict[str, Any]:
        if not isinstance(kv, dict) or any(k not in kv for k in _KV_KEYS):
            raise ValueError(f"a KV handoff needs {', '.join(_KV_KEYS)}")
        n = len(kv["prompt_ids"])
        c = self.dec.k_cache
        want = (c.shape[0], c.shape[2], n, c.shape[4])
        for key in ("k", "v"):
            if tuple(np.shape(kv[key])) != want:
                raise ValueError(f"KV handoff: {key} has shape {np.shape(kv[key])}, this thinker needs "
                                 f"{want} (prefill and decode must have the same model options)")
        if not 1 <= n < self.dec.max_len:
            raise ValueError(f"KV handoff: a prompt of {n} tokens is out of range")
        return kv

    def _prefill(self, req: ReqState) -> torch.Tensor:
        kv = req.model["kv"]
        if kv is None:  # warm-up: no prefill stage behind it
            return super()._prefill(req)
        req.model["kv"] = None
        slot, n = self._slot(req), len(kv["prompt_ids"])
        self.dec.reserve(n)
        with warnings.catch_warnings():  # the arrays view read-only ZMQ frames; copied into the cache
            warnings.simplefilter("ignore", UserWarning)
            self.dec.k_cache[:, slot, :, :n] = torch.as_tensor(kv["k"]).to(self.device)
            self.dec.v_cache[:, slot, :, :n] = torch.as_tensor(kv["v"]).to(self.device)
            hidden = torch.as_tensor(kv["hidden"]).to(self.device)
        req.model["pos"] = n
        return hidden

    def warmup(self) -> None:
        """The unsplit thinker's warm-up (a local prefill, then decode steps): same work, same sampling."""
        req = ReqState("__warmup__", "warm up")
        Thinker.admit(self, req)
        req.model["kv"] = None  # no prefill stage behind it: _prefill runs locally
        for _ in range(3):
            if any(r.finished for r in self.step([req])):
                break
        self.release(req)
