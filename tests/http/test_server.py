"""The HTTP front against a real uvicorn server on loopback, with a real HTTP client (httpx).

Most tests serve the in-process toy pipeline (deterministic, its stages record
aborts); one runs ``trio-orch serve`` as a new user would, with the real
worker processes, and checks that nothing is left running afterwards.
"""

from __future__ import annotations

import asyncio
import base64
import io
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
import wave
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from stages.lockdown import serving_pid
from tests.http_helpers import (
    FRONTS,
    HANG,
    Served,
    TrioServed,
    chat,
    deltas,
    listening_socket,
    metrics,
    serve,
    sse_events,
    wait_until,
)
from trio_orch.http.app import create_app
from trio_orch.http.limits import HTTPLimits
from trio_orch.testing.toy_pipeline import SAMPLE_RATE, toy_pipeline

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module", params=FRONTS)
def served(request: pytest.FixtureRequest) -> Iterator[Served | TrioServed]:
    s = serve(request.param, toy_pipeline(token_delay=0.01, audio_delay=0.005))
    yield s
    s.stop()


@pytest.fixture()
def client(served: Served) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=served.url, timeout=HANG) as c:
        yield c


# ---------------------------------------------------------------- streaming
def test_stream_text_only(client: httpx.Client, served: Served) -> None:
    with client.stream("POST", "/v1/chat/completions", json=chat("hello trio", stream=True)) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r.iter_lines())
    assert events[-1] == "[DONE]"
    ds = deltas(events)
    assert ds[0] == {"role": "assistant", "content": ""}
    assert "".join(d.get("content", "") for d in ds) == "You said: hello trio"
    assert not any("audio" in d for d in ds)
    assert events[-2]["choices"][0]["finish_reason"] == "stop"
    assert all(e["id"] == events[0]["id"] and e["object"] == "chat.completion.chunk" for e in events[:-1])


def test_stream_text_and_audio_decodes_to_pcm(client: httpx.Client) -> None:
    body = chat("one two three", stream=True, modalities=["text", "audio"],
                audio={"voice": "alloy", "format": "pcm16"}, stream_options={"include_usage": True})
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        events = sse_events(r.iter_lines())
    ds = deltas(events)
    text = "".join(d.get("content", "") for d in ds)
    assert text == "You said: one two three"
    audio = [d["audio"] for d in ds if "audio" in d and "data" in d["audio"]]
    assert len(audio) == 5  # one chunk per word
    assert "expires_at" in audio[0]
    transcript = [d["audio"]["transcript"] for d in ds if "transcript" in d.get("audio", {})]
    assert "".join(transcript) == text  # OpenAI's audio streaming carries the text here too
    assert len({d["audio"]["id"] for d in ds if "audio" in d}) == 1
    pcm = np.frombuffer(b"".join(base64.b64decode(a["data"]) for a in audio), "<i2")
    assert len(pcm) == 5 * int(SAMPLE_RATE * 0.08)
    assert 1000 < np.abs(pcm).max() <= 32767  # audible, not clipped garbage
    assert events[-1] == "[DONE]" and events[-2]["usage"]["completion_tokens"] == 5
    assert [e for e in events[:-1] if isinstance(e, dict) and "error" in e] == []


def test_non_streaming_with_wav_audio(client: httpx.Client) -> None:
    r = client.post("/v1/chat/completions", json=chat("wave at me", modalities=["text", "audio"]))
    assert r.status_code == 200
    out = r.json()
    msg = out["choices"][0]["message"]
    assert out["object"] == "chat.completion" and msg["content"] == "You said: wave at me"
    assert msg["audio"]["transcript"] == msg["content"]
    with wave.open(io.BytesIO(base64.b64decode(msg["audio"]["data"]))) as w:
        assert (w.getnchannels(), w.getsampwidth(), w.getframerate()) == (1, 2, SAMPLE_RATE)
        assert w.getnframes() == 5 * int(SAMPLE_RATE * 0.08)
    r = client.post("/v1/chat/completions", json=chat("a b c d e f", max_tokens=3))
    assert r.json()["choices"][0]["message"]["content"] == "You said: a "
    assert r.json()["choices"][0]["finish_reason"] == "length"


