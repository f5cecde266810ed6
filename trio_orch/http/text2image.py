"""Text-to-image requests: their options, how they become a request with a CFG companion, the CLI run.

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

Both ``trio-orch generate --pipeline text2image`` (:func:`generate_image`)
and ``POST /v1/images/generations`` (:mod:`trio_orch.http.openai_images`) build
requests here, so they check options the same way (:class:`ImageOptionError`
names the field).
"""

from __future__ import annotations

import argparse
import math
import re
import sys
import time
from dataclasses import dataclass
from typing import Any

from stages.registry import image_of
from trio_orch.types import OrchError

__all__ = ["ALIGN", "MAX_SIDE", "MAX_STEPS", "ImageOptionError", "ImageRequest", "add_arguments",
           "generate_image", "parse_size", "request_from_args"]

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


# ---------------------------------------------------------------------------- the CLI run
def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``trio-orch generate`` options for image pipelines."""
    g = parser.add_argument_group("image pipelines (--pipeline text2image)")
    g.add_argument("--negative", default=None, metavar="TEXT",
                   help="negative prompt: what guidance steers away from (default: the empty prompt)")
    g.add_argument("--size", default="256x256",
                   help="WIDTHxHEIGHT, multiples of 16 up to 512 (default 256x256)")
    g.add_argument("--steps", type=int, default=8, help="denoising steps (default 8)")
    g.add_argument("--guidance-scale", type=float, default=4.0,
                   help="classifier-free guidance scale (default 4; 1 turns guidance off)")


#: ``generate`` flags that concern text and speech stages: refused for an image pipeline
_NOT_FOR_IMAGES = ("max_tokens", "temperature", "top_p", "top_k", "stop", "voice", "stage_param")


def request_from_args(args: argparse.Namespace) -> ImageRequest:
    """The image request ``generate``'s arguments ask for (``--seed``: the initial latent's, default 0)."""
    for name in _NOT_FOR_IMAGES:
        if getattr(args, name, None):
            raise ValueError(f"--{name.replace('_', '-')} is for text and speech pipelines, not images")
    width, height = parse_size(args.size, "--size")
    seed = 0 if args.seed is None else args.seed
    return ImageRequest(args.text, args.negative, width, height, args.steps, args.guidance_scale,
                        seed).checked()


def _bar(step: int, steps: int, width: int = 24) -> str:
    filled = width * step // max(steps, 1)
    return f"[{'#' * filled}{'.' * (width - filled)}] {step}/{steps}"


async def generate_image(orch: Any, req: ImageRequest, out: str, *, request_id: str = "generate-1") -> int:
    """Run one image request through a started orchestrator; draw progress, write the PNG; exit code."""
    companions = req.companions(request_id)
    t0 = time.perf_counter()
    await orch.add_request(request_id, req.stage0_prompt(), companions=companions)
    tty = sys.stderr.isatty()
    while True:
        msg = await orch.next_output()
        if isinstance(msg, OrchError):
            print(f"\nerror: request failed at stage {msg.stage_id} ({msg.kind}): {msg.message}",
                  file=sys.stderr)
            return 1
        data = msg.data if isinstance(msg.data, dict) else {}
        progress = data.get("progress")
        if isinstance(progress, dict):
            line = f"denoising {_bar(int(progress['step']), int(progress['steps']))}"
            print(f"\r{line}" if tty else line, end="" if tty else "\n", file=sys.stderr, flush=True)
        if msg.finished:
            break
    if tty:
        print(file=sys.stderr)
    png = image_of(msg.data)
    if png is None:
        print(f"error: the pipeline's last output is not an image: {msg.data!r:.200}", file=sys.stderr)
        return 1
    guided_by = data.get("guided_by")
    if guided_by is not None:
        neg = companions[guided_by]["text"] if guided_by in companions else "?"
        print(f"guidance: scale {data.get('guidance_scale')} used the companion {guided_by!r} "
              f"(negative prompt {neg!r})", flush=True)
    else:
        print("guidance: off (guidance_scale 1: the prompt alone conditioned the image)", flush=True)
    try:
        with open(out, "wb") as f:
            f.write(png)
    except OSError as exc:
        print(f"error: cannot write {out}: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {out}: {data.get('width')}x{data.get('height')} PNG, {data.get('steps')} steps, "
          f"{len(png)} bytes, in {time.perf_counter() - t0:.2f} s", flush=True)
    return 0
