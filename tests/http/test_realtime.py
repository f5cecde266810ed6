"""The realtime session: its protocol (no I/O), then over a real server and a raw WebSocket client.

Every server event the protocol makes is validated against the official
``openai`` SDK's model for its ``type`` (:func:`sdk_event`: the field names
and types it parses).  Served tests use the in-process toy pipeline (its
stages record updates and aborts) or real worker processes; the acceptance
test runs ``trio-orch serve`` and the documented example client
(``docs/realtime_client.py``, built on the SDK) as a user would.  The SDK's
own client against both fronts is ``tests/http/test_realtime_sdk.py``.
"""

from __future__ import annotations

import base64
import importlib.util
import io
import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
import typing
import wave
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from openai.types.realtime import realtime_server_event
from pydantic import BaseModel
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import ClientConnection, connect

from stages.lockdown import serving_pid
from tests.conftest import live_task_names
from tests.http_helpers import FRONTS, g711_samples, serve
from tests.waiting import wait_until
from trio_orch.http.limits import HTTPLimits
from trio_orch.openai import audio_out
from trio_orch.openai.realtime import Append, Cancel, RealtimeSession, Start
from trio_orch.testing import child_pids, worker_alive
from trio_orch.testing.toy_pipeline import TOY_STAGE_PARAMS, toy_pipeline
from trio_orch.types import OrchError, OrchOutput

ROOT = Path(__file__).resolve().parents[2]
HANG = 30.0
OUTPUTS = ["text", "codes", "audio"]

_SDK_TYPES: dict[str, type[BaseModel]] = {
    value: cls for cls in typing.get_args(typing.get_args(realtime_server_event.RealtimeServerEvent)[0])
    for value in typing.get_args(cls.model_fields["type"].annotation)}


def sdk_event(event: dict[str, Any]) -> BaseModel:
    """The SDK's model of ``event``, validated (a missing or mistyped field fails here)."""
    assert event["type"] in _SDK_TYPES, f"the SDK knows no server event {event['type']!r}"
    return _SDK_TYPES[event["type"]].model_validate(event)


def load_example_client() -> Any:
    spec = importlib.util.spec_from_file_location("realtime_client", ROOT / "docs" / "realtime_client.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(spec.name, module)  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


# ---------------------------------------------------------------------------- the protocol, no I/O
class Driven:
    """A session under test: every event it makes is checked against the SDK's model."""

    def __init__(self, **kw: Any) -> None:
        kw.setdefault("final_stage_ids", {0, 2})
        kw.setdefault("outputs", OUTPUTS)
        self.s = RealtimeSession("s", max_event_bytes=1000, max_input_chars=50, **kw)
        self.check(self.s.opened())

    @staticmethod
    def check(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
        for e in events:
            sdk_event(e)
        return events

    def send(self, kind: str, **fields: Any) -> tuple[list[dict[str, Any]], list[Any]]:
        events, actions = self.s.receive(json.dumps({"type": kind, **fields}))
        return self.check(events), actions

    def say(self, text: str, role: str = "user") -> list[dict[str, Any]]:
        part = "output_text" if role == "assistant" else "input_text"
        return self.send("conversation.item.create",
                         item={"type": "message", "role": role, "content": [{"type": part, "text": text}]})[0]

    def respond(self, **params: Any) -> Any:
        events, actions = self.send("response.create", **({"response": params} if params else {}))
        assert [e["type"] for e in events] == [
            "response.created", "response.output_item.added", "conversation.item.added",
            "response.content_part.added"], events
        (action,) = actions
        return action

    def out(self, m: OrchOutput | OrchError) -> list[dict[str, Any]]:
        return self.check(self.s.output(m))

    def complete(self) -> list[dict[str, Any]]:
        """Both final stages close the response's segment (no more output)."""
        assert self.s.request is not None and self.s.response is not None
        rid, seg = self.s.request.id, self.s.response.segment
        return self.out(out(rid, 0, None, seg, done=True)) + self.out(out(rid, 2, None, seg, done=True))


def error_of(events: list[dict[str, Any]]) -> dict[str, Any]:
    assert len(events) == 1 and events[0]["type"] == "error", events
    return events[0]["error"]


def out(rid: str, stage: int, data: Any, seg: int, done: bool = False) -> OrchOutput:
    return OrchOutput(rid, stage, data, False, segment=seg, segment_done=done)


def user(text: Any, **extra: Any) -> dict[str, Any]:
    return {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}], **extra}


