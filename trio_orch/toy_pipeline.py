"""An in-process thinker -> talker -> vocoder pipeline: no worker processes, no torch.

Same data shapes as the real stage workers (``stages/models.py``), so the
serving front cannot tell them apart: stage 0 emits ``{"text": str}`` pieces,
stage 2 emits ``{"pcm": float32 array, "sample_rate": 24000}`` chunks.  The
thinker "answers" by echoing the prompt's last line one word at a time, the
talker turns each word into a code, the vocoder each code into a short tone.
Used by ``trio-orch serve --in-process`` and by the HTTP tests, which need
stages that are slow enough to be interrupted and that record their aborts.
"""

from __future__ import annotations

import math
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import numpy as np
import trio

from trio_orch.engine_base import PipelineSpec
from trio_orch.types import StageOutput, StageUnavailable

__all__ = ["SAMPLE_RATE", "ToyStage", "open_toy_pipeline", "toy_pipeline"]

SAMPLE_RATE = 24000
CHUNK_SECONDS = 0.08
_ROLES = {"system", "developer", "user", "assistant"}


class ToyStage:
    """A stage client that computes its outputs in tasks of the pipeline's nursery.

    ``produce(payload)`` returns the list of outputs for one request; they
    are emitted one every ``delay`` seconds, the last one ``finished``.
    Records ``submissions`` and ``aborts`` (ids) like ScriptedStage, and
    ``peak_active``: the most requests it ever held at once (admission tests).
    """

    def __init__(self, stage_id: int, nursery: trio.Nursery, produce: Callable[[Any], list[Any]],
                 delay: float, name: str) -> None:
        self.stage_id = stage_id
        self.name = name
        self._nursery = nursery
        self._produce = produce
        self.delay = delay
        self.submissions: list[tuple[str, Any]] = []
        self.aborts: list[str] = []
        self._scopes: dict[str, trio.CancelScope] = {}
        self.peak_active = 0
        self._send, self._recv = trio.open_memory_channel[StageOutput](math.inf)
        self.closed = False

    def __repr__(self) -> str:
        return f"<ToyStage {self.name}>"

    async def submit(self, request_id: str, payload: Any) -> None:
        if self.closed:
            raise StageUnavailable(f"{self.name} is closed")
        self.submissions.append((request_id, payload))
        scope = trio.CancelScope()
        self._scopes[request_id] = scope
        self.peak_active = max(self.peak_active, len(self._scopes))
        self._nursery.start_soon(self._run, request_id, payload, scope)
        await trio.lowlevel.checkpoint()

    async def _run(self, request_id: str, payload: Any, scope: trio.CancelScope) -> None:
        try:
            with scope:
                try:
                    items = self._produce(payload)
                except Exception as exc:  # a bad payload fails this request, not the stage
                    self._send.send_nowait(StageOutput(request_id, None, True, error=f"{self.name}: {exc}"))
                    return
                for i, item in enumerate(items):
                    await trio.sleep(self.delay)
                    self._send.send_nowait(StageOutput(request_id, item, i == len(items) - 1,
                                                       t_produced=time.perf_counter()))
        finally:
            if self._scopes.get(request_id) is scope:
                del self._scopes[request_id]

    async def abort(self, request_ids: list[str]) -> None:
        self.aborts.extend(request_ids)
        for rid in request_ids:
            scope = self._scopes.pop(rid, None)
            if scope is not None:
                scope.cancel()
        await trio.lowlevel.checkpoint()

    async def receive(self) -> list[StageOutput]:
        try:
            batch = [await self._recv.receive()]
        except (trio.EndOfChannel, trio.ClosedResourceError):
            raise StageUnavailable(f"{self.name} is closed") from None
        while True:
            try:
                batch.append(self._recv.receive_nowait())
            except (trio.WouldBlock, trio.EndOfChannel):
                return batch

    async def aclose(self) -> None:
        self.closed = True
        for scope in self._scopes.values():
            scope.cancel()
        self._send.close()
        await trio.lowlevel.checkpoint()


def _think(payload: Any) -> list[dict[str, Any]]:
    text, limit = (payload, None) if isinstance(payload, str) else (None, None)
    if isinstance(payload, dict):
        text, limit = payload.get("text"), payload.get("max_new_tokens")
    if not isinstance(text, str) or not text.strip():
        raise ValueError("thinker payload must be a non-empty string or {'text': str}")
    # a chat prompt ends with "assistant:": answer the last line that says something
    said = [ln.split(":", 1)[-1].strip() if ln.split(":", 1)[0] in _ROLES else ln.strip()
            for ln in text.splitlines()]
    said = [s for s in said if s]
    last = said[-1] if said else "nothing"
    words = f"You said: {last}".split()
    pieces = [w + " " for w in words[:-1]] + [words[-1]]
    return [{"text": p} for p in pieces[: limit or None]]


def _talk(words: list[str]) -> list[dict[str, Any]]:
    return [{"codes": np.array([sum(map(ord, w)) % 24], np.int32)} for w in words] or [{"codes": None}]


def _vocode(codes: list[int]) -> list[dict[str, Any]]:
    n = int(SAMPLE_RATE * CHUNK_SECONDS)
    t = np.arange(n, dtype=np.float32) / SAMPLE_RATE
    envelope = np.sin(np.pi * np.arange(n) / n).astype(np.float32)
    return [{"pcm": (0.3 * envelope * np.sin(2 * np.pi * (220.0 + 20.0 * c) * t)).astype(np.float32),
             "sample_rate": SAMPLE_RATE} for c in codes]


def _forward(k: int, prompt: Any, outputs: list[Any]) -> Any:
    if k == 0:
        return [o["text"].strip() for o in outputs if o and o.get("text", "").strip()]
    return [int(o["codes"][0]) for o in outputs if o and o.get("codes") is not None]


@asynccontextmanager
async def open_toy_pipeline(token_delay: float = 0.02,
                            audio_delay: float = 0.01) -> AsyncIterator[PipelineSpec]:
    """Yield the 3-stage toy pipeline (final stages 0 and 2); its tasks end with the block."""
    async with trio.open_nursery() as nursery:
        stages = [ToyStage(0, nursery, _think, token_delay, "toy thinker"),
                  ToyStage(1, nursery, _talk, audio_delay, "toy talker"),
                  ToyStage(2, nursery, _vocode, audio_delay, "toy vocoder")]
        try:
            yield PipelineSpec(stages, [0, 2], {"forward_fn": _forward})
        finally:
            nursery.cancel_scope.cancel()


def toy_pipeline(token_delay: float = 0.02, audio_delay: float = 0.01) -> Callable[[], Any]:
    """A pipeline factory for :class:`~trio_orch.bridge.Engine`."""
    return lambda: open_toy_pipeline(token_delay, audio_delay)
