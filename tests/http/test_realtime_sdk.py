"""``/v1/realtime`` driven by the official ``openai`` SDK, on both serve fronts.

The SDK's synchronous client (``OpenAI(...).realtime.connect(model=...)``,
over the ``websockets`` library) runs in the test's thread against a real
server on loopback (``tests.http_helpers.serve``: the serve command's app on
uvicorn, or on the lean server in the engine's Trio run), over the toy pipeline.
Each event is taken as the SDK parses it, so a wrong name or field shows as
the wrong type here.  A watchdog closes a connection that hangs, which fails
the test naming the wait instead of blocking the suite.
"""

from __future__ import annotations

import base64
import json
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import numpy as np
import pytest
from openai import OpenAI
from openai.resources.realtime.realtime import RealtimeConnection
from openai.types.realtime import (
    ConversationItemAdded,
    ConversationItemDone,
    RealtimeErrorEvent,
    ResponseAudioDeltaEvent,
    ResponseAudioTranscriptDeltaEvent,
    ResponseAudioTranscriptDoneEvent,
    ResponseContentPartAddedEvent,
    ResponseCreatedEvent,
    ResponseDoneEvent,
    ResponseOutputItemAddedEvent,
    ResponseTextDeltaEvent,
    ResponseTextDoneEvent,
    SessionCreatedEvent,
    SessionUpdatedEvent,
)
from websockets.exceptions import InvalidStatus

from tests.http_helpers import FRONTS, Served, TrioServed, g711_samples, metrics, serve
from tests.waiting import wait_until
from trio_orch.openai.audio_out import Resampler
from trio_orch.testing.toy_pipeline import toy_pipeline

HANG = 30.0  # seconds before a connection is declared hung (asserts nothing about timing)


@pytest.fixture(scope="module", params=FRONTS)
def server(request: pytest.FixtureRequest) -> Iterator[Served | TrioServed]:
    s = serve(request.param, toy_pipeline(token_delay=0.01, audio_delay=0.005), model_name="test")
    yield s
    s.stop()


def client(s: Served | TrioServed, api_key: str = "sk-unused") -> OpenAI:
    return OpenAI(base_url=f"{s.url}/v1", api_key=api_key, max_retries=0)


@contextmanager
def session(s: Served | TrioServed, api_key: str = "sk-unused") -> Iterator[RealtimeConnection]:
    """A connected session whose ``session.created`` was read."""
    with client(s, api_key).realtime.connect(model="test") as conn:
        watchdog = threading.Timer(HANG, conn.close)
        watchdog.start()
        try:
            created = conn.recv()
            assert isinstance(created, SessionCreatedEvent), created
            assert created.session.model == "test" and created.session.type == "realtime"
            yield conn
        finally:
            watchdog.cancel()


def until(conn: RealtimeConnection, kind: type) -> list[Any]:
    """The events up to and including the first of type ``kind``."""
    events = []
    while True:
        e = conn.recv()  # raises ConnectionClosed if the watchdog had to close a hung session
        events.append(e)
        if isinstance(e, kind):
            return events


def ask(conn: RealtimeConnection, text: str) -> None:
    conn.conversation.item.create(item={"type": "message", "role": "user",
                                        "content": [{"type": "input_text", "text": text}]})
    conn.response.create()


def of(events: list[Any], kind: type) -> list[Any]:
    return [e for e in events if isinstance(e, kind)]


def idle(s: Served | TrioServed) -> Callable[[], bool]:
    return lambda: s.engine.stats().active_requests == 0


def test_connect_then_item_create_and_response_create_end_with_response_done(server: Any) -> None:
    with session(server) as conn:
        conn.session.update(session={"type": "realtime", "output_modalities": ["text"]})
        (updated,) = until(conn, SessionUpdatedEvent)
        assert updated.session.output_modalities == ["text"]
        ask(conn, "Hello")
        events = until(conn, ResponseDoneEvent)
    added, item_done, created, item_added, _, part_added, *rest = events
    assert isinstance(added, ConversationItemAdded) and isinstance(item_done, ConversationItemDone)
    assert added.item.role == "user" and added.item.content[0].text == "Hello"
    assert isinstance(created, ResponseCreatedEvent) and created.response.status == "in_progress"
    assert isinstance(item_added, ResponseOutputItemAddedEvent) and item_added.item.role == "assistant"
    assert isinstance(part_added, ResponseContentPartAddedEvent) and part_added.part.type == "text"
    deltas = of(rest, ResponseTextDeltaEvent)
    (text_done,) = of(rest, ResponseTextDoneEvent)
    done = rest[-1]
    assert done.response.status == "completed" and done.response.id == created.response.id
    assert all(d.response_id == done.response.id and d.item_id == item_added.item.id for d in deltas)
    assert "".join(d.delta for d in deltas) == text_done.text == done.response.output[0].content[0].text \
        == "You said: Hello"
    wait_until(idle(server), "no request left")


