"""Operating the server: truthful health through a kill -9, shedding under a burst, metrics, drain.

Real servers on loopback; real worker processes (torch-free echo workers)
under the supervisor where health and worker-reported timings are the
point; ``trio-orch serve`` as a child process for the drain.  Latencies are
printed for the record, never asserted.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from stages.config import echo_config
from stages.lockdown import serving_pid
from stages.registry import outputs_of
from tests.http_helpers import HANG, Served, chat, metrics, sse_events, wait_until
from trio_orch.cluster.supervisor import RestartPolicy, supervised_pipeline
from trio_orch.engine import ThreadEngine
from trio_orch.http.limits import HTTPLimits
from trio_orch.http.metrics import FAMILIES
from trio_orch.testing import child_pids, worker_alive
from trio_orch.testing.toy_pipeline import toy_pipeline

ROOT = Path(__file__).resolve().parents[2]


# ---------------------------------------------------------------- health through a kill -9
class Supervised:
    """Two echo stages (stage 1 one replica, slow to restart) under the supervisor, served over HTTP."""

    def __init__(self) -> None:
        self.cfg = echo_config(2, final_stage_ids=[1], outputs=2, heartbeat_interval=0.2,
                               heartbeat_timeout=1.0, stop_grace=1.0)
        self.pipe: Any = None
        policy = RestartPolicy(max_restarts=3, window=30.0, backoff_initial=0.05)
        slow_start = lambda k, r, attempt: ["--startup-delay", "1.5"]  # noqa: E731

        @asynccontextmanager
        async def factory() -> AsyncIterator[Any]:
            async with supervised_pipeline(self.cfg, policy, extra_args=slow_start) as pipe:
                self.pipe = pipe
                yield pipe

        self.served = Served(ThreadEngine(factory, startup_timeout=30).start(),  # serves "toy" (chat())
                             outputs=outputs_of(s.kind for s in self.cfg.stages), stage_names=["a", "b"],
                             extra_metrics=lambda: self.pipe.supervisor.prometheus_counters())


@pytest.mark.slow
def test_health_is_503_degraded_for_the_whole_outage_of_a_killed_worker_and_200_once_replaced() -> None:
    s = Supervised()
    sup = s.pipe.supervisor
    try:
        with httpx.Client(base_url=s.served.url, timeout=HANG) as c:
            h = c.get("/health")
            assert h.status_code == 200 and h.json()["status"] == "ok"
            assert [(st["live"], st["total"]) for st in h.json()["stages"]] == [(1, 1), (1, 1)]
            victim = s.pipe.worker(1, 0).pid
            os.kill(victim, signal.SIGKILL)
            wait_until(lambda: bool(sup.events), "the supervisor saw the death")
            samples: list[tuple[int, dict[str, Any], int]] = []
            posts: list[tuple[int, str | None, int]] = []
            end = time.monotonic() + 30
            while time.monotonic() < end:  # poll every 20 ms until the replacement serves
                r = c.get("/health")
                samples.append((r.status_code, r.json(), sup.restarts))
                if len(samples) == 5:  # a request during the outage: refused at once, not queued
                    p = c.post("/v1/chat/completions", json=chat("during"))
                    posts.append((p.status_code, p.headers.get("retry-after"), sup.restarts))
                if r.status_code == 200:
                    break
                time.sleep(0.02)
            during = [(code, body) for code, body, restarts in samples if restarts == 0]
            assert len(during) >= 5
            assert all(code == 503 for code, _ in during)  # the whole outage, not only at give-up
            body = during[0][1]
            assert body["status"] == "degraded" and body["unavailable_stages"] == [1]
            assert [(st["name"], st["live"], st["total"]) for st in body["stages"]] == [("a", 1, 1),
                                                                                      ("b", 0, 1)]
            code, retry_after, restarts = posts[0]
            assert (code == 503 and retry_after == "1") or restarts > 0
            last_code, last, restarts = samples[-1]
            assert last_code == 200 and last["status"] == "ok" and restarts == 1
            assert [(st["live"], st["total"]) for st in last["stages"]] == [(1, 1), (1, 1)]
            r = c.post("/v1/chat/completions", json=chat("after"))
            assert r.status_code == 200
            timings = r.json()["timings"]  # the non-streaming extension, from the workers' reports
            assert [st["stage"] for st in timings["stages"]] == [0, 1]
            assert all(st["queue_ms"] is not None and st["compute_ms"] >= 0 for st in timings["stages"])
            assert [st["retried_from"] for st in timings["stages"]] == [None, None]  # sent after the restart
            m = metrics(c)
            shed = m["trio_orch_requests_shed_total{reason=stage_unavailable}"]
            assert shed >= (1 if posts[0][2] == 0 else 0)
            assert m["trio_orch_stage_replicas_live{stage=1}"] == 1
            assert m["trio_orch_stage_queue_seconds_count{stage=1}"] >= 1
            assert m["trio_orch_stage_compute_seconds_count{stage=0}"] >= 1
            assert m["trio_orch_supervisor_restarts_total{cause=exited,stage=1}"] == 1
    finally:
        s.served.stop()
    assert not worker_alive(victim)


# ---------------------------------------------------------------- shedding
def burst(url: str, n: int, **body: Any) -> list[tuple[int, float, dict[str, Any] | None, str | None]]:
    """``n`` concurrent non-streamed requests: (status, seconds, JSON, Retry-After) each."""

    async def one(c: httpx.AsyncClient, i: int) -> tuple[int, float, dict[str, Any] | None, str | None]:
        t = time.perf_counter()
        r = await c.post("/v1/chat/completions", json=chat(f"word{i} " * 4, **body))
        return r.status_code, time.perf_counter() - t, r.json(), r.headers.get("retry-after")

    async def main() -> list[Any]:
        limits = httpx.Limits(max_connections=n, max_keepalive_connections=n)
        async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as c:
            return await asyncio.gather(*(one(c, i) for i in range(n)))

    return asyncio.run(main())


def test_a_burst_past_the_bounds_is_shed_with_429_and_the_admitted_ones_all_complete() -> None:
    engine = ThreadEngine(toy_pipeline(token_delay=0.02, audio_delay=0.005), max_inflight=[2, 2, 2],
                    request_queue_size=2, admission_timeout=0.0, max_waiting=0).start()
    s = Served(engine)
    try:
        results = burst(s.url, 24, modalities=["text", "audio"])
        ok = [r for r in results if r[0] == 200]
        shed = [r for r in results if r[0] == 429]
        assert len(ok) + len(shed) == 24 and ok and shed
        for _, _, body, retry_after in shed:
            assert retry_after == "1" and body is not None
            assert body["error"]["type"] == "rate_limit_error" and body["error"]["code"] == "overloaded"
        for _, _, body, _ in ok:
            assert body is not None and body["choices"][0]["finish_reason"] == "stop"
            assert body["choices"][0]["message"]["audio"]["data"]
        assert all(st.peak_active <= 2 for st in engine.stages)  # the bound held on every stage
        with httpx.Client(base_url=s.url, timeout=HANG) as c:
            m = metrics(c)
        assert m["trio_orch_requests_shed_total{reason=overloaded}"] == len(shed)
        assert m["trio_orch_requests_admitted_total"] == len(ok)
        assert m["trio_orch_http_requests_total{route=/v1/chat/completions,status=429}"] == len(shed)
        assert m["trio_orch_stage_max_inflight{stage=0}"] == 2
    finally:
        s.stop()


def raw_burst(port: int, n: int) -> list[bytes]:
    """``n`` fresh connections at once, each sending a whole request and reading until the server's FIN."""
    body = json.dumps(chat("hi there", modalities=["text", "audio"])).encode()
    request = (b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nconnection: close\r\n"
               b"content-type: application/json\r\n" + f"content-length: {len(body)}\r\n\r\n".encode() + body)

    async def one() -> bytes:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(request)
        try:
            return await asyncio.wait_for(reader.read(), HANG)
        finally:
            writer.close()

    async def main() -> list[bytes]:
        return await asyncio.gather(*(one() for _ in range(n)))

    return asyncio.run(main())