@pytest.mark.parametrize(("frame", "code", "param"), [
    (b"\x00\x01", "binary_frame", None),
    (json.dumps({"type": "conversation.item.create", "item": user("x" * 2000)}), "event_too_large", None),
    ("{not json", "invalid_json", None),
    ("[1, 2]", "invalid_event", None),
    (json.dumps({"text": "hi"}), "missing_type", "type"),
    (json.dumps({"type": "input_text_buffer.append", "text": "hi"}), "unknown_event", "type"),
    (json.dumps({"type": "input_audio_buffer.append", "audio": ""}), "unsupported_event", "type"),
    (json.dumps({"type": "conversation.item.create"}), "invalid_item", "item"),
    (json.dumps({"type": "conversation.item.create", "item": {"type": "function_call"}}), "invalid_item",
     "item.type"),
    (json.dumps({"type": "conversation.item.create", "item": {**user("a"), "role": "robot"}}), "invalid_item",
     "item.role"),
    (json.dumps({"type": "conversation.item.create", "item": {
        "type": "message", "role": "user", "content": [{"type": "input_audio", "audio": ""}]}}),
     "invalid_item", "item.content[0].type"),
    (json.dumps({"type": "conversation.item.create", "item": user(5)}), "invalid_item",
     "item.content[0].text"),
    (json.dumps({"type": "conversation.item.create", "item": user("y" * 60)}), "input_too_large", "item"),
    (json.dumps({"type": "conversation.item.create", "item": user("b"), "previous_item_id": "nope"}),
     "unsupported_value", "previous_item_id"),
    (json.dumps({"type": "conversation.item.create", "item": user("b", id="kept")}), "invalid_value",
     "item.id"),
    (json.dumps({"type": "conversation.item.retrieve", "item_id": "nope"}), "item_not_found", "item_id"),
    (json.dumps({"type": "response.cancel"}), "response_cancel_not_active", None),
    (json.dumps({"type": "response.create", "response": {"conversation": "none"}}), "unsupported_value",
     "response.conversation"),
    (json.dumps({"type": "response.create", "response": {"input": []}}), "unsupported_value",
     "response.input"),
    (json.dumps({"type": "response.create", "response": {"tools": [{"type": "function"}]}}),
     "unsupported_value", "response.tools"),
    (json.dumps({"type": "response.create", "response": {"output_modalities": ["text"]}}),
     "unsupported_value", "response.output_modalities"),
    (json.dumps({"type": "session.update", "session": {"output_modalities": ["text", "audio"]}}),
     "invalid_value", "session.output_modalities"),
    (json.dumps({"type": "session.update", "session": {"type": "transcription"}}), "invalid_session",
     "session.type"),
    (json.dumps({"type": "session.update", "session": {"audio": {"output": {"format": {
        "type": "audio/opus"}}}}}), "unsupported_value", "session.audio.output.format"),
    (json.dumps({"type": "session.update", "session": {"audio": {"output": {"format": {
        "type": "audio/pcm", "rate": 16000}}}}}), "unsupported_value", "session.audio.output.format"),
    (json.dumps({"type": "session.update", "session": {"max_output_tokens": 0}}), "invalid_value",
     "session.max_output_tokens"),
    (json.dumps({"type": "session.update", "session": {"audio": {"output": {"voice": "alloy"}}}}),
     "unsupported_value", "session.audio.output.voice"),  # this pipeline declares no parameters
])
def test_a_bad_event_gets_an_error_naming_it_and_changes_nothing(frame: str | bytes, code: str,
                                                                 param: str | None) -> None:
    d = Driven()
    d.send("conversation.item.create", item=user("kept", id="kept"))
    events, actions = d.s.receive(frame)
    err = error_of(d.check(events))
    assert (err["code"], err["param"], err["type"], actions) == (code, param, "invalid_request_error", [])
    assert err["message"]
    start = d.respond()
    assert start == Start(start.request_id, start.response_id, "user: kept\nassistant:", None, None)


def test_deeply_nested_json_is_refused_without_harm() -> None:
    s = RealtimeSession("s", final_stage_ids={0}, max_event_bytes=10**7)
    assert error_of(s.receive("[" * 200_000 + "]" * 200_000)[0])["code"] == "invalid_json"


