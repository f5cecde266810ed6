"""What a vLLM operator's tools see around the routes, on both fronts: CORS, ``/openapi.json``, the access
log, the path prefix, the request log, the scheduler bound, the throughput line.

Real servers on loopback (the one app behind each front, as ``serve`` runs
it) and real HTTP clients; the throughput line's clock is Trio's, jumped.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import httpx
import pytest
import trio
import trio.testing

from tests.http_helpers import FRONTS, HANG, chat, running_and_waiting, wait_until
from trio_orch.http.access import ACCESS_LOGGER, Cors
from trio_orch.http.generation import REQUESTS_LOGGER
from trio_orch.http.metrics import FrontMetrics
from trio_orch.http.routes.openapi import REQUEST_SCHEMAS
from trio_orch.serve.throughput import STATS_LOGGER, ThroughputLog, run_thread, run_trio
from trio_orch.testing.toy_pipeline import toy_pipeline

SERVES = pytest.mark.processes  # a real server on loopback
FAST = toy_pipeline(token_delay=0.001, audio_delay=0.001)


@SERVES
@pytest.mark.parametrize("front", FRONTS)
def test_a_preflight_from_an_allowed_origin_gets_the_cors_headers_and_another_origin_none(
        front: str, serving: Callable[..., Any]) -> None:
    s = serving(front, FAST, cors=Cors(origins=("https://ui.example",)), api_key="k")
    preflight = {"origin": "https://ui.example", "access-control-request-method": "POST",
                 "access-control-request-headers": "authorization, content-type"}
    with httpx.Client(base_url=s.url, timeout=HANG) as c:
        r = c.options("/v1/chat/completions", headers=preflight)  # no key: a preflight never carries one
        assert r.status_code == 200
        assert r.headers["access-control-allow-origin"] == "https://ui.example"
        assert "POST" in r.headers["access-control-allow-methods"]
        assert "authorization" in r.headers["access-control-allow-headers"].lower()
        other = c.options("/v1/chat/completions", headers={**preflight, "origin": "https://evil.example"})
        assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
        r = c.post("/v1/chat/completions", json=chat("hi"),
                   headers={"origin": "https://ui.example", "authorization": "Bearer k"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://ui.example"


@SERVES
@pytest.mark.parametrize("front", FRONTS)
def test_vllms_cors_defaults_allow_any_origin(front: str, serving: Callable[..., Any]) -> None:
    s = serving(front, FAST)
    with httpx.Client(base_url=s.url, timeout=HANG) as c:
        r = c.options("/v1/completions", headers={"origin": "https://anywhere.example",
                                                  "access-control-request-method": "POST"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*"


@SERVES
@pytest.mark.parametrize("front", FRONTS)
def test_openapi_lists_the_real_routes_and_is_open_without_the_key(front: str,
                                                                    serving: Callable[..., Any]) -> None:
    s = serving(front, FAST, api_key="k", admin_token="t")
    with httpx.Client(base_url=s.url, timeout=HANG) as c:
        assert c.get("/v1/models").status_code == 401
        doc = c.get("/openapi.json")
        docs = c.get("/docs")
    assert doc.status_code == 200 and docs.status_code == 200 and "/openapi.json" in docs.text
    spec = doc.json()
    paths = spec["paths"]
    for path, method in (("/v1/chat/completions", "post"), ("/v1/completions", "post"),
                         ("/v1/audio/speech", "post"), ("/tokenize", "post"), ("/v1/models", "get"),
                         ("/v1/models/{name}", "get"), ("/health", "get"), ("/metrics", "get"),
                         ("/v1/realtime", "get"), ("/admin/pause", "post")):
        assert method in paths[path], (path, method)
    chat_body = paths["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert chat_body == {"$ref": "#/components/schemas/ChatCompletionRequest"}
    assert "messages" in spec["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    assert paths["/v1/completions"]["post"]["security"] == [{"bearer": []}]  # behind the key
    assert "security" not in paths["/health"]["get"]  # open
    # every POST route the app serves has its body described
    posts = [p for p, ops in paths.items() if "post" in ops]
    assert posts and all(p in REQUEST_SCHEMAS for p in posts)


@SERVES
@pytest.mark.parametrize("front", FRONTS)
def test_one_access_log_line_per_request_with_status_duration_and_request_id(
        front: str, serving: Callable[..., Any], caplog: pytest.LogCaptureFixture) -> None:
    s = serving(front, FAST)
    with caplog.at_level(logging.INFO, logger=ACCESS_LOGGER), httpx.Client(base_url=s.url, timeout=HANG) as c:
        ok = c.post("/v1/chat/completions", json=chat("one"), headers={"x-request-id": "trace-42"})
        with c.stream("POST", "/v1/chat/completions", json=chat("two", stream=True)) as r:
            list(r.iter_lines())
            streamed_id = r.headers["x-request-id"]
        c.get("/v1/nothing")
        wait_until(lambda: len([r for r in caplog.records if r.name == ACCESS_LOGGER]) == 3, "three lines")
    lines = [r.getMessage() for r in caplog.records if r.name == ACCESS_LOGGER]
    assert ok.headers["x-request-id"] == "trace-42"  # the client's own id, echoed
    assert '"POST /v1/chat/completions HTTP/1.1" 200 ' in lines[0]
    assert lines[0].endswith("request_id=trace-42")
    assert f"request_id={streamed_id}" in lines[1] and '" 200 ' in lines[1]  # logged once the stream ended
    assert '"GET /v1/nothing HTTP/1.1" 404 ' in lines[2]
    for line in lines:
        assert line.startswith("127.0.0.1:") and "ms request_id=" in line


@SERVES
def test_disable_fastapi_docs_leaves_out_openapi_and_docs(serving: Callable[..., Any]) -> None:
    s = serving("trio", FAST, docs=False)
    with httpx.Client(base_url=s.url, timeout=HANG) as c:
        assert c.get("/openapi.json").status_code == 404 and c.get("/docs").status_code == 404
        assert c.get("/health").status_code == 200


@SERVES
def test_without_the_access_log_nothing_is_logged_per_request(serving: Callable[..., Any],
                                                               caplog: pytest.LogCaptureFixture) -> None:
    s = serving("trio", FAST, access_log=False)
    with caplog.at_level(logging.INFO, logger=ACCESS_LOGGER), httpx.Client(base_url=s.url, timeout=HANG) as c:
        r = c.post("/v1/chat/completions", json=chat("one"))
    assert r.status_code == 200 and "x-request-id" not in r.headers
    assert [rec for rec in caplog.records if rec.name == ACCESS_LOGGER] == []


@SERVES
@pytest.mark.parametrize("front", FRONTS)
def test_a_root_path_prefix_reaches_the_same_routes_with_it_or_without_it(
        front: str, serving: Callable[..., Any]) -> None:
    s = serving(front, FAST, root_path="/llm", api_key="k")
    auth = {"authorization": "Bearer k"}
    with httpx.Client(base_url=s.url, timeout=HANG) as c:
        assert c.get("/llm/v1/models", headers=auth).json()["data"][0]["id"] == "toy"
        assert c.get("/v1/models", headers=auth).status_code == 200
        assert c.get("/llm/health").status_code == 200  # open with the prefix too
        assert c.get("/llm/openapi.json").json()["servers"] == [{"url": "/llm"}]
        assert c.post("/llm/v1/chat/completions", json=chat("hi"), headers=auth).status_code == 200


@SERVES
def test_the_request_log_says_what_each_request_asked(serving: Callable[..., Any],
                                                       caplog: pytest.LogCaptureFixture) -> None:
    s = serving("asyncio", FAST)
    client = httpx.Client(base_url=s.url, timeout=HANG)
    with caplog.at_level(logging.INFO, logger=REQUESTS_LOGGER), client as c:
        assert c.post("/v1/completions", json={"prompt": "tell me", "max_tokens": 3}).status_code == 200
    lines = [r.getMessage() for r in caplog.records if r.name == REQUESTS_LOGGER]
    assert len(lines) == 1 and "(/v1/completions): prompt: 'tell me'" in lines[0]


@SERVES
@pytest.mark.parametrize("front", FRONTS)
def test_max_num_seqs_bounds_the_running_requests_the_rest_wait(front: str,
                                                                 serving: Callable[..., Any]) -> None:
    """vLLM's ``--max-num-seqs 2``: of six requests, two run at a time, four wait, all are answered."""
    s = serving(front, toy_pipeline(token_delay=0.05, audio_delay=0.001), engine_options={"max_running": 2})
    results: list[int] = []

    def ask(i: int) -> None:
        with httpx.Client(base_url=s.url, timeout=HANG * 4) as c:
            results.append(c.post("/v1/chat/completions", json=chat(f"w{i} " * 8)).status_code)

    asking = [threading.Thread(target=ask, args=(i,), daemon=True) for i in range(6)]
    seen = running_and_waiting(s.url, asking, 2, 4)
    assert max(running for running, _ in seen) == 2 and seen[-1] == (0, 0)
    assert results == [200] * 6