def test_a_burst_on_fresh_connections_is_answered_whole_and_nothing_admitted_waits() -> None:
    """No queue and a bound of one: a request starts at once or gets its 429 (most of them from the
    shedder, before their body is read); every answer arrives whole (no reset), every count agrees."""
    engine = ThreadEngine(toy_pipeline(token_delay=0.005, audio_delay=0.002), max_inflight=[1, 1, 1],
                    request_queue_size=0, admission_timeout=0.0, max_waiting=0).start()
    s = Served(engine)
    try:
        answers = raw_burst(s.port, 96)
        statuses = [int(a[9:12]) if a.startswith(b"HTTP/1.1 ") else 0 for a in answers]
        assert set(statuses) <= {200, 429}, "an answer was cut or reset"
        ok, shed = statuses.count(200), statuses.count(429)
        assert ok >= 1 and shed >= 1
        for a in answers:
            payload = json.loads(a.partition(b"\r\n\r\n")[2])
            assert "choices" in payload or payload["error"]["code"] == "overloaded"
        assert all(st.peak_active <= 1 for st in engine.stages)
        with httpx.Client(base_url=s.url, timeout=HANG) as c:
            m = metrics(c)
        assert m["trio_orch_requests_admitted_total"] == ok
        assert m["trio_orch_http_requests_total{route=/v1/chat/completions,status=429}"] == shed
        assert m["trio_orch_requests_shed_total{reason=overloaded}"] == shed
        assert s.front.pending == 0  # every request let in was answered
    finally:
        s.stop()