def test_errors_echo_the_client_event_id() -> None:
    events, _ = RealtimeSession("s", final_stage_ids={0}).receive(
        json.dumps({"type": "response.create", "event_id": "e7"}))
    assert error_of(events)["event_id"] == "e7" and error_of(events)["code"] == "no_input"


def test_items_chain_in_conversation_order_and_can_be_retrieved_or_deleted_until_heard() -> None:
    d = Driven()
    first = d.say("one")
    assert [e["type"] for e in first] == ["conversation.item.added", "conversation.item.done"]
    a = first[0]["item"]
    assert first[0]["previous_item_id"] is None and a["status"] == "completed" and a["id"]
    second = d.send("conversation.item.create", item=user("two", id="mine"), previous_item_id=a["id"])[0]
    assert second[0]["item"]["id"] == "mine" and second[0]["previous_item_id"] == a["id"]
    (got,) = d.send("conversation.item.retrieve", item_id="mine")[0]
    assert got["type"] == "conversation.item.retrieved" and got["item"]["content"][0]["text"] == "two"
    (gone,) = d.send("conversation.item.delete", item_id="mine")[0]
    assert gone == {**gone, "type": "conversation.item.deleted", "item_id": "mine"}
    start = d.respond()
    assert start.prompt == "user: one\nassistant:"  # the deleted item never reached the pipeline
    assert error_of(d.send("conversation.item.delete", item_id=a["id"])[0])["code"] == "item_in_use"


def test_the_first_response_starts_the_request_and_each_later_one_is_its_next_segment() -> None:
    d = Driven()
    d.send("session.update", session={"type": "realtime", "instructions": "Be brief."})
    d.say("Earlier answer", role="assistant")
    d.say("Hello")
    start = d.respond(metadata={"turn": "1"})
    assert start == Start(start.request_id, start.response_id,
                          "system: Be brief.\nassistant: Earlier answer\nuser: Hello\nassistant:", None, None)
    assert error_of(d.send("response.create")[0])["code"] == "conversation_already_has_active_response"
    rid = start.request_id
    d.out(out(rid, 0, {"text": "Hi"}, 0))
    done = d.complete()
    assert done[-1]["type"] == "response.done" and done[-1]["response"]["metadata"] == {"turn": "1"}
    assert error_of(d.send("response.create")[0])["code"] == "no_input"  # nothing new to answer
    d.say("Again")
    assert d.respond() == Append(rid, d.s.response.id, "user: Again\nassistant:")  # instructions sent once
    d.complete()
    d.send("session.update", session={"instructions": "Be kind."})
    d.say("More")
    assert d.respond(instructions="Shout.").segment == "system: Shout.\nuser: More\nassistant:"
    d.complete()
    d.say("Last")
    assert d.respond().segment == "system: Be kind.\nuser: Last\nassistant:"  # changed: sent once more


def test_text_only_stops_at_the_thinker_and_its_deltas_make_the_final_text() -> None:
    d = Driven()
    (updated,) = d.send("session.update", session={"type": "realtime", "output_modalities": ["text"]})[0]
    assert updated["type"] == "session.updated" and updated["session"]["output_modalities"] == ["text"]
    d.say("hi")
    start = d.respond()
    assert start.final_stage_id == 0
    events = d.out(out(start.request_id, 0, {"text": "You "}, 0))
    events += d.out(out(start.request_id, 0, {"text": "said: hi"}, 0, done=True))
    kinds = [e["type"] for e in events]
    assert kinds == ["response.output_text.delta", "response.output_text.delta", "response.output_text.done",
                     "response.content_part.done", "response.output_item.done", "conversation.item.done",
                     "response.done"]
    deltas = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    done = events[-1]["response"]
    assert deltas == events[2]["text"] == done["output"][0]["content"][0]["text"] == "You said: hi"
    assert done["status"] == "completed" and done["output_modalities"] == ["text"]
    assert d.s.request is not None  # the request stays for the next response


