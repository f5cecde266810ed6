"""``--worker-backend ray`` on a real two-node Ray cluster on this machine.

One cluster per module (:class:`~trio_orch.testing.ray_cluster.LocalRayCluster`):
a head node (``127.0.0.2``, 3 CPUs, custom resource ``head``, label
``node=head``) and a second node (``127.0.0.3``, 2 CPUs, resource ``node2``,
label ``node=two``), each a ``ray start`` of its own with its own temp dir and
ports.  Each test runs ``trio-orch serve --worker-backend ray`` as a child
process (the Ray driver: the test process never becomes one) with the speech
pipeline in async-chunk mode, the thinker and the vocoder pinned to the head
by its resource and the talker pinned to the second node by its label, and
talks to it over HTTP.  The faults are real: ``kill -9`` of the talker's
worker, ``kill -9`` of its actor's process, the second node crashed (every
process of it SIGKILLed) or leaving (its raylet stopped).  Every stream must
end with exactly one terminal.  The module's finalizer stops the cluster even
when a test fails and fails the module if any process of it is left.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.http_helpers import chat, metrics, sse_events
from trio_orch.testing.ray_cluster import LocalRayCluster

pytest.importorskip("ray")

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
HANG = 240.0  #: seconds before a wait is a hang (start-up on two busy cores is slow; never a timing test)
TOKEN = "admin-token-for-the-test"

HEAD = {"num_cpus": 3, "resources": {"head": 10.0}, "labels": {"node": "head"}}
TWO = {"num_cpus": 2, "resources": {"node2": 10.0}, "labels": {"node": "two"}}

#: the speech pipeline, async-chunk; the thinker batches 4 and takes 60 ms a step (so most of 32
#: requests still wait in it, nothing of them streamed, when a talker's death is noticed, heartbeats
#: later) but admits 32; where the talker goes is filled in
SPEECH = """[pipeline]
final_stages = [0, 2]
async_chunk = true
heartbeat_interval = 0.5
heartbeat_timeout = 5.0
startup_timeout = {startup}
placement_strategy = "{strategy}"

[[stages]]
kind = "thinker"
max_batch = 4
max_inflight = 32
model = {{max_new_tokens = 12}}
worker_args = ["--step-delay-ms", "60"]
resources = {{head = 1}}

[[stages]]
kind = "talker"
{talker}