@pytest.mark.slow
def test_load_a_1024_request_burst_is_partly_shed_and_every_admitted_request_completes() -> None:
    """The load test: bounded in count and time, loopback only; latencies printed, not asserted."""
    engine = ThreadEngine(toy_pipeline(token_delay=0.01, audio_delay=0.002), max_inflight=[16, 16, 16],
                    request_queue_size=16, admission_timeout=0.5, max_waiting=16).start()
    # the head deadline is not under test: on a loaded machine one client process takes seconds to
    # write 1,024 request heads on connections the server accepted at once (a 10 s deadline cut some)
    s = Served(engine, max_connections=4096, limits=HTTPLimits(header_timeout=120.0))
    try:
        unloaded = sorted(r[1] for r in burst(s.url, 8, modalities=["text", "audio"]))
        results = burst(s.url, 1024, modalities=["text", "audio"])
        assert {r[0] for r in results} <= {200, 429}
        ok = sorted(r[1] for r in results if r[0] == 200)
        shed = [r for r in results if r[0] == 429]
        assert ok and shed and len(ok) + len(shed) == 1024
        assert all(st.peak_active <= 16 for st in engine.stages)
        with httpx.Client(base_url=s.url, timeout=HANG) as c:
            m = metrics(c)
            assert m["trio_orch_active_requests"] == 0 and m["trio_orch_requests_queued"] == 0
        assert m["trio_orch_requests_admitted_total"] == len(ok) + len(unloaded)

        def p99(xs: list[float]) -> float:
            return xs[min(len(xs) - 1, int(0.99 * len(xs)))]

        print(f"\nunloaded p99 {p99(unloaded) * 1000:.0f} ms; burst of 1024: {len(ok)} admitted "
              f"(p99 {p99(ok) * 1000:.0f} ms), {len(shed)} shed with 429")
    finally:
        s.stop()


# ---------------------------------------------------------------- metrics
def test_every_family_parses_with_prometheus_client_with_its_declared_type(tmp_path: Path) -> None:
    s = Served(ThreadEngine(toy_pipeline(token_delay=0.001, audio_delay=0.001)).start(),
               outputs=["text", "codes", "audio"])
    try:
        with httpx.Client(base_url=s.url, timeout=HANG) as c:
            r = c.post("/v1/chat/completions", json=chat("one two", modalities=["text", "audio"]))
            assert r.status_code == 200
            with c.stream("POST", "/v1/chat/completions", json=chat("three", stream=True)) as resp:
                list(resp.iter_lines())
            text = c.get("/metrics").text
    finally:
        s.stop()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name, (kind, _) in FAMILIES.items():
        assert families[name].type == kind, name
    for name, fam in families.items():
        names = {smp.name for smp in fam.samples}
        if fam.type == "counter":
            assert names <= {f"{name}_total", f"{name}_created"}, name
        elif fam.type == "histogram":
            assert names >= {f"{name}_bucket", f"{name}_sum", f"{name}_count"} or not names, name
    ttfo = {(smp.labels["stage"], smp.labels["output"]): smp.value
            for smp in families["trio_orch_time_to_first_output_seconds"].samples
            if smp.name.endswith("_count")}
    assert ttfo == {("0", "text"): 2, ("2", "audio"): 1}  # time to first token, time to first audio
    duration = families["trio_orch_request_duration_seconds"].samples
    durations = {smp.labels["kind"]: smp.value for smp in duration if smp.name.endswith("_count")}
    assert durations == {"finished": 2}
    rtf = [smp for smp in families["trio_orch_audio_real_time_factor"].samples if smp.name.endswith("_count")]
    assert [smp.value for smp in rtf] == [1]
    buckets = [smp for smp in families["trio_orch_request_duration_seconds"].samples
               if smp.name.endswith("_bucket")]
    assert buckets[-1].labels["le"] == "+Inf" and buckets[-1].value == 2


