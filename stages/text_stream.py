"""One request's generated tokens -> the text and tokens a text stage may release, step by step.

Shared by every text-generating stage model (the toy thinker, the checkpoint
kinds): each step pushes the token just sampled and gets back what may go
out now -- whole characters only (:class:`~stages.tokenizer.IncrementalDecoder`),
never any part of a stop string (:class:`~stages.sampling.StopText` holds text
back until it either completes one or cannot any more), and the tokens whose
characters that text holds (a held-back character keeps its tokens back too,
so ``tokens`` always spell ``text``).  A value pushed with a token (``extra``:
its hidden state, say) is released with it.  This module imports neither torch
nor trio.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from stages.sampling import StopText
from stages.tokenizer import IncrementalDecoder

__all__ = ["Release", "TextStream"]


@dataclass(slots=True)
class Release:
    """What one step lets out: text, the tokens that spell it (and their extras), whether it ended."""

    text: str
    tokens: list[int]
    extras: list[Any] = field(default_factory=list)
    done: bool = False
    #: when done: "stop" (end-of-text, a stop token or string) or "length" (a token limit)
    finish_reason: str | None = None


class TextStream:
    """Incremental detokenizing with stop strings and held tokens, for one request."""

    def __init__(self, decoder: IncrementalDecoder, stops: Sequence[str] = ()) -> None:
        self.decoder = decoder
        self.stop: StopText | None = None
        self.held: list[tuple[int, int, Any]] = []  # (token, characters its decoding completed, extra)
        self.restart(stops)

    def restart(self, stops: Sequence[str]) -> None:
        """A new input segment: stop strings apply afresh (the decoder's state carries on)."""
        self.stop = StopText(stops) if stops else None

    def push(self, token: int, *, ended: bool, length: bool, extra: Any = None) -> Release | None:
        """The token just generated; ``ended``: it ends the text (end-of-text or a stop token, never
        shown); ``length``: a token limit is reached with it.  None: nothing to release yet."""
        piece = self.decoder.push(token) if not ended else ""  # whole characters only
        if ended or length:  # the end: characters held back behind an unfinished last one go out
            piece += self.decoder.flush()
        if not ended:
            self.held.append((token, len(piece), extra))
        text, stopped = piece, False
        if self.stop is not None:
            text, stopped = self.stop.push(text)
            if (ended or length) and not stopped:
                text += self.stop.flush()
        n = chars = 0  # release the held tokens whose characters the text covers
        while n < len(self.held) and chars + self.held[n][1] <= len(text):
            chars += self.held[n][1]
            n += 1
        out, self.held[:n] = self.held[:n], []
        done = ended or stopped or length
        if not done and not out:
            return None  # held back: it may begin a stop string
        reason = ("length" if length and not (ended or stopped) else "stop") if done else None
        return Release(text, [t for t, _, _ in out], [x for _, _, x in out], done, reason)
