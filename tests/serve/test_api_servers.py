"""``serve --api-server-count 2``: two API-server processes in front of one head, as a user runs it.

The head runs the engine (here the in-process toy pipeline, whose streams take
a while: one word each 20 ms) and serves no HTTP; the fronts it launched share
the port.  The official ``openai`` SDK streams against the port; a front
killed with ``kill -9`` comes back while the head stays up, its streams drop
and each ends ``aborted`` in the head, once; SIGTERM to the head's whole
process group drains both fronts' streams, and nothing is left.  Each of
these runs with either ``--loop`` (the fronts' server: the lean Trio one, or
uvicorn with the remote engine behind the thread adapter); TLS with the
asyncio fronts.
"""

from __future__ import annotations

import contextlib
import glob
import os
import re
import shutil
import signal
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from stages.lockdown import serving_pid
from tests.serve_process import ROOT
from tests.waiting import HANG, wait_until
from trio_orch.testing import child_pids

pytestmark = pytest.mark.slow

#: a front that added requests, on /metrics
COUNTED = re.compile(r'api_server_requests_total\{front="(\d)"\} [1-9]')

#: a message the toy thinker answers word by word: about 1.3 s of stream at 20 ms a word
LONG = " ".join(f"w{i}" for i in range(60))


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


class Head:
    """``trio-orch serve --api-server-count 2`` in a session of its own, read until it serves."""

    def __init__(self, *args: str, env: dict[str, str] | None = None,
                 pipeline: tuple[str, ...] = ("--in-process",)) -> None:
        self.dirs_before = set(glob.glob("/tmp/trio-orch-fronts-*"))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "trio_orch.cli", "-v", "serve", "--port", "0", *pipeline,
             "--api-server-count", "2", *args], cwd=ROOT, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True, start_new_session=True, env={**os.environ, **(env or {})})
        assert self.proc.stdout is not None
        self.lines: list[str] = []
        for line in self.proc.stdout:
            self.lines.append(line)
            m = re.search(r"serving on (https?://\S+)", line)
            if m:
                self.url = m.group(1)
                break
        else:
            self.proc.wait(HANG)
            raise AssertionError(f"serve exited {self.proc.returncode} first: {''.join(self.lines)}")
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()
        self.head = serving_pid(self.proc.pid)

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)

    def fronts(self) -> set[int]:
        """The fronts serving now (each launched process's fresh child, the one that serves)."""
        return {serving_pid(p) for p in child_pids(self.head) if alive(p) and b"fronts.process" in cmdline(p)}

    def ready(self) -> set[int]:
        """The serving pids of every front the head said was ready, restarted ones included."""
        found = (re.search(r"ready \(pid (\d+)\)", line) for line in list(self.lines))
        return {int(m.group(1)) for m in found if m}

    def metric(self, name: str, **labels: str) -> float:
        text = httpx.get(self.url + "/metrics", timeout=HANG).text
        want = ",".join(f'{k}="{v}"' for k, v in labels.items())
        for line in text.splitlines():
            if line.startswith(name + ("{" + want + "}" if want else " ")):
                return float(line.rsplit(" ", 1)[1])
        return 0.0

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def stream(url: str, prompt: str = "hello there") -> tuple[str, bool]:
    """One streamed chat with the openai SDK on a connection of its own: (the text, ended cleanly)."""
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=HANG * 2)
    text = []
    try:
        with client:
            for chunk in client.chat.completions.create(model="trio-orch", stream=True,
                                                        messages=[{"role": "user", "content": prompt}]):
                if chunk.choices and chunk.choices[0].delta.content:
                    text.append(chunk.choices[0].delta.content)
    except (openai.APIError, httpx.HTTPError):
        return "".join(text), False
    return "".join(text), True


def run_streams(url: str, n: int, prompt: str = "hello there",
                during: Callable[[], object] | None = None) -> list[tuple[str, bool]]:
    """``n`` streams at once, each on a connection of its own; ``during()`` runs while they stream."""
    results: list[Any] = [None] * n

    def one(i: int) -> None:
        results[i] = stream(url, prompt)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    if during is not None:
        during()
    for t in threads:
        t.join(HANG * 3)
    return results


@pytest.fixture(params=["trio", "asyncio"])
def head(request: pytest.FixtureRequest) -> Any:
    h = Head("--loop", request.param)
    try:
        yield h
    finally:
        h.close()


