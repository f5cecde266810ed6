"""Placement with real workers: what each worker process was started with, and what is refused at start.

The workers are real ``stages.worker`` processes (echo stages: torch-free, so
one told ``--device cuda:0`` runs on this GPU-less host).  Where a test needs
a host with GPUs, the GPU count -- the one thing this host lacks -- is
given (``stages.placement.cuda_device_count``); the launch and the workers
are real, and each worker reports the device and ``CUDA_VISIBLE_DEVICES`` it
got through its ``stats`` RPC.  The command-line tests hide every GPU
(``CUDA_VISIBLE_DEVICES=""``), so they mean the same on any host.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from stages.config import from_dict
from stages.lockdown import serving_pid
from stages.placement import VISIBLE
from tests.waiting import HANG
from trio_orch.cluster.launcher import open_pipeline
from trio_orch.testing import LeakProbe, child_pids, processes_naming, worker_alive

ROOT = Path(__file__).resolve().parents[2]

#: the issue's example: stage 0 on cuda:1, stage 1 on CPU
TWO_STAGES = """[pipeline]
final_stages = [1]
startup_timeout = 120

[[stages]]
kind = "echo"
device = "cuda:1"

[[stages]]
kind = "echo"
device = "cpu"
"""


async def test_each_worker_is_started_seeing_the_gpu_its_placement_gives_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("stages.placement.cuda_device_count", lambda: 2)  # a host with two GPUs
    monkeypatch.setenv(VISIBLE, "5,7")  # the head itself was given GPUs 5 and 7: its cuda:1 is GPU 7
    cfg = from_dict({"pipeline": {"final_stages": [1], "startup_timeout": 120},
                     "stages": [{"kind": "echo", "device": "cuda:1"},
                                {"kind": "echo", "replicas": 2, "device": ["cpu", "cuda:0"]}]})
    probe = LeakProbe()
    async with open_pipeline(cfg) as pipe:
        probe.saw(pipe.pids)
        probe.saw_dir(pipe.tmpdir)
        seen = {(s["stage_id"], s["replica"]): (s["device"], s["cuda_visible_devices"])
                for s in await pipe.stats(timeout=HANG)}
    assert seen == {(0, 0): ("cuda:0", "7"), (1, 0): ("cpu", ""), (1, 1): ("cuda:0", "5")}
    assert probe.leaks()["processes"] == 0 and probe.leaks()["ipc_files"] == 0


async def test_a_missing_device_is_refused_before_any_worker_starts(monkeypatch: pytest.MonkeyPatch,
                                                                    tmp_path: Path) -> None:
    monkeypatch.setattr("stages.placement.cuda_device_count", lambda: 1)
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # where the pipeline's private directory would go
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)
    cfg = from_dict({"pipeline": {"final_stages": [1]}, "stages": [{"kind": "echo", "device": "cuda:1"},
                                                                   {"kind": "echo"}]})
    before = child_pids()
    with pytest.raises(ValueError, match=r"stage 0 \(echo\) replica 0: device cuda:1 asked for, but this "
                                         r"host has 1 CUDA device\(s\)"):
        async with open_pipeline(cfg):
            raise AssertionError("the pipeline started")
    assert child_pids() == before and list(tmp_path.iterdir()) == []


def _cli(command: str, config: Path, cwd: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    args = ["serve", "--config", str(config), "--port", "0"] if command == "serve" else \
        ["generate", "--config", str(config), "--out", str(cwd / "o.wav"), "Hi"]
    env = {**os.environ, VISIBLE: "", "TMPDIR": str(cwd)}
    return subprocess.run([sys.executable, "-m", "trio_orch.cli", *args, *extra], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("command", ["serve", "generate"])
def test_stage_0_on_cuda_1_without_cuda_exits_2_naming_it_and_starts_no_worker(tmp_path: Path,
                                                                               command: str) -> None:
    config = tmp_path / "placed.toml"
    config.write_text(TWO_STAGES)
    proc = _cli(command, config, tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert re.search(r"error: stage 0 \(echo\) replica 0: device cuda:1 asked for, but no CUDA device is "
                     r"available here", proc.stderr), proc.stderr
    assert "Traceback" not in proc.stderr and "starting" not in proc.stdout
    assert not processes_naming(tmp_path) and not list(tmp_path.glob("trio-orch-*"))  # none started or left


@pytest.mark.slow
def test_the_same_config_serves_with_cpu_everywhere(tmp_path: Path) -> None:
    config = tmp_path / "placed.toml"
    config.write_text(TWO_STAGES)
    env = {**os.environ, VISIBLE: "", "TMPDIR": str(tmp_path)}
    server = subprocess.Popen([sys.executable, "-m", "trio_orch.cli", "serve", "--config", str(config),
                               "--port", "0", "--device", "cpu"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
    assert server.stdout is not None
    lines: list[str] = []
    try:
        for line in server.stdout:
            lines.append(line)
            if m := re.search(r"serving on (http://\S+)", line):
                url = m.group(1)
                break
        else:
            raise AssertionError(f"serve exited {server.wait(HANG)} before serving: {''.join(lines)}")
        assert "worker pipeline echo -> echo on cpu" in lines[0]
        workers = {p for p in child_pids(serving_pid(server.pid)) if worker_alive(p)}
        assert len(workers) == 2
        r = httpx.post(f"{url}/v1/chat/completions", timeout=HANG * 3,
                       json={"messages": [{"role": "user", "content": "placed"}], "modalities": ["text"]})
        assert r.status_code == 200, r.text
        assert "placed" in r.json()["choices"][0]["message"]["content"]
    finally:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(HANG * 3)
        finally:
            if server.poll() is None:
                server.kill()
                server.wait()
    assert server.returncode == 0, "".join(lines)  # a clean drain
    assert not [p for p in workers if worker_alive(p)] and not processes_naming(tmp_path)


def test_a_joining_worker_takes_its_stages_device_and_refuses_one_its_host_lacks(tmp_path: Path) -> None:
    from stages.auth import generate_keys

    generate_keys(tmp_path / "keys", workers=1)
    config = tmp_path / "placed.toml"
    config.write_text(TWO_STAGES)
    base = [sys.executable, "-m", "stages.headless", "--head", "tcp://127.0.0.1:9", "--keys",
            str(tmp_path / "keys"), "--key", "worker-1", "--config", str(config), "--register-timeout", "1"]
    env = {**os.environ, VISIBLE: ""}
    proc = subprocess.run([*base, "--stage", "0"], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr  # before it registers: nothing was sent to the head
    assert "error: stage 0 (echo): device cuda:1 asked for, but no CUDA device is available" in proc.stderr
    proc = subprocess.run([*base, "--stage", "0", "--device", "cpu"], env=env, capture_output=True, text=True,
                          timeout=120)  # its own --device wins: it gets as far as the (absent) head
    assert proc.returncode == 1 and "cannot join tcp://127.0.0.1:9" in proc.stderr, proc.stderr
