"""The generation routes take ``priority`` (an int, lower first); anything else is a 400 naming it.

Over ``trio-orch serve`` with a real worker process, on both fronts: a later
urgent request streams before the queued low-priority ones.
"""

from __future__ import annotations

import re
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from bench.perf.serving import stop_server
from tests.http_helpers import FRONTS, Served, TrioServed, deltas, metrics, sse_events
from tests.waiting import wait_until
from trio_orch.testing.toy_pipeline import toy_pipeline

ROOT = Path(__file__).resolve().parents[2]
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


# ---------------------------------------------------------------- trio-orch serve, a real worker process
ECHO_ONE_AT_A_TIME = """[pipeline]
final_stage_ids = [0]

[[stages]]
kind = "echo"
replicas = 1
max_batch = 1
model = {outputs = 4}
worker_args = ["--step-delay-ms", "20"]
"""
ADMIN = {"authorization": "Bearer prio-test"}


def start_serve(front: str, config: Path, aging: float = 3600.0) -> tuple[subprocess.Popen[str], str]:
    """``trio-orch serve --loop FRONT`` on a free loopback port; its URL once it serves.

    ``aging`` (``--priority-aging``): by default none to speak of -- on a loaded
    machine building a queue takes seconds, and a low request queued 5 s
    before a mid one would rightly start first.
    """
    proc = subprocess.Popen([sys.executable, "-m", "trio_orch.cli", "serve", "--loop", front, "--port", "0",
                             "--config", str(config), "--admin-token", ADMIN["authorization"].split()[1],
                             "--priority-aging", str(aging)],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    for line in proc.stdout:
        m = re.search(r"serving on (http://\S+)", line)
        if m:
            threading.Thread(target=proc.stdout.read, daemon=True).start()  # never a full pipe
            return proc, m.group(1)
    proc.wait()
    raise AssertionError(f"trio-orch serve --loop {front} exited ({proc.returncode}) before serving")


QUEUE = [("low0", 5), ("low1", 5), ("low2", 5), ("mid0", 0), ("mid1", 0), ("urgent", -5)]


@pytest.mark.slow
@pytest.mark.processes
@pytest.mark.parametrize(("front", "aging", "order"), [
    ("trio", 3600.0, ["busy", "urgent", "mid0", "mid1", "low0", "low1", "low2"]),  # ties: arrival
    ("asyncio", 3600.0, ["busy", "urgent", "mid0", "mid1", "low0", "low1", "low2"]),
    # --priority-aging 10 us: each request was queued at least one HTTP round trip after the one
    # before it, more than the 11 epochs by which urgent (-5) could pass low (5): arrival order
    ("trio", 1e-5, ["busy", "low0", "low1", "low2", "mid0", "mid1", "urgent"]),
])
def test_over_trio_orch_serve_a_later_urgent_request_streams_before_queued_low_ones(
        front: str, aging: float, order: list[str], tmp_path: Path) -> None:
    """The acceptance over a real serve and its worker process, on both fronts.

    One replica batching one request: ``busy`` occupies the pipeline, three
    ``priority: 5`` and two ``priority: 0`` requests queue behind it, then a
    ``priority: -5`` one.  A ``pause(mode="keep")`` (busy keeps running, nothing
    new starts) holds the queue while it is built, so the outcome does not
    depend on how long ``busy`` takes; the start order after ``resume`` is the
    core's alone.
    """
    config = tmp_path / "echo1.toml"
    config.write_text(ECHO_ONE_AT_A_TIME)
    proc, url = start_serve(front, config, aging)
    firsts: list[str] = []
    finished: list[str] = []
    lock = threading.Lock()

    def stream(rid: str, priority: int) -> None:
        body = {"model": "trio-orch", "messages": [{"role": "user", "content": rid}], "stream": True,
                "modalities": ["text"], "priority": priority}
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=120) as r:
            assert r.status_code == 200, (rid, r.status_code)
            for delta in deltas(sse_events(r.iter_lines())):
                if delta.get("content"):
                    with lock:
                        if rid not in firsts:
                            firsts.append(rid)
        with lock:
            finished.append(rid)

    try:
        with httpx.Client(base_url=url, timeout=60) as c:
            def depth() -> float:
                return metrics(c)["trio_orch_request_channel_depth"]

            threads: list[threading.Thread] = []

            def send(rid: str, priority: int) -> None:
                t = threading.Thread(target=stream, args=(rid, priority), daemon=True)
                threads.append(t)
                t.start()

            send("busy", 0)
            wait_until(lambda: "busy" in firsts, "busy streams", hang=60)
            assert c.post("/admin/pause", json={"mode": "keep"}, headers=ADMIN).status_code == 200
            queue = QUEUE
            for n, (rid, priority) in enumerate(queue, 1):
                send(rid, priority)
                wait_until(lambda n=n: depth() >= n, f"{rid} queued", hang=60)  # type: ignore[misc]
            assert c.post("/admin/resume", json={}, headers=ADMIN).status_code == 200
            for t in threads:
                t.join(120)
            assert firsts == order
            assert sorted(finished) == sorted(["busy", *(rid for rid, _ in queue)])  # every one completes
            bad = c.post("/v1/chat/completions", json={"model": "trio-orch", "priority": "high",
                                                       "messages": [{"role": "user", "content": "x"}]})
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "priority", bad.text
    finally:
        stop_server(proc)
