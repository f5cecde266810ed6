"""thinker -> talker: the thinker's outputs framed as ``generate()`` frames them for the talker.

Runs in the orchestrator (``StageSpec.next_input`` of the Omni thinker) and in
the talker's worker (async-chunk mode, as the outputs stream in), so it only
joins and slices numpy arrays -- no torch, no trio.  A thinker asked to speak
(``"speak": true`` in its payload) sends, besides its text:

- in each output, ``rows``: float32 [k, H], per position it ran (the prompt's
  L at the prefill, then one per reply token fed back), the last layer's
  hidden state plus the input embedding (zero at image and audio
  placeholders);
- in its first output, ``talker``: the prompt's ids, the speaker's start id,
  ``frame`` -- the thinker's embeddings of the speaker's start token, the
  text end token and the text pad token (float32 [3, H]) -- and the media
  grids the talker's rope index reads; for a later segment of a conversation
  (a realtime session's next turn) the ids of the whole conversation and
  ``history``, the rows of everything before the segment, so the talker
  frames the new answer as ``generate()`` would on the whole conversation.

``generate()`` then starts the talker from ``embeds`` = the prompt's rows,
the start embedding, the first reply token's row (``[L+2, H]``) and feeds it
one more row per code: the other reply rows, then the end and pad embeddings,
the pad one repeating.  The reply's last token (end-of-text, or the one the
length limit cut) was never fed to the thinker, so it has no row: n-1 rows
for n tokens.  :class:`TalkerTrack` holds this as it arrives; the talker asks
it for its prefill once the first reply row is in, and for each next row
(None: not here yet -- it waits).
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["TALKER_KEYS", "TalkerTrack", "talker_input"]

#: the keys of the thinker's ``talker`` header that go to the talker's rope index unchanged
TALKER_KEYS = ("image_grid_thw", "video_grid_thw", "audio_feature_lengths", "video_second_per_grid",
               "use_audio_in_video")


class TalkerTrack:
    """The talker's text track of one request, from the thinker's outputs as they come (see above)."""

    def __init__(self) -> None:
        self.head: dict[str, Any] | None = None
        self.rows: list[np.ndarray] = []  # one [k, H] block per output
        self.count = 0  # rows so far
        self.first: int | None = None  # the first reply token
        self.closed = False
        self._flat: np.ndarray | None = None

    def add(self, output: Any) -> None:
        """One thinker output (``None`` or a dict without rows adds nothing)."""
        if not isinstance(output, dict):
            return
        if isinstance(output.get("talker"), dict):
            self.head = output["talker"]
            if self.head.get("history") is not None:  # a later turn: the conversation's rows so far
                block = np.asarray(self.head["history"], dtype=np.float32)
                self.rows.append(block)
                self.count += len(block)
                self._flat = None
        if output.get("rows") is not None:
            block = np.asarray(output["rows"], dtype=np.float32)
            self.rows.append(block)
            self.count += len(block)
            self._flat = None
        tokens = np.asarray(output.get("tokens", ()), dtype=np.int64).reshape(-1)
        if self.first is None and len(tokens):
            self.first = int(tokens[0])

    def close(self) -> None:
        """The thinker finished: the end and pad embeddings follow the last row."""
        self.closed = True

    @property
    def prompt_len(self) -> int:
        if self.head is None:
            raise ValueError("the thinker's outputs carry no talker context (its payload must ask it to "
                             "speak)")
        return len(self.head["prompt_ids"])

    def _all(self) -> np.ndarray:
        if self._flat is None:
            self._flat = np.concatenate(self.rows) if self.rows else np.zeros((0, 0), np.float32)
            self.rows = [self._flat] if self.rows else []
        return self._flat

    @property
    def empty(self) -> bool:
        """Closed with no reply row: the talker has nothing to say (``generate()`` fails on it)."""
        return self.closed and (self.head is None or self.count <= self.prompt_len or self.first is None)

    def ready(self) -> bool:
        """Can the talker's prefill run (the prompt's rows and the first reply row are in)?"""
        return self.head is not None and self.first is not None and self.count > self.prompt_len

    def prefill(self) -> dict[str, Any]:
        """``embeds`` [L+2, H], ``text_ids`` [L+2] and the media grids: what the talker starts from."""
        head, n = self.head, self.prompt_len
        assert head is not None and self.first is not None
        rows = self._all()
        start = np.asarray(head["frame"], dtype=np.float32)[0]
        out = {"embeds": np.concatenate([rows[:n], start[None], rows[n:n + 1]]),
               "text_ids": np.concatenate([np.asarray(head["prompt_ids"], dtype=np.int64).reshape(-1),
                                           [int(head["speaker_id"])], [self.first]])}
        out.update({k: head[k] for k in TALKER_KEYS if head.get(k) is not None})
        return out

    def reply(self, j: int) -> np.ndarray | None:
        """The row fed with the talker's ``j``-th code (0-based after the prefill); None: not here yet."""
        n = self.prompt_len
        rows = self._all()
        at = n + 1 + j
        if at < len(rows):
            return rows[at]
        if not self.closed:
            return None
        assert self.head is not None
        frame = np.asarray(self.head["frame"], dtype=np.float32)
        return frame[1] if at == len(rows) else frame[2]  # the text end, then the pad for ever

    def remaining(self) -> np.ndarray:
        """Every row the talker will be fed, closed: the reply rows after the first, end, pad."""
        assert self.closed and self.head is not None
        frame = np.asarray(self.head["frame"], dtype=np.float32)
        return np.concatenate([self._all()[self.prompt_len + 1:], frame[1:3]])


def talker_input(prompt: Any, outputs: list[Any]) -> Any:
    """The thinker's outputs for one request -> the talker's input (see the module's docstring).

    ``{"embeds", "text_ids", "reply", ...grids}``; a reply with nothing fed
    back gives ``{"empty": True}``: the talker has nothing to say.
    """
    track = TalkerTrack()
    for out in outputs:
        track.add(out)
    track.close()
    if track.prompt_len and track.empty:
        return {"empty": True}
    return {**track.prefill(), "reply": track.remaining()}
