"""Both fronts serve the one app: the same route table answers alike behind uvicorn and the lean Trio
server.

Real servers on loopback (the serve command's settings), a real HTTP client.
The app is built once for both (``create_app``); these tests catch a front
that serves a route the other does not, or answers it differently.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.http_helpers import FRONTS, HANG, chat, wait_until
from trio_orch.engine import static_pipeline
from trio_orch.http.app import GENERATION_PATHS
from trio_orch.testing import ScriptedStage
from trio_orch.testing.toy_pipeline import toy_pipeline

TOKEN = "s3cret"
AUTH = {"authorization": f"Bearer {TOKEN}"}


def answers(url: str) -> dict[str, Any]:
    """What the route table answers, reduced to what must not depend on the front."""
    out: dict[str, Any] = {}
    with httpx.Client(base_url=url, timeout=HANG) as c:
        r = c.get("/health")
        out["health"] = (r.status_code, r.json()["status"], [st["name"] for st in r.json()["stages"]])
        r = c.get("/metrics")
        families = {f.name for f in text_string_to_metric_families(r.text)}
        out["metrics"] = (r.status_code, r.headers["content-type"].split(";")[0],
                          {"trio_orch_requests_admitted", "trio_orch_http_requests"} <= families)
        r = c.get("/v1/models")
        cards = r.json()["data"]
        assert all(isinstance(card.pop("created"), int) for card in cards)  # when that server started
        out["models"] = (r.status_code, r.json()["object"], cards)
        r = c.get("/admin/stats")
        out["admin without token"] = (r.status_code, r.headers.get("www-authenticate"))
        r = c.get("/admin/stats", headers={"authorization": "Bearer wrong"})
        out["admin wrong token"] = r.status_code
        r = c.get("/admin/stats", headers=AUTH)
        out["admin stats"] = (r.status_code, sorted(r.json()), r.json()["paused"])
        r = c.post("/v1/chat/completions", json=chat("same on both"))
        out["chat"] = (r.status_code, r.json()["choices"][0]["message"]["content"])
        r = c.post("/v1/chat/completions", json=chat("hi", max_tokens=0))
        out["chat 400"] = (r.status_code, r.json()["error"]["param"], r.json()["error"]["type"])
        r = c.post("/v1/chat/completions", content=b"{}", headers={"content-type": "text/plain"})
        out["chat 415"] = (r.status_code, r.json()["error"]["code"])
        r = c.post("/v1/images/generations", json={"prompt": "a cat"})
        out["images on a speech pipeline"] = (r.status_code, r.json()["error"]["param"])
        r = c.get("/no/such/route")
        out["404"] = r.status_code
        r = c.get("/v1/chat/completions")
        out["405"] = r.status_code
    return out


def test_both_fronts_answer_the_same_route_table_alike(serving: Callable[..., Any]) -> None:
    seen = {}
    for front in FRONTS:
        s = serving(front, toy_pipeline(token_delay=0.001, audio_delay=0.001), admin_token=TOKEN,
                    stage_names=["a", "b", "c"])
        seen[front] = answers(s.url)
    assert seen["asyncio"] == seen["trio"]
    got = seen["trio"]
    assert got["health"] == (200, "ok", ["a", "b", "c"])
    assert got["metrics"] == (200, "text/plain", True)
    assert got["models"] == (200, "list", [{"id": "toy", "object": "model", "owned_by": "trio-orch",
                                            "max_model_len": None}])  # in-process toy stages report none
    assert got["admin without token"] == (401, "Bearer") and got["admin wrong token"] == 401
    assert got["admin stats"] == (200, ["paused", "results"], None)
    assert got["chat"] == (200, "You said: same on both")
    assert got["chat 400"] == (400, "max_tokens", "invalid_request_error")
    assert got["chat 415"] == (415, "unsupported_media_type")
    assert got["images on a speech pipeline"] == (400, "model")
    assert (got["404"], got["405"]) == (404, 405)


def test_without_a_token_neither_front_serves_admin(serving: Callable[..., Any]) -> None:
    for front in FRONTS:
        s = serving(front, toy_pipeline())
        with httpx.Client(base_url=s.url, timeout=HANG) as c:
            assert c.get("/admin/stats", headers=AUTH).status_code == 404


def head(path: str, length: int = 100) -> bytes:
    """The head of a POST announcing a ``length``-byte body."""
    return (f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            f"content-length: {length}\r\n\r\n").encode()


def read_answer(sock: socket.socket) -> bytes:
    """One JSON answer: its head and its whole body."""
    data = b""
    while b"\r\n\r\n" not in data or not data.rstrip().endswith(b"}"):
        chunk = sock.recv(65536)
        assert chunk, f"closed before an answer: {data!r}"
        data += chunk
    return data


@pytest.mark.parametrize("front", FRONTS)
def test_every_generation_route_is_shed_before_its_body_is_read(serving: Callable[..., Any],
                                                                front: str) -> None:
    """Once the requests let in and not answered fill the engine's capacity (here: streams a stage never
    answers), a POST to any generation route (chat, images, completions, speech) gets 429 with
    Retry-After before its body is read; when they go, there is room again. (An upload still in
    progress holds no room: tests/http/test_http_limits.py.)"""
    assert GENERATION_PATHS == {"/v1/chat/completions", "/v1/images/generations", "/v1/completions",
                                "/v1/audio/speech"}
    # one stage that never answers: each request let in holds its room until its client leaves, so
    # the engine holds exactly its capacity (two started; with no request channel nothing waits)
    stage = ScriptedStage(0)
    s = serving(front, static_pipeline([stage], {0}),
                engine_options={"max_inflight": [2], "request_queue_size": 0, "max_waiting": 0})
    capacity = s.engine.capacity
    assert capacity == 2
    body = json.dumps(chat("hello", stream=True)).encode()
    let_in = [socket.create_connection(("127.0.0.1", s.port), timeout=HANG) for _ in range(int(capacity))]
    try:
        for k, conn in enumerate(let_in):  # one after the other: each reaches the stage first
            conn.sendall(head("/v1/chat/completions", len(body)) + body)
            wait_until(lambda k=k: len(stage.submissions) == k + 1, "the stream reaches the stage")
        assert s.front.pending == capacity
        for path in sorted(GENERATION_PATHS):
            with socket.create_connection(("127.0.0.1", s.port), timeout=HANG) as probe:
                probe.sendall(head(path))
                status, _, answer = read_answer(probe).partition(b"\r\n\r\n")
            assert status.startswith(b"HTTP/1.1 429") and b"\r\nretry-after: 1" in status.lower(), status
            assert json.loads(answer)["error"]["code"] == "overloaded"
            assert s.front.requests[(path, 429)] == 1
        assert s.front.shed == len(GENERATION_PATHS) and s.front.pending == capacity
    finally:
        for conn in let_in:
            conn.close()  # clients that leave mid-stream: their requests end
    # gone from the front and from the orchestrator: the front counts a request off when its response
    # ends, the orchestrator when it ended it and aborted it at the stage (on the threaded front that
    # comes later, through the bridge; a request sent in between finds no room and is shed)
    wait_until(lambda: s.front.pending == 0 and len(stage.aborts) == capacity, "the streams gone")
    with socket.create_connection(("127.0.0.1", s.port), timeout=HANG) as again:  # room again: let in
        again.sendall(head("/v1/chat/completions", len(body)) + body)
        assert again.recv(64).startswith(b"HTTP/1.1 200")