def test_audio_responses_stream_the_transcript_and_pcm_and_end_when_every_final_stage_closed() -> None:
    d = Driven()
    d.say("hi")
    rid = d.respond().request_id
    assert d.out(out(rid, 0, {"text": "ab"}, 0))[0]["type"] == "response.output_audio_transcript.delta"
    got = d.out(out(rid, 0, {"text": "c"}, 0, done=True))
    assert [(e["type"], e.get("transcript")) for e in got] == [
        ("response.output_audio_transcript.delta", None), ("response.output_audio_transcript.done", "abc")]
    (audio,) = d.out(out(rid, 2, {"pcm": np.array([0.5, -0.5], np.float32), "sample_rate": 24000}, 0))
    assert audio["type"] == "response.output_audio.delta"
    assert np.frombuffer(base64.b64decode(audio["delta"]), "<i2").tolist() == [16383, -16383]
    got = d.out(out(rid, 2, {"pcm": np.zeros(0, np.float32), "sample_rate": 24000}, 0, done=True))
    assert [e["type"] for e in got] == ["response.output_audio.done", "response.content_part.done",
                                        "response.output_item.done", "conversation.item.done",
                                        "response.done"]
    item = got[-1]["response"]["output"][0]
    assert item["content"] == [{"type": "output_audio", "transcript": "abc"}]
    assert item["status"] == "completed"
    assert d.out(out(rid, 0, {"text": "late"}, 0)) == []  # nothing after response.done
    (retrieved,) = d.send("conversation.item.retrieve", item_id=item["id"])[0]
    assert retrieved["item"] == item  # the answer joined the conversation


@pytest.mark.parametrize(("kind", "law"), [("audio/pcmu", "ULAW"), ("audio/pcma", "ALAW")])
def test_audio_in_g711_is_the_24_khz_audio_at_8_khz_whatever_its_pieces(kind: str, law: str) -> None:
    d = Driven()
    (updated,) = d.send("session.update", session={"audio": {"output": {"format": {"type": kind}}}})[0]
    assert updated["session"]["audio"]["output"]["format"] == {"type": kind}
    d.say("hi")
    rid = d.respond().request_id
    t = np.arange(2401) / 24000  # a 440 Hz tone and a 9 kHz one, which 8 kHz cannot hold
    pcm = (0.4 * np.sin(2 * np.pi * 440 * t) + 0.3 * np.sin(2 * np.pi * 9000 * t)).astype(np.float32)
    events = []
    for piece in np.split(pcm, [1, 2, 500, 1201, 1202]):  # pieces too short to complete an 8 kHz sample too
        events += d.out(out(rid, 2, {"pcm": piece, "sample_rate": 24000}, 0))
    events += d.complete()
    deltas = [e for e in events if e["type"] == "response.output_audio.delta"]
    assert events.index(deltas[-1]) < [e["type"] for e in events].index("response.output_audio.done")
    data = b"".join(base64.b64decode(e["delta"]) for e in deltas)
    assert len(data) == round(len(pcm) / 3)  # one byte a sample, 8 kHz, as long as the audio
    whole = audio_out.AudioStream(audio_out.REALTIME_OUT[kind], 24000)
    assert data == whole.encode(pcm) + whole.flush()  # the pieces make what the whole makes
    heard = g711_samples(data, law)
    ref = 0.4 * np.sin(2 * np.pi * 440 * np.arange(len(heard)) / 8000)
    assert np.abs(heard - ref)[20:-20].max() < 0.05  # the tone, on time; the 9 kHz one filtered out
    assert events[-1]["response"]["audio"]["output"]["format"] == {"type": kind}


def test_a_response_may_ask_for_its_own_output_format_and_the_next_has_the_session_s() -> None:
    d = Driven()
    d.say("hi")
    start = d.respond(audio={"output": {"format": {"type": "audio/pcma"}}})
    piece = {"pcm": np.full(30, 0.25, np.float32), "sample_rate": 24000}
    events = d.out(out(start.request_id, 2, piece, 0)) + d.complete()
    deltas = [base64.b64decode(e["delta"]) for e in events if e["type"] == "response.output_audio.delta"]
    assert len(b"".join(deltas)) == 10  # A-law at 8 kHz: a byte for three 24 kHz samples
    assert events[-1]["response"]["audio"]["output"]["format"] == {"type": "audio/pcma"}
    d.say("again")
    append = d.respond()
    (delta,) = d.out(out(append.request_id, 2, piece, 1))
    assert np.frombuffer(base64.b64decode(delta["delta"]), "<i2").tolist() == [8191] * 30  # 24 kHz PCM
    assert d.s.describe()["audio"]["output"]["format"] == {"type": "audio/pcm", "rate": 24000}