[[stages]]
kind = "code2wav"
resources = {{head = 1}}
"""

PINNED_TALKER = 'label_selector = {node = "two"}'


def speech(*, talker: str = PINNED_TALKER, strategy: str = "PACK", startup: float = 120.0) -> str:
    return SPEECH.format(talker=talker, strategy=strategy, startup=startup)


@pytest.fixture(scope="module")
def cluster(request: pytest.FixtureRequest) -> LocalRayCluster:
    c = LocalRayCluster()

    def stop() -> None:
        c.stop()
        left = c.leftovers()
        assert left == [], f"processes of the test cluster left running: {left}"

    request.addfinalizer(stop)  # before anything starts: a failed start is stopped too
    c.start_head(**HEAD)  # type: ignore[arg-type]
    c.add_node("two", **TWO)  # type: ignore[arg-type]
    return c


@pytest.fixture()
def two_nodes(cluster: LocalRayCluster) -> LocalRayCluster:
    """The cluster with its second node up (a test before may have stopped it)."""
    if "two" not in cluster.nodes:
        cluster.add_node("two", **TWO)  # type: ignore[arg-type]
    return cluster


class Serve:
    """``trio-orch serve --worker-backend ray`` on the cluster, as a child process (its output in a file)."""

    def __init__(self, cluster: LocalRayCluster, tmp: Path, config: str, *extra: str) -> None:
        self.cluster = cluster
        cfg = tmp / "pipeline.toml"
        cfg.write_text(config)
        self.log = tmp / "serve.log"
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "trio_orch.cli", "serve", "--port", "0", "--served-model-name", "toy",
                 "--config", str(cfg), "--worker-backend", "ray", "--ray-address", cluster.address,
                 "--admin-token", TOKEN, "--startup-timeout", str(HANG), *extra],
                cwd=ROOT, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                env=cluster.driver_env, start_new_session=True)
        self.url = ""

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_serving(self) -> str:
        end = time.monotonic() + HANG
        while time.monotonic() < end and self.proc.poll() is None:
            m = re.search(r"serving on (http://\S+)", self.output())
            if m:
                self.url = m.group(1)
                return self.url
            time.sleep(0.2)
        raise AssertionError(f"serve did not start (exit {self.proc.poll()}):\n{self.output()[-4000:]}")

    def get(self, path: str) -> httpx.Response:
        with httpx.Client(base_url=self.url, timeout=60) as c:
            return c.get(path, headers={"Authorization": f"Bearer {TOKEN}"})

    def wait_health(self, pred: Any, what: str) -> dict[str, Any]:
        """Poll ``/health`` until ``pred(status code, body)``; the body."""
        end = time.monotonic() + HANG
        last: Any = None
        while time.monotonic() < end:
            r = self.get("/health")
            last = (r.status_code, r.json())
            if pred(*last):
                return last[1]
            time.sleep(0.25)
        raise AssertionError(f"timed out waiting for {what}; last /health: {last}\n{self.output()[-3000:]}")

    def metrics(self) -> dict[str, float]:
        with httpx.Client(base_url=self.url, timeout=60) as c:
            return metrics(c)

    def stats(self) -> dict[int, dict[str, Any]]:
        """``/admin/stats``: each stage's (single) replica's worker stats."""
        r = self.get("/admin/stats")
        assert r.status_code == 200, r.text
        return {res["stage_id"]: res["value"] for res in r.json()["results"]}

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # a drain, as an operator stops it
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


@contextlib.contextmanager
def serving(cluster: LocalRayCluster, tmp: Path, config: str, *extra: str) -> Any:
    s = Serve(cluster, tmp, config, *extra)
    try:
        s.wait_serving()
        yield s
    except BaseException:
        s.stop()
        print(s.output()[-6000:])  # what serve said, beside the failure
        raise
    code = s.stop()
    assert code == 0, f"serve exited {code}:\n{s.output()[-4000:]}"  # a clean drain on SIGTERM
    # every worker an actor started is gone with its actor (Ray's own idle workers may stay)
    wait_for(lambda: not any(n.find("stages.headless") for n in cluster.nodes.values()),
             "the Ray workers' trio-orch workers exit")


def wait_for(pred: Any, what: str, hang: float = HANG) -> None:
    end = time.monotonic() + hang
    while not pred():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def all_ready(code: int, body: dict[str, Any]) -> bool:
    return code == 200 and body["status"] == "ok"


def talker(cluster: LocalRayCluster, node: str = "two") -> list[int]:
    """Pids of the talker's trio-orch worker on that node."""
    return cluster.nodes[node].workers("--stage 1 ")


class Streams:
    """``n`` concurrent streaming chat requests (text and audio) in a thread; each one's SSE events."""

    def __init__(self, url: str, n: int, tag: str) -> None:
        self.events: list[list[Any]] = [[] for _ in range(n)]
        self.status: list[int | None] = [None] * n
        self.first_text = threading.Event()
        self.thread = threading.Thread(target=asyncio.run, args=(self._main(url, n, tag),), daemon=True)
        self.thread.start()

    async def _one(self, c: httpx.AsyncClient, i: int, tag: str) -> None:
        body = chat(f"{tag} request {i}: tell me something", stream=True, modalities=["text", "audio"])
        async with c.stream("POST", "/v1/chat/completions", json=body) as r:
            self.status[i] = r.status_code
            async for line in r.aiter_lines():
                for e in sse_events([line]):
                    self.events[i].append(e)
                    if isinstance(e, dict) and any(ch.get("delta", {}).get("content")
                                                   for ch in e.get("choices", ())):
                        self.first_text.set()

    async def _main(self, url: str, n: int, tag: str) -> None:
        limits = httpx.Limits(max_connections=n, max_keepalive_connections=n)
        async with httpx.AsyncClient(base_url=url, timeout=HANG, limits=limits) as c:
            await asyncio.gather(*(self._one(c, i, tag) for i in range(n)))

    def join(self) -> list[str]:
        """Wait for every stream to end; each one's single terminal: ``finish`` or ``error:<kind>``."""
        self.thread.join(HANG)
        assert not self.thread.is_alive(), "streams still open"
        out = []
        for i, events in enumerate(self.events):
            assert self.status[i] == 200, (i, self.status[i], events)
            terminals = [terminal_of(e) for e in events if terminal_of(e) is not None]
            assert len(terminals) == 1, (i, terminals)  # exactly one terminal ...
            assert events[-1] == "[DONE]"  # ... and nothing after it but the end of the stream
            last = [e for e in events if isinstance(e, dict) and e.get("choices") != []][-1]
            assert terminal_of(last) is not None, (i, events[-3:])
            out.append(str(terminals[0]))
        return out