# ---------------------------------------------------------------- drain
def start_serve(*extra: str, env: dict[str, str] | None = None,
                new_session: bool = False) -> tuple[subprocess.Popen[str], str]:
    """``trio-orch serve --port 0 --served-model-name toy EXTRA...`` (the name ``chat()`` asks for);
    ``new_session``: in a session (process group) of its own."""
    proc = subprocess.Popen([sys.executable, "-m", "trio_orch.cli", "serve", "--port", "0",
                             "--served-model-name", "toy", *extra], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=new_session)
    assert proc.stdout is not None
    end = time.monotonic() + 120
    while time.monotonic() < end:
        line = proc.stdout.readline()
        if not line:
            break
        m = re.search(r"serving on (http://\S+)", line)
        if m:
            # keep reading what it says (an access-log line per request) so it never blocks on a full pipe
            threading.Thread(target=proc.stdout.read, daemon=True).start()
            return proc, m.group(1)
    proc.kill()
    raise AssertionError("serve did not report its address")


def stream_in_background(url: str, words: int) -> tuple[Any, list[Any]]:
    events: list[Any] = []

    def run() -> None:
        with httpx.Client(base_url=url, timeout=60) as c:
            body = chat(" ".join(f"w{i}" for i in range(words)), stream=True)
            with c.stream("POST", "/v1/chat/completions", json=body) as r:
                events.extend(sse_events(r.iter_lines()))

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, events


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_drains_in_flight_requests_refuses_new_ones_and_exits_0(sig: int) -> None:
    proc, url = start_serve("--in-process")
    try:
        t, events = stream_in_background(url, 60)  # ~1.2 s of text
        with httpx.Client(base_url=url, timeout=HANG) as c:
            wait_until(lambda: metrics(c)["trio_orch_active_requests"] == 1, "the stream runs")
            proc.send_signal(sig)
            wait_until(lambda: c.get("/health").status_code == 503, "health says draining")
            assert c.get("/health").json()["status"] == "draining"
            r = c.post("/v1/chat/completions", json=chat("too late"))
            assert r.status_code == 503 and r.json()["error"]["code"] == "draining"
            assert r.headers["retry-after"] == "1"
        t.join(HANG)
        assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "stop"  # it finished
        assert proc.wait(HANG) == 0  # a clean drain, as uvicorn's and vllm serve's
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.slow
@pytest.mark.parametrize("loop", ["asyncio", "trio"])
def test_a_second_signal_ends_the_drain_at_once(loop: str) -> None:
    proc, url = start_serve("--in-process", "--loop", loop, "--shutdown-timeout", "300")
    try:
        t, events = stream_in_background(url, 3000)  # about a minute of text: far past HANG
        with httpx.Client(base_url=url, timeout=HANG) as c:
            wait_until(lambda: metrics(c)["trio_orch_active_requests"] == 1, "the stream runs")
            proc.send_signal(signal.SIGTERM)
            wait_until(lambda: c.get("/health").status_code == 503, "health says draining")
            r = c.post("/v1/chat/completions", json=chat("too late"))
            assert r.status_code == 503 and r.json()["error"]["code"] == "draining"
        proc.send_signal(signal.SIGINT)  # stop now: the stream gets its shutdown error
        assert proc.wait(HANG) == 1  # the drain was cut short
        t.join(HANG)
        assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "shutdown"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.slow
