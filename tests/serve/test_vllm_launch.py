"""A ``vllm serve`` launch line, run as ``trio-orch serve``: it starts, and the operator's tools see what they
expect -- the key from ``$VLLM_API_KEY``, vLLM's metric names, the access log, exit 0 after a clean drain.

The real command in a process of its own: on a tiny random checkpoint built
here (a real ``hf-causal-lm`` worker) for the stock launch line, on the
in-process toy pipeline for the access log on both fronts.
"""

from __future__ import annotations

import re
import shutil
import signal
import ssl
import subprocess
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.http.test_vllm_metrics import DASHBOARD
from tests.http_helpers import running_and_waiting
from tests.serve_process import Server
from tests.waiting import HANG, wait_until
from trio_orch.testing import worker_alive

#: ``vllm serve DIR`` + this, as a team's launch script has it
STOCK = ("--max-num-seqs", "8", "--max-model-len", "256", "--disable-log-requests", "--uvicorn-log-level",
         "warning")
ACCESS = re.compile(r'trio_orch\.access: 127\.0\.0\.1:\d+ - "(\w+) (\S+) HTTP/1\.1" (\d+) [\d.]+ms '
                    r"request_id=(\w+)")


def stop_cleanly(s: Server) -> None:
    """SIGTERM, as systemd stops it: nothing in flight, so a clean drain, exit 0; no worker left."""
    s.proc.send_signal(signal.SIGTERM)
    try:
        assert s.proc.wait(HANG * 3) == 0, "".join(s.lines)
    finally:
        if s.proc.poll() is None:
            s.proc.kill()
            s.proc.wait()
    assert not [p for p in s.workers if worker_alive(p)]


@pytest.mark.slow
def test_a_stock_vllm_launch_line_serves_a_checkpoint_behind_vllms_api_key(tiny_qwen2: Any) -> None:
    model = str(tiny_qwen2.path)
    s = Server(model, *STOCK, env={"VLLM_API_KEY": "k"})
    try:
        banner = "".join(s.lines)
        assert "the API needs its key" in banner and "/v1/completions" in banner and "/tokenize" in banner
        with httpx.Client(base_url=s.url, timeout=HANG * 2) as c:
            refused = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
            assert refused.status_code == 401
            r = c.post("/v1/chat/completions", headers={"authorization": "Bearer k"},
                       json={"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                             "temperature": 0})
            assert r.status_code == 200, r.text
            card = c.get("/v1/models", headers={"authorization": "Bearer k"}).json()["data"][0]
            assert (card["id"], card["max_model_len"]) == (model, 256)
            text = c.get("/metrics").text  # open without the key, as vLLM's
        samples = {s.name: s for f in text_string_to_metric_families(text) for s in f.samples}
        assert all(samples[name].labels["model_name"] == model for name in DASHBOARD)
    finally:
        stop_cleanly(s)
    assert not [line for line in s.lines if "trio_orch.access" in line]  # --uvicorn-log-level warning


@pytest.mark.slow
@pytest.mark.parametrize("loop", ["asyncio", "trio"])
def test_one_access_line_per_request_by_default_none_with_disable_uvicorn_access_log(loop: str) -> None:
    s = Server("--in-process", "--loop", loop, "--served-model-name", "toy")
    try:
        with httpx.Client(base_url=s.url, timeout=HANG) as c:
            for path in ("/health", "/v1/models", "/nothing"):
                c.get(path)
            c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})

            def logged() -> list[tuple[str, ...]]:
                return [m.groups() for line in list(s.lines) if (m := ACCESS.search(line))]

            wait_until(lambda: len(logged()) == 4, "four access lines")
        assert [(m, p, st) for m, p, st, _ in logged()] == [
            ("GET", "/health", "200"), ("GET", "/v1/models", "200"), ("GET", "/nothing", "404"),
            ("POST", "/v1/completions", "200")]
    finally:
        stop_cleanly(s)
    quiet = Server("--in-process", "--loop", loop, "--disable-uvicorn-access-log")
    try:
        with httpx.Client(base_url=quiet.url, timeout=HANG) as c:
            assert c.get("/health").status_code == 200
    finally:
        stop_cleanly(quiet)
    assert not [line for line in quiet.lines if "trio_orch.access" in line]


@pytest.mark.slow
def test_max_num_seqs_from_the_command_line_bounds_the_running_requests() -> None:
    """``serve --max-num-seqs 2``: of four streams, two run and two wait (vLLM's gauges say so), and all
    four are answered; the banner says the API is open (no key anywhere)."""
    s = Server("--in-process", "--served-model-name", "toy", "--max-num-seqs", "2",
               env={"VLLM_API_KEY": "", "TRIO_ORCH_API_KEY": ""})
    try:
        assert "the API is OPEN" in "".join(s.lines)
        answers: list[list[str]] = [[] for _ in range(4)]

        def stream(i: int) -> None:
            body = {"model": "toy", "stream": True,
                    "messages": [{"role": "user", "content": " ".join(f"w{k}" for k in range(80))}]}
            with httpx.Client(base_url=s.url, timeout=HANG * 4) as c, \
                    c.stream("POST", "/v1/chat/completions", json=body) as r:
                answers[i].extend(line for line in r.iter_lines() if line.startswith("data: "))

        seen = running_and_waiting(s.url, [threading.Thread(target=stream, args=(i,), daemon=True)
                                           for i in range(4)], 2, 2)
        assert max(running for running, _ in seen) == 2 and seen[-1] == (0, 0)
        assert all(a and a[-1] == "data: [DONE]" and '"finish_reason":"stop"' in "".join(a) for a in answers)
    finally:
        stop_cleanly(s)


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command to make a certificate")
def test_tls_with_vllms_ssl_flags_on_the_asyncio_front(tmp_path: Path) -> None:
    """``--ssl-keyfile``/``--ssl-certfile`` as vLLM's: the banner says https, a TLS client is answered, and a
    plain-HTTP one is not."""
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key),
                    "-out", str(cert), "-days", "1", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True)
    s = Server("--in-process", "--loop", "asyncio", "--ssl-keyfile", str(key), "--ssl-certfile", str(cert))
    try:
        assert s.url.startswith("https://127.0.0.1:")
        with httpx.Client(base_url=s.url, timeout=HANG, verify=ssl.create_default_context(cafile=cert)) as c:
            assert c.get("/health").json()["status"] == "ok"
        with pytest.raises(httpx.HTTPError), httpx.Client(timeout=HANG) as plain:
            plain.get(s.url.replace("https://", "http://") + "/health")
    finally:
        stop_cleanly(s)
