"""Example client of the ``trio-orch serve`` realtime session (``/v1/realtime``).

Sends each text segment, prints the answer's text as it streams, collects
its audio, waits until the segment's answer is complete, pauses, sends the
next one; then finishes the session and writes the audio to a WAV file::

    trio-orch serve --port 8000 &
    python docs/realtime_client.py "Hello" "How are you today?" "Goodbye" --pause 1 --out session.wav

Uses the ``websockets`` library (installed with trio-orch) in its plain,
synchronous form; nothing else beyond the standard library.
"""

from __future__ import annotations

import argparse
import base64
import json
import sys
import time
import wave
from typing import Any

from websockets.exceptions import WebSocketException
from websockets.sync.client import connect

SAMPLE_RATE = 24000  # the session's audio: 16-bit little-endian mono PCM at 24 kHz


def talk(url: str, segments: list[str], *, pause: float = 1.0, out: str | None = "session.wav",
         modalities: list[str] | None = None, show: bool = True, timeout: float = 120.0) -> list[Any]:
    """Run one session; return its log: ``("sent", event)`` and ``("recv", event)`` in order."""
    log: list[Any] = []
    audio = bytearray()

    with connect(url, open_timeout=timeout, close_timeout=5) as ws:

        def send(event: dict[str, Any]) -> None:
            ws.send(json.dumps(event))
            log.append(("sent", event))

        def receive_until(kind: str, segment: int | None = None) -> None:
            while True:
                event = json.loads(ws.recv(timeout=timeout))
                log.append(("recv", event))
                t = event["type"]
                if t == "error":
                    raise RuntimeError(f"the server refused an event: {event['error']['message']}")
                if t == "response.text.delta" and show:
                    print(event["delta"], end="", flush=True)
                elif t == "response.audio.delta":
                    audio.extend(base64.b64decode(event["delta"]))
                elif t == "response.done" and kind != "response.done":
                    raise RuntimeError(f"the response ended early: {event['response']}")
                if t == kind and (segment is None or event.get("segment") == segment):
                    return

        receive_until("session.created")
        if modalities is not None:
            send({"type": "session.update", "session": {"modalities": modalities}})
            receive_until("session.updated")
        for i, text in enumerate(segments):
            if i and pause:
                time.sleep(pause)
            if show:
                print(f"\n> {text}\n< ", end="", flush=True)
            send({"type": "input_text_buffer.append", "text": text})
            send({"type": "input_text_buffer.commit"})
            receive_until("response.segment.done", i)  # this segment's text and audio are complete
        send({"type": "session.finish"})
        receive_until("response.done")
    if show:
        print()
    if out:
        with wave.open(out, "wb") as w:
            w.setnchannels(1)
            w.setsampwidth(2)
            w.setframerate(SAMPLE_RATE)
            w.writeframes(bytes(audio))
        if show:
            print(f"wrote {len(audio) // 2 / SAMPLE_RATE:.2f} s of audio to {out}")
    return log


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Talk to a trio-orch realtime session: text segments in, "
                                            "streamed text and audio out.")
    p.add_argument("segments", nargs="+", help="the input segments, sent one after the other")
    p.add_argument("--url", default="ws://127.0.0.1:8000/v1/realtime", help="the session's WebSocket URL")
    p.add_argument("--pause", type=float, default=1.0,
                   help="seconds to wait after a segment's answer before sending the next (default 1)")
    p.add_argument("--out", default="session.wav", help="WAV file for the session's audio")
    p.add_argument("--text-only", action="store_true", help="ask for text only (no audio)")
    args = p.parse_args(argv)
    try:
        talk(args.url, args.segments, pause=args.pause, out=None if args.text_only else args.out,
             modalities=["text"] if args.text_only else None)
    except (OSError, RuntimeError, WebSocketException) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