def test_the_sdk_streams_through_two_fronts_and_metrics_count_every_request_once(head: Head) -> None:
    fronts = head.fronts()
    assert len(fronts) == 2
    sent = 0
    end = time.monotonic() + HANG * 3
    while (head.metric("trio_orch_api_server_requests_total", front="0") == 0
           or head.metric("trio_orch_api_server_requests_total", front="1") == 0):
        assert time.monotonic() < end, "the requests never landed on both fronts"
        results = run_streams(head.url, 8)
        sent += 8
        assert all(ok and text == "You said: hello there" for text, ok in results), results
    per_front = [head.metric("trio_orch_api_server_requests_total", front=str(i)) for i in (0, 1)]
    assert sum(per_front) == sent  # each request counted once, by the head
    assert head.metric("trio_orch_requests_admitted_total") == sent
    assert head.metric("trio_orch_terminals_total", kind="finished") == sent
    # the HTTP counters are the whole server's too, whichever front answers the scrape
    for _ in range(4):
        chat = head.metric("trio_orch_http_requests_total", route="/v1/chat/completions", status="200")
        assert chat == sent
        assert head.metric("trio_orch_request_success_total", finished_reason="stop") == sent
    assert httpx.get(head.url + "/health", timeout=HANG).json()["status"] == "ok"
    assert head.fronts() == fronts  # nothing restarted


def test_a_front_killed_mid_stream_comes_back_and_its_requests_end_aborted_once(head: Head) -> None:
    before = head.fronts()
    victim = sorted(before)[0]

    def kill() -> None:
        wait_until(lambda: head.metric("trio_orch_active_requests") >= 32, "32 streams open in the head")
        os.kill(victim, signal.SIGKILL)

    results = run_streams(head.url, 32, LONG, during=kill)
    dropped = sum(1 for _, ok in results if not ok)
    completed = [text for text, ok in results if ok]
    assert 0 < dropped < 32  # the victim held some, the other front the rest
    assert all(text == "You said: " + LONG for text in completed)
    wait_until(lambda: bool(head.ready() - before), "the front restarted and ready")
    assert len(head.fronts()) == 2 and victim not in head.fronts()
    wait_until(lambda: head.metric("trio_orch_active_requests") == 0, "every request ended in the head")
    assert head.metric("trio_orch_terminals_total", kind="aborted") == dropped
    assert head.metric("trio_orch_terminals_total", kind="finished") == 32 - dropped
    assert alive(head.head)
    assert all(ok for _, ok in run_streams(head.url, 4))  # served again, by both fronts


def test_sigterm_to_the_process_group_drains_both_fronts_and_leaves_nothing(head: Head) -> None:
    fronts = head.fronts()

    def terminate() -> None:
        wait_until(lambda: head.metric("trio_orch_active_requests") >= 16, "16 streams open in the head")
        os.killpg(head.proc.pid, signal.SIGTERM)

    results = run_streams(head.url, 16, LONG, during=terminate)
    assert all(ok and text == "You said: " + LONG for text, ok in results), results
    code = head.proc.wait(HANG * 3)
    assert code == 0, "".join(head.lines)  # a clean drain
    assert not [p for p in fronts | {head.head} if alive(p)]
    assert set(glob.glob("/tmp/trio-orch-fronts-*")) <= head.dirs_before  # the fronts' ipc files too


def test_a_head_killed_with_kill_9_takes_its_fronts_and_their_ipc_files_along(head: Head) -> None:
    fronts = head.fronts()
    assert all(ok for _, ok in run_streams(head.url, 2))
    os.kill(head.head, signal.SIGKILL)
    wait_until(lambda: not [p for p in fronts if alive(p)], "the fronts gone with their head")
    wait_until(lambda: set(glob.glob("/tmp/trio-orch-fronts-*")) <= head.dirs_before, "the ipc files removed")


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command to make a certificate")
def test_asyncio_fronts_speak_tls_on_the_shared_port(tmp_path: Path) -> None:
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key),
                    "-out", str(cert), "-days", "1", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True)
    h = Head("--loop", "asyncio", "--ssl-keyfile", str(key), "--ssl-certfile", str(cert))
    try:
        assert h.url.startswith("https://127.0.0.1:") and "asyncio fronts" in "".join(h.lines)
        verify = ssl.create_default_context(cafile=cert)
        chat = {"messages": [{"role": "user", "content": "hi"}]}
        end = time.monotonic() + HANG * 3
        seen: set[str] = set()
        while seen != {"0", "1"}:  # fresh connections until both fronts answered some
            assert time.monotonic() < end, "the requests never landed on both fronts"
            r = httpx.post(h.url + "/v1/chat/completions", json=chat, timeout=HANG, verify=verify)
            assert r.status_code == 200, r.text
            text = httpx.get(h.url + "/metrics", timeout=HANG, verify=verify).text
            seen = {m.group(1) for m in COUNTED.finditer(text)}
        with pytest.raises(httpx.HTTPError):
            httpx.get(h.url.replace("https://", "http://") + "/health", timeout=HANG)
    finally:
        h.close()