def test_audio_responses_stream_transcript_and_pcm_turn_after_turn(server: Any) -> None:
    with session(server) as conn:
        turns = []
        for text in ("Hello", "How are you"):
            ask(conn, text)
            turns.append(until(conn, ResponseDoneEvent))
    for text, events in zip(("Hello", "How are you"), turns, strict=True):
        transcript = "".join(d.delta for d in of(events, ResponseAudioTranscriptDeltaEvent))
        (done,) = of(events, ResponseAudioTranscriptDoneEvent)
        assert transcript == done.transcript == f"You said: {text}"
        pcm = np.frombuffer(b"".join(base64.b64decode(d.delta) for d in of(events, ResponseAudioDeltaEvent)),
                            "<i2")
        assert len(pcm) > 0 and np.abs(pcm).max() > 0
        assert events[-1].response.status == "completed"
        assert events[-1].response.output[0].content[0].transcript == transcript
    assert turns[0][-1].response.id != turns[1][-1].response.id
    wait_until(idle(server), "no request left")


def audio_of(server: Any, fmt: dict[str, Any]) -> tuple[bytes, ResponseDoneEvent]:
    """The audio of one answer to "Hello" in a new session whose output format is ``fmt``."""
    with session(server) as conn:
        conn.session.update(session={"type": "realtime", "audio": {"output": {"format": fmt}}})
        (updated,) = until(conn, SessionUpdatedEvent)
        assert updated.session.audio.output.format.type == fmt["type"]
        ask(conn, "Hello")
        events = until(conn, ResponseDoneEvent)
    return b"".join(base64.b64decode(d.delta) for d in of(events, ResponseAudioDeltaEvent)), events[-1]


@pytest.mark.parametrize(("kind", "law"), [("audio/pcmu", "ULAW"), ("audio/pcma", "ALAW")])
def test_g711_sessions_get_the_same_audio_at_8_khz(server: Any, kind: str, law: str) -> None:
    pcm, _ = audio_of(server, {"type": "audio/pcm", "rate": 24000})
    g711, done = audio_of(server, {"type": kind})
    assert done.response.status == "completed" and done.response.audio.output.format.type == kind
    samples = np.frombuffer(pcm, "<i2").astype(np.float32) / 32768
    assert len(samples) > 0 and len(g711) == round(len(samples) / 3)  # a byte a sample at 8 kHz
    heard = g711_samples(g711, law)
    r = Resampler(24000, 8000)
    expected = np.concatenate([r.feed(samples), r.flush()])
    assert np.abs(heard - expected).max() < 0.03 * np.abs(expected).max() + 0.002  # G.711's quantisation
    wait_until(idle(server), "no request left")


def test_cancel_mid_response_ends_it_cancelled_and_the_session_goes_on(server: Any) -> None:
    with session(server) as conn:
        ask(conn, "words " * 50)
        until(conn, ResponseAudioTranscriptDeltaEvent)
        conn.response.cancel()
        cancelled = until(conn, ResponseDoneEvent)[-1]
        ask(conn, "again")
        again = until(conn, ResponseDoneEvent)
    assert cancelled.response.status == "cancelled"
    assert cancelled.response.status_details.reason == "client_cancelled"
    assert again[-1].response.status == "completed"
    assert "".join(d.delta for d in of(again, ResponseAudioTranscriptDeltaEvent)) == "You said: again"
    wait_until(idle(server), "no request left")