def test_cancel_aborts_the_request_and_the_next_response_starts_a_new_one() -> None:
    d = Driven()
    d.say("long")
    first = d.respond()
    d.out(out(first.request_id, 0, {"text": "par"}, 0))
    response_id = d.s.response.id
    assert error_of(d.send("response.cancel", response_id="other")[0])["code"] == "response_cancel_not_active"
    assert d.send("response.cancel", response_id=response_id) == ([], [Cancel(first.request_id)])
    assert d.send("response.cancel") == ([], [])  # already cancelling: its response.done follows
    events = d.out(OrchError(first.request_id, 0, "aborted", "aborted by the client"))
    assert [e["type"] for e in events] == [
        "response.output_audio.done", "response.output_audio_transcript.done", "response.content_part.done",
        "response.output_item.done", "conversation.item.done", "response.done"]
    done = events[-1]["response"]
    assert (done["status"], done["status_details"]) == ("cancelled", {"type": "cancelled",
                                                                      "reason": "client_cancelled"})
    assert done["output"][0]["status"] == "incomplete" and events[1]["transcript"] == "par"
    d.say("again")
    second = d.respond()
    assert type(second) is Start and second.request_id != first.request_id


@pytest.mark.parametrize("kind", ["stage_failed", "timeout", "replica_died"])
def test_a_terminal_error_fails_the_response_and_the_session_goes_on(kind: str) -> None:
    d = Driven()
    d.say("hi")
    rid = d.respond().request_id
    (*_, done) = d.out(OrchError(rid, 1, kind, "why"))
    assert done["response"]["status"] == "failed"
    error = done["response"]["status_details"]["error"]
    assert error == {"type": "server_error", "code": kind, "message": "why"}
    d.say("hi")
    assert type(d.respond()) is Start


def test_a_request_that_ends_between_responses_is_an_error_event() -> None:
    d = Driven()
    d.say("hi")
    rid = d.respond().request_id
    d.complete()
    err = error_of(d.out(OrchError(rid, None, "shutdown", "the server is stopping")))
    assert (err["type"], err["code"]) == ("server_error", "shutdown")
    assert d.out(out(rid, 0, {"text": "stale"}, 1)) == []


def test_a_refused_start_or_update_fails_only_its_own_response() -> None:
    d = Driven()
    d.say("hi")
    start = d.respond()
    (*_, done) = d.check(d.s.request_failed(start.response_id, RuntimeError("overloaded")))
    assert done["response"]["status_details"]["error"]["code"] == "request_refused"
    assert d.s.request is None and d.s.request_failed(start.response_id, RuntimeError("again")) == []
    d.say("hi")
    d.respond()
    d.complete()
    d.say("more")
    append = d.respond()
    (*_, done) = d.check(d.s.update_failed(append.response_id, ValueError("ended")))
    assert done["response"]["status_details"]["error"]["code"] == "update_refused"


def test_settings_that_shape_the_request_are_mapped_to_stage_parameters_and_fixed_while_it_is_live() -> None:
    d = Driven(stage_params=TOY_STAGE_PARAMS)
    d.send("session.update", session={"audio": {"output": {"voice": "echo", "format": {
        "type": "audio/pcm", "rate": 24000}}}, "max_output_tokens": 3})
    bad = error_of(d.send("session.update", session={"audio": {"output": {"voice": "nobody"}}})[0])
    assert bad["param"] == "session.audio.output.voice"
    d.say("hi")
    start = d.respond()
    assert start.sampling == {0: {"max_tokens": 3}, 2: {"voice": "echo"}}
    late = error_of(d.send("session.update", session={"output_modalities": ["text"]})[0])
    assert late["code"] == "session_active"
    (ok,) = d.send("session.update", session={"instructions": "later", "max_output_tokens": 3})[0]
    assert ok["type"] == "session.updated"  # unchanged shaping settings, new instructions: fine


