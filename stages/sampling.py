"""Sampling with per-request parameters, shared by the torch stage models.

Each request owns a :class:`RequestSampler`: its resolved parameters, its own
``torch.Generator`` (seeded with the request's ``seed``, or with a seed drawn
from the model's generator when it has none) and the token counts its
penalties need.  :func:`sample` picks one token per row of a batch's logits;
every step of the pipeline is row-wise, and a request draws its random
numbers only from its own generator, so a request's tokens do not depend on
which other requests share its batch (a global RNG would hand each request
whatever draws the others left).  Sampling runs on the CPU in float32 whatever
the model's device: the vocabularies are small, and the same seed then gives
the same choice from the same logits on every device.

:class:`StopText` holds back streamed text that could still become a stop
string, so a stop string is never emitted, not even in part.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

__all__ = ["RequestSampler", "StopText", "sample"]


class RequestSampler:
    """One request's sampling state.

    ``params`` are resolved (:func:`stages.sampling_params.with_defaults`):
    ``temperature`` (0: greedy), and optionally ``top_p``, ``top_k``,
    ``repetition_penalty``, ``frequency_penalty``, ``presence_penalty``, ``seed``.
    ``rows``: tokens sampled per step (the talker samples frames x codebooks);
    ``groups``: independent count tables among them (row r counts in group
    ``r % groups``: per codebook for the talker).  ``prompt`` tokens count as
    seen for the repetition penalty.
    """

    def __init__(self, params: Mapping[str, Any], vocab: int, *, seed_source: torch.Generator,
                 rows: int = 1, groups: int = 1, prompt: Sequence[int] = ()) -> None:
        self.temperature = float(params["temperature"])
        self.top_p = float(params.get("top_p", 1.0))
        self.top_k = int(params.get("top_k", 0))
        self.repetition = float(params.get("repetition_penalty", 1.0))
        self.frequency = float(params.get("frequency_penalty", 0.0))
        self.presence = float(params.get("presence_penalty", 0.0))
        seed = params.get("seed")
        if seed is None:  # no seed asked: one of the model's (reproducible for one worker seed)
            seed = int(torch.randint(0, 2**62, (), generator=seed_source))
        self.gen = torch.Generator(device="cpu").manual_seed(int(seed))
        self.rows, self.groups, self.vocab = rows, groups, vocab
        self.penalised = self.repetition != 1.0 or self.frequency != 0.0 or self.presence != 0.0
        self.counts = torch.zeros(groups, vocab) if self.penalised else None
        self.seen: torch.Tensor | None = None
        if self.repetition != 1.0:
            self.seen = torch.zeros(groups, vocab, dtype=torch.bool)
            if len(prompt):
                self.seen[:, torch.as_tensor(list(prompt), dtype=torch.long)] = True

    def observe(self, tokens: torch.Tensor) -> None:
        """Count the tokens this request just produced (``rows`` of them)."""
        if self.counts is None:
            return
        toks = tokens.reshape(-1).long().cpu()
        group = torch.arange(len(toks)) % self.groups
        self.counts.index_put_((group, toks), torch.ones(len(toks)), accumulate=True)
        if self.seen is not None:
            self.seen[group, toks] = True

    def penalise(self, logits: torch.Tensor) -> torch.Tensor:
        """This request's ``rows`` of logits with its penalties applied (a new tensor)."""
        if not self.penalised:
            return logits
        assert self.counts is not None
        reps = self.rows // self.groups
        if self.seen is not None:  # repetition (prompt and output): shrink positive, grow negative
            seen = self.seen.repeat(reps, 1)
            scaled = torch.where(logits > 0, logits / self.repetition, logits * self.repetition)
            logits = torch.where(seen, scaled, logits)
        if self.frequency or self.presence:  # OpenAI's: per occurrence, and once if present (output)
            counts = self.counts.repeat(reps, 1)
            logits = logits - self.frequency * counts - self.presence * (counts > 0).float()
        return logits


def sample(samplers: Sequence[RequestSampler], logits: torch.Tensor) -> torch.Tensor:
    """One token per row: ``logits`` [sum of rows, vocab], each request's rows in order -> long [rows].

    Penalties, then temperature (0: argmax), top-k, top-p, and a draw from
    the request's own generator (inverse CDF over the kept tokens).
    """
    logits = logits.detach().float().cpu()
    sizes = [s.rows for s in samplers]
    if sum(sizes) != logits.shape[0]:
        raise ValueError(f"{logits.shape[0]} rows of logits for samplers of {sum(sizes)} rows")
    if any(s.penalised for s in samplers):
        logits = torch.cat([s.penalise(part) for s, part in zip(samplers, logits.split(sizes), strict=True)])
    out = logits.argmax(-1)
    drawn = [s for s in samplers if s.temperature > 0]
    if not drawn:
        return out
    counts = torch.tensor(sizes)
    per_row = [torch.tensor([getattr(s, a) for s in samplers]).repeat_interleave(counts)
               for a in ("temperature", "top_p", "top_k")]
    temp, top_p, top_k = per_row
    rows = (temp > 0).nonzero()[:, 0]
    u = torch.cat([torch.rand(s.rows, generator=s.gen) for s in drawn])  # in row order
    scaled = logits[rows] / temp[rows, None]
    vocab = scaled.shape[-1]
    sorted_logits, order = torch.sort(scaled, dim=-1, descending=True, stable=True)
    probs = torch.softmax(sorted_logits, dim=-1)
    k = torch.where(top_k[rows] > 0, top_k[rows], vocab)
    keep = torch.arange(vocab)[None, :] < k[:, None]
    keep &= (probs.cumsum(-1) - probs) < top_p[rows, None]  # the mass before a token: the first stays
    cdf = (probs * keep).cumsum(-1)
    pick = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).clamp_(max=vocab - 1)
    out[rows] = order.gather(1, pick)[:, 0]
    return out


class StopText:
    """Stop strings over streamed text.

    :meth:`push` takes the text of the next token(s) and returns what may be
    released now and whether a stop string completed: text that is a prefix
    of some stop string is held back until it either completes one (dropped,
    with everything after it) or cannot any more (released).
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [s for s in stops if s]
        self.held = ""

    def push(self, text: str) -> tuple[str, bool]:
        buf = self.held + text
        hits = [i for i in (buf.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.held = ""
            return buf[: min(hits)], True
        keep = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(buf)), keep, -1):
                if buf.endswith(s[:n]):
                    keep = n
                    break
        self.held = buf[len(buf) - keep:]
        return buf[: len(buf) - keep], False

    def flush(self) -> str:
        """The text still held back (the output ended without completing a stop string)."""
        text, self.held = self.held, ""
        return text
