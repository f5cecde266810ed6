"""The generation routes take ``priority`` (an int, lower first); anything else is a 400 naming it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
import pytest

from tests.http_helpers import FRONTS, Served, TrioServed
from trio_orch.testing.toy_pipeline import toy_pipeline

ROUTES = [
    ("/v1/chat/completions", {"model": "toy", "messages": [{"role": "user", "content": "hi"}],
                              "max_tokens": 2}),
    ("/v1/completions", {"model": "toy", "prompt": "hi", "max_tokens": 2}),
    ("/v1/audio/speech", {"model": "toy", "input": "hi", "voice": "alloy"}),
    ("/v1/images/generations", {"model": "toy", "prompt": "a cat"}),
]


@pytest.fixture(params=FRONTS)
def toy(request: pytest.FixtureRequest, serving: Callable[..., Any]) -> Served | TrioServed:
    return serving(request.param, toy_pipeline(token_delay=0.001, audio_delay=0.001))  # type: ignore[no-any-return]


@pytest.mark.parametrize(("path", "body"), ROUTES, ids=[p for p, _ in ROUTES])
def test_a_priority_that_is_not_an_int_is_a_400_naming_it(toy: Served, path: str,
                                                          body: dict[str, Any]) -> None:
    for bad in ("high", 1.5, True, None):
        r = httpx.post(toy.url + path, json={**body, "priority": bad}, timeout=30)
        assert r.status_code == 400, (bad, r.text)
        err = r.json()["error"]
        assert err["param"] == "priority" and err["type"] == "invalid_request_error", err


def test_an_int_priority_is_served(toy: Served) -> None:
    for prio in (-5, 0, 7):
        for path, body in ROUTES[:3]:  # the toy pipeline makes text and audio
            r = httpx.post(toy.url + path, json={**body, "priority": prio}, timeout=30)
            assert r.status_code == 200, (path, prio, r.text)
