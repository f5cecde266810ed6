"""``trio-orch demo``: a 3-stage pipeline of in-process stages, no processes, no torch.

Shows the routing contract (docs/design.md) as it streams: a "thinker" stage emits words,
a "talker" turns them into codes, a "vocoder" turns codes into fake audio
chunks; stages 0 and 2 are final-output stages.
"""

from __future__ import annotations

import argparse
import random
import time
from typing import Any

import trio

from trio_orch import OrchError, Orchestrator, OrchOutput
from trio_orch.testing import ScriptedStage


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompts", nargs="*", default=["Hello from trio-orch", "Structured concurrency"],
                        help="prompts to run (default: two built-in ones)")
    parser.add_argument("--delay-ms", type=float, default=20.0,
                        help="simulated per-step compute time of each stage in ms (default 20)")
    parser.add_argument("--seed", type=int, default=0, help="random seed for the simulated timings")


async def _thinker(stage: ScriptedStage, delay: float, rng: random.Random) -> None:
    """Turns each submitted prompt into one output per word."""
    done = 0
    async with trio.open_nursery() as nursery:
        while True:
            while done < len(stage.submissions):
                rid, prompt = stage.submissions[done]
                done += 1
                nursery.start_soon(_words, stage, rid, str(prompt).split(), delay, rng)
            await trio.sleep(delay / 4)


async def _words(stage: ScriptedStage, rid: str, words: list[str], delay: float, rng: random.Random) -> None:
    for i, w in enumerate(words):
        await trio.sleep(delay * rng.uniform(0.5, 1.5))
        stage.emit_nowait(rid, w, finished=i == len(words) - 1)


async def _transform(stage: ScriptedStage, fn: Any, delay: float, rng: random.Random) -> None:
    """A downstream stage: one output per item of its input list."""
    done = 0
    async with trio.open_nursery() as nursery:
        while True:
            while done < len(stage.submissions):
                rid, payload = stage.submissions[done]
                done += 1
                items = payload if isinstance(payload, list) else [payload]
                nursery.start_soon(_emit_items, stage, rid, [fn(x) for x in items], delay, rng)
            await trio.sleep(delay / 4)


async def _emit_items(
    stage: ScriptedStage, rid: str, items: list[Any], delay: float, rng: random.Random
) -> None:
    for i, item in enumerate(items):
        await trio.sleep(delay * rng.uniform(0.5, 1.5))
        if rid in stage.aborts:
            return
        stage.emit_nowait(rid, item, finished=i == len(items) - 1)


async def _main(args: argparse.Namespace) -> int:
    rng = random.Random(args.seed)
    delay = args.delay_ms / 1000
    stages = [ScriptedStage(0, name="thinker"), ScriptedStage(1, name="talker"),
              ScriptedStage(2, name="vocoder")]
    orch = Orchestrator(stages, final_stage_ids={0, 2}, async_chunk=False)
    t0 = time.perf_counter()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_thinker, stages[0], delay, rng)
        nursery.start_soon(_transform, stages[1], lambda w: f"codes({w})", delay, rng)
        nursery.start_soon(_transform, stages[2], lambda c: f"pcm[{c}]", delay, rng)
        await nursery.start(orch.run)
        for i, prompt in enumerate(args.prompts):
            await orch.add_request(f"req-{i}", prompt)
            print(f"{time.perf_counter() - t0:7.3f}s  + req-{i}: {prompt!r}", flush=True)
        remaining = len(args.prompts)
        while remaining:
            msg = await orch.next_output()
            stamp = f"{time.perf_counter() - t0:7.3f}s"
            if isinstance(msg, OrchOutput):
                kind = "text " if msg.stage_id == 0 else "audio"
                end = "  [finished]" if msg.finished else ""
                print(f"{stamp}  {msg.request_id} stage {msg.stage_id} {kind} {msg.data!r}{end}", flush=True)
            else:
                assert isinstance(msg, OrchError)
                print(f"{stamp}  {msg.request_id} ERROR {msg.kind}: {msg.message}", flush=True)
            if msg.finished:
                remaining -= 1
        await orch.shutdown()
        nursery.cancel_scope.cancel()
    print(f"done: {len(args.prompts)} requests, dropped outputs: {orch.dropped_outputs}")
    return 0


def run(args: argparse.Namespace) -> int:
    return trio.run(_main, args)
