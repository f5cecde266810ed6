"""``trio-orch chaos --worker-backend ray``: the Ray faults run on the two-node cluster the command starts.

The command runs as a child process (it is the Ray driver; the test process
never becomes one) with echo workers and a small load, on ``ray_node_lost``
(the second node, holding one of the two talkers, crashes under load).  Its
JSON must show the guarantees kept -- every accepted request with one
terminal, no leak, still serving -- and the lost talker detected and
replaced on the node left; its exit status that the cluster it started was
stopped with nothing of it left running.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("ray")

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_chaos_on_ray_loses_a_node_under_load_and_keeps_every_guarantee(tmp_path: Path) -> None:
    out = tmp_path / "ray.json"
    proc = subprocess.run(
        [sys.executable, "-m", "trio_orch.cli", "chaos", "--worker-backend", "ray", "--echo",
         "--requests", "80", "--concurrency", "16", "--probe", "8", "--no-progress",
         "--only", "ray_node_lost", "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=900, start_new_session=True)
    # exit 0: every row kept its guarantees, and the cluster it started was stopped with nothing of it
    # left running (it checks every process of the nodes' sessions and fails otherwise)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-6000:]
    [row] = json.loads(out.read_text())["results"]
    assert row["ok"] and row["error"] is None
    assert row["accepted"] >= 80 and row["without_terminal"] == 0 and row["duplicates"] == 0
    assert (row["leaked_processes"], row["leaked_fds"], row["leaked_ipc_files"]) == (0, 0, 0)
    assert row["still_serving"] == "yes" and row["restarts"] == 1
    assert row["notes"]["replicas_on_lost_node"] == 1 and row["notes"]["replaced_on_head"] == 2
    assert row["detect_s"] is not None and row["recover_s"] >= row["detect_s"]
    assert set(row["failed"]) <= {"replica_died", "stage_unavailable"}
