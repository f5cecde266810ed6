"""Text-to-image requests: their options, and how they become a request with a CFG companion.

An image request is a prompt, an optional negative prompt and image
options.  It enters the pipeline (encoder -> diffusion) as one request
whose stage-0 prompt carries the options, plus -- when guidance is on -- a
*companion* request for the negative prompt: the orchestrator runs it on
stage 0 next to its parent, holds the parent's forward until both are
encoded, and hands both encodings to the diffusion stage, which then
computes ``eps_uncond + guidance_scale * (eps_cond - eps_uncond)``.  Guidance
is on whenever ``guidance_scale != 1`` (at 1 the formula is the conditional
prediction alone); the negative prompt defaults to the empty string, the
usual unconditional prompt.

Both ``trio-orch generate --pipeline text2image`` (:mod:`trio_orch.cli.text2image`)
and ``POST /v1/images/generations`` (:mod:`trio_orch.http.routes.images`,
through :func:`parse_image_request`) build requests here, so they check
options the same way (:class:`ImageOptionError` names the field; the HTTP
route answers a 400 naming it).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from trio_orch.openai.protocol import ImageGenerationRequest
from trio_orch.openai.validation import BadRequest

__all__ = ["ALIGN", "MAX_SIDE", "MAX_STEPS", "ImageOptionError", "ImageRequest", "parse_image_request",
           "parse_size"]

ALIGN = 16  # image sides are multiples of this (the VAE's 8 x the DiT's 2-pixel patches)
MAX_SIDE = 512  # the diffusion stage's default max_size
MAX_STEPS = 100  # the diffusion stage's default max_steps
_SIZE = re.compile(r"(\d{1,5})x(\d{1,5})")


class ImageOptionError(ValueError):
    """An image option out of range; ``field`` names it (the HTTP front answers 400 with it)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def parse_size(size: Any, field: str = "size") -> tuple[int, int]:
    """``"WIDTHxHEIGHT"`` -> (width, height), each a multiple of :data:`ALIGN` up to :data:`MAX_SIDE`."""
    m = _SIZE.fullmatch(size) if isinstance(size, str) else None
    if m is None:
        raise ImageOptionError(field, f"{field} must be 'WIDTHxHEIGHT', e.g. '256x256', got {size!r}")
    w, h = int(m[1]), int(m[2])
    if not (ALIGN <= w <= MAX_SIDE and ALIGN <= h <= MAX_SIDE and w % ALIGN == 0 and h % ALIGN == 0):
        raise ImageOptionError(field, f"{field}: width and height must be multiples of {ALIGN} from {ALIGN} "
                                      f"to {MAX_SIDE}, got {size!r}")
    return w, h


@dataclass(frozen=True)
class ImageRequest:
    """One image to make.  ``negative=None``: the empty negative prompt (when guidance is on)."""

    prompt: str
    negative: str | None = None
    width: int = 256
    height: int = 256
    steps: int = 8
    guidance_scale: float = 4.0
    seed: int = 0

    def checked(self) -> ImageRequest:
        """Self, if every option is in range; ImageOptionError naming the first that is not."""
        if not isinstance(self.prompt, str) or not self.prompt.strip():
            raise ImageOptionError("prompt", "prompt must be a non-empty string")
        if self.negative is not None and not isinstance(self.negative, str):
            raise ImageOptionError("negative_prompt", "negative_prompt must be a string")
        parse_size(f"{self.width}x{self.height}")
        s = self.steps
        if isinstance(s, bool) or not isinstance(s, int) or not 1 <= s <= MAX_STEPS:
            raise ImageOptionError("num_inference_steps",
                                   f"num_inference_steps must be an integer from 1 to {MAX_STEPS}, got {s!r}")
        g = self.guidance_scale
        if isinstance(g, bool) or not isinstance(g, int | float) or not math.isfinite(g) or not 0 <= g <= 100:
            raise ImageOptionError("guidance_scale",
                                   f"guidance_scale must be a number from 0 to 100, got {g!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed < 2**63:
            raise ImageOptionError("seed", f"seed must be a non-negative integer, got {self.seed!r}")
        return self

    @property
    def guided(self) -> bool:
        """Does this request run classifier-free guidance (with a companion)?"""
        return self.guidance_scale != 1

    def stage0_prompt(self) -> dict[str, Any]:
        """The parent's prompt: the text (encoded by stage 0) and the options (read by diffusion)."""
        return {"text": self.prompt, "width": self.width, "height": self.height, "steps": self.steps,
                "guidance_scale": float(self.guidance_scale), "seed": self.seed}

    def companions(self, request_id: str) -> dict[str, Any]:
        """``{id: prompt}`` of the negative-prompt companion when guided, else ``{}``."""
        if not self.guided:
            return {}
        return {f"{request_id}:negative": {"text": self.negative or ""}}


def parse_image_request(req: ImageGenerationRequest) -> ImageRequest:
    """The decoded body -> a range-checked :class:`ImageRequest` (BadRequest naming the field)."""
    try:
        width, height = parse_size(req.size)
        return ImageRequest(req.prompt, req.negative_prompt, width, height, req.num_inference_steps,
                            float(req.guidance_scale), req.seed).checked()
    except ImageOptionError as exc:
        raise BadRequest(str(exc), exc.field) from None
