"""The request schemas on their own: messages built from the schema, unknown fields, unsupported ones, models.

No server: :func:`~trio_orch.openai.validation.decode` on decoded JSON.  The same
requests over HTTP, on both fronts, are in tests/http/test_server.py and
tests/http/test_openai_sdk.py.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest

from trio_orch.openai.protocol import ChatCompletionRequest, ServedModels
from trio_orch.openai.validation import BadRequest, decode

HI = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(("body", "param", "message"), [
    ({"messages": "hi"}, "messages", "'messages' must be an array, got string"),
    ({}, "messages", "'messages' is required"),
    ({"messages": []}, "messages", "'messages' must not be empty"),
    ({"messages": [{"content": "hi"}]}, "messages[0].role", "'messages[0].role' is required"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role",
     "'messages[0].role' must be one of ['assistant', 'developer', 'system', 'user'], got 'robot'"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content",
     "'messages[0].content' must be a string or an array of text parts, got number"),
    ({"messages": HI, "max_tokens": True}, "max_tokens", "'max_tokens' must be an integer, got boolean"),
    ({"messages": HI, "max_tokens": 10**30}, "max_tokens", "'max_tokens' must be between 1 and 2147483647"),
    ({"messages": HI, "temperature": 2.5}, "temperature", "'temperature' must be between 0.0 and 2.0"),
    ({"messages": HI, "seed": -(2**63) - 1}, "seed",
     "'seed' must be an integer that fits in a signed 64-bit"),
    ({"messages": HI, "model": "m" * 257}, "model", "'model' is longer than 256 characters"),
    ({"messages": HI, "stop": ["x", 1]}, "stop[1]", "'stop[1]' must be a string, got number"),
    ({"messages": HI, "audio": {"format": "ogg"}}, "audio.format",
     "'audio.format' must be one of ['aac', 'flac', 'mp3', 'opus', 'pcm16', 'wav'], got 'ogg'"),
    ({"messages": HI, "stream_options": []}, "stream_options",
     "'stream_options' must be an object, got array"),
    (["not", "an", "object"], None, "the request body must be a JSON object, got array"),
])
def test_a_value_that_does_not_fit_is_a_400_naming_its_path(body: Any, param: str | None,
                                                            message: str) -> None:
    with pytest.raises(BadRequest) as info:
        decode(body, ChatCompletionRequest, what="a test request")
    assert (info.value.status, info.value.param) == (400, param)
    assert message in str(info.value)


def test_unknown_fields_anywhere_are_ignored_and_named_in_one_log_line(
        caplog: pytest.LogCaptureFixture) -> None:
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi", "cache": 1}], "x": 2}],
            "top_a": 0.1, "audio": {"voice": "nova", "speed": 2},
            "stream_options": {"include_obfuscation": True}}
    with caplog.at_level(logging.WARNING, logger="trio_orch.openai"):
        req = decode(body, ChatCompletionRequest, what="a test request")
    assert req.audio is not None and req.audio.voice == "nova" and not req.include_usage
    [line] = [r.getMessage() for r in caplog.records]
    assert line == ("ignored unknown fields in a test request: 'messages[0].content[0].cache', "
                    "'messages[0].x', 'top_a', 'audio.speed', 'stream_options.include_obfuscation'")


def test_known_fields_this_server_cannot_honour_are_named_together() -> None:
    body = {"messages": HI, "n": 3, "tool_choice": "required", "response_format": {"type": "json_object"}}
    with pytest.raises(BadRequest) as info:
        decode(body, ChatCompletionRequest, what="a test request")
    assert (info.value.status, info.value.param, info.value.code) == (400, "n", "unsupported_parameter")
    for name in ("only 'n': 1", "'tool_choice'", "'response_format'"):
        assert name in str(info.value)
    # their harmless values pass: the defaults a client library may send
    ok = decode({"messages": HI, "n": 1, "tools": [], "tool_choice": "none", "logprobs": False,
                 "response_format": {"type": "text"}, "logit_bias": {}}, ChatCompletionRequest, what="x")
    assert ok.n == 1 and ok.sampling_fields() == {}


def test_sampling_fields_are_those_given_and_the_served_models_answer_with_the_first_name() -> None:
    req = decode({"messages": HI, "temperature": 0, "max_completion_tokens": 5, "stop": "x",
                  "stage_sampling": {"talker": {"seed": 1}}}, ChatCompletionRequest, what="x")
    assert req.sampling_fields() == {"temperature": 0.0, "max_completion_tokens": 5, "stop": "x",
                                     "stage_sampling": {"talker": {"seed": 1}}}
    models = ServedModels(["m1", "m2"], created=123)
    assert (models.resolve(None), models.resolve("m2")) == ("m1", "m1")
    with pytest.raises(BadRequest) as info:
        models.resolve("gpt-4o")
    assert (info.value.status, info.value.code, info.value.param) == (404, "model_not_found", "model")
    assert models.listing() == {"object": "list", "data": [
        {"id": n, "object": "model", "created": 123, "owned_by": "trio-orch", "max_model_len": None}
        for n in ("m1", "m2")]}
    assert ServedModels("m", max_model_len=4096).card("m")["max_model_len"] == 4096
    with pytest.raises(ValueError):
        ServedModels([""])
