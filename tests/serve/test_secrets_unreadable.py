"""No secret is readable by another process of the same user, from any process of the pipeline.

The attacker (:mod:`tests.serve.same_user_attacker`) is a process of the same
user without capabilities: it tries ``/proc/<pid>/environ``, ``mem`` and every
``fd/N``.  Where the tests run with capabilities (root), the pipeline *and*
the attacker are started with every capability dropped (``setpriv``): root's
capabilities would otherwise stop the attacker whatever the pipeline does, and
the test would prove nothing.  A dumpable process started the same way is the
control: the attacker reads its environment, so every refusal below is the
pipeline's own doing.

* ``trio-orch serve`` given the API key in its environment and the admin token
  in a file: nothing of serve or its workers can be read.
* ``trio-orch serve`` attacked from its first instant: held at its first line
  of Python (the window between ``exec`` and the lock-down, made as long as the
  attacker needs), it is opened -- ``mem`` and ``maps`` kept open -- and then
  reads its API key and admin token from files; nothing turns up, in any of its
  processes, through the handles held or new ones.  The control: a process
  opened the same way that only makes itself non-dumpable (no fresh child)
  gives away the secret it reads afterwards.
* A head that tells the test its workers' secrets as it makes them (the
  pipeline secret, the key pair, each launch's ticket): three workers are
  killed and restarted while the attacker reads every new worker from the
  moment it appears -- before it locks itself down -- and none of those
  secrets turns up.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from stages.lockdown import serving_pid
from tests.http_helpers import HANG, wait_until
from trio_orch.testing import child_pids, worker_alive

ROOT = Path(__file__).resolve().parents[2]
SECRET_KINDS = ("environ", "mem", "fd")


def unprivileged() -> list[str]:
    """The prefix that runs a command as this user without any capability ([] where it has none)."""
    status = Path("/proc/self/status").read_text()
    cap_eff = int(re.search(r"^CapEff:\s*([0-9a-f]+)", status, re.M).group(1), 16)  # type: ignore[union-attr]
    if cap_eff == 0:
        return []
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("the tests run with capabilities and setpriv (util-linux) is missing to drop them")
    return [setpriv, "--inh-caps=-all", "--ambient-caps=-all", "--bounding-set=-all", "--no-new-privs", "--"]


def attack(tmp_path: Path, needles: dict[str, str], *args: str) -> dict[str, Any]:
    """Run the attacker to its end, looking for ``needles``; its report."""
    path = tmp_path / "needles.json"
    path.write_text(json.dumps(needles))
    out = tmp_path / f"attack-{time.monotonic_ns()}.json"
    subprocess.run([*unprivileged(), sys.executable, "-m", "tests.serve.same_user_attacker", "--needles",
                    str(path), "--out", str(out), *args], cwd=ROOT, check=True, timeout=HANG)
    report: dict[str, Any] = json.loads(out.read_text())
    assert report["cap_eff"] == "0000000000000000" and report["uid"] == os.getuid()  # same user, no caps
    return report


def start_control(marker: str) -> subprocess.Popen[bytes]:
    """A dumpable process of the same user (without capabilities) with ``marker`` in its environment."""
    return subprocess.Popen([*unprivileged(), sys.executable, "-c", "import time; time.sleep(120)"],
                            env={**os.environ, "CONTROL_SECRET": marker})


def terminate(proc: subprocess.Popen[Any]) -> None:
    """SIGTERM (it stops its workers), SIGKILL if it does not exit in time."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(HANG)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def serving_url(serve: subprocess.Popen[str]) -> str:
    """Where ``trio-orch serve`` says it serves, read from its output."""
    assert serve.stdout is not None
    for line in serve.stdout:
        m = re.search(r"serving on (http://\S+)", line)
        if m:
            return m.group(1)
    raise AssertionError("serve did not start")


def statuses(report: dict[str, Any], pid: int) -> dict[str, set[str]]:
    return {ch: set(n) for ch, n in report["results"].get(str(pid), {}).items()}


def refused_everything(report: dict[str, Any], pid: int) -> bool:
    """Every attempt on ``pid`` was denied: an fd may also have been ``gone`` (closed between the
    listing of ``/proc/<pid>/fd``, which its owner may read, and the open: nothing was read)."""
    got = statuses(report, pid)
    return (set(got) == set(SECRET_KINDS) and all("denied" in got[ch] for ch in SECRET_KINDS)
            and got["environ"] == got["mem"] == {"denied"} and got["fd"] <= {"denied", "gone"})


