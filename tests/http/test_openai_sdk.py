"""The official ``openai`` SDK against a real server on loopback, both fronts: what a vLLM user's client does.

The served names, the API key, chat (streamed and not), the errors the SDK
turns into its exception types (401, 404 ``model_not_found``, 400 for a field
this server cannot honour), unknown extras accepted, and the token and
finish-reason counters.  The last test runs ``trio-orch serve`` itself with
the flags (and the key's environment variable), as the acceptance asks.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.http_helpers import FRONTS, HANG, metrics
from trio_orch import __version__
from trio_orch.testing.toy_pipeline import toy_pipeline

openai = pytest.importorskip("openai")

ROOT = Path(__file__).resolve().parents[2]
KEY = "K-s3cret"
USER = [{"role": "user", "content": "one two three"}]


def sdk(url: str, key: str | None = KEY) -> Any:
    return openai.OpenAI(base_url=url + "/v1", api_key=key or "wrong", max_retries=0, timeout=HANG)


def start(serving: Callable[..., Any], front: str) -> Any:
    return serving(front, toy_pipeline(token_delay=0.001, audio_delay=0.001), model_name=["m1", "m2"],
                   api_key=KEY)


@pytest.mark.parametrize("front", FRONTS)
def test_models_lists_every_served_name_with_the_time_the_server_started(serving: Callable[..., Any],
                                                                          front: str) -> None:
    before = int(time.time())
    s = start(serving, front)
    c = sdk(s.url)
    models = c.models.list().data
    assert [m.id for m in models] == ["m1", "m2"]
    assert all(before <= m.created <= time.time() and m.owned_by == "trio-orch" for m in models)
    assert c.models.retrieve("m2").id == "m2"
    with pytest.raises(openai.NotFoundError) as info:
        c.models.retrieve("gpt-4o")
    assert info.value.body["code"] == "model_not_found"


@pytest.mark.parametrize("front", FRONTS)
def test_chat_streamed_and_not_with_the_sdk(serving: Callable[..., Any], front: str) -> None:
    s = start(serving, front)
    c = sdk(s.url)
    resp = c.chat.completions.create(model="m2", messages=USER)
    assert resp.model == "m1"  # answers carry the first served name, as vLLM's
    assert resp.choices[0].message.content == "You said: one two three"
    assert resp.choices[0].finish_reason == "stop" and resp.usage is not None
    chunks = list(c.chat.completions.create(model="m1", messages=USER, stream=True,
                                            stream_options={"include_usage": True}))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == "You said: one two three"
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "stop"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == resp.usage.completion_tokens


@pytest.mark.parametrize("front", FRONTS)
def test_the_errors_a_vllm_client_expects(serving: Callable[..., Any], front: str) -> None:
    s = start(serving, front)
    for key in (None, "not-the-key"):
        c = sdk(s.url, key)
        with pytest.raises(openai.AuthenticationError) as auth:
            c.chat.completions.create(model="m1", messages=USER)
        assert auth.value.status_code == 401 and auth.value.body["code"] == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            c.models.list()
    c = sdk(s.url)
    with pytest.raises(openai.NotFoundError) as missing:
        c.chat.completions.create(model="gpt-4o", messages=USER)
    assert (missing.value.body["code"], missing.value.body["param"]) == ("model_not_found", "model")
    extra = c.chat.completions.create(model="m1", messages=USER, extra_body={"my_client_extra": {"x": 1},
                                                                            "top_a": 0.5})
    assert extra.choices[0].message.content == "You said: one two three"
    with pytest.raises(openai.BadRequestError) as two:
        c.chat.completions.create(model="m1", messages=USER, n=2)
    assert two.value.body["param"] == "n" and "only 'n': 1" in two.value.body["message"]
    with pytest.raises(openai.BadRequestError) as tools:
        c.chat.completions.create(model="m1", messages=USER, tools=[
            {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}])
    assert tools.value.body["param"] == "tools" and "no tool calling" in tools.value.body["message"]
    with pytest.raises(openai.BadRequestError) as temp:
        c.chat.completions.create(model="m1", messages=USER, temperature=3)
    assert temp.value.body["param"] == "temperature" and "between 0.0 and 2.0" in temp.value.body["message"]
    # open without the key: the routes a load balancer or scraper asks
    with httpx.Client(base_url=s.url, timeout=HANG) as h:
        assert h.get("/health").status_code == 200 and h.get("/metrics").status_code == 200
        assert h.get("/version").json() == {"version": __version__}
        assert h.get("/ping").status_code == 200
        r = h.get("/no/such/route")
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"  # guarded unless listed


@pytest.mark.parametrize("front", FRONTS)
def test_a_websocket_session_needs_the_key_too(serving: Callable[..., Any], front: str) -> None:
    from websockets.exceptions import InvalidStatus
    from websockets.sync.client import connect

    s = start(serving, front)
    ws_url = s.url.replace("http://", "ws://") + "/v1/realtime"
    with pytest.raises(InvalidStatus) as refused:
        connect(ws_url, open_timeout=HANG)
    assert refused.value.response.status_code == 401
    assert b"invalid_api_key" in refused.value.response.body
    with connect(ws_url, open_timeout=HANG, additional_headers={"Authorization": f"Bearer {KEY}"}) as ws:
        assert ws.recv(timeout=HANG)  # the session's first event: the handshake passed


@pytest.mark.parametrize("front", FRONTS)
def test_token_and_finish_reason_counters_start_at_zero_and_follow_usage(serving: Callable[..., Any],
                                                                          front: str) -> None:
    s = start(serving, front)
    with httpx.Client(base_url=s.url, timeout=HANG) as h:
        first = metrics(h)
    assert first["trio_orch_prompt_tokens_total"] == 0
    assert first["trio_orch_generation_tokens_total{stage=0}"] == 0
    success = "trio_orch_request_success_total{{finished_reason={}}}"
    assert [first[success.format(r)] for r in ("stop", "length", "abort")] == [0, 0, 0]
    c = sdk(s.url)
    done = c.chat.completions.create(model="m1", messages=USER)
    cut = c.chat.completions.create(model="m1", messages=USER, max_tokens=2)
    streamed = list(c.chat.completions.create(model="m1", messages=USER, stream=True,
                                              stream_options={"include_usage": True}))
    usages = [done.usage, cut.usage, streamed[-1].usage]
    assert cut.choices[0].finish_reason == "length"
    with httpx.Client(base_url=s.url, timeout=HANG) as h:
        after = metrics(h)
    assert after["trio_orch_prompt_tokens_total"] == sum(u.prompt_tokens for u in usages)
    assert after["trio_orch_generation_tokens_total{stage=0}"] == sum(u.completion_tokens for u in usages)
    assert [after[success.format(r)] for r in ("stop", "length", "abort")] == [2, 1, 0]


def _serve(*flags: str, env: dict[str, str]) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen([sys.executable, "-m", "trio_orch.cli", "serve", "--in-process", "--port", "0",
                             *flags], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env)
    assert proc.stdout is not None
    for line in proc.stdout:
        m = re.search(r"serving on (http://\S+)", line)
        if m:
            return proc, m.group(1)
    proc.wait(HANG)
    raise AssertionError(f"serve did not report its address (exit {proc.returncode})")


@pytest.mark.processes
@pytest.mark.parametrize("front", FRONTS)
def test_serve_with_served_model_name_and_api_key_as_a_vllm_user_starts_it(front: str) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRIO_ORCH_API_KEY"}
    if front == "trio":  # the flag on one front, the environment variable on the other
        flags: tuple[str, ...] = ("--loop", "trio", "--served-model-name", "m1", "--api-key", KEY)
    else:
        flags, env = ("--loop", "asyncio", "--served-model-name", "m1"), {**env, "TRIO_ORCH_API_KEY": KEY}
    proc, url = _serve(*flags, env=env)
    try:
        c = sdk(url)
        assert [m.id for m in c.models.list().data] == ["m1"]
        with pytest.raises(openai.AuthenticationError):
            sdk(url, None).chat.completions.create(model="m1", messages=USER)
        with pytest.raises(openai.NotFoundError):
            c.chat.completions.create(model="gpt-4o", messages=USER)
        ok = c.chat.completions.create(model="m1", messages=USER, extra_body={"some_extra_field": True})
        assert ok.choices[0].message.content == "You said: one two three"
        with httpx.Client(base_url=url, timeout=HANG) as h:
            assert h.get("/version").status_code == 200
            seen = metrics(h)
        assert seen["trio_orch_prompt_tokens_total"] == ok.usage.prompt_tokens
        assert seen["trio_orch_generation_tokens_total{stage=0}"] == ok.usage.completion_tokens
        proc.send_signal(signal.SIGINT)
        assert proc.wait(HANG * 3) == 0  # a clean drain, as vllm serve's
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