def test_a_text_only_pipeline_answers_in_text_and_refuses_audio() -> None:
    d = Driven(final_stage_ids={0}, outputs=["text"])
    assert d.s.describe()["output_modalities"] == ["text"]
    bad = error_of(d.send("session.update", session={"output_modalities": ["audio"]})[0])
    assert (bad["code"], bad["param"]) == ("invalid_value", "session.output_modalities")
    d.say("hi")
    start = d.respond(output_modalities=["text"])  # the session's own: accepted
    assert start.final_stage_id == 0
    events = d.out(out(start.request_id, 0, {"text": "yo"}, 0, done=True))
    assert [e["type"] for e in events][:2] == ["response.output_text.delta", "response.output_text.done"]
    assert events[-1]["response"]["status"] == "completed"


def test_unknown_fields_are_ignored_and_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    d = Driven()
    with caplog.at_level(logging.INFO, "trio_orch.openai.realtime"):
        for _ in range(2):
            (e,) = d.send("session.update", session={"type": "realtime", "truncation": "auto"})[0]
            assert e["type"] == "session.updated"
    assert [r.getMessage() for r in caplog.records].count(
        "realtime session s: session.truncation is not supported; ignored") == 1


def test_a_session_update_naming_a_model_not_served_is_refused_and_changes_nothing() -> None:
    d = Driven(served=["m1", "m2"])
    (created,) = d.s.opened()
    assert created["session"]["model"] == "m1"  # no ?model=: the first served name
    (bad,) = d.send("session.update", session={"type": "realtime", "model": "gpt-4o",
                                               "instructions": "be brief"})[0]
    assert (bad["type"], bad["error"]["code"], bad["error"]["param"]) == (
        "error", "model_not_found", "session.model")
    assert "'m1', 'm2'" in bad["error"]["message"]
    assert (d.s.model, d.s.instructions) == ("m1", "")
    (ok,) = d.send("session.update", session={"type": "realtime", "model": "m2"})[0]
    assert (ok["type"], ok["session"]["model"]) == ("session.updated", "m2")


def test_outputs_of_an_ended_request_are_dropped() -> None:
    d = Driven()
    d.say("hi")
    first = d.respond()
    d.send("response.cancel")
    d.out(OrchError(first.request_id, 0, "aborted", ""))
    assert d.out(out(first.request_id, 0, {"text": "ghost"}, 0)) == []


# ---------------------------------------------------------------------------- over a real server
class Server:
    """The realtime endpoint behind a front (``tests.http_helpers.serve``: the serve command's app and
    settings); ``max_message``: the largest frame (``--max-body-bytes``)."""

    def __init__(self, front: str, factory: Any, outputs: list[str] | None = None,
                 max_message: int = 256 * 1024) -> None:
        self.served = serve(front, factory, model_name="test", outputs=outputs,
                            limits=HTTPLimits(max_body_bytes=max_message))
        self.engine = self.served.engine
        self.url = f"ws://127.0.0.1:{self.served.port}/v1/realtime"
        self.base_url = f"http://127.0.0.1:{self.served.port}/v1"

    @contextmanager
    def connect(self) -> Iterator[ClientConnection]:
        with connect(self.url, open_timeout=HANG) as ws:
            assert json.loads(ws.recv(timeout=HANG))["type"] == "session.created"
            yield ws

    def idle(self) -> bool:
        return self.engine.stats().active_requests == 0

    def stop(self) -> None:
        self.served.stop()


@pytest.fixture(scope="module", params=FRONTS)
def toy(request: pytest.FixtureRequest) -> Iterator[Server]:
    s = Server(request.param, toy_pipeline(token_delay=0.01, audio_delay=0.005))
    yield s
    s.stop()


def recv_until(ws: ClientConnection, kind: str) -> list[dict[str, Any]]:
    events = []
    while True:
        e = json.loads(ws.recv(timeout=HANG))
        sdk_event(e)
        events.append(e)
        if e["type"] == kind:
            return events


def ask(ws: ClientConnection, text: str) -> None:
    ws.send(json.dumps({"type": "conversation.item.create", "item": user(text)}))
    ws.send(json.dumps({"type": "response.create"}))


def check_answered_in_turn(turns: list[Any], n: int) -> bytes:
    """Each turn's response completed before the next began, answering it; return all the audio."""
    assert len(turns) == n
    ids = set()
    for turn in turns:
        kinds = [e.type for e in turn.events]
        assert kinds[0] == "response.created" and kinds[-1] == "response.done", kinds
        assert {"response.output_audio_transcript.delta", "response.output_audio.delta"} <= set(kinds)
        assert turn.status == "completed" and turn.transcript == f"You said: {turn.text}"
        ids.add(turn.events[0].response.id)
    assert len(ids) == n
    return b"".join(t.audio for t in turns)