def test_concurrent_clients_each_get_their_own_stream(served: Served) -> None:
    async def one(c: httpx.AsyncClient, i: int) -> str:
        body = chat(f"client number {i}", stream=True, modalities=["text", "audio"])
        async with c.stream("POST", "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            lines = [line async for line in r.aiter_lines()]
        ds = deltas(sse_events(iter(lines)))
        assert sum("data" in d.get("audio", {}) for d in ds) == 5
        return "".join(d.get("content", "") for d in ds)

    async def main() -> list[str]:
        async with httpx.AsyncClient(base_url=served.url, timeout=HANG) as c:
            return await asyncio.gather(*(one(c, i) for i in range(12)))

    texts = asyncio.run(main())
    assert texts == [f"You said: client number {i}" for i in range(12)]


# ---------------------------------------------------------------- disconnects abort
def test_disconnect_mid_stream_aborts_the_request(client: httpx.Client, served: Served) -> None:
    thinker = served.engine.stages[0]
    before = metrics(client)
    n_aborts = len(thinker.aborts)
    words = " ".join(f"w{i}" for i in range(300))  # ~3 s of text: the client leaves long before
    with client.stream("POST", "/v1/chat/completions", json=chat(words, stream=True)) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(3)]  # role chunk, blank, first text chunk
        assert got[2].startswith("data: ")
    wait_until(lambda: len(thinker.aborts) == n_aborts + 1, "the thinker sees the abort")
    rid = thinker.aborts[-1]
    assert rid in [s for s, _ in thinker.submissions]
    wait_until(lambda: metrics(client)["trio_orch_http_client_disconnects_total"]
               == before.get("trio_orch_http_client_disconnects_total", 0) + 1, "disconnect counted")
    wait_until(lambda: metrics(client)["trio_orch_active_requests"] == 0, "request cleaned up")
    assert metrics(client).get("trio_orch_errors_total{kind=aborted}", 0) >= 1


def test_disconnect_while_waiting_for_a_non_streamed_answer_aborts(served: Served) -> None:
    thinker = served.engine.stages[0]
    n_aborts = len(thinker.aborts)
    words = " ".join(f"w{i}" for i in range(300))
    with httpx.Client(base_url=served.url, timeout=httpx.Timeout(HANG, read=0.2)) as c:
        with pytest.raises(httpx.ReadTimeout):
            c.post("/v1/chat/completions", json=chat(words))
    wait_until(lambda: len(thinker.aborts) == n_aborts + 1, "the thinker sees the abort")


# ---------------------------------------------------------------- bad requests
@pytest.mark.parametrize(("body", "fragment"), [
    (b'{"messages": [', "malformed JSON"),
    (b"\xff\xfe", "not valid UTF-8"),
    (b'["not", "an", "object"]', "must be a JSON object"),
    (b'{"messages": "hi"}', "'messages' must be an array, got string"),
    (b'{"model": "toy"}', "'messages' is required"),
    (b'{"messages": []}', "must not be empty"),
    (b'{"messages": [{"role": "robot", "content": "hi"}]}', "'messages[0].role' must be one of"),
    (b'{"messages": [{"role": "user", "content": 5}]}', "must be a string or an array of text parts"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "stream": "yes"}', "'stream' must be a boolean"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "modalities": ["audio"]}', "'modalities' must be"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}', "'max_tokens' must be between"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": true}', "must be an integer"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "stream": true, "modalities": ["text", "audio"],'
     b' "audio": {"format": "wav"}}', "streamed audio is 16-bit PCM"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "n": 2}', "only 'n': 1"),
    (b'{"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}], "logprobs": true}',
     "'logprobs' is not supported: the stages report no log-probabilities; 'tools' is not supported"),
    (b'{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}',
     "'messages[0].content[0]': this pipeline takes no image input"),
])
def test_bad_requests_get_4xx_json_and_leave_the_server_fine(client: httpx.Client, body: bytes,
                                                             fragment: str) -> None:
    r = client.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400
    err = r.json()["error"]
    assert fragment in err["message"] and err["type"] == "invalid_request_error"
    ok = client.post("/v1/chat/completions", json=chat("still here"))
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"] == "You said: still here"


