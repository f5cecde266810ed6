"""``trio-orch generate --stream-input``: one resumable request fed line by line from stdin.

The first non-empty line starts the request; every later one is its next
input segment, sent as soon as it is read (while the answer to the previous
one may still stream); end of input closes it with an empty final segment.
The answer streams to stdout, one line of text per segment; the audio of
every segment goes to one WAV file.  Try it by hand::

    trio-orch generate --stream-input            # type lines; Ctrl-D ends
    printf 'Hello\\nHow are you?\\n' | trio-orch generate --stream-input --out talk.wav
"""

from __future__ import annotations

import sys
from typing import Any, TextIO

import numpy as np
import trio

from stages.config import PipelineConfig
from stages.registry import as_audio, as_text, outputs_of
from trio_orch.shell.orchestrator import Orchestrator
from trio_orch.types import OrchError

__all__ = ["first_line", "stream_input"]

RID = "generate-stream"


async def _read_line(stream: TextIO) -> str | None:
    """The next non-empty line without its newline (None at end of input)."""
    while True:
        line = await trio.to_thread.run_sync(stream.readline, abandon_on_cancel=True)
        if not line:
            return None
        if line.strip():
            return line.rstrip("\r\n")


async def first_line(stream: TextIO) -> str | None:
    """The first non-empty line of ``stream`` (None: no input at all); read before workers start."""
    return await _read_line(stream)


async def _feed(orch: Orchestrator, stream: TextIO) -> int:
    """Send every later line as the next segment; close the input at its end.  Return the count."""
    n = 0
    try:
        while (line := await _read_line(stream)) is not None:
            await orch.update_request(RID, line)
            n += 1
        await orch.update_request(RID, None, final=True)  # an empty final segment: no more input
    except (ValueError, RuntimeError):  # the request ended (failed); its error is reported
        pass
    return n


async def stream_input(cfg: PipelineConfig, orch: Orchestrator, sampling: Any = None,
                       stream: TextIO | None = None, *, first: str | None = None, priority: int = 0
                       ) -> tuple[int, np.ndarray | None, int]:
    """Run the session through ``orch``; return (exit code, the audio or None, its sample rate).

    ``sampling``: the request's per-stage parameters (they hold for every segment).
    ``first``: the first line, if the caller read it already (:func:`first_line`).
    ``priority``: the request's (lower first).
    """
    stream = stream or sys.stdin
    outputs = outputs_of(s.kind for s in cfg.stages)
    if first is None:
        first = await _read_line(stream)
    if first is None:
        print("error: --stream-input read no line from standard input", file=sys.stderr)
        return 2, None, 0
    pcm: list[np.ndarray] = []
    rate = 24000
    failed: OrchError | None = None
    await orch.add_request(RID, first, resumable=True, sampling=sampling, priority=priority)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_feed, orch, stream)
        while True:
            msg = await orch.next_output()
            if isinstance(msg, OrchError):
                failed = msg
                break
            text = as_text(outputs[msg.stage_id], msg.data)
            audio = as_audio(outputs[msg.stage_id], msg.data) if text is None else None
            if text:
                print(text, end="", flush=True)
            elif audio is not None and len(audio[0]):
                pcm.append(audio[0])
                rate = audio[1]
            if msg.segment_done and text is not None:
                print(flush=True)  # one line of answer per input segment
            if msg.finished:
                break
        nursery.cancel_scope.cancel()  # the reader may still wait for a line
    if failed is not None:
        print(f"\nerror: request failed at stage {failed.stage_id} ({failed.kind}): {failed.message}",
              file=sys.stderr)
        return 1, None, rate
    return 0, np.concatenate(pcm) if pcm else None, rate
