"""The serving benchmark over a real ``serve``: the workers' steps and CPU come from ``/admin/stats``."""

from __future__ import annotations

import json
from pathlib import Path

from bench.perf import serving as sv


def test_measure_front_counts_the_workers_steps_and_cpu(tmp_path: Path) -> None:
    """Steps are bounded by the requests streamed (4 outputs at each of 3 echo stages); the workers end."""
    token = "bench-token"
    proc, url = sv.start_server(["--config", sv.echo_pipeline_file(4, str(tmp_path)), "--loop", "trio"],
                                admin_token=token)
    try:
        pids = [r["value"]["pid"] for r in json.loads(sv.http_get(url, "/admin/stats", token))["results"]]
        body = json.dumps({"messages": sv.BODY["messages"], "stream": True}).encode()
        res = sv.measure_front(url, proc.pid, 4, 0.5, 1, body, admin_token=token)
        refused = sv.http_get(url, "/admin/stats", "wrong-token")
    finally:
        sv.stop_server(proc)
    assert res["ok"] > 0 and res["failed"] == 0
    # a request takes 4 steps on each stage; a step carries one request or more
    assert 12 <= res["worker_steps"] <= 12 * res["ok"]
    assert res["worker_cpu_s"] > 0
    assert "error" in json.loads(refused)  # the counts sit behind the admin token
    assert len(pids) == 3 and not any(Path(f"/proc/{pid}").exists() for pid in pids)