def test_past_the_shutdown_timeout_in_flight_requests_get_their_shutdown_error(tmp_path: Path) -> None:
    proc, url = start_serve("--in-process", "--shutdown-timeout", "0.3")
    try:
        t, events = stream_in_background(url, 300)  # ~6 s of text: longer than the drain allows
        with httpx.Client(base_url=url, timeout=HANG) as c:
            wait_until(lambda: metrics(c)["trio_orch_active_requests"] == 1, "the stream runs")
        proc.send_signal(signal.SIGTERM)
        t.join(HANG)
        assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "shutdown"
        assert proc.wait(HANG) == 1  # the drain ran out of time: cut short
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.slow
def test_drain_with_worker_processes_leaves_nothing_behind(tmp_path: Path) -> None:
    cfg = tmp_path / "echo.toml"
    cfg.write_text('[pipeline]\nfinal_stages = [1]\n[[stages]]\nkind = "echo"\n[[stages]]\nkind = "echo"\n')
    proc, url = start_serve("--config", str(cfg), env={**os.environ, "TMPDIR": str(tmp_path)})
    try:
        workers = child_pids(serving_pid(proc.pid))
        assert len(workers) >= 2
        with httpx.Client(base_url=url, timeout=HANG) as c:
            assert c.post("/v1/chat/completions", json=chat("hi")).status_code == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(HANG * 3) == 0
        wait_until(lambda: not any(worker_alive(p) for p in workers), "worker processes gone")
        assert sorted(p.name for p in tmp_path.iterdir()) == ["echo.toml"]  # no ipc file or log left
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_ctl_drives_the_trio_front_served_with_an_admin_token() -> None:
    """``serve --loop trio --admin-token T`` serves ``/admin`` like the asyncio front: ``trio-orch ctl``
    works against it, and a wrong token is refused."""
    token = "s3cret"
    proc, url = start_serve("--loop", "trio", "--in-process", "--admin-token", token)
    env = {k: v for k, v in os.environ.items() if k != "TRIO_ORCH_ADMIN_TOKEN"}

    def ctl(*args: str, given: str = token) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "trio_orch.cli", "ctl", "--url", url, "--token", given,
                               *args], cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)

    try:
        paused = ctl("pause", "--mode", "keep")
        assert paused.returncode == 0 and "paused: keep" in paused.stdout, paused.stdout + paused.stderr
        with httpx.Client(base_url=url, timeout=HANG) as c:
            stats = c.get("/admin/stats", headers={"authorization": f"Bearer {token}"})
            assert stats.status_code == 200 and stats.json()["paused"] == "keep"
        resumed = ctl("resume")
        assert resumed.returncode == 0 and "paused: no" in resumed.stdout, resumed.stdout + resumed.stderr
        refused = ctl("resume", given="wrong")
        assert refused.returncode == 1 and "HTTP 401" in refused.stderr
        with httpx.Client(base_url=url, timeout=HANG) as c:
            assert c.post("/v1/chat/completions", json=chat("after ctl")).status_code == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(HANG) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_stage_timings_reach_the_non_streamed_answer_as_an_extension() -> None:
    s = Served(ThreadEngine(toy_pipeline(token_delay=0.001, audio_delay=0.001)).start())
    try:
        with httpx.Client(base_url=s.url, timeout=HANG) as c:
            body = c.post("/v1/chat/completions", json=chat("a b", modalities=["text", "audio"])).json()
    finally:
        s.stop()
    t = body["timings"]
    assert t["total_ms"] >= t["time_to_first_audio_ms"] >= t["time_to_first_token_ms"] > 0
    assert t["real_time_factor"] > 0 and t["stages"] == []  # toy stages keep no per-stage timings
    json.dumps(body)


@pytest.mark.parametrize("phase", ["starting", "serving on"])
def test_a_sigterm_at_any_point_of_startup_exits_0_too(phase: str) -> None:
    """Nothing was accepted yet (or nothing is in flight): a clean stop."""
    proc = subprocess.Popen([sys.executable, "-m", "trio_orch.cli", "serve", "--port", "0", "--in-process"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert proc.stdout is not None
        for line in proc.stdout:  # starting the pipeline, or serving: the outcome is the same
            if line.startswith(phase):
                break
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(HANG) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
