"""No one takes a worker's place: a real rogue process against a real supervised pipeline served over HTTP.

The attack: kill -9 the first stage's worker, then connect to its control
socket as the head rebinds it -- reconnecting every 5 ms, so it is there
before the replacement -- with everything it might have stolen: the killed
worker's ticket, the pipeline secret, and (as soon as the head makes it) the
replacement's own ticket; once in, it would send ``Ready`` and heartbeats and
answer every request.  It must be refused every time and reported; the
replacement must get the slot and serve; ``/health`` must not say ok until
the replacement is ready; no request may reach the rogue.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from stages.config import echo_config
from stages.registry import outputs_of
from tests.http_helpers import HANG, Served, chat, metrics, wait_until
from trio_orch.cluster.supervisor import RestartPolicy, supervised_pipeline
from trio_orch.engine import ThreadEngine
from trio_orch.testing import worker_alive
from trio_orch.testing.rogue import ROGUE_TEXT, read_report

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_a_rogue_with_stolen_credentials_never_takes_a_killed_workers_slot(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="stages.auth")
    cfg = echo_config(2, final_stage_ids=[1], outputs=2, heartbeat_interval=0.2, heartbeat_timeout=1.0,
                      stop_grace=1.0)
    policy = RestartPolicy(max_restarts=3, window=30.0, backoff_initial=0.05)
    holder: dict[str, Any] = {}

    @asynccontextmanager
    async def factory() -> AsyncIterator[Any]:
        # the replacement takes 1.5 s before it connects: the rogue is sure to be there first
        slow = ["--startup-delay", "1.5"]
        async with supervised_pipeline(cfg, policy, extra_args=lambda k, r, attempt: slow) as p:
            holder["pipe"] = p
            yield p

    served = Served(ThreadEngine(factory, startup_timeout=30).start(), stage_names=["thinker", "talker"],
                    outputs=outputs_of(s.kind for s in cfg.stages),
                    extra_metrics=lambda: holder["pipe"].supervisor.prometheus_counters())
    pipe = holder["pipe"]
    auth, sup = pipe.authenticator, pipe.supervisor
    victim = pipe.worker(0, 0)
    slot = victim.client.zap_domain(victim.client.address)
    earlier = auth.launches.current(slot)
    assert earlier is not None and earlier.pid == victim.pid
    stolen = tmp_path / "stolen"
    stolen.write_text(f"{earlier.ticket.decode()}\n{pipe.security.secret.decode()}\n")
    rogue: subprocess.Popen[str] | None = None
    try:
        with httpx.Client(base_url=served.url, timeout=HANG) as c:
            assert c.get("/health").json()["status"] == "ok"
            os.kill(victim.pid, signal.SIGKILL)
            rogue = subprocess.Popen([sys.executable, "-m", "trio_orch.testing.rogue", "--interval-ms", "5",
                                      "--connect", victim.client.address, "--passwords", str(stolen)],
                                     cwd=ROOT, stdout=subprocess.PIPE, text=True)
            wait_until(lambda: auth.launches.current(slot) not in (None, earlier), "the replacement's launch")
            current = auth.launches.current(slot)
            assert current is not None
            with stolen.open("a") as f:  # even the replacement's own ticket
                f.write(current.ticket.decode() + "\n")
            samples: list[tuple[int, str, int]] = []
            end = time.monotonic() + 60
            while time.monotonic() < end:  # /health every 20 ms until the replacement serves
                r = c.get("/health")
                samples.append((r.status_code, r.json()["status"], sup.restarts))
                if r.status_code == 200 and auth.refused["launch:stranger"] >= 1:
                    break
                time.sleep(0.02)
            # ok only once the replacement was ready, and the stage was never ok with the slot empty
            assert [s for s in samples if s[1] == "ok" and s[2] == 0] == []
            assert samples[0][:2] == (503, "degraded") and samples[-1][:3] == (200, "ok", 1)
            replacement = pipe.worker(0, 0)
            assert replacement.pid == current.pid != victim.pid
            assert replacement.client.ready is not None and replacement.client.ready.pid == current.pid
            for i in range(4):  # the replacement serves: each answer is the echo, none the rogue's
                r = c.post("/v1/chat/completions", json=chat(f"after {i}"))
                assert r.status_code == 200, r.text
                assert f"after {i}" in r.json()["choices"][0]["message"]["content"]
                assert ROGUE_TEXT not in r.text
            m = metrics(c)
            assert m["trio_orch_auth_refused_total{reason=launch:stranger}"] >= 1
            assert m["trio_orch_auth_refused_total{reason=launch:stale_ticket}"] >= 1
        rogue.send_signal(signal.SIGTERM)
        out, _ = rogue.communicate(timeout=HANG)
        done = read_report(out)[-1]
        assert done["event"] == "done", out
        assert done["connected"] == 0 and done["submits"] == 0 and done["refused"] >= 2, done
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert any("stage 0 (echo) replica 0's control socket" in w and "not the process launched for it"
                   in w for w in warnings), warnings
    finally:
        if rogue is not None and rogue.poll() is None:
            rogue.kill()
            rogue.wait()
        served.stop()
    assert not worker_alive(victim.pid) and not worker_alive(current.pid)