def test_sessions_count_into_the_token_and_finish_reason_counters(server: Any) -> None:
    success = "trio_orch_request_success_total{{finished_reason={}}}"
    with httpx.Client(base_url=server.url, timeout=HANG) as h:
        before = metrics(h)
        with session(server) as conn:
            conn.session.update(session={"type": "realtime", "output_modalities": ["text"]})
            ask(conn, "Hello")
            first = until(conn, ResponseDoneEvent)
            ask(conn, "words " * 50)
            until(conn, ResponseTextDeltaEvent)
            conn.response.cancel()
            until(conn, ResponseDoneEvent)
        wait_until(idle(server), "no request left")
        after = metrics(h)
    # the toy pipeline has no tokenizer the server knows: a segment counts its UTF-8 bytes, as chat's prompt
    segments = ["user: Hello\nassistant:", "user: " + "words " * 50 + "\nassistant:"]
    assert after["trio_orch_prompt_tokens_total"] - before["trio_orch_prompt_tokens_total"] == sum(
        len(s.encode()) for s in segments)
    generated = after["trio_orch_generation_tokens_total{stage=0}"] - before[
        "trio_orch_generation_tokens_total{stage=0}"]
    assert generated > len(of(first, ResponseTextDeltaEvent))  # the first answer's tokens and the cut one's
    assert [after[success.format(r)] - before[success.format(r)] for r in ("stop", "length", "abort")] == [
        1, 0, 1]


def test_a_client_that_closes_mid_response_left_before_its_answer_as_an_http_client_may(server: Any) -> None:
    """The one handler of a client that leaves: its request aborted, a disconnect and an abort counted."""
    with httpx.Client(base_url=server.url, timeout=HANG) as h:
        before = metrics(h)
        with session(server) as conn:
            ask(conn, "words " * 50)
            until(conn, ResponseAudioTranscriptDeltaEvent)
        wait_until(idle(server), "the session's request aborted")
        wait_until(lambda: metrics(h)["trio_orch_http_client_disconnects_total"]
                   == before["trio_orch_http_client_disconnects_total"] + 1, "the disconnect counted")
        after = metrics(h)
    abort = "trio_orch_request_success_total{finished_reason=abort}"
    assert after[abort] - before[abort] == 1


def test_a_malformed_event_gets_an_error_event_and_the_session_goes_on(server: Any) -> None:
    with session(server) as conn:
        conn.send_raw("not json")
        (bad_json,) = until(conn, RealtimeErrorEvent)
        conn.send({"type": "conversation.item.create", "event_id": "mine",
                   "item": {"type": "function_call", "name": "f", "arguments": "{}"}})
        (bad_item,) = until(conn, RealtimeErrorEvent)
        conn.response.cancel()  # nothing to cancel
        (no_response,) = until(conn, RealtimeErrorEvent)
        ask(conn, "still here")
        events = until(conn, ResponseDoneEvent)
    assert bad_json.error.code == "invalid_json"
    assert (bad_item.error.code, bad_item.error.param, bad_item.error.event_id) == (
        "invalid_item", "item.type", "mine")
    assert no_response.error.code == "response_cancel_not_active"
    assert events[-1].response.status == "completed"
    assert "".join(d.delta for d in of(events, ResponseAudioTranscriptDeltaEvent)) == "You said: still here"


def test_a_model_the_server_does_not_serve_is_a_404_at_the_handshake(server: Any) -> None:
    with pytest.raises(InvalidStatus) as refused:
        with client(server).realtime.connect(model="gpt-4o"):
            pass
    assert refused.value.response.status_code == 404
    body = json.loads(refused.value.response.body)
    assert (body["error"]["code"], body["error"]["param"]) == ("model_not_found", "model")
    with session(server) as conn:  # the served name still connects, and the server is unharmed
        ask(conn, "after")
        assert until(conn, ResponseDoneEvent)[-1].response.status == "completed"


@pytest.mark.parametrize("front", FRONTS)
def test_with_an_api_key_the_session_needs_it(serving: Callable[..., Any], front: str) -> None:
    s = serving(front, toy_pipeline(token_delay=0.001, audio_delay=0.001), model_name="test", api_key="K")
    with pytest.raises(InvalidStatus) as refused:
        with client(s, api_key="wrong").realtime.connect(model="test"):
            pass
    assert refused.value.response.status_code == 401
    with session(s, api_key="K") as conn:
        ask(conn, "let in")
        assert until(conn, ResponseDoneEvent)[-1].response.status == "completed"