def test_unknown_fields_are_ignored_and_logged_once_per_request(client: httpx.Client,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    body = {**chat("still here"), "temperatur": 1, "metadata": {"k": "v"},
            "messages": [{"role": "user", "content": "still here", "extra": 1}], "audio": {"speed": 2}}
    with caplog.at_level(logging.WARNING, logger="trio_orch.openai"):
        r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "You said: still here"
    ignored = [rec.getMessage() for rec in caplog.records if "ignored unknown field" in rec.getMessage()]
    assert len(ignored) == 1, ignored
    for name in ("'temperatur'", "'metadata'", "'messages[0].extra'", "'audio.speed'"):
        assert name in ignored[0]


def test_unknown_route_and_method_are_json_errors(client: httpx.Client) -> None:
    r = client.get("/v1/nothing")
    assert r.status_code == 404 and "error" in r.json()
    r = client.get("/v1/chat/completions")
    assert r.status_code == 405 and "error" in r.json()
    assert client.get("/v1/models").json()["data"][0]["id"] == "toy"


# ---------------------------------------------------------------- health and metrics
def test_health_and_metrics_move_when_requests_run(client: httpx.Client) -> None:
    assert client.get("/health").json()["status"] == "ok"
    before = metrics(client)
    for t in ("m1", "m2"):
        r = client.post("/v1/chat/completions", json=chat(t, modalities=["text", "audio"]))
        assert r.status_code == 200
    client.post("/v1/chat/completions", content=b"{", headers={"content-type": "application/json"})
    after = metrics(client)
    assert after["trio_orch_up"] == 1
    # "You said: m1": 3 text outputs + 3 audio chunks per request
    assert after["trio_orch_outputs_routed_total"] - before["trio_orch_outputs_routed_total"] == 2 * 6
    assert after["trio_orch_terminals_total{kind=finished}"] \
        - before["trio_orch_terminals_total{kind=finished}"] == 2
    key = "trio_orch_dispatch_latency_seconds_count"
    assert after[key] > before[key]
    assert after["trio_orch_http_requests_total{route=/v1/chat/completions,status=400}"] \
        > before.get("trio_orch_http_requests_total{route=/v1/chat/completions,status=400}", 0)
    for key in ("trio_orch_request_channel_depth", "trio_orch_stage_inflight{stage=0}",
                "trio_orch_dropped_outputs_total", "trio_orch_dispatch_latency_seconds_bucket{le=+Inf}"):
        assert key in after


def test_stage_inflight_gauge_moves_while_a_request_streams(client: httpx.Client, served: Served) -> None:
    words = " ".join(f"w{i}" for i in range(100))
    with client.stream("POST", "/v1/chat/completions", json=chat(words, stream=True)) as r:
        lines = r.iter_lines()
        assert "You" in [next(lines) for _ in range(3)][2]  # role chunk, blank, first text
        assert metrics(client)["trio_orch_stage_inflight{stage=0}"] == 1
        assert metrics(client)["trio_orch_active_requests"] == 1
    wait_until(lambda: metrics(client)["trio_orch_active_requests"] == 0)


# ---------------------------------------------------------------- the engine dies under the server
@pytest.mark.parametrize("front", FRONTS)
@pytest.mark.processes
def test_engine_death_mid_stream_ends_streams_and_later_requests_get_503(front: str) -> None:
    s = serve(front, toy_pipeline(token_delay=0.01))
    engine = s.engine
    try:
        with httpx.Client(base_url=s.url, timeout=HANG) as c:
            words = " ".join(f"w{i}" for i in range(300))
            with c.stream("POST", "/v1/chat/completions", json=chat(words, stream=True)) as r:
                lines = r.iter_lines()
                for _ in range(3):
                    next(lines)
                engine.call_soon(engine.orchestrator.request_shutdown)  # the orchestrator stops
                events = sse_events(lines)
            assert events[-1] == "[DONE]"
            assert events[-2]["error"]["code"] == "shutdown"
            r = c.post("/v1/chat/completions", json=chat("anyone?"))
            assert r.status_code == 503
            assert "not running: its orchestrator stopped" in r.json()["error"]["message"]
            h = c.get("/health")
            assert h.status_code == 503 and h.json()["status"] == "down"
            assert metrics(c)["trio_orch_up"] == 0
    finally:
        s.stop()


# ---------------------------------------------------------------- real worker processes
@pytest.mark.parametrize("front", FRONTS)
@pytest.mark.processes
def test_disconnect_mid_stream_aborts_on_the_worker_process(front: str) -> None:
    from stages.config import echo_config
    from trio_orch.cluster.launcher import open_pipeline

    # one slow echo worker: 400 outputs, 5 ms apart
    cfg = echo_config(1, final_stage_ids=[0], outputs=400, worker_args=["--step-delay-ms", "5"])
    s = serve(front, lambda: open_pipeline(cfg))
    try:
        worker = s.engine.stages[0].replicas[0]  # the pool's ZMQ client of replica 0

        def worker_stats() -> dict[str, Any]:
            return s.engine.run_in_trio(worker.rpc, "stats")

        with httpx.Client(base_url=s.url, timeout=HANG) as c:
            with c.stream("POST", "/v1/chat/completions", json=chat("echo me", stream=True)) as r:
                lines = r.iter_lines()
                got = [next(lines) for _ in range(3)]
                assert "user: echo me" in got[2]
            wait_until(lambda: worker_stats()["aborts"] == 1, "the worker process sees the abort")
            assert worker_stats()["active"] == 0
            assert metrics(c)["trio_orch_http_client_disconnects_total"] == 1
    finally:
        s.stop()


# ---------------------------------------------------------------- the real command, real workers
def _children(pid: int) -> list[int]:
    kids = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                stat = Path(f"/proc/{d}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                kids.append(int(d))
    return kids


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.slow
@pytest.mark.parametrize("loop", FRONTS)
@pytest.mark.processes
def test_trio_orch_serve_with_worker_processes_streams_text_and_audio(tmp_path: Path, loop: str) -> None:
    env = {**os.environ, "TMPDIR": str(tmp_path)}  # the launcher's ipc sockets and logs go here
    proc = subprocess.Popen([sys.executable, "-m", "trio_orch.cli", "serve", "--port", "0", "--loop", loop,
                             "--served-model-name", "toy"],
                            cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        assert proc.stdout is not None
        url = None
        start = time.monotonic()
        while url is None and time.monotonic() - start < 60:
            line = proc.stdout.readline()
            if not line:
                break
            m = re.search(r"serving on (http://\S+)", line)
            url = m.group(1) if m else None
        assert url, "serve did not report its address"
        workers = _children(serving_pid(proc.pid))
        assert len(workers) >= 3
        assert any(tmp_path.iterdir())
        body = chat("Hello!", stream=True, modalities=["text", "audio"], audio={"format": "pcm16"})
        with httpx.Client(base_url=url, timeout=60) as c:
            with c.stream("POST", "/v1/chat/completions", json=body) as r:
                assert r.status_code == 200
                events = sse_events(r.iter_lines())
            assert c.get("/health").json()["status"] == "ok"
            short = c.post("/v1/chat/completions", json=chat("Hello!", max_tokens=5)).json()
            assert short["usage"]["completion_tokens"] == 5  # the thinker's own floor (8) is above it
            assert short["choices"][0]["finish_reason"] == "length"
            full = c.post("/v1/chat/completions", json=chat("Hello!")).json()
            n = len(full["choices"][0]["message"]["content"])  # one character per token
            assert full["choices"][0]["finish_reason"] == ("length" if n == 48 else "stop")  # its own cap
        ds = deltas(events)
        # the thinker reports why it ended: end-of-text ("stop") or its token limit ("length")
        assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] in ("stop", "length")
        assert "".join(d.get("content", "") for d in ds)
        pcm = np.frombuffer(b"".join(base64.b64decode(d["audio"]["data"]) for d in ds
                                     if "data" in d.get("audio", {})), "<i2")
        assert len(pcm) > 0 and np.abs(pcm).max() > 0
        text, audio = _openai_client_stream(url)  # the official client reads the same stream
        assert text and len(audio) > 0 and np.abs(np.frombuffer(audio, "<i2")).max() > 0
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0  # a clean drain after the signal (SIGTERM gives the same)
        wait_until(lambda: not any(_alive(p) for p in workers), "worker processes gone")
        assert list(tmp_path.iterdir()) == []  # no ipc socket or log file left behind
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _openai_client_stream(url: str) -> tuple[str, bytes]:
    """Text and PCM bytes of one streamed text+audio answer, read with the ``openai`` package."""
    from openai import OpenAI

    client = OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=60)
    stream = client.chat.completions.create(
        model="toy", messages=[{"role": "user", "content": "Hello!"}], stream=True,
        modalities=["text", "audio"], audio={"voice": "alloy", "format": "pcm16"})
    text, pcm = [], []
    for chunk in stream:
        for choice in chunk.choices:
            delta = choice.delta
            text.append(delta.content or "")
            audio = getattr(delta, "audio", None)  # the client's own ChoiceDeltaAudio
            if audio is not None and audio.data:
                pcm.append(base64.b64decode(audio.data))
    client.close()
    return "".join(text), b"".join(pcm)


@pytest.mark.parametrize("front", FRONTS)
@pytest.mark.processes
def test_request_timeout_gives_504_or_a_timeout_error_event(front: str) -> None:
    s = serve(front, toy_pipeline(token_delay=0.01), engine_options={"request_timeout": 0.1})
    try:
        with httpx.Client(base_url=s.url, timeout=HANG) as c:
            words = " ".join(f"w{i}" for i in range(300))
            r = c.post("/v1/chat/completions", json=chat(words))
            assert r.status_code == 504 and r.json()["error"]["code"] == "timeout"
            with c.stream("POST", "/v1/chat/completions", json=chat(words, stream=True)) as r:
                events = sse_events(r.iter_lines())
            assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "timeout"
            assert metrics(c)["trio_orch_errors_total{kind=timeout}"] == 2
            assert c.post("/v1/chat/completions", json=chat("quick")).status_code == 200
    finally:
        s.stop()


@pytest.mark.parametrize("front", FRONTS)
@pytest.mark.processes
def test_health_is_degraded_when_a_stage_dies(front: str) -> None:
    from trio_orch.engine import static_pipeline
    from trio_orch.testing import ScriptedStage

    stages = [ScriptedStage(0), ScriptedStage(1)]
    s = serve(front, static_pipeline(stages, {0, 1}))
    try:
        with httpx.Client(base_url=s.url, timeout=HANG) as c:
            assert c.get("/health").json()["status"] == "ok"
            s.engine.call_soon(stages[1].fail_nowait)
            wait_until(lambda: c.get("/health").status_code == 503, "health reports the dead stage")
            h = c.get("/health").json()
            assert h["status"] == "degraded" and h["stages_available"] == [True, False]
            assert metrics(c)["trio_orch_stage_available{stage=1}"] == 0
    finally:
        s.stop()


@pytest.mark.parametrize("front", ["asyncio", "trio"])
@pytest.mark.parametrize("ending", ["the engine dies", "SIGTERM"])
def test_a_front_s_whole_run_ends_as_the_command_reports_it(front: str, ending: str) -> None:
    """Each front's ``serve(options)`` -- the twins' one entry point -- on a real socket and engine: an
    engine that stops on its own stops the server (``died``), a SIGTERM drains and stops it (not a death)."""
    import importlib

    from trio_orch.serve.options import ServeOptions

    module = importlib.import_module(f"trio_orch.serve.{front}_front")
    sock = listening_socket(16)
    announced: list[tuple[str, int, str]] = []
    answered: list[int] = []

    def end(engine: Any) -> None:  # in a thread, once it serves
        wait_until(lambda: bool(announced), "the front serving")
        with httpx.Client(base_url=f"http://127.0.0.1:{sock.getsockname()[1]}", timeout=HANG) as c:
            answered.append(c.post("/v1/chat/completions", json=chat("hi")).status_code)
        if ending == "SIGTERM":
            os.kill(os.getpid(), signal.SIGTERM)
        else:
            engine.call_soon(lambda: engine.orchestrator.request_shutdown())

    def make_app(engine: Any, front_metrics: Any, counters: Any) -> Any:
        threading.Thread(target=end, args=(engine,), daemon=True).start()
        return create_app(engine, model_name="toy", front=front_metrics, extra_metrics=counters)

    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        out = module.serve(ServeOptions(
            pipeline=toy_pipeline(token_delay=0.001, audio_delay=0.001), make_app=make_app, sock=sock,
            limits=HTTPLimits(max_connections=100), startup_timeout=HANG, shutdown_timeout=5.0,
            announce=lambda host, port, name: announced.append((host, port, name))))
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        sock.close()
    assert out.served and out.startup_error is None and answered == [200]
    assert announced[0][2] == module.FRONT
    if ending == "SIGTERM":
        assert out.stopped_by == ["SIGTERM"] and out.died is None
    else:
        assert out.stopped_by == [] and out.died == "its orchestrator stopped"


def test_a_model_not_served_is_404_and_answers_name_the_first_served_name(serving: Any) -> None:
    s = serving("asyncio", toy_pipeline(token_delay=0.001), model_name=["toy", "alias"])
    with httpx.Client(base_url=s.url, timeout=HANG) as c:
        r = c.post("/v1/chat/completions", json={**chat("hi"), "model": "x" * 200})
        assert r.status_code == 404
        assert (r.json()["error"]["code"], r.json()["error"]["param"]) == ("model_not_found", "model")
        assert c.post("/v1/chat/completions", json={**chat("hi"), "model": "alias"}).json()["model"] == "toy"
        body = {**chat("hi", stream=True), "model": "alias"}
        with c.stream("POST", "/v1/chat/completions", json=body) as r:
            events = sse_events(r.iter_lines())
        assert {e["model"] for e in events if isinstance(e, dict)} == {"toy"}
        unnamed = {"messages": [{"role": "user", "content": "no model named"}]}
        assert c.post("/v1/chat/completions", json=unnamed).json()["model"] == "toy"  # model is optional


@pytest.mark.parametrize("front", FRONTS)
@pytest.mark.processes
def test_finish_reason_is_length_when_the_text_stage_own_limit_cut_the_answer(front: str) -> None:
    s = serve(front, toy_pipeline(token_delay=0.001), token_limit=4)
    try:
        with httpx.Client(base_url=s.url, timeout=HANG) as c:
            short = c.post("/v1/chat/completions", json=chat("hi")).json()  # "You said: hi": 3 tokens
            cut = c.post("/v1/chat/completions", json=chat("a b c d")).json()
            assert short["choices"][0]["finish_reason"] == "stop"
            assert cut["choices"][0]["finish_reason"] == "length"
            with c.stream("POST", "/v1/chat/completions", json=chat("a b c d", stream=True)) as r:
                events = sse_events(r.iter_lines())
            assert events[-2]["choices"][0]["finish_reason"] == "length"
    finally:
        s.stop()
