"""Torch stage models with seeded dummy weights (nothing is downloaded).

- ``thinker``: a small decoder-only transformer over a byte vocabulary with a
  KV cache; batched sampled (or greedy, ``temperature=0``) decoding, one token
  per request per step; sampling is restricted to printable ASCII (with a
  letter-frequency bias) so its text decodes and reads like words.  Its
  tokenizer (:mod:`stages.tokenizer`, the ``tokenizer`` option: a
  ``tokenizer.json``) is byte-level by default: a token is one byte, 256 is
  end-of-text.  Text is decoded incrementally, whole characters only; stop
  strings are matched on it, and held-back text maps back to the tokens
  whose characters it holds.
  A payload may carry encoder features (``{"text": ..., "features":
  float32[rows, feature_dim]}``, :mod:`stages.media`): projected into the
  embedding space, they come before the prompt's tokens in the prefill, so
  the answer depends on the image or sound they encode.
- ``talker``: a causal transformer that turns thinker tokens into
  ``frames_per_token`` frames of ``codebooks`` speech codes each, emitted in
  chunks of ``chunk_frames`` frames; a speaker embedding (the request's
  ``voice``) is added to every input.
- ``code2wav``: a vocoder: summed code embeddings plus the voice's speaker
  embedding through a conv upsampler (``hop`` samples per frame) to float32
  PCM at 24 kHz, ``chunk_frames`` frames per step, on a tone whose pitch is
  set by the voice and follows the codes.

Per-request sampling parameters (``ReqState.sampling``; what each kind takes
is in :mod:`stages.sampling_params`) are resolved at admission; the sampling
itself is :mod:`stages.sampling`.

Every model batches: one :meth:`step` runs one forward pass over every
runnable request.  Every model takes more input for a resumable request
(:meth:`extend`, one input segment at a time): the thinker appends the new
text to the KV cache it has and keeps generating from there; the talker keeps
its speech context; the vocoder its phase.  Arrays handed back are numpy (CPU), so the wire never
sees a torch tensor.  The building blocks live in :mod:`stages.toy.torch_blocks`;
what each kind means to the orchestrator (its output modality, how its outputs
become the next stage's input) is its row in :mod:`stages.registry`, which also
builds these classes (``build_model``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from stages.base import ReqState, StepResult
from stages.limits import check_context
from stages.media import FEATURE_DIM
from stages.sampling import RequestSampler, sample
from stages.sampling_params import (
    CODE2WAV_PARAMS,
    TALKER_PARAMS,
    THINKER_PARAMS,
    VOICES,
    voice_index,
    with_defaults,
)
from stages.schema import NonNegativeFloat, NonNegativeInt, PositiveInt
from stages.text_stream import TextStream
from stages.tokenizer import TextTokenizer, load_tokenizer
from stages.toy.torch_blocks import SlotModel, TinyDecoder, Upsampler

__all__ = ["Code2Wav", "Talker", "Thinker"]

SAMPLE_RATE = 24000
EOS = 256  # thinker vocabulary: 256 bytes + EOS
_FREQ = {" ": 13.0, "e": 10.2, "t": 7.5, "a": 6.5, "o": 6.2, "i": 5.7, "n": 5.7, "s": 5.3, "h": 4.9,
         "r": 5.0, "d": 3.4, "l": 3.3, "u": 2.3, "c": 2.2, "m": 2.0, "w": 1.9, "f": 1.8, "g": 1.6,
         "y": 1.6, "p": 1.5, "b": 1.2, ",": 1.0, ".": 1.0, "v": 0.8, "k": 0.6}


def _text_bias(tok: TextTokenizer) -> torch.Tensor:
    """Logit bias toward printable text: letters and spaces in English proportions, end-of-text.

    The byte-level tokenizer's printable ASCII bytes; for another tokenizer,
    every token whose text is printable ASCII (one letter: its frequency).
    """
    bias = torch.full((tok.vocab_size,), -math.inf)
    if tok.source == "byte-level":
        for c in range(32, 127):
            bias[c] = math.log(0.05)
        for ch, f in _FREQ.items():
            bias[ord(ch)] = math.log(f)
    else:
        for t in range(tok.vocab_size):
            text = tok.decode([t])
            if text and all(32 <= ord(c) < 127 for c in text):
                bias[t] = math.log(_FREQ.get(text, 0.05))
    bias[tok.eos] = math.log(1.0)
    return bias


class Thinker(SlotModel):
    """Text LLM: prompt bytes -> one sampled byte token per step.

    Payload: a string, or ``{"text": str, "max_new_tokens": int}``; with
    ``"say": str`` the answer is that text, token by token, then end-of-text
    (forced decoding: the speech route has the talker speak its input word for
    word through the whole pipeline).  Output per
    step: ``{"text": str, "tokens": int32[n]}`` (n is 1, or 0 while text that may
    begin a stop string is held back, or more when held text is released); the
    last output also says ``"finish_reason"``: ``"stop"`` (end-of-text, a stop
    string or stop token) or ``"length"``.  Downstream chunk: the released tokens.
    The model options ``temperature``, ``max_new_tokens`` and ``min_new_tokens``
    are the defaults of the request parameters ``temperature``, ``max_tokens``
    (also its cap) and ``min_tokens``.  ``max_model_len`` is the context: the
    prompt (feature rows and tokens) and the answer share it, and a request
    that does not fit is refused in vLLM's words (:mod:`stages.limits`) --
    nothing is cut to fit.  Without ``max_tokens`` an answer ends ("length")
    when the context is full.
    """

    #: the prompt room the thinker's weights were first drawn for: a longer context draws its other
    #: positions from a stream of their own, so every weight, and every answer, stays what it was
    DRAWN_PROMPT = 192

    kind = "thinker"

    def __init__(self, d_model: PositiveInt = 128, layers: PositiveInt = 2, heads: PositiveInt = 4,
                 max_model_len: PositiveInt = 32768, max_new_tokens: PositiveInt = 48,
                 min_new_tokens: NonNegativeInt = 8, temperature: NonNegativeFloat = 0.9,
                 slots: PositiveInt = 32, device: str = "cpu", seed: int = 0,
                 feature_dim: PositiveInt = FEATURE_DIM, tokenizer: str = "") -> None:
        super().__init__(slots, device, seed)
        torch.manual_seed(seed)
        if max_model_len < 2:
            raise ValueError(f"thinker: max_model_len must be >= 2 (a prompt and an answer), got "
                             f"{max_model_len}")
        self.max_model_len, self.max_new, self.min_new = max_model_len, max_new_tokens, min_new_tokens
        self.temperature = temperature
        self.tok = load_tokenizer(tokenizer)  # default: byte-level, ids = bytes, EOS = 256
        self.eos, self.vocab = self.tok.eos, self.tok.vocab_size
        self.emb = nn.Embedding(self.vocab, d_model).to(self.device)
        self.dec = TinyDecoder(d_model, layers, heads, max_model_len, slots,
                               drawn_positions=self.DRAWN_PROMPT + max_new_tokens)
        self.dec = self.dec.to(self.device).eval()
        self.head = nn.Linear(d_model, self.vocab).to(self.device)
        self.bias = _text_bias(self.tok).to(self.device)  # mostly letters and spaces, in English proportions
        # drawn last, so the weights above are what they were before features existed
        self.feature_dim = feature_dim
        self.feat = nn.Linear(feature_dim, d_model).to(self.device)  # encoder features -> embeddings

    def admit(self, req: ReqState) -> None:
        if req.upstream:
            raise ValueError("a thinker takes a whole prompt, not streamed chunks: make it stage 0")
        p = req.payload
        text, max_new = (p, self.max_new) if isinstance(p, str) else (None, self.max_new)
        if isinstance(p, dict):
            text, max_new = p.get("text"), int(p.get("max_new_tokens", self.max_new))
        if not isinstance(text, str) or not text:
            raise ValueError("thinker payload must be a non-empty string or {'text': str}")
        say = p.get("say") if isinstance(p, dict) else None
        if say is not None and (not isinstance(say, str) or not say):
            raise ValueError("thinker: 'say' must be a non-empty string")
        feats = self._features(p)
        self._start(req, self.tok.encode(text), max_new, features=len(feats) if feats is not None else 0)
        req.model["features"] = feats
        if say is not None:  # forced: the tokens of ``say``, then EOS; no token budget cuts it short
            m = req.model
            fits = self.max_model_len - 1 - m["context"]  # the context holds the prompt, then the answer
            said = self.tok.encode(say)
            if len(said) > fits:
                raise ValueError(f"thinker: 'say' is {len(said)} tokens, over the {fits} that fit "
                                 "after this prompt")
            m["say"], m["min_new"] = [*said, self.eos], 0
            m["max_new"] = len(m["say"])

    def _features(self, payload: Any) -> torch.Tensor | None:
        """The encoder features a payload carries (``stages.media``), checked: rows of ``feature_dim``."""
        f = payload.get("features") if isinstance(payload, dict) else None
        if f is None:
            return None
        a = np.asarray(f, dtype=np.float32)
        if a.ndim != 2 or a.shape[1] != self.feature_dim:
            raise ValueError(f"thinker: features must be float32[rows, {self.feature_dim}], got "
                             f"{list(a.shape)} (the encoders' dim must be the thinker's feature_dim)")
        return torch.from_numpy(a.copy()).to(self.device) if len(a) else None

    def _start(self, req: ReqState, ids: list[int], max_new: int, features: int = 0) -> None:
        """Set up a request for its prompt token ``ids``: limits, stop conditions, its sampler.

        ``features``: the feature rows before the prompt (they take context too).
        Refused (ValueError, vLLM's words) when the prompt and the answer asked
        for do not fit the context.  The decode role of a split thinker
        (:mod:`stages.toy.pd`) calls it when the prompt's KV cache arrives, with the
        prompt the prefill role encoded.
        """
        sp = with_defaults(THINKER_PARAMS, req.sampling, temperature=self.temperature,
                           max_tokens=self.max_new, min_tokens=self.min_new)
        context = features + len(ids)
        check_context(self.max_model_len, context, req.sampling.get("max_tokens"))
        req.model = {"slot": None, "prompt": ids, "pos": None, "n": 0, "last": None, "context": context,
                     "max_new": self._budget(context, max_new, sp["max_tokens"]),
                     "min_new": sp["min_tokens"], "stop_ids": frozenset(sp["stop_token_ids"]),
                     "text": TextStream(self.tok.decoder(), sp["stop"]),
                     "sampler": RequestSampler(sp, self.vocab, seed_source=self.gen, prompt=ids),
                     "cap": min(sp["max_tokens"], self.max_new), "params": sp}

    def _budget(self, context: int, *limits: int) -> int:
        """Tokens an answer may have after ``context`` positions: the smallest limit, the cap, the room."""
        return max(1, min(*limits, self.max_new, self.max_model_len - context))

    def extend(self, req: ReqState, payload: Any) -> None:
        """The next input segment: its text joins the context in the KV cache; generation goes on.

        The cache keeps the conversation so far (prompt, answers, earlier
        segments); only the new tokens are run through the decoder.  The last
        sampled token (EOS after a full answer) goes in first, as the turn's
        separator.  A segment that leaves the conversation no room for an
        answer is refused in vLLM's words (the request fails): nothing of the
        conversation is dropped to make room.
        """
        p = payload
        text, max_new = (p, self.max_new) if isinstance(p, str) else (None, self.max_new)
        if isinstance(p, dict):
            text, max_new = p.get("text"), int(p.get("max_new_tokens", self.max_new))
        if not isinstance(text, str) or not text:
            raise ValueError("thinker segment must be a non-empty string or {'text': str}")
        m = req.model
        new = self.tok.encode(text)
        # the context so far: the prompt (not prefilled yet), or every cached position and the last token
        context = m["context"] + len(new) if m["pos"] is None else m["pos"] + 1 + len(new)
        asked = req.sampling.get("max_tokens")  # what the request asked for, as vLLM counts it
        check_context(self.max_model_len, context, asked)
        m["n"], m["max_new"], m["context"] = 0, self._budget(context, max_new, m["cap"]), context
        m["text"].restart(m["params"]["stop"])  # stop strings apply per segment
        if m["pos"] is None:  # not prefilled yet: the segment joins the prompt
            m["prompt"] = m["prompt"] + new
            return
        seq = [m["last"], *new]  # the last sampled token (not cached yet), then the new text
        with torch.inference_mode():
            self.dec.extend(self.emb(torch.tensor(seq[:-1], device=self.device)), self._slot(req), m["pos"])
        m["pos"] += len(new)
        m["last"] = seq[-1]

    @torch.inference_mode()
    def step(self, reqs: list[ReqState]) -> list[StepResult]:
        hidden: list[torch.Tensor | None] = [None] * len(reqs)
        dec_idx = []
        for i, r in enumerate(reqs):
            m = r.model
            if m["pos"] is None:  # prefill the prompt, then sample the first token from it
                hidden[i] = self._prefill(r)
            else:
                dec_idx.append(i)
        if dec_idx:
            last = torch.tensor([reqs[i].model["last"] for i in dec_idx], device=self.device)
            slots = torch.tensor([reqs[i].model["slot"] for i in dec_idx], device=self.device)
            pos = torch.tensor([reqs[i].model["pos"] for i in dec_idx], device=self.device)
            h = self.dec.step(self.emb(last), slots, pos)
            for j, i in enumerate(dec_idx):
                hidden[i] = h[j]
                reqs[i].model["pos"] += 1
        logits = (self.head(torch.stack(hidden)) + self.bias).float().cpu()  # type: ignore[arg-type]
        for i, r in enumerate(reqs):
            if r.model["n"] < r.model["min_new"]:
                logits[i, self.eos] = -math.inf
        samplers = [r.model["sampler"] for r in reqs]
        toks = sample(samplers, logits)
        results = []
        for r, s, tok in zip(reqs, samplers, toks.tolist(), strict=True):
            m = r.model
            forced = m.get("say")
            if forced is not None:
                tok = forced[min(m["n"], len(forced) - 1)]
            m["n"] += 1
            m["last"] = tok
            s.observe(toks.new_tensor([tok]))
            results.append(self._emit(m, tok))
        return results

    def _prefill(self, req: ReqState) -> torch.Tensor:
        """Fill the request's cache slot with its prompt and set its position; the last hidden state.

        The decode role of a split thinker (:mod:`stages.toy.pd`) takes both from
        the prefill role's KV cache instead.
        """
        m = req.model
        x = self.emb(torch.tensor(m["prompt"], device=self.device))
        feats = m.get("features")
        if feats is not None:  # the encoders' features come first, then the prompt's tokens
            f = self.feat(feats)
            f = f / f.pow(2).mean(-1, keepdim=True).sqrt().clamp_min(1e-6)  # unit RMS, as token embeddings
            x = torch.cat([f, x])
        hidden = self.dec.prefill(x, self._slot(req))
        m["pos"] = len(x)
        return hidden

    def _emit(self, m: dict[str, Any], tok: int) -> StepResult:
        """The step's output for one request: its released text and tokens, and whether it ended."""
        ended = tok == self.eos or tok in m["stop_ids"]
        length = m["n"] >= m["max_new"]
        out = m["text"].push(tok, ended=ended, length=length)
        if out is None:
            return StepResult(None, False, None)  # held back: it may begin a stop string
        toks = np.array(out.tokens, dtype=np.int32)
        data: dict[str, Any] = {"text": out.text, "tokens": toks}
        if out.done:
            data["finish_reason"] = out.finish_reason
        return StepResult(data, out.done, toks if len(toks) else None)

    def warmup(self) -> None:
        self._warm("warm up")

    def info(self) -> dict[str, Any]:
        return {"kind": self.kind, "max_new_tokens": self.max_new, "max_model_len": self.max_model_len,
                "max_say": self.max_model_len - 2, "device": str(self.device),
                "feature_dim": self.feature_dim,
                "tokenizer": "" if self.tok.source == "byte-level" else self.tok.source,
                "vocab_size": self.vocab, "eos": self.eos}


class Talker(SlotModel):
    """Speech-token LM: thinker tokens -> ``frames_per_token`` x ``codebooks`` codes per token.

    Input: ``{"tokens": int[...]}`` (normal mode) or streamed token chunks, ids
    below ``vocab_size`` (the thinker's vocabulary: a pipeline whose thinker has
    a larger one is refused at start, :mod:`stages.fit`; a token past it fails
    its request).  Output: ``{"codes": int32[frames, codebooks]}`` every
    ``chunk_frames`` frames.  Each frame's codes are sampled per codebook with
    the request's parameters (default greedy); the request's ``voice`` picks the
    speaker embedding.  ``max_tokens`` is its context: a longer input is spoken
    whole, the context starting afresh when it is full (never cut short).
    """

    kind = "talker"

    def __init__(self, d_model: PositiveInt = 96, layers: PositiveInt = 2, heads: PositiveInt = 4,
                 codebooks: PositiveInt = 4, codebook_size: PositiveInt = 256,
                 frames_per_token: PositiveInt = 2, chunk_frames: PositiveInt = 8,
                 max_tokens: PositiveInt = 256, vocab_size: PositiveInt = 257,  # the byte-level thinker's
                 slots: PositiveInt = 32, device: str = "cpu", seed: int = 0) -> None:
        super().__init__(slots, device, seed)
        torch.manual_seed(seed + 1)
        self.cb, self.cbs, self.fpt, self.chunk = codebooks, codebook_size, frames_per_token, chunk_frames
        self.vocab = vocab_size
        self.emb = nn.Embedding(vocab_size, d_model).to(self.device)
        self.dec = TinyDecoder(d_model, layers, heads, max_tokens, slots).to(self.device).eval()
        self.head = nn.Linear(d_model, frames_per_token * codebooks * codebook_size).to(self.device)
        self.spk = nn.Embedding(len(VOICES), d_model).to(self.device)  # one speaker per voice

    def admit(self, req: ReqState) -> None:
        if not req.upstream:
            p = req.payload
            toks = p.get("tokens") if isinstance(p, dict) else None
            if toks is None:
                raise ValueError("talker payload must be {'tokens': int array}")
            req.inputs.append(self._tokens(toks))
        sp = with_defaults(TALKER_PARAMS, req.sampling)
        req.model = {"slot": None, "queue": [], "pos": 0, "codes": [], "frames": 0, "limit": sp["max_tokens"],
                     "voice": voice_index(sp["voice"]),
                     "sampler": RequestSampler(sp, self.cbs, seed_source=self.gen, rows=self.fpt * self.cb,
                                               groups=self.cb)}

    def extend(self, req: ReqState, payload: Any) -> None:
        """The next segment's tokens continue the speech context (a fresh one once 3/4 of it is used)."""
        if req.model["pos"] > self.dec.max_len * 3 // 4:
            req.model["pos"] = 0
        if req.upstream:
            req.input_done = False
            return
        toks = payload.get("tokens") if isinstance(payload, dict) else None
        if toks is None:
            raise ValueError("talker segment must be {'tokens': int array}")
        req.inputs.append(self._tokens(toks))

    def feed(self, req: ReqState, data: Any, end: bool) -> None:
        """A chunk of the thinker's tokens (checked: ids of this talker's vocabulary)."""
        super().feed(req, None if data is None else self._tokens(data), end)

    def _tokens(self, toks: Any) -> np.ndarray:
        """Input token ids as a flat array, each below ``vocab_size`` (else ValueError naming the first)."""
        a = np.asarray(toks).reshape(-1)
        if not a.size:
            return a.astype(np.int64)
        if a.dtype.kind not in "iu":
            raise ValueError(f"talker: tokens must be integers, got {a.dtype}")
        bad = np.flatnonzero((a < 0) | (a >= self.vocab))
        if len(bad):
            raise ValueError(f"talker: token {int(a[bad[0]])} is not in its vocabulary of {self.vocab} "
                             "(the thinker's vocabulary must fit: set the talker's vocab_size)")
        return a

    def runnable(self, req: ReqState) -> bool:
        return bool(req.inputs) or bool(req.model["queue"]) or req.input_done

    @torch.inference_mode()
    def step(self, reqs: list[ReqState]) -> list[StepResult]:
        active = []
        for r in reqs:
            m = r.model
            while r.inputs:
                m["queue"].extend(int(t) for t in np.asarray(r.inputs.pop(0)).reshape(-1))
            if m["limit"] is not None and m["frames"] >= m["limit"]:
                m["queue"].clear()  # max_tokens frames made: the rest of the input is skipped
            if m["queue"]:
                if m["pos"] >= self.dec.max_len:
                    m["pos"] = 0  # the context is full: it starts afresh, the input is spoken whole
                active.append(r)
        if active:
            toks = torch.tensor([r.model["queue"].pop(0) for r in active], device=self.device)
            slots = torch.tensor([self._slot(r) for r in active], device=self.device)
            pos = torch.tensor([r.model["pos"] for r in active], device=self.device)
            voices = torch.tensor([r.model["voice"] for r in active], device=self.device)
            h = self.dec.step(self.emb(toks) + self.spk(voices), slots, pos)
            samplers = [r.model["sampler"] for r in active]
            codes = sample(samplers, self.head(h).view(-1, self.cbs)).view(len(active), self.fpt, self.cb)
            for r, s, c in zip(active, samplers, codes, strict=True):
                m = r.model
                s.observe(c)
                frames = c.to(torch.int32).numpy()
                if m["limit"] is not None:
                    frames = frames[: m["limit"] - m["frames"]]
                m["pos"] += 1
                m["frames"] += len(frames)
                m["codes"].append(frames)
        results = []
        for r in reqs:
            m = r.model
            done = r.input_done and not r.inputs and not m["queue"]
            have = sum(len(c) for c in m["codes"])
            if m["codes"] and (have >= self.chunk or done):
                arr = np.concatenate(m["codes"], axis=0)
                m["codes"] = []
                results.append(StepResult({"codes": arr}, done, arr))
            elif done:
                results.append(StepResult({"codes": np.zeros((0, self.cb), np.int32)}, True, None))
            else:
                results.append(StepResult(None, False, None))
        return results

    def warmup(self) -> None:
        self._warm({"tokens": np.arange(8, dtype=np.int32) + 97})

    def info(self) -> dict[str, Any]:
        return {"kind": self.kind, "codebooks": self.cb, "frames_per_token": self.fpt,
                "vocab_size": self.vocab, "device": str(self.device)}


class Code2Wav(SlotModel):
    """Vocoder: codes -> float32 PCM at 24 kHz, ``chunk_frames`` frames per step.

    Input: ``{"codes": int[frames, codebooks]}`` or streamed code chunks.
    Output: ``{"pcm": float32[samples], "sample_rate": 24000}``.  The request's
    ``voice`` picks the speaker embedding that conditions the upsampler and the
    base pitch of the tone.
    """

    kind = "code2wav"

    def __init__(self, codebooks: PositiveInt = 4, codebook_size: PositiveInt = 256, dim: PositiveInt = 64,
                 upsample: Sequence[PositiveInt] = (8, 6, 5, 2), chunk_frames: PositiveInt = 8,
                 gain: NonNegativeFloat = 0.5, slots: PositiveInt = 32, device: str = "cpu",
                 seed: int = 0) -> None:
        super().__init__(slots, device, seed)
        torch.manual_seed(seed + 2)
        self.cb, self.chunk, self.gain = codebooks, chunk_frames, gain
        self.hop = int(np.prod(upsample))
        self.net = Upsampler(codebooks, codebook_size, dim, list(upsample)).to(self.device).eval()
        self.spk = nn.Embedding(len(VOICES), dim).to(self.device)  # one speaker per voice

    def admit(self, req: ReqState) -> None:
        if not req.upstream:
            p = req.payload
            codes = p.get("codes") if isinstance(p, dict) else None
            if codes is None:
                raise ValueError("code2wav payload must be {'codes': int array [frames, codebooks]}")
            req.inputs.append(np.asarray(codes))
        voice = voice_index(with_defaults(CODE2WAV_PARAMS, req.sampling)["voice"])
        req.model = {"queue": np.zeros((0, self.cb), np.int32), "phase": 0.0, "voice": voice}

    def extend(self, req: ReqState, payload: Any) -> None:
        """The next segment's codes; the voice's phase carries on, so segments join without a click."""
        if req.upstream:
            req.input_done = False
            return
        codes = payload.get("codes") if isinstance(payload, dict) else None
        if codes is None:
            raise ValueError("code2wav segment must be {'codes': int array [frames, codebooks]}")
        req.inputs.append(np.asarray(codes))

    @torch.inference_mode()
    def step(self, reqs: list[ReqState]) -> list[StepResult]:
        take = []
        for r in reqs:
            m = r.model
            while r.inputs:
                c = np.asarray(r.inputs.pop(0)).reshape(-1, self.cb)
                m["queue"] = np.concatenate([m["queue"], c.astype(np.int32)], axis=0)
            n = min(self.chunk, len(m["queue"]))
            take.append(m["queue"][:n])
            m["queue"] = m["queue"][n:]
        pcm: list[np.ndarray | None] = [None] * len(reqs)
        # One forward pass per chunk length (usually one: full chunks).  Padding a shorter chunk
        # would let the padding's embeddings leak into its last frames through the convolutions,
        # making a request's audio depend on its batch-mates.
        for n in {len(t) for t in take} - {0}:
            idx = [i for i, t in enumerate(take) if len(t) == n]
            batch = torch.from_numpy(np.stack([take[i] for i in idx])).to(self.device)
            voices = torch.tensor([reqs[i].model["voice"] for i in idx], device=self.device)
            out = (self.net(batch, self.spk(voices)) * self.gain).float().cpu().numpy()
            for j, i in enumerate(idx):
                pcm[i] = out[j]
        results = []
        for i, r in enumerate(reqs):
            done = r.input_done and not r.inputs and not len(r.model["queue"])
            n = len(take[i])
            if n:
                texture = pcm[i]
                assert texture is not None
                audio = self._voice(r, take[i], texture[: n * self.hop])
                results.append(StepResult({"pcm": audio, "sample_rate": SAMPLE_RATE}, done, None))
            elif done:
                results.append(StepResult({"pcm": np.zeros(0, np.float32), "sample_rate": SAMPLE_RATE},
                                          True, None))
            else:
                results.append(StepResult(None, False, None))
        return results

    def _voice(self, req: ReqState, codes: np.ndarray, texture: np.ndarray) -> np.ndarray:
        """A phase-continuous tone, pitched by the voice and following codebook 0, plus the conv texture.

        Random conv weights alone give a near-silent DC offset; this makes the
        dummy audio audible and code-dependent.
        """
        f0 = np.repeat(80.0 + 9.0 * req.model["voice"] + (codes[:, 0] % 24) * 15.0, self.hop)
        phase = req.model["phase"] + np.cumsum(2 * np.pi * f0 / SAMPLE_RATE)
        req.model["phase"] = float(phase[-1] % (2 * np.pi))
        tex = texture - texture.mean()
        tex = tex / (np.abs(tex).max() + 1e-6)
        return (self.gain * (0.8 * np.sin(phase) + 0.2 * tex)).astype(np.float32)

    def runnable(self, req: ReqState) -> bool:
        return bool(req.inputs) or bool(len(req.model["queue"])) or req.input_done

    def warmup(self) -> None:
        self._warm({"codes": np.zeros((2 * self.chunk, self.cb), np.int32)})

    def info(self) -> dict[str, Any]:
        return {"kind": self.kind, "sample_rate": SAMPLE_RATE, "hop": self.hop, "device": str(self.device)}