def test_the_example_client_gets_each_turn_answered_before_it_sends_the_next(
        toy: Server, tmp_path: Path) -> None:
    client = load_example_client()
    wav = tmp_path / "session.wav"
    turns = client.talk(toy.base_url, ["Hello", "How are you", "Bye"], pause=0, out=str(wav), show=False)
    audio = check_answered_in_turn(turns, 3)
    with wave.open(str(wav)) as w:
        assert (w.getnchannels(), w.getsampwidth(), w.getframerate()) == (1, 2, 24000)
        assert w.readframes(w.getnframes()) == audio and len(audio) > 0
    wait_until(toy.idle, "no request left")


def test_bad_frames_get_errors_and_the_same_socket_still_works(toy: Server) -> None:
    with toy.connect() as ws:
        for frame in [b"\x00binary", "not json", json.dumps({"type": "nope"}),
                      json.dumps({"type": "conversation.item.create", "item": user("x" * 200_000)}),
                      json.dumps({"type": "response.create"})]:
            ws.send(frame)
            e = json.loads(ws.recv(timeout=HANG))
            assert e["type"] == "error", e
        ask(ws, "still here")
        events = recv_until(ws, "response.done")
    assert "".join(e["delta"] for e in events if e["type"] == "response.output_audio_transcript.delta") \
        == "You said: still here"
    wait_until(toy.idle, "no request left")


def test_closing_the_socket_mid_stream_aborts_the_request_on_every_stage(toy: Server) -> None:
    stages = toy.engine.stages
    with toy.connect() as ws:
        ask(ws, "a long answer " * 30)
        recv_until(ws, "response.output_audio_transcript.delta")
    wait_until(toy.idle, "the request ended")
    holders = [s for s in stages if any(r.startswith("req_") for r, _ in s.submissions)]
    rids = {r for s in holders for r, _ in s.submissions if r.startswith("req_")}
    assert holders and rids
    wait_until(lambda: all(any(r in s.aborts for r in rids) for s in holders), "every stage saw the abort")
    assert toy.engine.stats().terminals_by_kind.get("aborted", 0) >= 1


def test_a_frame_over_the_transport_limit_closes_only_that_session(toy: Server) -> None:
    with toy.connect() as ws:
        ask(ws, "started")
        recv_until(ws, "response.created")
        ws.send("x" * 300_000)  # over the server's ws_max_size: the server closes the connection (1009)
        with pytest.raises(ConnectionClosed):
            while True:
                ws.recv(timeout=HANG)
    wait_until(toy.idle, "the session's request was aborted")
    turns = load_example_client().talk(toy.base_url, ["ok"], pause=0, out=None, show=False)
    assert turns[-1].status == "completed"  # the server still serves


@pytest.mark.parametrize(("frame", "code"), [
    (b"\x83\x80\0\0\0\0", 1002),  # a frame with a reserved opcode
    (b"\x82\xff" + (1 << 40).to_bytes(8, "big") + b"\0\0\0\0", 1009),  # a terabyte announced, nothing sent
], ids=["protocol-error", "impossible-length"])
def test_a_websocket_protocol_error_ends_with_a_close_frame_and_its_code(toy: Server, frame: bytes,
                                                                         code: int) -> None:
    with toy.connect() as ws:
        ws.socket.sendall(frame)  # raw bytes: no client library would send them
        with pytest.raises(ConnectionClosed) as closed:
            while True:
                ws.recv(timeout=HANG)
    assert closed.value.rcvd is not None and closed.value.rcvd.code == code  # the server's close frame
    wait_until(toy.idle, "nothing left running")


def test_cancel_ends_the_response_and_the_session_takes_another(toy: Server) -> None:
    with toy.connect() as ws:
        ask(ws, "words " * 50)
        recv_until(ws, "response.output_audio_transcript.delta")
        ws.send(json.dumps({"type": "response.cancel"}))
        done = recv_until(ws, "response.done")[-1]
        ask(ws, "more")
        again = recv_until(ws, "response.done")
    assert done["response"]["status"] == "cancelled"
    assert again[-1]["response"]["status"] == "completed"
    assert "".join(e["delta"] for e in again if e["type"] == "response.output_audio_transcript.delta") \
        == "You said: more"
    wait_until(toy.idle, "no request left")


