"""``omni-talker``: the talker of a Qwen2.5-Omni checkpoint as a stage: thinker rows in, codec codes out.

Each request's text track (:class:`stages.hf.omni.forwarding.TalkerTrack`)
comes whole, framed by the thinker's forward function (normal mode), or
streams in as the thinker's outputs (async-chunk mode): the talker starts
once the prompt's rows and the first reply row are in and waits, between
steps, for each next row, so both modes compute the same codes.  Codes are
generated as the talker's ``generate()`` inside
``Qwen2_5OmniForConditionalGeneration.generate()`` generates them: the start
code suppressed, the repetition penalty over its input and answer codes, then
greedy (``temperature: 0``) or sampled with top-k and top-p
(:mod:`stages.hf.omni.params` has the defaults, ``generate()``'s).  It stops
at the checkpoint's codec end or pad code (its config's, not the ids
``generate()`` hard-codes) or after ``max_tokens``; as in ``generate()``,
whose answer drops its last code, a code that reaches ``max_tokens`` is not
kept.  Codes go out as soon as they are made, ``chunk_codes`` to an output:
``{"codes": int32[k]}`` (and downstream, async-chunk); the next stage's input
is every code, in order (:func:`stages.forwarding.codes_input`).

Requests join and leave between steps; a step runs one forward pass per
request, each with the shapes it has alone, so a request's codes do not
depend on the others in the batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from stages.base import ReqState, StageModel, StepResult
from stages.control import rpc_method
from stages.hf.omni.checkpoint import read_omni_config, speakers
from stages.hf.omni.compute import TalkerInput, TalkerRunner, TalkerSequence
from stages.hf.omni.forwarding import TalkerTrack
from stages.hf.omni.params import talker_params
from stages.hf.omni.parts import load_part, weights_summary
from stages.sampling import RequestSampler, sample
from stages.sampling_params import with_defaults
from stages.schema import PositiveInt

__all__ = ["OmniTalker"]


class _Framed:
    """A text track that came whole (normal mode): the framed payload of the thinker's forward function."""

    def __init__(self, payload: dict[str, Any]) -> None:
        reply = np.asarray(payload.get("reply"), dtype=np.float32)
        if reply.ndim != 2 or not len(reply):
            raise ValueError("a talker input has 'reply' [m, H]: the rows it is fed after the prefill")
        self.inp = TalkerInput.from_payload(payload)
        self.rows = reply

    def ready(self) -> bool:
        return True

    def reply(self, j: int) -> np.ndarray:
        return self.rows[min(j, len(self.rows) - 1)]  # the last one (the text pad) repeats


@dataclass(slots=True)
class _Talk:
    """One request's talker state (``ReqState.model``)."""

    source: _Framed | TalkerTrack | None  # None: the reply had nothing to say
    sampler: RequestSampler
    max_new: int
    seq: TalkerSequence | None = None
    last: int | None = None
    n: int = 0
    pending: list[int] = field(default_factory=list)


