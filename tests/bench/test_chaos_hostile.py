"""The hostile clients of the ``slow_body`` and ``smuggle`` chaos faults, against both fronts.

The faults themselves run against ``trio-orch serve`` over the torch
pipeline (``trio-orch chaos --only slow_body --only smuggle``); here their
attackers (:mod:`bench.chaos.hostile`) meet the toy pipeline behind each
front, so what the rows count is checked where it is quick.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
import trio

from bench.chaos.hostile import SlowUploads, slow_uploads, smuggle
from tests.http_helpers import FRONTS, HANG, Served, TrioServed, chat, serve
from trio_orch.http.limits import HTTPLimits
from trio_orch.testing.toy_pipeline import open_toy_pipeline

LIMITS = HTTPLimits(max_body_reads=8, body_timeout=HANG, body_rate_window=0.5)


@pytest.fixture(scope="module", params=FRONTS)
def served(request: pytest.FixtureRequest) -> Iterator[Served | TrioServed]:
    s = serve(request.param, lambda: open_toy_pipeline(0.001, 0.001), limits=LIMITS)
    yield s
    s.stop()


async def test_every_slow_upload_loses_its_slot_with_a_408_and_the_server_serves_on(
        served: Served | TrioServed) -> None:
    seen = SlowUploads()
    stop = trio.Event()
    with trio.fail_after(HANG):
        await slow_uploads(served.url, LIMITS.max_body_reads, stop, seen, byte_every=0.1)
    assert seen.started == LIMITS.max_body_reads and seen.answers == {"408": LIMITS.max_body_reads}
    async with httpx.AsyncClient(base_url=served.url, timeout=HANG) as client:
        assert (await client.post("/v1/chat/completions", json=chat("after"))).status_code == 200


async def test_every_smuggling_attempt_is_a_400_and_a_close_and_the_hidden_get_is_never_served(
        served: Served | TrioServed) -> None:
    """Were the hidden GET served, its answer would follow the 400 on the same connection: the
    attacker counts that as ``served``."""
    with trio.fail_after(HANG):
        assert await smuggle(served.url, 5) == {"refused": 5}
    with httpx.Client(base_url=served.url, timeout=HANG) as client:
        assert client.get("/v1/models").status_code == 200  # served as a request of its own