def restarts(m: dict[str, float], stage: int) -> float:
    """Restarts of a stage's replicas, whatever the cause, from ``/metrics``."""
    return sum(v for k, v in m.items()
               if k.startswith("trio_orch_supervisor_restarts_total{") and f"stage={stage}}}" in k)


def terminal_of(e: Any) -> str | None:
    if not isinstance(e, dict):
        return None
    if "error" in e:
        return f"error:{e['error'].get('code')}"
    if any(ch.get("finish_reason") for ch in e.get("choices", ())):
        return "finish"
    return None


def check_connector_over_curve(stats: dict[int, dict[str, Any]]) -> None:
    """Stage k streams its chunks to stage k+1's worker on the other node over TCP, CurveZMQ both ends."""
    thinker, talker_, vocoder = (stats[k]["connector"] for k in range(3))
    for sender, receiver in ((thinker, talker_), (talker_, vocoder)):
        [peer] = sender["outbox"]
        assert peer["address"].startswith("tcp://") and peer["mechanism"] == "CURVE", peer
        inbox = receiver["inbox"]
        assert inbox["tcp"] == peer["address"] and inbox["curve_server"] and not inbox["plain_server"]
        assert inbox["received"] > 0 and sender["sent"] > 0  # chunks did cross


# --------------------------------------------------------------------------------------------------------
def test_a_pipeline_the_cluster_cannot_hold_is_refused_at_start_naming_what_is_missing(
        two_nodes: LocalRayCluster, tmp_path: Path) -> None:
    # more GPUs than any node has: known from the nodes' totals, refused before anything is placed
    gpus = speech(talker='resources = {num_gpus = 4}')
    s = Serve(two_nodes, tmp_path, gpus)
    assert s.proc.wait(HANG) == 1
    out = s.output()
    assert "missing resource 'GPU'" in out and "stage 1 (talker) replica 0 needs GPU 4" in out, out[-3000:]
    # two talkers of 1.5 CPUs pinned to the 2-CPU node: every total fits, the placement never can;
    # refused once startup_timeout (5 s) ran out, saying so
    (tmp_path / "b").mkdir()
    packed = speech(talker='replicas = 2\nresources = {num_cpus = 1.5}\nlabel_selector = {node = "two"}',
                    startup=5.0)
    s = Serve(two_nodes, tmp_path / "b", packed)
    assert s.proc.wait(HANG) == 1
    out = s.output()
    assert "did not place placement group(s) pipeline within 5 s (startup_timeout)" in out, out[-3000:]
    assert "no way to give each replica one node" in out
    assert not any(n.find("stages.headless") for n in two_nodes.nodes.values())