# ---------------------------------------------------------------------------- real worker processes
TINY_TOML = """
[pipeline]
final_stages = [0, 2]

[[stages]]
kind = "thinker"
[stages.model]
d_model = 32
layers = 1
heads = 2
max_new_tokens = 10
min_new_tokens = 10

[[stages]]
kind = "talker"
[stages.model]
d_model = 32
layers = 1
heads = 2
chunk_frames = 4

[[stages]]
kind = "code2wav"
[stages.model]
dim = 16
upsample = [4, 3]
chunk_frames = 4
"""


@pytest.mark.slow
@pytest.mark.processes
def test_a_session_closed_mid_stream_leaves_nothing_on_the_workers(tmp_path: Path) -> None:
    from stages.config import load_config
    from trio_orch.cluster.launcher import open_pipeline

    (tmp_path / "tiny.toml").write_text(TINY_TOML)
    cfg = load_config(str(tmp_path / "tiny.toml"))
    s = Server("asyncio", lambda: open_pipeline(cfg), OUTPUTS)
    try:
        def worker_stats() -> list[dict[str, Any]]:  # over each worker's stats RPC
            return [s.engine.run_in_trio(r.rpc, "stats") for pool in s.engine.stages for r in pool.replicas]

        tasks_before = sorted(s.engine.run_sync_in_trio(live_task_names))
        with s.connect() as ws:
            ask(ws, "Hello")
            recv_until(ws, "response.done")
            ask(ws, "and then")
            recv_until(ws, "response.output_audio_transcript.delta")
            held = worker_stats()
        wait_until(s.idle, "the request ended")
        wait_until(lambda: all(st["active"] == st["waiting"] == st["sessions"] == 0 for st in worker_stats()),
                   "the workers let the session go")
        wait_until(lambda: sorted(s.engine.run_sync_in_trio(live_task_names)) == tasks_before,
                   "no task left for the session")
        assert [st["sessions"] for st in held] == [1, 1, 1]  # it was held on every stage
        assert all(st["aborts"] == 1 for st in worker_stats())
        assert s.engine.stats().terminals_by_kind == {"aborted": 1}
    finally:
        s.stop()


@pytest.mark.slow
@pytest.mark.processes
def test_trio_orch_serve_and_the_example_client_as_a_user_would(tmp_path: Path) -> None:
    """Serve; three turns through the documented client (the SDK); a playable WAV; nothing left after
    Ctrl-C."""
    (tmp_path / "tiny.toml").write_text(TINY_TOML)
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    proc = subprocess.Popen([sys.executable, "-m", "trio_orch.cli", "serve", "--port", "0", "--config",
                             str(tmp_path / "tiny.toml")], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env)
    try:
        assert proc.stdout is not None
        url = None
        start = time.monotonic()
        while url is None and time.monotonic() - start < 60:
            line = proc.stdout.readline()
            if not line:
                break
            m = re.search(r"serving on http://(\S+)", line)
            url = m.group(1) if m else None
        assert url, "serve did not report its address"
        workers = child_pids(serving_pid(proc.pid))
        assert len(workers) >= 3
        client = load_example_client()
        wav = tmp_path / "out" / "session.wav"
        wav.parent.mkdir()
        turns = client.talk(f"http://{url}/v1", ["Hello", "How are you?", "Goodbye"], pause=0.2,
                            out=str(wav), show=False)
        assert len(turns) == 3 and all(t.status == "completed" and t.transcript and t.audio for t in turns)
        audio = b"".join(t.audio for t in turns)
        with wave.open(io.BytesIO(wav.read_bytes())) as w:
            assert (w.getnchannels(), w.getsampwidth(), w.getframerate()) == (1, 2, 24000)
            pcm = np.frombuffer(w.readframes(w.getnframes()), "<i2")
        assert pcm.tobytes() == audio and len(pcm) == 3 * 10 * 2 * 12 and np.abs(pcm).max() > 0
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0  # a clean drain after the signal (documented exit code)
        wait_until(lambda: not any(worker_alive(p) for p in workers), "worker processes gone")
        assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "tiny.toml"]  # no ipc file left
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