@pytest.mark.slow
def test_nothing_of_serve_or_its_workers_can_be_read_by_a_same_user_process(tmp_path: Path) -> None:
    api_key, admin_token, marker = (secrets.token_hex(16) for _ in range(3))
    token_file = tmp_path / "admin-token"
    token_file.write_text(admin_token + "\n")
    token_file.chmod(0o600)
    config = tmp_path / "echo.toml"
    config.write_text('[pipeline]\nfinal_stages = [1]\n' + '[[stages]]\nkind = "echo"\n' * 2)
    serve = subprocess.Popen([*unprivileged(), sys.executable, "-m", "trio_orch.cli", "serve", "--port", "0",
                              "--served-model-name", "toy", "--config", str(config), "--admin-token-file",
                              str(token_file)], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True, env={**os.environ, "TRIO_ORCH_API_KEY": api_key})
    control = start_control(marker)
    try:
        url = serving_url(serve)
        with httpx.Client(base_url=url, timeout=HANG) as c:  # it holds both, and uses them
            assert c.get("/v1/models").status_code == 401
            assert c.get("/v1/models", headers={"Authorization": f"Bearer {api_key}"}).status_code == 200
            stats = c.get("/admin/stats", headers={"Authorization": f"Bearer {admin_token}"})
            assert stats.status_code == 200, stats.text
        fresh = serving_pid(serve.pid)  # serve goes on in a fresh child; the launched process stands in
        workers = child_pids(fresh)
        assert fresh != serve.pid and len(workers) == 2
        report = attack(tmp_path, {"api_key": api_key, "admin_token": admin_token, "control": marker},
                        "--control", str(control.pid), "--pids", str(serve.pid), str(fresh),
                        *map(str, workers))
        # the control: an unlocked process of the same user gives its environment away
        assert set(report["found"]) == {"control"}
        assert {f"{control.pid}/environ", f"{control.pid}/mem"} <= set(report["found"]["control"])
        for pid in (serve.pid, fresh, *workers):  # serve and every worker: nothing opens
            assert refused_everything(report, pid), (pid, report)
    finally:
        control.kill()
        control.wait()
        serve.send_signal(signal.SIGTERM)
        try:
            serve.communicate(timeout=HANG)
        except subprocess.TimeoutExpired:
            serve.kill()
            serve.communicate()
    assert not any(worker_alive(w) for w in workers)


#: a process held at its first line until its stdin says go, then the ``trio-orch`` program (what the
#: console script runs) with the rest of the command line: the window between ``exec`` and the lock-down,
#: as long as the attacker needs
HELD_PROGRAM = ("import runpy, sys\n"
                "print('held', flush=True)\n"
                "sys.stdin.readline()\n"
                "sys.argv = ['trio-orch', *sys.argv[1:]]\n"
                "runpy.run_module('trio_orch.cli', run_name='__main__')\n")
#: the control: held the same way, then non-dumpable in place (no fresh child), then it reads a secret
HELD_LOCKED_IN_PLACE = ("import sys, time\n"
                        "print('held', flush=True)\n"
                        "sys.stdin.readline()\n"
                        "from stages.lockdown import lock_down\n"
                        "lock_down()\n"
                        "secret = open(sys.argv[1]).read()\n"
                        "print('locked', flush=True)\n"
                        "time.sleep(120)\n")


