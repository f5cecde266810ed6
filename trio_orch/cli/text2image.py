"""``trio-orch generate --pipeline text2image``: the image options on the command line, the run with progress.

The request itself -- its options, their ranges, the negative-prompt
companion -- is :mod:`trio_orch.openai.images`', the same the HTTP route
builds, so both check options alike.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from stages.registry import image_of
from trio_orch.openai.images import ImageRequest, parse_size
from trio_orch.types import OrchError

__all__ = ["add_arguments", "generate_image", "request_from_args"]


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