class Snapshot:
    """What the throughput line reads of an engine snapshot."""

    def __init__(self, active: int = 0, queued: int = 0, admission: int = 0) -> None:
        self.active_requests, self.queued_requests, self.admission_waiting = active, queued, admission


def test_the_throughput_line_shows_rates_running_and_waiting_and_goes_quiet_when_idle() -> None:
    front = FrontMetrics()
    meter = ThroughputLog(front, now=0.0)
    assert meter.line(Snapshot(), 10.0) is None  # idle
    front.count_tokens(100, {0: 40})
    line = meter.line(Snapshot(active=5, queued=2, admission=1), 20.0)
    assert line == ("Avg prompt throughput: 10.0 tokens/s, Avg generation throughput: 4.0 tokens/s, "
                    "Running: 3 reqs, Waiting: 3 reqs")
    assert meter.line(Snapshot(), 30.0) is not None  # one more line: the drop to 0
    assert meter.line(Snapshot(), 40.0) is None


async def test_the_trio_front_logs_the_line_every_interval_while_busy(
        autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture) -> None:
    front = FrontMetrics()
    snapshots = [Snapshot(active=1), Snapshot(active=1), Snapshot(), Snapshot(), Snapshot()]

    class Engine:
        async def stats_async(self) -> Snapshot:
            return snapshots.pop(0)

    with caplog.at_level(logging.INFO, logger=STATS_LOGGER):
        with trio.move_on_after(50.5):
            await run_trio(Engine(), front, interval=10.0)  # type: ignore[arg-type]
    lines = [r.getMessage() for r in caplog.records if r.name == STATS_LOGGER]
    assert len(lines) == 3 and lines[0].endswith("Running: 1 reqs, Waiting: 0 reqs")  # busy, busy, the drop


def test_the_asyncio_fronts_thread_logs_the_line_while_busy_and_stops_when_told(
        caplog: pytest.LogCaptureFixture) -> None:
    """The thread beside uvicorn: busy, busy, the drop to 0, then nothing however long it idles."""
    front = FrontMetrics()
    snapshots = [Snapshot(active=2), Snapshot(active=1, queued=1), Snapshot()]
    stop = threading.Event()

    class Engine:
        def stats(self) -> Snapshot:
            if not snapshots:
                stop.set()  # every snapshot read: the next wait ends the thread
                return Snapshot()
            return snapshots.pop(0)

    with caplog.at_level(logging.INFO, logger=STATS_LOGGER):
        thread = threading.Thread(target=run_thread, args=(Engine(), front, stop, 0.001), daemon=True)
        thread.start()
        thread.join(HANG)
    assert not thread.is_alive()
    lines = [r.getMessage() for r in caplog.records if r.name == STATS_LOGGER]
    assert [line.split("tokens/s, ")[-1] for line in lines] == [
        "Running: 2 reqs, Waiting: 0 reqs", "Running: 0 reqs, Waiting: 1 reqs",
        "Running: 0 reqs, Waiting: 0 reqs"]
