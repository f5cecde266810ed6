"""The worker's model stepping alone: the baseline of ``python -m bench.perf.overhead``.

:class:`AloneModel` builds a checkpoint's stage model as the worker builds it
(the ``hf-causal-lm`` kind, the worker's seed and batch size, one torch
thread as the worker has) and drives it by the worker's loop reduced to the
model: admit every request of a wave (tokenizing it, as the worker does),
step the batch until each finished, release -- no orchestrator, no socket,
no HTTP.

``python -m bench.perf.alone CHECKPOINT DEVICE`` runs it in a process of its
own, started in a session of its own as the launcher starts a worker (so
the machine's scheduler treats it as it treats a worker: with autogroups,
CPU is shared between sessions, not processes).  It reads one wave per
line on stdin (``{"texts": [...], "tokens": N}``) and answers one line per
wave: per request its TTFT and text, the gaps between its text pieces, the
tokens generated, the wall time and the model steps so far.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

__all__ = ["AloneModel", "main"]


class AloneModel:
    """The checkpoint's stage model and the worker's loop reduced to it (see the module's docstring)."""

    def __init__(self, checkpoint: str, device: str) -> None:
        import torch

        from stages.config import checkpoint_config
        from stages.registry import build_model, spec_for
        from stages.sampling_params import check_params

        torch.set_num_threads(1)  # as the worker (its stage's threads: 1)
        cfg = checkpoint_config(checkpoint, device=device)
        st = cfg.stages[0]
        self.model = build_model(st.kind, st.model, device=device, seed=cfg.model_seed(0), slots=st.max_batch)
        self.model.warmup()
        spec = spec_for(st.kind)
        self.check = lambda sampling: check_params(spec.kind, spec.sampling, sampling)  # as the worker does
        self.steps = 0

    def wave(self, texts: list[str], tokens: int) -> dict[str, Any]:
        """Every request of ``texts`` at once, greedy, exactly ``tokens`` tokens each."""
        from stages.base import ReqState

        out: dict[str, Any] = {"ttft": [], "gaps": [], "texts": [""] * len(texts), "tokens": 0}
        sampling = self.check({"temperature": 0.0, "max_tokens": tokens, "min_tokens": tokens})
        t0 = time.perf_counter()
        reqs = []
        for i, text in enumerate(texts):
            req = ReqState(f"alone-{i}", text, sampling=dict(sampling))
            self.model.admit(req)
            reqs.append(req)
        last: list[float | None] = [None] * len(texts)
        active = list(range(len(texts)))
        while active:
            results = self.model.step([reqs[i] for i in active])
            self.steps += 1
            now = time.perf_counter()
            for i, res in zip(active, results, strict=True):
                data = res.data if isinstance(res.data, dict) else {}
                out["tokens"] += len(data.get("tokens", ()))
                if data.get("text"):
                    prev = last[i]
                    if prev is None:
                        out["ttft"].append(now - t0)
                    else:
                        out["gaps"].append(now - prev)
                    last[i] = now
                    out["texts"][i] += data["text"]
                if res.finished:
                    self.model.release(reqs[i])
            active = [i for i, res in zip(active, results, strict=True) if not res.finished]
        out["wall"] = time.perf_counter() - t0
        out["steps"] = self.steps
        return out


def main(argv: list[str] | None = None) -> int:
    checkpoint, device = argv if argv is not None else sys.argv[1:]
    alone = AloneModel(checkpoint, device)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        ask = json.loads(line)
        print(json.dumps(alone.wave(ask["texts"], ask["tokens"])), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
