"""An in-process thinker -> talker -> vocoder pipeline: no worker processes, no torch.

Same data shapes as the real stage workers (``stages/toy/models.py``), so the
serving front cannot tell them apart: stage 0 emits ``{"text": str}`` pieces,
stage 2 emits ``{"pcm": float32 array, "sample_rate": 24000}`` chunks.  The
thinker "answers" by echoing the prompt's last line one word at a time, the
talker turns each word into a code, the vocoder each code into a short tone.
Used by ``trio-orch serve --in-process`` and by the HTTP tests, which need
stages that are slow enough to be interrupted and that record their aborts.
Its stages take few sampling parameters (:data:`TOY_STAGE_PARAMS`): the
thinker a word limit, the vocoder a voice (its pitch).  Resumable requests
work as with the workers: each input segment is answered after the one
before it, and a None segment is empty (one finished output with no data).
"""

from __future__ import annotations

import math
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import numpy as np
import trio

from stages.sampling_params import VOICES, Param, StageParams, voice_index
from trio_orch.engine.base import PipelineSpec
from trio_orch.types import StageOutput, StageUnavailable

__all__ = ["SAMPLE_RATE", "TOY_STAGE_PARAMS", "ToyStage", "open_toy_pipeline", "toy_pipeline"]

SAMPLE_RATE = 24000
CHUNK_SECONDS = 0.08
_ROLES = {"system", "developer", "user", "assistant"}

#: What each toy stage takes per request (requests are checked against it).
TOY_STAGE_PARAMS = (
    StageParams("toy thinker", {"max_tokens": Param("int", None, "most words (default: all)", lo=1)}),
    StageParams("toy talker", {}),
    StageParams("toy vocoder", {"voice": Param("choice", "alloy", "speaker: the pitch of the tones",
                                               choices=VOICES)}),
)


class ToyStage:
    """A stage client that computes its outputs in tasks of the pipeline's nursery.

    ``produce(payload, sampling)`` returns the list of outputs for one request
    (or one input segment of a resumable request); they are emitted one every
    ``delay`` seconds, the last one ``finished``.  Records ``submissions``,
    ``updates``, ``sampling`` (id, parameters) and ``aborts`` (ids) like
    ScriptedStage, and ``peak_active``: the most requests it held at once.
    """

    def __init__(self, stage_id: int, nursery: trio.Nursery,
                 produce: Callable[[Any, dict[str, Any]], list[Any]], delay: float, name: str) -> None:
        self.stage_id = stage_id
        self.name = name
        self._nursery = nursery
        self._produce = produce
        self.delay = delay
        self.submissions: list[tuple[str, Any]] = []
        self.updates: list[tuple[str, Any]] = []
        self.sampling: list[tuple[str, dict[str, Any]]] = []
        self.aborts: list[str] = []
        self._scopes: dict[str, trio.CancelScope] = {}
        self.peak_active = 0
        self._segments: dict[str, trio.MemorySendChannel[Any]] = {}  # resumable requests' next inputs
        self._send, self._recv = trio.open_memory_channel[StageOutput](math.inf)
        self.closed = False

    def __repr__(self) -> str:
        return f"<ToyStage {self.name}>"

    async def submit(self, request_id: str, payload: Any, *, sampling: dict[str, Any] | None = None,
                     resumable: bool = False) -> None:
        if self.closed:
            raise StageUnavailable(f"{self.name} is closed")
        self.submissions.append((request_id, payload))
        if sampling is not None:
            self.sampling.append((request_id, sampling))
        scope = trio.CancelScope()
        self._scopes[request_id] = scope
        self.peak_active = max(self.peak_active, len(self._scopes))
        send, recv = trio.open_memory_channel[Any](math.inf)
        send.send_nowait(payload)
        if resumable:
            self._segments[request_id] = send
        else:
            send.close()
        self._nursery.start_soon(self._run, request_id, recv, sampling or {}, scope)
        await trio.lowlevel.checkpoint()

    async def update(self, request_id: str, payload: Any, *, final: bool = False,
                     sampling: Any = None) -> None:
        """The next input segment of a resumable request: answered once the current one is."""
        send = self._segments.get(request_id)
        if send is None:
            raise StageUnavailable(f"{self.name}: request {request_id!r} is not running here")
        self.updates.append((request_id, payload))
        send.send_nowait(payload)
        if final:
            send.close()
            del self._segments[request_id]
        await trio.lowlevel.checkpoint()

    async def _run(self, request_id: str, segments: trio.MemoryReceiveChannel[Any],
                   sampling: dict[str, Any], scope: trio.CancelScope) -> None:
        with scope:
            async for payload in segments:
                try:
                    items = [None] if payload is None else self._produce(payload, sampling)
                except Exception as exc:  # a bad payload fails this request, not the stage
                    self._send.send_nowait(StageOutput(request_id, None, True, error=f"{self.name}: {exc}"))
                    break
                for i, item in enumerate(items):
                    await trio.sleep(self.delay)
                    self._send.send_nowait(StageOutput(request_id, item, i == len(items) - 1,
                                                       t_produced=time.perf_counter()))
        if self._scopes.get(request_id) is scope:  # not a later request with the same id
            del self._scopes[request_id]
            self._segments.pop(request_id, None)

    async def abort(self, request_ids: list[str]) -> None:
        self.aborts.extend(request_ids)
        for rid in request_ids:
            self._segments.pop(rid, None)
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


def _think(payload: Any, sampling: dict[str, Any]) -> list[dict[str, Any]]:
    text = payload.get("text") if isinstance(payload, dict) else payload
    limits = [n for n in (payload.get("max_new_tokens") if isinstance(payload, dict) else None,
                          sampling.get("max_tokens")) if n]
    limit = min(limits) if limits else None
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


def _talk(words: list[str], sampling: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"codes": np.array([sum(map(ord, w)) % 24], np.int32)} for w in words] or [{"codes": None}]


def _vocode(codes: list[int], sampling: dict[str, Any]) -> list[dict[str, Any]]:
    base = 220.0 + 15.0 * voice_index(sampling.get("voice", "alloy"))
    n = int(SAMPLE_RATE * CHUNK_SECONDS)
    t = np.arange(n, dtype=np.float32) / SAMPLE_RATE
    envelope = np.sin(np.pi * np.arange(n) / n).astype(np.float32)
    return [{"pcm": (0.3 * envelope * np.sin(2 * np.pi * (base + 20.0 * c) * t)).astype(np.float32),
             "sample_rate": SAMPLE_RATE} for c in codes]


def _forward(k: int, prompt: Any, outputs: list[Any]) -> Any:
    if not any(outputs):
        return None  # an empty input segment stays empty
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
            yield PipelineSpec(stages, [0, 2], {"forward_fn": _forward}, TOY_STAGE_PARAMS)
        finally:
            nursery.cancel_scope.cancel()


def toy_pipeline(token_delay: float = 0.02, audio_delay: float = 0.01) -> Callable[[], Any]:
    """A pipeline factory for :class:`~trio_orch.engine.bridge.ThreadEngine`."""
    return lambda: open_toy_pipeline(token_delay, audio_delay)