def test_streams_across_nodes_survive_a_killed_talker_worker_and_a_killed_talker_actor(
        two_nodes: LocalRayCluster, tmp_path: Path) -> None:
    c = two_nodes
    with serving(c, tmp_path, speech()) as s:
        s.wait_health(all_ready, "every stage joined")
        # placement: the talker's worker runs on the second node, the others on the head
        [first] = talker(c)
        assert len(c.nodes["head"].workers()) == 2 and not talker(c, "head")

        streams = Streams(s.url, 32, "a")
        assert streams.first_text.wait(HANG), "no stream got text"
        os.kill(first, signal.SIGKILL)  # mid-stream: most requests wait in the thinker with nothing shown
        ends = streams.join()
        wait_for(lambda: restarts(s.metrics(), 1) == 1, "the killed worker's actor was replaced")
        m = s.metrics()
        assert restarts(m, 0) == restarts(m, 2) == 0
        # requests that had shown nothing were restarted on the replacement and completed there;
        # those that had streamed text end with replica_died (their partial output was seen)
        assert m["trio_orch_requests_retried_total{stage=1}"] >= 1
        assert ends.count("finish") >= m["trio_orch_requests_retried_total{stage=1}"]
        assert set(ends) <= {"finish", "error:replica_died"}, ends
        [second] = talker(c)
        assert second != first
        check_connector_over_curve(s.stats())

        # the actor itself killed: its worker exits with it, a new actor comes up in the same bundle
        actor = c.nodes["two"].actor_of(second)
        os.kill(actor, signal.SIGKILL)
        wait_for(lambda: restarts(s.metrics(), 1) == 2, "the killed actor was replaced")
        s.wait_health(all_ready, "health back to ok")
        [third] = talker(c)
        assert third not in (first, second) and c.nodes["two"].actor_of(third) != actor
        assert Streams(s.url, 8, "b").join() == ["finish"] * 8


def test_losing_the_talkers_node_ends_every_stream_once_health_names_the_stage_and_it_comes_back(
        two_nodes: LocalRayCluster, tmp_path: Path) -> None:
    c = two_nodes
    with serving(c, tmp_path, speech(), "--request-timeout", "120") as s:
        s.wait_health(all_ready, "every stage joined")
        [lost] = talker(c)
        streams = Streams(s.url, 16, "c")
        assert streams.first_text.wait(HANG), "no stream got text"
        c.stop_node("two", crash=True)  # the machine is gone: every process of it at once
        body = s.wait_health(
            lambda code, b: code == 503 and b.get("unavailable_stages") == [1]
            and "node" in b["stages"][1]["replicas"][0].get("restart", ""),
            "health to name the talker's stage and what its replacement waits for")
        rep = body["stages"][1]["replicas"][0]
        assert rep["state"] == "restarting" and "{'node': 'two'}" in rep["restart"], rep
        assert s.metrics()['trio_orch_membership_events_total{event=lost}'] >= 1
        c.add_node("two", **TWO)  # type: ignore[arg-type]  # a node with the label comes back
        ends = streams.join()
        assert set(ends) <= {"finish", "error:replica_died"}, ends
        s.wait_health(all_ready, "the talker replaced on the new node")
        [back] = talker(c)
        assert back != lost
        assert Streams(s.url, 4, "d").join() == ["finish"] * 4


def test_a_lost_nodes_unpinned_replica_is_replaced_on_the_node_left(
        two_nodes: LocalRayCluster, tmp_path: Path) -> None:
    c = two_nodes
    # the talker may go anywhere; SPREAD puts it on the node the pinned stages leave free
    with serving(c, tmp_path, speech(talker="", strategy="SPREAD")) as s:
        s.wait_health(all_ready, "every stage joined")
        assert len(talker(c)) == 1 and not talker(c, "head")
        c.stop_node("two")  # the node leaves: its raylet stops
        s.wait_health(lambda code, b: code == 503 and b.get("unavailable_stages") == [1], "the talker lost")
        s.wait_health(all_ready, "the talker replaced")
        assert len(talker(c, "head")) == 1  # on the head now: its bundle was placed there
        assert Streams(s.url, 4, "e").join() == ["finish"] * 4
        m = s.metrics()
        assert restarts(m, 1) == 1 and restarts(m, 0) == restarts(m, 2) == 0
