"""Continuous batching of an autoregressive text model, over a model adapter.

:class:`DecoderStage` is the stage model every checkpoint kind that generates
tokens reuses; what differs between models is a :class:`DecoderAdapter` --
how one sequence's new tokens run through the model on top of the cache it
has.  The loop owns the rest, per request:

- admission: the prompt's tokens (the checkpoint's tokenizer), the context
  rule (:mod:`stages.limits`: refused in vLLM's words, never cut), the
  sampling parameters (:data:`~stages.sampling_params.HF_PARAMS`, defaults
  from ``generation_config.json``), a sampler with its own generator
  (:mod:`stages.sampling`: the same seed gives the same text on every replica);
- each step: one forward per running request -- a new one's whole prompt
  (its prefill), a running one's last token -- then one token each, sampled
  row by row; requests join and leave between steps (the worker's loop);
- each token: released as text only once it ends a whole character, held
  back while it may begin a stop string (:class:`~stages.text_stream.TextStream`);
  the request ends at an end-of-text id, a stop token or string, ``max_tokens``
  or a full context;
- outputs: ``{"text", "tokens": int32[n]}`` (and ``"hidden": float32[n, H]``,
  the final hidden state each token was sampled from, when the stage is asked
  for hidden states), numpy arrays the wire sends as zero-copy frames; the
  last one says ``finish_reason``.  Downstream (async-chunk) gets the same.

**Batching does not change a request's numbers.** Each running request's
forward pass is computed alone, with the shapes it would have alone (no
padding, no stacking across requests in the model), so its logits -- and
its greedy answer -- are bit for bit what it would get alone and what
``transformers``' ``generate()`` gives; only sampling is batched, and it is
row-wise.  The cost is throughput: a step is as many small forward passes as
requests (``docs/models.md``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from stages.base import ReqState, StageModel, StepResult
from stages.limits import check_context
from stages.sampling import RequestSampler, sample
from stages.sampling_params import HF_PARAMS, with_defaults
from stages.text_stream import TextStream
from stages.tokenizer import TextTokenizer

__all__ = ["DecoderAdapter", "DecoderStage", "Decoding", "Forward"]


@dataclass(slots=True)
class Forward:
    """One forward pass of one sequence: the next-token logits (float32 [vocab], CPU) and, when asked,
    the final hidden state they come from (float32 [hidden], CPU)."""

    logits: torch.Tensor
    hidden: torch.Tensor | None = None


class DecoderAdapter(Protocol):
    """How one model runs one sequence; the loop never batches across sequences in it."""

    vocab_size: int
    hidden_size: int

    def start(self) -> Any:
        """A new sequence's state (an empty KV cache)."""

    def forward(self, state: Any, new_ids: list[int], *, hidden: bool) -> Forward:
        """Run ``new_ids`` (the prompt, or the tokens since the last call) on top of ``state``."""

    def release(self, state: Any) -> None:
        """The sequence is done: free what its state holds."""


@dataclass(slots=True)
class Decoding:
    """One request's decoding state (``ReqState.model``)."""

    prompt: list[int]
    feed: list[int]  # the tokens the next forward runs: the prompt, then the last sampled one
    context: int  # the positions the next forward leaves filled (prompt + fed tokens)
    max_new: int
    min_new: int
    stops: frozenset[int]  # end-of-text ids and the request's stop tokens: the answer ends there
    text: TextStream
    sampler: RequestSampler
    params: dict[str, Any]
    state: Any = None
    n: int = 0  # tokens generated in this segment
    last: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)


