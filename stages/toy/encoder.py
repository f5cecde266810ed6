"""``encoder``: the thinker's transformer used as a text encoder (stage 0 of text-to-image).

Image pipelines condition their diffusion stage on a text encoding.  Here
that encoding is the thinker's own: the same embedding and causal decoder
(same options, same seeded dummy weights), run once over the prompt, every
hidden state kept.  A leading EOS token stands in for BOS, so the empty
string -- the usual unconditional prompt of classifier-free guidance --
encodes too.  The prompt may be a dict carrying image options for the next
stage; the encoder reads only its ``text``.
"""

from __future__ import annotations

from typing import Any

import torch

from stages.base import ReqState, StepResult
from stages.limits import check_context
from stages.schema import PositiveInt
from stages.toy.models import EOS, Thinker

__all__ = ["ThinkerEncoder"]


class ThinkerEncoder(Thinker):
    """Prompt -> ``{"embedding": float32[1 + prompt bytes, d_model]}`` in one step.

    Payload: a string (may be empty) or ``{"text": str, ...}``.  A prompt longer
    than the context (``max_model_len``, with the leading EOS) is refused, never cut.
    """

    kind = "encoder"

    def __init__(self, d_model: PositiveInt = 128, layers: PositiveInt = 2, heads: PositiveInt = 4,
                 max_model_len: PositiveInt = 32768, device: str = "cpu", seed: int = 0) -> None:
        # The thinker's constructor draws the weights; its KV cache is left unused (one slot).
        super().__init__(d_model, layers, heads, max_model_len, max_new_tokens=1, min_new_tokens=0,
                         slots=1, device=device, seed=seed)
        self.d_model = d_model

    def admit(self, req: ReqState) -> None:
        p = req.payload
        text = p.get("text") if isinstance(p, dict) else p
        if not isinstance(text, str):
            raise ValueError("encoder payload must be a string (may be empty) or {'text': str}")
        ids = [EOS, *text.encode()]
        check_context(self.max_model_len, len(ids), 0)  # refused, never cut: the whole prompt is encoded
        req.model = {"ids": ids}

    def runnable(self, req: ReqState) -> bool:
        return True

    @torch.inference_mode()
    def step(self, reqs: list[ReqState]) -> list[StepResult]:
        results = []
        for r in reqs:  # one short forward each: prompts differ in length
            ids = torch.tensor(r.model["ids"], device=self.device)
            h = self.dec.encode(self.emb(ids)).float().cpu().numpy()
            results.append(StepResult({"embedding": h}, True, None))
        return results

    def release(self, req: ReqState) -> None:
        pass

    def warmup(self) -> None:
        req = ReqState("__warmup__", "warm up")
        self.admit(req)
        self.step([req])

    def info(self) -> dict[str, Any]:
        return {"kind": self.kind, "d_model": self.d_model, "device": str(self.device),
                "max_model_len": self.max_model_len}
