"""How each built-in kind's outputs become the next stage's input (``StageSpec.next_input``).

These run in the orchestrator process, on the routing path, so they import
neither torch nor trio and only reshape what the workers sent: numpy arrays
are joined, dicts are built, nothing is computed.  A function that takes a
``companions`` keyword conditions on companion requests (classifier-free
guidance): the registry passes it ``companions={id: [data values]}`` when the
request has companions, and refuses companions for a kind whose function
does not declare the keyword.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

__all__ = ["IMAGE_KEYS", "codes_input", "encoding_input", "kv_handoff_input", "last_output",
           "placeholder_input", "tokens_input"]

#: The image parameters a text-to-image prompt carries to the diffusion stage (stage 0 ignores them).
IMAGE_KEYS = ("width", "height", "guidance_scale", "steps", "seed")


def last_output(prompt: Any, outputs: list[Any]) -> Any:
    """Default ``next_input``: the next stage gets this stage's last output."""
    return outputs[-1] if outputs else None


def placeholder_input(stage_id: int, prompt: Any) -> Any:
    """Default ``prewarm_input``: a placeholder, as the real input streams from the previous stage."""
    return {"prewarm": stage_id, "prompt_chars": len(str(prompt))}


def tokens_input(prompt: Any, outputs: list[Any]) -> Any:
    """thinker -> next stage: every generated token, in order (None: an empty input segment); with the
    hidden state each was sampled from, one row per token, when the stage emits them (``"hidden"``)."""
    done = [o for o in outputs if o is not None]
    if not done:
        return None
    out = {"tokens": np.concatenate([np.asarray(o["tokens"]).reshape(-1) for o in done])}
    if all("hidden" in o for o in done):
        out["hidden"] = np.concatenate([np.asarray(o["hidden"]) for o in done], axis=0)
    return out


def codes_input(prompt: Any, outputs: list[Any]) -> Any:
    """talker -> next stage: every code frame, in order (None: an empty input segment)."""
    codes = [np.asarray(o["codes"]) for o in outputs if o is not None]
    return {"codes": np.concatenate(codes, axis=0)} if codes else None


def kv_handoff_input(prompt: Any, outputs: list[Any]) -> Any:
    """thinker prefill -> thinker decode: only a receipt.

    The KV cache itself went worker to worker, to the decode replica the
    pool reserved for the request; the decode worker continues from it.
    """
    return {"kv_handoff": outputs[-1] if outputs else None}


def encoding_input(prompt: Any, outputs: list[Any], *,
                   companions: Mapping[str, list[Any]] | None = None) -> Any:
    """encoder -> diffusion: the prompt's encoding, the negative prompt's for guidance, the image options.

    ``companions`` holds the encoding of the unconditional (negative) prompt:
    with one, the diffusion stage runs classifier-free guidance; without,
    it denoises on the prompt alone.  The image options (:data:`IMAGE_KEYS`)
    ride along in the stage-0 prompt, which the encoder ignores.
    """
    if not outputs or not isinstance(outputs[-1], dict) or "embedding" not in outputs[-1]:
        raise ValueError("the encoder's output has no 'embedding'")
    payload: dict[str, Any] = {"cond": outputs[-1]["embedding"]}
    if isinstance(prompt, dict):
        payload.update({k: prompt[k] for k in IMAGE_KEYS if k in prompt})
    if companions:
        if len(companions) != 1:
            raise ValueError(f"guidance takes one companion (the negative prompt), got {len(companions)}: "
                             f"{', '.join(map(repr, companions))}")
        [(cid, outs)] = companions.items()
        if not outs or not isinstance(outs[-1], dict) or "embedding" not in outs[-1]:
            raise ValueError(f"companion {cid!r} has no encoding")
        payload["uncond"] = outs[-1]["embedding"]
        payload["companion"] = cid
    return payload