@pytest.mark.slow
def test_serve_attacked_from_its_first_instant_gives_nothing_away(tmp_path: Path) -> None:
    api_key, admin_token, late = (secrets.token_hex(16) for _ in range(3))
    key_file, creds, late_file = tmp_path / "api-key", tmp_path / "credentials", tmp_path / "late"
    creds.mkdir(mode=0o700)
    for path, value in ((key_file, api_key), (creds / "admin-token", admin_token), (late_file, late)):
        path.write_text(value + "\n")
        path.chmod(0o600)
    config = tmp_path / "echo.toml"
    config.write_text('[pipeline]\nfinal_stages = [1]\n' + '[[stages]]\nkind = "echo"\n' * 2)
    needles = tmp_path / "needles.json"
    needles.write_text(json.dumps({"api_key": api_key, "admin_token": admin_token, "late": late}))
    stop, ready, out = tmp_path / "stop", tmp_path / "ready", tmp_path / "report.json"
    env = {k: v for k, v in os.environ.items() if k not in ("TRIO_ORCH_API_KEY", "TRIO_ORCH_ADMIN_TOKEN")}
    serve = subprocess.Popen([*unprivileged(), sys.executable, "-c", HELD_PROGRAM, "serve", "--port", "0",
                              "--served-model-name", "toy", "--config", str(config), "--api-key-file",
                              str(key_file)], cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True,
                             env={**env, "CREDENTIALS_DIRECTORY": str(creds)})
    control = subprocess.Popen([*unprivileged(), sys.executable, "-c", HELD_LOCKED_IN_PLACE, str(late_file)],
                               cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    attacker: subprocess.Popen[bytes] | None = None
    fresh, workers = 0, set[int]()
    try:
        assert serve.stdin and serve.stdout and control.stdin and control.stdout
        assert serve.stdout.readline().strip() == "held" and control.stdout.readline().strip() == "held"
        attacker = subprocess.Popen([*unprivileged(), sys.executable, "-m", "tests.serve.same_user_attacker",
                                     "--needles", str(needles), "--out", str(out), "--pids", str(serve.pid),
                                     str(control.pid), "--children-of", str(serve.pid), "--duration", "300",
                                     "--stop-file", str(stop), "--ready-file", str(ready)], cwd=ROOT)

        def passes() -> int:
            try:
                return int(ready.read_text())
            except (OSError, ValueError):
                return 0

        wait_until(lambda: passes() > 0, "the attacker opened both while they were held", hang=HANG)
        for p in (serve, control):  # go on: both lock down with the attacker's handles open
            p.stdin.write("go\n")  # type: ignore[union-attr]
            p.stdin.close()  # type: ignore[union-attr]
        url = serving_url(serve)
        assert control.stdout.readline().strip() == "locked"
        with httpx.Client(base_url=url, timeout=HANG) as c:  # it holds both, and uses them
            assert c.get("/v1/models").status_code == 401
            assert c.get("/v1/models", headers={"Authorization": f"Bearer {api_key}"}).status_code == 200
            stats = c.get("/admin/stats", headers={"Authorization": f"Bearer {admin_token}"})
            assert stats.status_code == 200, stats.text
        fresh = serving_pid(serve.pid)
        workers = child_pids(fresh)
        assert fresh != serve.pid and len(workers) == 2
        after = passes()
        wait_until(lambda: passes() > after + 1, "two full passes with every secret in memory", hang=HANG)
    finally:
        stop.touch()
        if attacker is not None:
            attacker.wait(HANG)
        control.kill()
        control.wait()
        terminate(serve)
    report = json.loads(out.read_text())
    assert report["cap_eff"] == "0000000000000000" and report["uid"] == os.getuid()
    # the control: a handle opened in the window reads what the process got after its lock-down
    assert set(report["found"]) == {"late"} and set(report["found"]["late"]) == {f"{control.pid}/held"}
    # serve's launched process was opened the same way, and the handles kept reading it to the end ...
    launched = statuses(report, serve.pid)
    assert "read" in launched["mem"] and launched["held"] == {"read"}, launched
    # ... and what serves, its fresh child, opened to nothing from its first instant (the workers, each
    # readable from its exec to its own lock-down, gave nothing away either: "found" above)
    assert refused_everything(report, fresh), report["results"]
    assert {fresh, *workers} <= {int(pid) for pid in report["results"]}
    assert serve.returncode == 0  # a clean drain after the SIGTERM
    assert not any(worker_alive(w) for w in workers)


@pytest.mark.slow
def test_a_restarting_worker_never_holds_a_secret_another_process_could_read(tmp_path: Path) -> None:
    needles, status = tmp_path / "needles.json", tmp_path / "status.json"
    stop, ready = tmp_path / "stop", tmp_path / "ready"
    head = subprocess.Popen([*unprivileged(), sys.executable, "-m", "tests.serve.secret_head", "--needles",
                             str(needles), "--status", str(status)], cwd=ROOT)
    seen: set[int] = set()
    try:
        def state() -> dict[str, Any]:
            try:
                return dict(json.loads(status.read_text()))
            except (OSError, ValueError):
                return {"pids": [], "restarts": -1}

        wait_until(lambda: len(state()["pids"]) == 2, "the head's two workers", hang=HANG)
        attacker = subprocess.Popen([*unprivileged(), sys.executable, "-m", "tests.serve.same_user_attacker",
                                     "--needles", str(needles), "--out", str(tmp_path / "report.json"),
                                     "--children-of", str(head.pid), "--duration", "300", "--stop-file",
                                     str(stop), "--ready-file", str(ready)], cwd=ROOT)
        def passes() -> int:
            try:
                return int(ready.read_text())
            except (OSError, ValueError):
                return 0

        try:
            wait_until(lambda: passes() > 0, "the attacker watches the head's children", hang=HANG)
            for i in range(3):  # kill -9 a worker: the attacker goes for its replacement from the start
                victim = state()["pids"][i % 2]
                seen.add(victim)
                os.kill(victim, signal.SIGKILL)
                wait_until(lambda n=i + 1: state()["restarts"] == n and len(state()["pids"]) == 2,
                           f"restart {i + 1}", hang=HANG)
            seen.update(state()["pids"])
            after = passes()
            wait_until(lambda: passes() > after + 1, "a full pass over the last workers", hang=HANG)
        finally:
            stop.touch()
            attacker.wait(HANG)
        report = json.loads((tmp_path / "report.json").read_text())
        assert report["cap_eff"] == "0000000000000000" and report["uid"] == os.getuid()
        assert report["found"] == {}, report["found"]  # no ticket, no pipeline secret, no key, ever
        attacked = {int(pid) for pid in report["results"]}
        assert seen <= attacked  # it went for every worker, the killed ones and their replacements
        print("attacks per worker channel:", {pid: {ch: dict(n) for ch, n in r.items()}
                                              for pid, r in report["results"].items()})
    finally:
        terminate(head)
    assert not any(worker_alive(w) for w in seen)