def test_the_fronts_get_the_api_key_from_the_head_not_from_their_environment() -> None:
    h = Head(env={"TRIO_ORCH_API_KEY": "front-secret"})  # the head's environment; fronts get a scrubbed one
    try:
        for front in h.fronts():
            assert b"front-secret" not in Path(f"/proc/{front}/cmdline").read_bytes()
            with contextlib.suppress(PermissionError):  # non-dumpable: readable only with privileges
                assert b"front-secret" not in Path(f"/proc/{front}/environ").read_bytes()
        statuses = set()
        for _ in range(8):  # fresh connections: both fronts answer some
            r = httpx.post(h.url + "/v1/chat/completions", timeout=HANG,
                           json={"messages": [{"role": "user", "content": "hi"}]})
            statuses.add(r.status_code)
        assert statuses == {401}
        r = httpx.post(h.url + "/v1/chat/completions", timeout=HANG, json={"messages": [{"role": "user",
                                                                                 "content": "hi"}]},
                       headers={"authorization": "Bearer front-secret"})
        assert r.status_code == 200
    finally:
        h.close()


def test_a_front_that_keeps_dying_is_given_up_and_the_server_stops_with_exit_1() -> None:
    h = Head("--max-restarts", "1", "--restart-window", "60")
    try:
        before = h.fronts()
        os.kill(min(before), signal.SIGKILL)  # the slot's first death: restarted
        wait_until(lambda: bool(h.ready() - before), "the restarted front ready")
        (again,) = h.ready() - before
        os.kill(again, signal.SIGKILL)  # the same slot's second death: past its intensity (per slot)
        assert h.proc.wait(HANG * 3) == 1
        h.reader.join(HANG)
        assert any("given up" in line for line in h.lines), "".join(h.lines)
        assert not [p for p in child_pids(h.head) if alive(p)]
    finally:
        h.close()


def listening_inodes(pid: int, port: int) -> set[str]:
    """The inodes of the TCP sockets listening on ``port`` that process ``pid`` holds."""
    listening = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(table) as f:
            for row in f.readlines()[1:]:
                cols = row.split()
                if cols[3] == "0A" and int(cols[1].rsplit(":", 1)[1], 16) == port:
                    listening.add(cols[9])
    held = set()
    for fd in glob.glob(f"/proc/{pid}/fd/*"):
        with contextlib.suppress(OSError):
            target = os.readlink(fd)
            if target.startswith("socket:[") and target[8:-1] in listening:
                held.add(target[8:-1])
    return held


def test_with_real_workers_only_the_fronts_hold_the_listening_socket(tmp_path: Path) -> None:
    from bench.perf.serving import echo_pipeline_file

    config = echo_pipeline_file(3, str(tmp_path))
    h = Head(pipeline=("--config", config))
    try:
        port = int(h.url.rsplit(":", 1)[1])
        fronts = h.fronts()
        workers = [serving_pid(p) for p in child_pids(h.head) if b"stages.worker" in cmdline(p)]
        assert len(workers) == 3 and len(fronts) == 2
        assert all(listening_inodes(f, port) for f in fronts)  # each front accepts on it
        assert not [w for w in workers if listening_inodes(w, port)]  # no worker inherited it
        chat = {"messages": [{"role": "user", "content": "hi"}], "modalities": ["text", "audio"]}
        r = httpx.post(h.url + "/v1/chat/completions", timeout=HANG, json=chat)
        assert r.status_code == 200, r.text
    finally:
        h.close()