class OmniTalker(StageModel):
    """The talker of the checkpoint in directory ``checkpoint`` (see the module's docstring).

    Options: ``checkpoint``, ``dtype`` (auto: the checkpoint's), ``chunk_codes``
    (codes per output: smaller reaches token2wav sooner in async-chunk mode),
    ``max_tokens`` (the default of the request parameter: ``generate()``'s 4096).
    """

    kind = "omni-talker"

    def __init__(self, checkpoint: str, dtype: str = "auto", chunk_codes: PositiveInt = 16,
                 max_tokens: PositiveInt = 4096, device: str = "cpu", seed: int = 0) -> None:
        self.cfg = read_omni_config(checkpoint)
        self.runner = TalkerRunner(load_part(checkpoint, "talker", device=device, dtype=dtype), self.cfg)
        self.voices = list(speakers(checkpoint))
        self.schema = talker_params(self.voices)
        self.chunk = chunk_codes
        self.max_tokens = max_tokens
        self.stop = frozenset(self.cfg.codec_stop)
        self.start_code = self.cfg.codec["start"]
        self.width = int(self.cfg.talker["embedding_size"])
        self.gen = torch.Generator(device="cpu").manual_seed(seed)

    def admit(self, req: ReqState) -> None:
        req.model = self._talk(req, req.payload)

    def _talk(self, req: ReqState, payload: Any) -> _Talk:
        sp = with_defaults(self.schema, req.sampling, max_tokens=self.max_tokens)
        prompt = [self.cfg.codec["mask"], self.cfg.codec["pad"], self.start_code]  # what the penalty counts
        sampler = RequestSampler(sp, self.runner.vocab_size, seed_source=self.gen, prompt=prompt)
        source: _Framed | TalkerTrack | None
        if req.upstream:  # the thinker's outputs stream in (feed)
            source = TalkerTrack()
        else:
            if not isinstance(payload, dict):
                raise ValueError("omni-talker: the payload is the thinker's framed answer (a dict)")
            source = None if payload.get("empty") else _Framed(payload)
            if source is not None and source.inp.embeds.shape[1] != self.width:
                raise ValueError(f"omni-talker: rows of width {source.inp.embeds.shape[1]}, the talker "
                                 f"reads {self.width}")
        return _Talk(source, sampler, sp["max_tokens"])

    def extend(self, req: ReqState, payload: Any) -> None:
        """A conversation's next answer: spoken afresh from its framing (the whole conversation's rows)."""
        self.release(req)
        req.model = self._talk(req, payload)
        if req.upstream:
            req.input_done = False

    def feed(self, req: ReqState, data: Any, end: bool) -> None:
        track = req.model.source
        assert isinstance(track, TalkerTrack)
        track.add(data)
        if end:
            track.close()
            req.input_done = True

    def runnable(self, req: ReqState) -> bool:
        t: _Talk = req.model
        src = t.source
        if not isinstance(src, TalkerTrack):
            return True
        if src.empty:
            return True
        return src.reply(t.n - 1) is not None if t.seq is not None else src.ready()

    @torch.inference_mode()
    def step(self, reqs: list[ReqState]) -> list[StepResult]:
        live = [r for r in reqs if not self._silent(r.model)]
        logits = []
        for r in live:  # one forward per request, with the shapes it has alone
            t: _Talk = r.model
            assert t.source is not None
            if t.seq is None:
                src = t.source
                inp = src.inp if isinstance(src, _Framed) else TalkerInput.from_payload(src.prefill())
                t.seq, row = self.runner.start(inp)
            else:
                assert t.last is not None
                text = t.source.reply(t.n - 1)
                assert text is not None
                row = self.runner.forward(t.seq, t.last, text)
            logits.append(row)
        codes: dict[str, int] = {}
        if live:
            stacked = torch.stack(logits)
            stacked[:, self.start_code] = -math.inf  # generate() suppresses the start code
            drawn = sample([r.model.sampler for r in live], stacked).tolist()
            codes = {r.request_id: c for r, c in zip(live, drawn, strict=True)}
        return [self._emit(r.model, codes.get(r.request_id)) for r in reqs]

    @staticmethod
    def _silent(t: _Talk) -> bool:
        return t.source is None or (isinstance(t.source, TalkerTrack) and t.source.empty)

    def _emit(self, t: _Talk, code: int | None) -> StepResult:
        if code is None:  # nothing to say: done, no codes
            return StepResult({"codes": np.zeros(0, np.int32)}, True, None)
        t.sampler.observe(torch.tensor([code]))
        t.n += 1
        t.last = code
        done = code in self.stop or t.n >= t.max_new
        if not done:  # the code that reaches max_tokens is dropped, as generate() drops it
            t.pending.append(code)
        if not done and len(t.pending) < self.chunk:
            return StepResult(None, False, None)
        out = {"codes": np.asarray(t.pending, dtype=np.int32)}
        t.pending = []
        return StepResult(out, done, out if len(out["codes"]) else None)

    def release(self, req: ReqState) -> None:
        t = req.model
        if isinstance(t, _Talk) and t.seq is not None:
            self.runner.release(t.seq)
            t.seq = None

    @rpc_method("weights")
    def weights(self) -> dict[str, Any]:
        """The ``weights`` RPC: the names, count and bytes of the tensors this worker holds."""
        return weights_summary("talker", self.runner.model)

    def info(self) -> dict[str, Any]:
        return {"kind": self.kind, "checkpoint": str(self.cfg.path), "voices": self.voices,
                "codec_stop": sorted(self.stop), "device": str(self.runner.device)}
