"""The systemd unit in docs/operating.md: its settings, ``systemd-analyze verify``, a stop as systemd does it.

The unit is read from the page (the fenced ``ini`` block under "Running under
systemd"), so the test checks what an operator copies.  Its ``ExecStart`` runs
with this checkout's interpreter, a free loopback port and a torch-free echo
pipeline, in a session of its own (systemd starts a service in its own session);
then it is stopped the way ``KillMode=mixed`` stops it -- ``KillSignal`` to the
main process, SIGKILL to whatever is left in the unit once it exited -- and, for
the group-wide signals (``kill -- -PGID``, ``timeout``), with SIGTERM to its whole
process group.  Real processes, real HTTP streams on loopback; no timing asserts.
"""

from __future__ import annotations

import configparser
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from stages.lockdown import serving_pid
from tests.http_helpers import HANG, metrics, sse_events, wait_until
from tests.serve.test_deploy import alive, slow_echo_config
from trio_orch.serve.credentials import CREDENTIAL_FILES
from trio_orch.testing import child_pids

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "operating.md"


def unit_text() -> str:
    """The fenced ``ini`` block of the page's "Running under systemd" section."""
    text = DOC.read_text()
    section = text.split("## Running under systemd", 1)[1].split("\n## ", 1)[0]
    m = re.search(r"```ini\n(.*?)```", section, re.S)
    assert m, "docs/operating.md: no ```ini block under 'Running under systemd'"
    return m.group(1)


def parse(text: str) -> configparser.ConfigParser:
    """The unit's sections (a key systemd takes more than once, like ``LoadCredential``: its last value)."""
    unit = configparser.ConfigParser(interpolation=None, strict=False, comment_prefixes=("#", ";"))
    unit.optionxform = str  # type: ignore[assignment,method-assign]  # keys are case-sensitive
    unit.read_string(text)
    return unit


def option(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_the_units_settings_let_the_drain_finish_before_systemd_kills_anything() -> None:
    svc = parse(unit_text())["Service"]
    argv = shlex.split(svc["ExecStart"])
    assert Path(argv[0]).name == "trio-orch" and argv[1] == "serve"
    # SIGTERM to serve alone: it drains and stops its workers; SIGKILL only for what is left after
    assert svc["KillMode"] == "mixed" and svc["KillSignal"] == "SIGTERM"
    drain = float(option(argv, "--shutdown-timeout"))
    stop_grace = 3.0  # the pipeline's default seconds between a worker's SIGTERM and SIGKILL
    assert float(svc["TimeoutStopSec"]) > drain + stop_grace
    assert "SuccessExitStatus" not in svc  # serve exits 0 after a signal's clean drain, as uvicorn does
    assert svc["Restart"] == "on-failure" and "2" in svc["RestartPreventExitStatus"].split()
    assert parse(unit_text())["Install"]["WantedBy"] == "multi-user.target"


def test_the_unit_hands_serve_its_secrets_as_systemd_credentials_by_the_names_it_reads() -> None:
    lines = unit_text().splitlines()
    loaded = [line.split("=", 1)[1] for line in lines if line.startswith("LoadCredential=")]
    assert sorted(item.split(":", 1)[0] for item in loaded) == sorted(CREDENTIAL_FILES)
    assert all(item.split(":", 1)[1].startswith("/etc/trio-orch/") for item in loaded)
    assert "Environment" not in unit_text()  # no secret in an environment


def test_systemd_analyze_verifies_the_unit(tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed here")
    # verify checks that ExecStart's program exists: point it at this checkout's, as installed
    program = Path(sys.executable).parent / "trio-orch"
    text = unit_text().replace("/opt/trio-orch/.venv/bin/trio-orch",
                               str(program if program.exists() else sys.executable))
    text = text.replace("WorkingDirectory=/opt/trio-orch", f"WorkingDirectory={ROOT}")
    path = tmp_path / "trio-orch.service"
    path.write_text(text)
    r = subprocess.run([analyze, "verify", str(path)], capture_output=True, text=True, timeout=60)
    complaints = [ln for ln in (r.stdout + r.stderr).splitlines() if "trio-orch.service" in ln]
    assert r.returncode == 0 and complaints == [], r.stdout + r.stderr


def start_exec_start(tmp_path: Path) -> tuple[subprocess.Popen[str], str]:
    """The unit's ExecStart in a session of its own: this checkout's interpreter, a free loopback
    port and a slow echo pipeline for its config; the rest of its command line as written."""
    argv = shlex.split(parse(unit_text())["Service"]["ExecStart"])
    argv[argv.index("--port") + 1] = "0"
    argv[argv.index("--host") + 1] = "127.0.0.1"
    argv[argv.index("--config") + 1] = slow_echo_config(tmp_path)
    cmd = [sys.executable, "-m", "trio_orch.cli", *argv[1:]]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    assert proc.stdout is not None
    end = time.monotonic() + 120
    while time.monotonic() < end:
        line = proc.stdout.readline()
        if not line:
            break
        m = re.search(r"serving on (http://\S+)", line)
        if m:
            threading.Thread(target=proc.stdout.read, daemon=True).start()  # keep the pipe drained
            return proc, m.group(1)
    proc.kill()
    proc.wait()
    raise AssertionError("serve did not report its address")


def stream(url: str, model: str, events: list[Any]) -> None:
    body = {"model": model, "stream": True, "messages": [{"role": "user", "content": "w0 w1 w2"}]}
    with httpx.Client(base_url=url, timeout=60) as c, \
            c.stream("POST", "/v1/chat/completions", json=body) as r:
        events.extend(sse_events(r.iter_lines()))


@pytest.mark.slow
@pytest.mark.parametrize("target", ["main", "group"])
def test_the_units_exec_start_stopped_as_systemd_does_drains_every_open_stream(tmp_path: Path,
                                                                                target: str) -> None:
    """``main``: KillMode=mixed's SIGTERM to the main process; ``group``: SIGTERM to serve's whole
    process group.  Either way all four open streams end with ``[DONE]`` and no error event,
    serve exits by itself, and nothing is left for systemd's final SIGKILL."""
    proc, url = start_exec_start(tmp_path)
    try:
        workers = child_pids(serving_pid(proc.pid))
        assert len(workers) == 3
        with httpx.Client(base_url=url, timeout=HANG) as c:
            model = c.get("/v1/models").json()["data"][0]["id"]
            streams: list[list[Any]] = [[] for _ in range(4)]
            threads = [threading.Thread(target=stream, args=(url, model, events), daemon=True)
                       for events in streams]
            for t in threads:
                t.start()
            wait_until(lambda: metrics(c)["trio_orch_active_requests"] == 4, "four streams run")
        if target == "main":
            os.kill(proc.pid, signal.SIGTERM)
        else:
            os.killpg(proc.pid, signal.SIGTERM)
        for t in threads:
            t.join(60)
        for events in streams:
            assert events and events[-1] == "[DONE]", events
            assert not any(isinstance(e, dict) and "error" in e for e in events), events
        assert proc.wait(60) == 0  # a clean drain: no SuccessExitStatus needed
        # what KillMode=mixed would SIGKILL now, once the main process exited: nothing is left
        assert [w for w in workers if alive(w)] == []
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
