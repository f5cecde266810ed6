"""How serve behaves where it is deployed: signals to its whole process group, secrets, orphans.

Real ``trio-orch serve`` processes with real echo worker processes, real HTTP
clients on loopback.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import trio
import zmq

from stages.config import echo_config
from stages.lockdown import not_dumpable, serving_pid
from tests.http_helpers import HANG, metrics, wait_until
from tests.serve.test_service import start_serve, stream_in_background
from trio_orch import OrchOutput, open_orchestrator
from trio_orch.cluster.launcher import open_pipeline
from trio_orch.testing import child_pids

#: an environment variable named like a secret (auth, secret, token, password, key)
SECRET_NAME = re.compile(r"auth|secret|token|password|key", re.I)

SLOW_ECHO = """[pipeline]
final_stages = [0, 2]
{stages}
"""


def slow_echo_config(tmp_path: Path) -> str:
    """Three echo stages that take ~1 s per request: a stream is still open when the signal comes."""
    stage = '[[stages]]\nkind = "echo"\nmodel = {outputs = 40}\nworker_args = ["--step-delay-ms", "25"]\n'
    path = tmp_path / "echo.toml"
    path.write_text(SLOW_ECHO.format(stages="\n".join([stage] * 3)))
    return str(path)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with contextlib.suppress(OSError), open(f"/proc/{pid}/stat") as f:
        return f.read().split(") ")[-1][:1] != "Z"
    return True


@pytest.mark.slow
def test_a_sigterm_to_the_whole_process_group_drains_the_open_streams(tmp_path: Path) -> None:
    """systemd's KillMode=control-group, ``timeout``, ``kill -- -PGID``: the workers are not in serve's
    group, so they serve the open streams to their end while serve drains."""
    proc, url = start_serve("--config", slow_echo_config(tmp_path), "--shutdown-timeout", "30",
                            new_session=True)
    try:
        workers = child_pids(serving_pid(proc.pid))
        assert len(workers) == 3 and all(os.getpgid(w) != proc.pid for w in workers)
        streams = [stream_in_background(url, 3) for _ in range(4)]
        with httpx.Client(base_url=url, timeout=HANG) as c:
            wait_until(lambda: metrics(c)["trio_orch_active_requests"] == 4, "four streams run")
        os.killpg(proc.pid, signal.SIGTERM)  # the whole group, as a process manager does
        for t, _ in streams:
            t.join(60)
        for _, events in streams:
            assert events and events[-1] == "[DONE]"
            assert not any(isinstance(e, dict) and "error" in e for e in events), events
        assert proc.wait(60) == 0  # it exits by itself once drained, cleanly
        wait_until(lambda: not any(alive(w) for w in workers), "the workers are stopped", hang=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.slow
def test_a_sigkilled_serve_leaves_no_orphan_worker(tmp_path: Path) -> None:
    proc, _ = start_serve("--config", slow_echo_config(tmp_path), new_session=True)
    workers = child_pids(serving_pid(proc.pid))
    assert len(workers) == 3
    proc.kill()
    proc.wait()
    # each worker checks its parent every heartbeat and exits once it is gone
    wait_until(lambda: not any(alive(w) for w in workers), "the orphaned workers exit", hang=30)


async def test_no_worker_holds_a_secret_in_its_environment_or_command_line(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Not the pipeline secret, and none of the head's own (an admin token, a cloud key): workers need
    none of them, and any process of the same user can read an environment in /proc."""
    monkeypatch.setenv("TRIO_ORCH_ADMIN_TOKEN", "head-only-token")
    monkeypatch.setenv("SOME_CLOUD_SECRET_KEY", "head-only-key")
    async with open_pipeline(echo_config(2)) as pipe:
        assert pipe.security is not None
        secret = pipe.security.secret
        for pid in pipe.pids:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            names = [e.split(b"=", 1)[0].decode() for e in environ if e]
            assert [n for n in names if SECRET_NAME.search(n)] == []
            assert all(secret not in e and b"head-only" not in e for e in environ)
            assert "PATH" in names  # the rest of the environment is passed on
            assert secret not in Path(f"/proc/{pid}/cmdline").read_bytes()
        # and the workers authenticated with it all the same: they serve
        assert all("error" not in s for s in await pipe.stats())


def test_a_process_can_make_itself_non_dumpable() -> None:
    """What every worker does first (no ptrace, no /proc/<pid>/mem of it by the same user, no core)."""
    code = ("import ctypes, sys\n"
            "from stages.lockdown import not_dumpable\n"
            "ok = not_dumpable()\n"
            "sys.exit(0 if ok and ctypes.CDLL(None).prctl(3, 0, 0, 0, 0) == 0 else 1)\n")  # PR_GET_DUMPABLE
    if not sys.platform.startswith("linux"):
        assert not_dumpable() is False
        return
    root = Path(__file__).resolve().parents[2]
    assert subprocess.run([sys.executable, "-c", code], cwd=root).returncode == 0


async def test_workers_run_in_a_session_of_their_own() -> None:
    async with open_pipeline(echo_config(1)) as pipe:
        launched = pipe.workers[0].process
        assert launched is not None
        # the launched process leads a session of its own; the one serving (its fresh child) is in it
        assert os.getsid(launched.pid) == launched.pid != os.getsid(0)
        assert os.getsid(pipe.pids[0]) == launched.pid != pipe.pids[0]


async def test_no_other_process_takes_a_share_of_a_workers_control_socket() -> None:
    """Neither the pipeline secret nor the slot's own current ticket lets another process onto a replica's
    control socket: only the pid launched for it.  Each attempt is refused, counted and logged."""
    async with open_pipeline(echo_config(1)) as pipe, \
            open_orchestrator(pipe.stages, **pipe.orchestrator_kwargs()) as orch:
        assert pipe.security is not None and pipe.authenticator is not None
        client = pipe.workers[0].client
        launch = pipe.authenticator.launches.current(client.zap_domain(client.address))
        assert launch is not None and launch.pid == pipe.pids[0]
        intruders = []
        try:
            for password, reason in ((pipe.security.secret, "launch:stale_ticket"),
                                     (launch.ticket, "launch:stranger")):
                intruder = zmq.Context.instance().socket(zmq.DEALER)
                intruders.append(intruder)
                intruder.linger = 0
                intruder.plain_username = b"launch"
                intruder.plain_password = password
                intruder.connect(client.address)
                with trio.fail_after(HANG):
                    while pipe.authenticator.refused[reason] < 1:
                        await trio.sleep(0.01)
            for i in range(6):
                await orch.add_request(f"r{i}", f"p{i}")
            ended = set()
            with trio.fail_after(HANG):
                while len(ended) < 6:
                    out = await orch.next_output()
                    assert isinstance(out, OrchOutput), out
                    if out.finished:
                        ended.add(out.request_id)
            assert all(intruder.poll(0) == 0 for intruder in intruders)  # they got none of them
        finally:
            for intruder in intruders:
                intruder.close()
