"""``/admin/...`` and ``trio-orch ctl``: off without a token, 401 without the right one, and the
control plane end to end -- in-process (the toy pipeline) and as a user runs it (``serve`` with
worker processes, driven by ``ctl``)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch

from stages.registry import build_model
from stages.weights import state_of
from tests.http_helpers import FRONTS, HANG, Served, chat, metrics, wait_until
from tests.serve.test_service import start_serve
from trio_orch.engine import ThreadEngine
from trio_orch.testing.toy_pipeline import toy_pipeline

pytestmark = pytest.mark.processes  # real worker processes or servers

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "s3cret-token"


@pytest.fixture()
def admin() -> Iterator[Served]:
    s = Served(ThreadEngine(toy_pipeline(token_delay=0.001, audio_delay=0.001)).start(), admin_token=TOKEN)
    yield s
    s.stop()


def auth(token: str = TOKEN) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def test_without_a_token_there_is_no_admin_route() -> None:
    s = Served(ThreadEngine(toy_pipeline()).start())
    try:
        with httpx.Client(base_url=s.url, timeout=HANG) as c:
            assert c.post("/admin/pause", headers=auth(), json={}).status_code == 404
            assert c.get("/admin/stats", headers=auth()).status_code == 404
        assert s.engine.paused is None
    finally:
        s.stop()


@pytest.mark.parametrize("headers", [{}, auth("wrong"), {"Authorization": TOKEN}, auth(TOKEN + "x")],
                         ids=["missing", "wrong", "not-bearer", "longer"])
def test_a_missing_or_wrong_token_gets_401_and_changes_nothing(admin: Served,
                                                               headers: dict[str, str]) -> None:
    with httpx.Client(base_url=admin.url, timeout=HANG) as c:
        r = c.post("/admin/pause", headers=headers, json={"mode": "wait"})
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        assert "token" in r.json()["error"]["message"]
        assert "paused" not in r.json()  # nothing about the server's state
        assert admin.engine.paused is None
        assert c.post("/v1/chat/completions", json=chat("still served")).status_code == 200


@pytest.mark.parametrize("front", FRONTS)
def test_auth_comes_before_every_other_check(serving: Callable[..., Served], front: str) -> None:
    s = serving(front, toy_pipeline(), admin_token=TOKEN)
    with httpx.Client(base_url=s.url, timeout=HANG) as c:
        refused = [
            c.post("/admin/pause"),  # no Content-Type, no body
            c.post("/admin/pause", headers={"Content-Type": "text/plain"}, content=b"x"),
            c.post("/admin/pause", headers={"Content-Type": "application/json"},
                   content=b"x" * (s.limits.max_body_bytes + 1)),
            c.post("/admin/rpc", json={"method": 7}),  # a bad argument
            c.get("/admin/pause"),  # a method the route does not take
            c.post("/admin/nosuch", json={}),  # a route that does not exist
        ]
        assert [r.status_code for r in refused] == [401] * len(refused)
        for r in refused:
            assert r.json()["error"]["type"] == "authentication_error"
            assert r.json()["error"]["code"] == "invalid_api_key"
        # with the token, the other checks answer
        assert c.post("/admin/pause", headers=auth()).status_code == 415
        assert c.get("/admin/pause", headers=auth()).status_code == 405
        assert c.post("/admin/nosuch", headers=auth(), json={}).status_code == 404
    assert s.engine.paused is None


@pytest.mark.parametrize(("route", "body", "key"), [
    ("abort", {"request_id": 7}, "request_id"),
    ("abort", {}, "request_id"),
    ("pause", {"mode": "later"}, "mode"),
    ("pause", {"mode": "wait", "stage_ids": [0]}, "stage_ids"),
    ("rpc", {"method": "stats", "args": {"a": 1}}, "args"),
    ("rpc", {"method": "stats", "stage_ids": [True]}, "stage_ids"),
    ("sleep", {"level": 3}, "level"),
    ("stats", {"timeout": -1}, "timeout"),
    ("stats", {"nosuch": 1}, "nosuch"),
    ("reload_weights", {"path": ""}, "path"),
])
def test_bad_arguments_are_400_in_the_openai_shape_naming_the_key(admin: Served, route: str,
                                                                   body: dict[str, object], key: str) -> None:
    with httpx.Client(base_url=admin.url, timeout=HANG) as c:
        r = c.post(f"/admin/{route}", headers=auth(), json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error" and err["code"] == "bad_argument"
    assert key in err["message"]
    assert admin.engine.paused is None


def test_pause_and_resume_over_http_with_requests_waiting_meanwhile(admin: Served) -> None:
    with httpx.Client(base_url=admin.url, timeout=HANG) as c, ThreadPoolExecutor(1) as pool:
        r = c.post("/admin/pause", headers=auth(), json={"mode": "wait"})
        assert r.status_code == 200 and r.json()["paused"] == "wait"
        waiting = pool.submit(c.post, "/v1/chat/completions", json=chat("after the pause"))
        assert metrics(c)["trio_orch_paused{mode=wait}"] == 1
        wait_until(lambda: admin.engine.stats().queued_requests == 1, "the request accepted and queued")
        assert not waiting.done()  # accepted, not started while paused (it waits, no error)
        assert c.post("/admin/resume", headers=auth(), json={}).json()["paused"] is None
        answer = waiting.result(HANG)
        assert answer.status_code == 200
        assert answer.json()["choices"][0]["message"]["content"] == "You said: after the pause"


def test_rpc_answers_per_stage_and_bad_calls_are_400(admin: Served) -> None:
    with httpx.Client(base_url=admin.url, timeout=HANG) as c:
        r = c.get("/admin/stats", headers=auth())
        assert r.status_code == 200  # the toy stages take no RPC: one error result per stage
        results = r.json()["results"]
        assert [x["stage_id"] for x in results] == [0, 1, 2]
        assert all("takes no rpc calls" in x["error"] for x in results)
        for body in ({"method": "stats", "stage_ids": [7]}, {"args": []}, [1, 2]):
            bad = c.post("/admin/rpc", headers=auth(), json=body)
            assert bad.status_code == 400, body
            assert bad.json()["error"]["message"]
        bad_json = {**auth(), "Content-Type": "application/json"}
        assert c.post("/admin/rpc", headers=bad_json, content=b"{nope").status_code == 400
        assert c.post("/admin/pause", headers=auth(), json={"mode": "later"}).status_code == 400
        failed = c.post("/admin/sleep", headers=auth(), json={})  # no stage can sleep
        assert failed.status_code == 502 and failed.json()["error"]["code"] == "control_failed"
        assert len(failed.json()["results"]) == 3  # every replica's answer
        assert admin.engine.paused is None  # the failed sleep resumed
        m = metrics(c)
    assert m["trio_orch_rpc_calls_total{method=stats}"] == 1
    assert m["trio_orch_rpc_errors_total{method=stats}"] == 3
    assert m["trio_orch_paused{mode=wait}"] == 0


def ctl(url: str, *args: str, token: str | None = TOKEN) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "trio_orch.cli", "ctl", "--url", url, *(["--token", token] if token else []),
           *args]
    env = {k: v for k, v in os.environ.items() if k != "TRIO_ORCH_ADMIN_TOKEN"}
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)


def test_an_unknown_rpc_method_is_404_and_ctl_says_so_on_stderr(serving: Callable[..., Served]) -> None:
    from stages.config import echo_config
    from trio_orch.cluster.launcher import open_pipeline

    s = serving("asyncio", lambda: open_pipeline(echo_config(2)), admin_token=TOKEN)
    with httpx.Client(base_url=s.url, timeout=HANG) as c:
        r = c.post("/admin/rpc", headers=auth(), json={"method": "nosuch"})
        assert r.status_code == 404, r.text
        assert r.json()["error"]["code"] == "unknown_method" and "nosuch" in r.json()["error"]["message"]
        known = c.post("/admin/rpc", headers=auth(), json={"method": "methods"})
        assert known.status_code == 200 and all("stats" in x["value"] for x in known.json()["results"])
    unknown = ctl(s.url, "rpc", "nosuch")
    assert unknown.returncode == 1 and unknown.stdout == ""
    assert "HTTP 404" in unknown.stderr and "nosuch" in unknown.stderr
    wrong = ctl(s.url, "stats", token="wrong")
    assert wrong.returncode == 1 and wrong.stdout == "" and "HTTP 401" in wrong.stderr
    bad = ctl(s.url, "--timeout", "-1", "abort", "r1")  # ctl refuses it before asking (a usage error) ...
    assert bad.returncode == 2 and bad.stdout == "" and "--timeout" in bad.stderr
    with httpx.Client(base_url=s.url, timeout=HANG) as c:  # ... and the server, asked anyway, says 400
        r = c.post("/admin/abort", headers=auth(), json={"request_id": "r1", "timeout": -1})
        assert r.status_code == 400 and "timeout" in r.text, r.text


def test_ctl_exits_1_when_the_server_cannot_be_reached_and_2_only_for_usage() -> None:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # nothing listens there now
    gone = ctl(f"http://127.0.0.1:{port}", "stats")
    assert gone.returncode == 1 and gone.stdout == "" and "cannot reach" in gone.stderr
    for args in (("rpc", "stats", "--args", "{nope"), ("rpc", "stats", "--args", "{}"), ("nosuch",)):
        usage = ctl(f"http://127.0.0.1:{port}", *args)
        assert usage.returncode == 2 and usage.stdout == "" and usage.stderr, args
    bad_url = ctl("127.0.0.1:8000", "stats")
    assert bad_url.returncode == 2 and "--url" in bad_url.stderr
    bad_port = ctl("http://127.0.0.1:99999", "stats")
    assert bad_port.returncode == 2 and "--url" in bad_port.stderr


def greedy(c: httpx.Client, prompt: str = "Hello!") -> str:
    r = c.post("/v1/chat/completions", json=chat(prompt, temperature=0))
    assert r.status_code == 200, r.text
    return str(r.json()["choices"][0]["message"]["content"])


@pytest.mark.slow
def test_serve_with_an_admin_token_driven_by_ctl(tmp_path: Path) -> None:
    weights = tmp_path / "thinker.pt"
    torch.save(state_of(build_model("thinker", {}, seed=42)), weights)  # fits the default thinker
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    proc, url = start_serve("--admin-token", TOKEN, env=env)
    try:
        stats = ctl(url, "stats")
        assert stats.returncode == 0, stats.stderr
        lines = stats.stdout.splitlines()
        assert [ln.split(":")[0] for ln in lines[:3]] == [f"stage {k} replica 0" for k in range(3)]
        assert '"steps"' in lines[0] and lines[-1] == "paused: no"
        refused = ctl(url, "stats", token="wrong")
        assert refused.returncode == 1 and "HTTP 401" in refused.stderr
        with httpx.Client(base_url=url, timeout=60) as c:
            before = greedy(c)
            slept = ctl(url, "sleep", "--level", "1")
            assert slept.returncode == 0, slept.stdout + slept.stderr
            assert slept.stdout.count('"asleep": 1') == 3 and "paused: wait" in slept.stdout
            woke = ctl(url, "wake")
            assert woke.returncode == 0 and "paused: no" in woke.stdout
            assert greedy(c) == before  # same outputs after sleep and wake
            with ThreadPoolExecutor(6) as pool:  # requests in flight while the weights change
                load = [pool.submit(greedy, c, f"Hello {i}!") for i in range(6)]
                reload = ctl(url, "reload-weights", "--stage", "0", str(weights))
                answers = [f.result(120) for f in load]
            assert reload.returncode == 0, reload.stdout + reload.stderr
            assert reload.stdout.startswith("stage 0 replica 0:") and "paused: no" in reload.stdout
            assert all(answers)  # none lost
            assert greedy(c) != before  # the new thinker weights answer now
            bad = ctl(url, "reload-weights", "--stage", "0", str(tmp_path / "missing.pt"))
            assert bad.returncode == 1 and "no weights file" in bad.stdout
            assert c.get("/health").json()["status"] == "ok"
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0  # a clean drain
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_serve_takes_its_key_and_token_from_systemds_credentials_and_ctl_from_a_token_file(
        tmp_path: Path) -> None:
    """``LoadCredential=api-key:...`` and ``admin-token:...`` as systemd hands them over; ``--token-file``."""
    creds = tmp_path / "credentials"
    creds.mkdir(mode=0o700)
    for name, value in (("api-key", "the-api-key"), ("admin-token", TOKEN)):
        (creds / name).write_text(value + "\n")
        (creds / name).chmod(0o400)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRIO_ORCH_")}
    proc, url = start_serve("--in-process", env={**env, "CREDENTIALS_DIRECTORY": str(creds)})
    try:
        with httpx.Client(base_url=url, timeout=HANG) as c:
            assert c.get("/v1/models").status_code == 401
            assert c.get("/v1/models", headers={"Authorization": "Bearer the-api-key"}).status_code == 200
            assert c.get("/admin/stats", headers=auth()).status_code == 200
            assert c.get("/admin/stats", headers={"Authorization": "Bearer the-api-key"}).status_code == 401
        token_file = tmp_path / "token"
        token_file.write_text(TOKEN + "\n")
        token_file.chmod(0o600)
        stats = ctl(url, "--token-file", str(token_file), "stats", token=None)
        # it got in (the toy stages take no RPC: each says so, and ctl exits 1 for that, not 401)
        assert "paused: no" in stats.stdout and "401" not in stats.stderr, stats
        both = ctl(url, "--token-file", str(token_file), "stats")
        assert both.returncode == 2 and "not both" in both.stderr
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0  # a clean drain