class DecoderStage(StageModel):
    """A text stage over ``adapter`` and ``tokenizer`` (see the module's docstring).

    ``max_model_len``: the context; ``eos_ids``: the ids that end an answer;
    ``defaults``: sampling defaults (``generation_config.json``'s, by HF_PARAMS
    name); ``hidden_states``: outputs carry each token's final hidden state.
    """

    kind = "decoder"

    def __init__(self, adapter: DecoderAdapter, tokenizer: TextTokenizer, *, max_model_len: int,
                 eos_ids: list[int], defaults: Mapping[str, Any] | None = None, seed: int = 0,
                 hidden_states: bool = False) -> None:
        self.adapter = adapter
        self.tok = tokenizer
        self.max_model_len = max_model_len
        self.eos_ids = frozenset({*eos_ids, tokenizer.eos})
        self.defaults = dict(defaults or {})
        self.hidden_states = hidden_states
        self.gen = torch.Generator(device="cpu").manual_seed(seed)

    # ------------------------------------------------------------------ admission
    def _text(self, payload: Any, what: str) -> str:
        text = payload.get("text") if isinstance(payload, dict) else payload
        if not isinstance(text, str) or not text:
            raise ValueError(f"{self.kind}: a {what} is a non-empty string or {{'text': str}}")
        return text

    def admit(self, req: ReqState) -> None:
        if req.upstream:
            raise ValueError(f"{self.kind} takes a whole prompt, not streamed chunks: make it stage 0")
        self.begin(req, self.tok.encode(self._text(req.payload, "prompt")))

    def begin(self, req: ReqState, ids: list[int]) -> None:
        """Set ``req`` up to answer the prompt of token ``ids``: the context rule, its sampling, its
        decoding state (a kind whose prompt is more than its text -- images, audio -- makes the ids
        its own way and calls this).  A payload ``{"say": text}`` forces the answer: its tokens,
        then end-of-text (the speech route has the rest of the pipeline speak them)."""
        say = req.payload.get("say") if isinstance(req.payload, dict) else None
        if say is not None:
            forced = self._forced(say, len(ids))
            req.sampling = {**req.sampling, "max_tokens": len(forced), "min_tokens": 0}
        sp = with_defaults(HF_PARAMS, req.sampling, **self.defaults)
        asked = req.sampling.get("max_tokens")
        check_context(self.max_model_len, len(ids), asked)
        bad = [t for t in sp["stop_token_ids"] if t >= self.adapter.vocab_size]
        if bad:
            raise ValueError(f"stop_token_ids: {bad[0]} is not in the model's vocabulary of "
                             f"{self.adapter.vocab_size}")
        sampling = {**sp, "temperature": 1.0 if sp["temperature"] is None else sp["temperature"],
                    "top_k": max(0, sp["top_k"] or 0)}
        req.model = Decoding(prompt=ids, feed=list(ids), context=len(ids),
                             max_new=self._budget(len(ids), asked if asked is not None else sp["max_tokens"]),
                             min_new=sp["min_tokens"], stops=self.eos_ids | frozenset(sp["stop_token_ids"]),
                             text=TextStream(self.tok.decoder(), sp["stop"]),
                             sampler=RequestSampler({k: v for k, v in sampling.items() if v is not None},
                                                    self.adapter.vocab_size, seed_source=self.gen,
                                                    prompt=ids),
                             params=sp)
        if say is not None:
            req.model.extra["say"] = forced

    def _forced(self, say: Any, prompt: int) -> list[int]:
        if not isinstance(say, str) or not say:
            raise ValueError(f"{self.kind}: 'say' must be a non-empty string")
        forced = [*self.tok.encode(say), self.tok.eos]
        if prompt + len(forced) > self.max_model_len:
            raise ValueError(f"{self.kind}: 'say' is {len(forced) - 1} tokens, over the "
                             f"{self.max_model_len - prompt - 1} that fit after this prompt")
        return forced

    def _budget(self, context: int, limit: int | None) -> int:
        """Tokens an answer may have after ``context`` positions: ``limit``, and what the context holds."""
        room = self.max_model_len - context
        return max(1, min(limit, room) if limit is not None else room)

    def extend(self, req: ReqState, payload: Any) -> None:
        """A resumable request's next segment: its tokens follow the conversation in the cache."""
        m: Decoding = req.model
        new = self.tok.encode(self._text(payload, "segment"))
        feed = [*m.feed, *new] if m.state is None else [m.last, *new]  # the last answer's end goes in first
        context = m.context - len(m.feed) + len(feed)
        asked = req.sampling.get("max_tokens")
        check_context(self.max_model_len, context, asked)
        m.feed, m.context, m.n = feed, context, 0
        m.max_new = self._budget(context, asked if asked is not None else m.params["max_tokens"])
        m.text.restart(m.params["stop"])

    # ------------------------------------------------------------------ the step
    @torch.inference_mode()
    def step(self, reqs: list[ReqState]) -> list[StepResult]:
        runs = []
        for r in reqs:  # one forward per request, each with the shapes it has alone
            m: Decoding = r.model
            if m.state is None:
                m.state = self.adapter.start()
            runs.append(self.adapter.forward(m.state, m.feed, hidden=self.hidden_states))
            m.feed = []
        logits = torch.stack([f.logits for f in runs])
        for i, r in enumerate(reqs):
            if r.model.n < r.model.min_new:  # no end before min_tokens
                logits[i, list(r.model.stops)] = -math.inf
        samplers = [r.model.sampler for r in reqs]
        toks = sample(samplers, logits).tolist()
        for i, r in enumerate(reqs):  # a forced answer: the next of its tokens, whatever was drawn
            forced = r.model.extra.get("say")
            if forced is not None:
                toks[i] = forced[r.model.n]
        return [self._emit(r.model, s, tok, run)
                for r, s, tok, run in zip(reqs, samplers, toks, runs, strict=True)]

    def _emit(self, m: Decoding, sampler: RequestSampler, tok: int, run: Forward) -> StepResult:
        m.n += 1
        m.last = tok
        sampler.observe(torch.tensor([tok]))
        ended = tok in m.stops
        if not ended:
            m.feed = [tok]
            m.context += 1
        length = m.n >= m.max_new
        hidden = run.hidden.float().numpy() if run.hidden is not None else None
        out = m.text.push(tok, ended=ended, length=length, extra=hidden)
        fields = self.step_fields(m, run)
        if out is None:  # held back: it may begin a stop string
            if not fields:
                return StepResult(None, False, None)
            data = {"text": "", "tokens": np.zeros(0, np.int32), **fields}
            return StepResult(data, False, data)
        toks = np.array(out.tokens, dtype=np.int32)
        data: dict[str, Any] = {"text": out.text, "tokens": toks, **fields}
        if self.hidden_states:
            data["hidden"] = (np.stack(out.extras) if out.extras
                              else np.zeros((0, self.adapter.hidden_size), np.float32))
        if out.done:
            data["finish_reason"] = out.finish_reason
        return StepResult(data, out.done, data if len(toks) or fields else None)

    def step_fields(self, m: Decoding, run: Forward) -> dict[str, Any]:
        """What a kind adds to this step's output besides the text (sent even while text is held
        back); none by default."""
        return {}

    def release(self, req: ReqState) -> None:
        m = req.model
        if isinstance(m, Decoding) and m.state is not None:
            self.adapter.release(m.state)
            m.state = None

    def warmup(self) -> None:
        req = ReqState("__warmup__", "Hello", sampling={"max_tokens": 2})
        self.admit(req)
        for _ in range(2):
            if self.step([req])[0].finished:
                break
        self.release(req)

    def info(self) -> dict[str, Any]:
        return {"kind": self.kind, "max_model_len": self.max_model_len, "max_say": self.max_model_len - 2,
                "vocab_size": self.adapter.vocab_size,
                "eos": sorted(self.eos_ids), "hidden_states": self.hidden_states}
