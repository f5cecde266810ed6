"""Health pollers that give up while serve is still starting leave no error behind.

``serve`` listens before its pipeline is ready, so a load balancer's poller
may connect, wait, and leave (closing, or resetting the connection, with or
without a request sent) before anything accepted it.  Once serving, those
connections are accepted already gone: nothing about them may reach the log
as an error or a traceback.  A real ``trio-orch serve`` with an echo worker
that takes a while to start, raw sockets on loopback.
"""

from __future__ import annotations

import signal
import socket
import struct
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.http_helpers import HANG, wait_until
from tests.serve.test_service import ROOT

SLOW_START = """[pipeline]
final_stages = [0]

[[stages]]
kind = "echo"
worker_args = ["--startup-delay", "2"]
"""


def leave(port: int, *, request: bool, reset: bool) -> None:
    """Connect, maybe send a health check, and go: a FIN, or a RST (SO_LINGER 0)."""
    s = socket.create_connection(("127.0.0.1", port), timeout=HANG)
    if request:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: lb\r\n\r\n")
    if reset:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    s.close()


@pytest.mark.slow
@pytest.mark.parametrize("loop", ["asyncio", "trio"])
def test_pollers_that_left_during_startup_log_no_error(tmp_path: Path, loop: str) -> None:
    cfg = tmp_path / "slow.toml"
    cfg.write_text(SLOW_START)
    with socket.socket() as probe:  # a free port, known before serve says where it listens
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "trio_orch.cli", "serve", "--port", str(port), "--loop",
                             loop, "--config", str(cfg)], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        def listening() -> bool:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=HANG).close()
            except ConnectionRefusedError:
                return False
            return True

        wait_until(listening, "serve listens", hang=60)
        for request in (False, True):
            for reset in (False, True):
                leave(port, request=request, reset=reset)
        url = f"http://127.0.0.1:{port}"
        with httpx.Client(base_url=url, timeout=HANG) as c:
            def serving() -> bool:
                try:
                    return c.get("/health").status_code == 200
                except httpx.TransportError:
                    return False

            wait_until(serving, "serve answers 200", hang=60)  # the queued connections were accepted
        proc.send_signal(signal.SIGTERM)
        out = proc.communicate(timeout=60)[0]
        assert proc.returncode == 0, out  # a clean drain: nothing was in flight
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert "Traceback" not in out and " ERROR " not in out and "Errno" not in out, out
