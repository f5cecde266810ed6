"""Example client of the ``trio-orch serve`` realtime session (``/v1/realtime``), on the official SDK.

Connects with ``openai``'s ``client.realtime.connect(model=...)``, then for
each text turn adds a user message (``conversation.item.create``), asks for a
response (``response.create``), prints the answer's text as it streams,
collects its audio until ``response.done``, pauses, and sends the next turn;
at the end it writes all the audio to a WAV file::

    trio-orch serve --port 8000 &
    python docs/realtime_client.py "Hello" "How are you today?" "Goodbye" --pause 1 --out session.wav

Needs the ``openai`` package (``pip install "openai[realtime]"``; it brings
``websockets``, which trio-orch installs anyway).  The key, if the server was
started with ``--api-key``, comes from ``--api-key`` or ``OPENAI_API_KEY``.
"""

from __future__ import annotations

import argparse
import base64
import os
import sys
import threading
import time
import wave
from dataclasses import dataclass, field
from typing import Any

from openai import OpenAI, OpenAIError
from websockets.exceptions import WebSocketException

SAMPLE_RATE = 24000  # the session's audio: 16-bit little-endian mono PCM at 24 kHz
TEXT_DELTAS = ("response.output_text.delta", "response.output_audio_transcript.delta")


@dataclass
class Turn:
    """One turn: what was said, every server event of its response (SDK models), and the answer."""

    text: str
    events: list[Any] = field(default_factory=list)
    status: str | None = None  # response.done's status: completed, cancelled, failed
    transcript: str = ""  # the streamed text deltas, joined
    audio: bytes = b""  # the streamed audio, 16-bit PCM


def talk(base_url: str, texts: list[str], *, pause: float = 1.0, out: str | None = "session.wav",
         text_only: bool = False, show: bool = True, api_key: str | None = None, model: str | None = None,
         timeout: float = 120.0) -> list[Turn]:
    """Run one session over ``base_url`` (``http://HOST:PORT/v1``); return its turns in order.

    ``model``: the served name to ask for (default: the server's first, from
    ``GET /v1/models``: a name it does not serve is refused at the handshake).
    ``timeout``: seconds a turn may take; past it the connection is closed and RuntimeError raised.
    """
    client = OpenAI(base_url=base_url, api_key=api_key or os.environ.get("OPENAI_API_KEY") or "unused")
    turns: list[Turn] = []
    if model is None:
        served = client.models.list().data
        if not served:
            raise RuntimeError("the server lists no model")
        model = served[0].id
    with client.realtime.connect(model=model) as conn:
        created = conn.recv()
        if created.type != "session.created":
            raise RuntimeError(f"expected session.created, got {created.type}")
        if text_only:
            conn.session.update(session={"type": "realtime", "output_modalities": ["text"]})
            if (ack := conn.recv()).type != "session.updated":
                raise RuntimeError(f"session.update was not taken: {ack}")
        for i, text in enumerate(texts):
            if i and pause:
                time.sleep(pause)
            if show:
                print(f"\n> {text}\n< ", end="", flush=True)
            conn.conversation.item.create(item={"type": "message", "role": "user",
                                                "content": [{"type": "input_text", "text": text}]})
            conn.response.create()
            turns.append(_receive_turn(conn, Turn(text), show, timeout))
    if show:
        print()
    if out and not text_only:
        audio = b"".join(t.audio for t in turns)
        with wave.open(out, "wb") as w:
            w.setnchannels(1)
            w.setsampwidth(2)
            w.setframerate(SAMPLE_RATE)
            w.writeframes(audio)
        if show:
            print(f"wrote {len(audio) // 2 / SAMPLE_RATE:.2f} s of audio to {out}")
    return turns


def _receive_turn(conn: Any, turn: Turn, show: bool, timeout: float) -> Turn:
    """Read events until the response's ``response.done`` (closing the connection after ``timeout``)."""
    watchdog = threading.Timer(timeout, conn.close)
    watchdog.start()
    audio = bytearray()
    try:
        for event in conn:
            if event.type == "error":
                raise RuntimeError(f"the server refused an event: {event.error.message}")
            if event.type in ("conversation.item.added", "conversation.item.done") and not turn.events:
                continue  # the acknowledgement of our own user message
            turn.events.append(event)
            if event.type in TEXT_DELTAS:
                turn.transcript += event.delta
                if show:
                    print(event.delta, end="", flush=True)
            elif event.type == "response.output_audio.delta":
                audio.extend(base64.b64decode(event.delta))
            elif event.type == "response.done":
                turn.status = event.response.status
                turn.audio = bytes(audio)
                if turn.status != "completed":
                    raise RuntimeError(f"the response ended {turn.status}: {event.response.status_details}")
                return turn
    finally:
        watchdog.cancel()
    raise RuntimeError(f"no response.done within {timeout} s (the connection was closed)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Talk to a trio-orch realtime session with the official openai "
                                            "SDK: text turns in, streamed text and audio out.")
    p.add_argument("texts", nargs="+", help="the user's turns, sent one after the other")
    p.add_argument("--base-url", default="http://127.0.0.1:8000/v1",
                   help="the server's OpenAI base URL (the session is BASE_URL/realtime)")
    p.add_argument("--model", default=None,
                   help="the model name sent as ?model= (default: the server's first served name, "
                        "from GET /v1/models)")
    p.add_argument("--api-key", default=None, help="the server's --api-key (default: $OPENAI_API_KEY)")
    p.add_argument("--pause", type=float, default=1.0,
                   help="seconds to wait after an answer before sending the next turn (default 1)")
    p.add_argument("--out", default="session.wav", help="WAV file for the session's audio")
    p.add_argument("--text-only", action="store_true", help="ask for text only (no audio, no WAV)")
    args = p.parse_args(argv)
    try:
        talk(args.base_url, args.texts, pause=args.pause, out=args.out, text_only=args.text_only,
             api_key=args.api_key, model=args.model)
    except (OSError, RuntimeError, OpenAIError, WebSocketException) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
