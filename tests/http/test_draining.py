"""Draining, as both fronts answer it: new work gets 503 ``draining`` before any other check.

The serve command sets ``front.draining`` on its first signal; here the test
sets it on a real server over the toy pipeline, so what is checked is the
answer itself (tests/serve/test_deploy.py sends the signals).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
import pytest
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect

from tests.http_helpers import FRONTS, HANG, chat
from trio_orch.testing.toy_pipeline import toy_pipeline

pytestmark = pytest.mark.processes  # real servers on loopback


@pytest.mark.parametrize("front", FRONTS)
def test_every_new_piece_of_work_gets_503_draining_before_any_other_check(serving: Callable[..., Any],
                                                                          front: str) -> None:
    s = serving(front, toy_pipeline())
    s.front.draining = True
    with httpx.Client(base_url=s.url, timeout=HANG) as c:
        answers = [
            c.post("/v1/chat/completions", json=chat("hi")),
            c.post("/v1/images/generations", json={"prompt": "a cat"}),
            c.post("/v1/chat/completions", content=b"not json", headers={"Content-Type": "text/plain"}),
            c.post("/v1/chat/completions", json=chat("x" * (s.limits.max_prompt_chars + 1))),
        ]
        for r in answers:
            assert r.status_code == 503, r.text
            assert r.json()["error"]["code"] == "draining" and r.headers["retry-after"] == "1"
            assert r.headers["connection"] == "close"
        health = c.get("/health")
        assert health.status_code == 503 and health.json()["status"] == "draining"
        assert c.get("/metrics").status_code == 200  # what an operator watches still answers
    with pytest.raises(InvalidStatus) as refused:
        connect(f"ws://127.0.0.1:{s.port}/v1/realtime", open_timeout=HANG)
    assert refused.value.response.status_code == 503
    assert b"draining" in refused.value.response.body
    assert s.engine.stats().active_requests == 0  # none of it reached the engine
