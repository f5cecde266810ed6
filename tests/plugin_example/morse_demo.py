"""A pipeline of plug-in stage models defined outside ``stages/``: shout the prompt, then beep it.

``Shout`` (a text stage) emits the prompt's words one per step, upper-cased and
followed by a suffix; ``Morse`` (an audio stage) turns each word into Morse-code
beeps.  numpy only, no torch.  The walk-through is docs/plugins.md; run it from
the repository root with::

    PYTHONPATH=tests/plugin_example .venv/bin/trio-orch generate "Hello plug-ins" \\
        --config tests/plugin_example/morse.toml --out morse.wav
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from stages.base import ReqState, StageModel, StepResult
from stages.registry import StageSpec
from stages.sampling_params import Param

__all__ = ["Morse", "Shout", "morse_pcm", "words_input"]

MORSE = {"A": ".-", "B": "-...", "C": "-.-.", "D": "-..", "E": ".", "F": "..-.", "G": "--.", "H": "....",
         "I": "..", "J": ".---", "K": "-.-", "L": ".-..", "M": "--", "N": "-.", "O": "---", "P": ".--.",
         "Q": "--.-", "R": ".-.", "S": "...", "T": "-", "U": "..-", "V": "...-", "W": ".--", "X": "-..-",
         "Y": "-.--", "Z": "--..", "0": "-----", "1": ".----", "2": "..---", "3": "...--", "4": "....-",
         "5": ".....", "6": "-....", "7": "--...", "8": "---..", "9": "----."}


def morse_pcm(word: str, *, sample_rate: int = 8000, tone_hz: float = 600.0,
              unit_ms: float = 60.0) -> np.ndarray:
    """One word as float32 beeps: dot 1 unit, dash 3; gaps of 1 unit in a letter, 3 between
    letters, 7 after the word.  Characters without a Morse code are skipped."""
    unit = max(1, int(sample_rate * unit_ms / 1000))
    t = np.arange(3 * unit) / sample_rate
    tone = (0.5 * np.sin(2 * np.pi * tone_hz * t)).astype(np.float32)
    spans: list[tuple[bool, int]] = []
    for letter in (c for c in word.upper() if c in MORSE):
        for symbol in MORSE[letter]:
            spans += [(True, 1 if symbol == "." else 3), (False, 1)]
        spans.append((False, 2))
    spans.append((False, 4))
    return np.concatenate([tone[: n * unit] if on else np.zeros(n * unit, np.float32) for on, n in spans])


def words_input(prompt: Any, outputs: list[Any]) -> Any:
    """Shout -> next stage, normal mode: the shouted words, in order (runs in the orchestrator)."""
    return {"words": [o["word"] for o in outputs]}


class Shout(StageModel):
    """Text stage: the prompt's words, one per step, upper-cased, each followed by ``suffix``.

    Payload: the prompt, or ``{"text": str, "max_new_tokens": int}`` (at most that many words).
    Sampling parameter ``max_tokens``: at most that many words, too.
    Output per step: ``{"text": "WORD! ", "word": "WORD"}``; async-chunk: the word goes downstream.
    """

    kind = "shout"
    stage_spec = StageSpec(output="text", next_input=words_input,
                           sampling={"max_tokens": Param("int", None, "most words (default: all)", lo=1)})

    def __init__(self, suffix: str = "!") -> None:
        self.suffix = suffix

    def admit(self, req: ReqState) -> None:
        if req.upstream:
            raise ValueError("shout takes the whole prompt: make it stage 0")
        p = req.payload
        text, limit = (p.get("text"), p.get("max_new_tokens")) if isinstance(p, dict) else (p, None)
        if not isinstance(text, str) or not text.split():
            raise ValueError("shout: the payload must be a non-empty string or {'text': str}")
        limit = req.sampling.get("max_tokens", limit)  # checked against stage_spec.sampling already
        req.model = [w.upper() for w in text.split()][: limit or None]

    def step(self, reqs: list[ReqState]) -> list[StepResult]:
        results = []
        for r in reqs:
            word = r.model.pop(0)
            results.append(StepResult({"text": word + self.suffix + " ", "word": word}, not r.model, word))
        return results

    def info(self) -> dict[str, Any]:
        return {"kind": self.kind, "suffix": self.suffix, "pid": os.getpid()}


class Morse(StageModel):
    """Audio stage: each word as Morse-code beeps, one word per step.

    Input: ``{"words": [str, ...]}`` (normal mode) or the words streamed one by one
    (async-chunk).  Output: ``{"pcm": float32[samples], "sample_rate": int}``.
    Sampling parameter ``tone_hz``: this request's beep pitch (default: the model's).
    """

    kind = "morse"
    stage_spec = StageSpec(output="audio", sampling={
        "tone_hz": Param("float", None, "beep pitch in Hz (default: the model option)", lo=100.0, hi=2000.0)})

    def __init__(self, tone_hz: float = 600.0, unit_ms: float = 60.0, sample_rate: int = 8000) -> None:
        if tone_hz <= 0 or unit_ms <= 0 or sample_rate <= 0:
            raise ValueError("morse: tone_hz, unit_ms and sample_rate must be > 0")
        self.tone_hz, self.unit_ms, self.rate = tone_hz, unit_ms, sample_rate

    def admit(self, req: ReqState) -> None:
        if not req.upstream:
            words = req.payload.get("words") if isinstance(req.payload, dict) else None
            if not isinstance(words, list):
                raise ValueError("morse: the payload must be {'words': [str, ...]}")
            req.inputs.extend(words)

    def step(self, reqs: list[ReqState]) -> list[StepResult]:
        results = []
        for r in reqs:
            word = r.inputs.pop(0) if r.inputs else None
            tone = r.sampling.get("tone_hz", self.tone_hz)
            pcm = (morse_pcm(str(word), sample_rate=self.rate, tone_hz=tone, unit_ms=self.unit_ms)
                   if word else np.zeros(0, np.float32))
            results.append(StepResult({"pcm": pcm, "sample_rate": self.rate}, r.input_done and not r.inputs))
        return results

    def info(self) -> dict[str, Any]:
        return {"kind": self.kind, "sample_rate": self.rate, "pid": os.getpid()}
