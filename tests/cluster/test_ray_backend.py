"""``--worker-backend ray``: a local Ray cluster (``ray.init()`` on this machine, loopback only)
places every replica as an actor whose worker joins over TCP; a request goes through end to end
and everything stops.  Each replica is on the CPU: its worker is told ``cpu`` and sees no GPU,
though its node's processes are told of one (``CUDA_VISIBLE_DEVICES=5``, which Ray leaves to an
actor that reserves no GPU).

The Ray driver runs in a child process: once a driver has lived in a process,
Ray's gRPC clients there go on reconnecting to the stopped cluster, so the
test process itself would see sockets come and go in every later leak check."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import trio

from stages.auth import SECRET_NAME, Keypair
from stages.config import echo_config
from trio_orch import OrchOutput, open_orchestrator
from trio_orch.cluster.distributed import HeadOptions, open_head_pipeline
from trio_orch.cluster.registrar import Registrar

pytest.importorskip("ray")

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def environ(pid: int) -> list[bytes]:
    return [e for e in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") if e]


def parent_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def check_no_key_in_reach(pid: int, keys: list[Keypair], *, named_like_a_secret: bool) -> None:
    """No key material in ``pid``'s environment or command line; ``named_like_a_secret``: nor any
    variable named like a secret (a worker's: the actor's is Ray's to make)."""
    env = environ(pid)
    material = [k for pair in keys for k in (pair.secret, pair.public)]
    assert not any(m in e for m in material for e in env)
    assert not any(m in Path(f"/proc/{pid}/cmdline").read_bytes() for m in material)
    named = [n for n in (e.split(b"=", 1)[0].decode() for e in env) if SECRET_NAME.search(n)]
    assert [n for n in named if n.startswith("TRIO_ORCH_")] == []
    if named_like_a_secret:
        assert named == []


async def scenario() -> None:
    """The whole run, in a process of its own (the test below runs it)."""
    import ray

    made: list[Keypair] = []  # each actor's one-time key
    one_time_key = Registrar.one_time_key
    Registrar.one_time_key = lambda self: made.append(one_time_key(self)) or made[-1]  # type: ignore[method-assign]
    temp = tempfile.mkdtemp(prefix="ray-")  # short: Ray's unix socket paths must fit 107 bytes
    # a node whose processes are told of a GPU 5: Ray leaves the variable to an actor that reserves no GPU
    os.environ["CUDA_VISIBLE_DEVICES"] = "5"
    await trio.to_thread.run_sync(lambda: ray.init(
        num_cpus=8, num_gpus=0, include_dashboard=False, log_to_driver=False, _temp_dir=temp,
        _node_ip_address="127.0.0.1"))
    try:
        cfg = echo_config(2, heartbeat_interval=0.2, heartbeat_timeout=2.0)
        local = echo_config(2, replicas=0, heartbeat_interval=0.2, heartbeat_timeout=2.0)
        opts = HeadOptions(listen="tcp://127.0.0.1:0", backend="ray")
        pids: list[int] = []
        async with open_head_pipeline(local, opts, full_config=cfg, supervised=False) as pipe:
            reg = pipe.registrar
            assert reg is not None and pipe.workers == []  # no local worker: every replica is an actor
            async with open_orchestrator(pipe.stages, **pipe.orchestrator_kwargs()) as orch:
                with trio.fail_after(120):
                    while reg.counters["joined"] < 2:
                        await trio.sleep(0.1)
                await orch.add_request("r1", "hello")
                with trio.fail_after(30):
                    msg = await orch.next_output()
                    while not msg.finished:
                        msg = await orch.next_output()
                assert isinstance(msg, OrchOutput) and msg.stage_id == 1
                pids = [m.client.ready.pid for m in reg.members.values() if m.client.ready is not None]
                assert len(pids) == 2 and len(made) == 2  # one one-time key per actor ...
                assert reg.counters["one_time_keys_spent"] == 2  # ... spent by its worker's registration
                # the keys reached each worker over the hand-over: not in its environment, its stand-in's
                # (its parent: the process the actor started) nor its actor's
                for pid in pids:
                    check_no_key_in_reach(pid, made, named_like_a_secret=True)
                    check_no_key_in_reach(parent_of(pid), made, named_like_a_secret=True)
                    check_no_key_in_reach(parent_of(parent_of(pid)), made, named_like_a_secret=False)
                    # a CPU replica's worker sees no GPU, whatever its actor (its node) was told
                    assert b"CUDA_VISIBLE_DEVICES=5" in environ(parent_of(parent_of(pid)))
                    assert b"CUDA_VISIBLE_DEVICES=" in environ(pid)
                for m in reg.members.values():
                    got = await m.client.rpc("stats", timeout=30)
                    assert (got["device"], got["cuda_visible_devices"]) == ("cpu", "")
        assert not any(_pid_alive(p) for p in pids)  # every actor's worker is gone
    finally:
        await trio.to_thread.run_sync(ray.shutdown)
        shutil.rmtree(temp, ignore_errors=True)


def test_a_ray_placed_pipeline_serves_a_request_and_stops() -> None:
    """Run :func:`scenario` in a child (its assertions fail it); it must exit 0 within the bound."""
    proc = subprocess.run([sys.executable, "-m", "tests.cluster.test_ray_backend"], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]


if __name__ == "__main__":
    trio.run(scenario)
