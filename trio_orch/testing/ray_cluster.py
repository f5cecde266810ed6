"""A real multi-node Ray cluster on this machine, for tests and chaos runs: ``ray start`` per node.

Each node is one ``ray start --block`` process started in a session of its
own, with its own temp dir, its own ports (free ones, picked here) and its
own loopback address (``127.0.0.2``, ``127.0.0.3``, ...: Linux routes all of
``127/8`` over loopback, and Ray keeps such an address where it would replace
``127.0.0.1`` by the host's network address), its CPU count given
explicitly, its custom resources and labels.  Every process Ray starts for a
node -- the raylet, its agents, the actors' workers and what *they* start
(a trio-orch worker) -- stays in that session, which is how a node is found,
stopped and checked for leftovers without touching any other Ray on the
machine (``ray stop`` would stop every one of the user's).

* :meth:`LocalRayCluster.stop_node`: ``crash=True`` SIGKILLs every process of
  the node at once (a machine lost); else SIGTERM to its raylet (the node
  leaves: Ray stops its workers), then SIGTERM to the rest (as ``ray stop``),
  then SIGKILL to whatever is left after a grace.  The cluster (its GCS)
  notices a crashed node after its health checks fail (:data:`RAY_ENV`: 5
  misses 1 s apart).
* :meth:`LocalRayCluster.stop`: every node, the head last; the temp dirs
  removed; :meth:`LocalRayCluster.leftovers` then lists any process still in a
  node's session or naming a temp dir (a test asserts it is empty).

Nothing here imports Ray: the nodes are command lines (``ray`` next to this
Python), and the tests' process never becomes a Ray driver (a driver's gRPC
clients stay in its process).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["RAY_ENV", "LocalRayCluster", "RayNode", "parent_of", "session_pids"]

#: environment of every node (and of a driver: :attr:`LocalRayCluster.driver_env`): no usage report,
#: no token authentication (the cluster is on loopback; a token file in the shared ``~/.ray`` of
#: another cluster on the machine would otherwise be picked up), no idle workers started ahead, and a
#: crashed node declared dead after 5 failed health checks 1 s apart (Ray's default takes 15 s or more)
RAY_ENV = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled", "RAY_enable_worker_prestart": "0",
           "RAY_prestart_worker_first_driver": "0", "RAY_health_check_period_ms": "1000",
           "RAY_health_check_failure_threshold": "5", "RAY_health_check_timeout_ms": "5000"}

#: the ``ray`` command of this Python's environment
RAY_BIN = str(Path(sys.executable).with_name("ray"))


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def session_pids(sid: int) -> list[int]:
    """Every live process whose session id is ``sid`` (zombies left out), from /proc."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z" and int(fields[3]) == sid:
            out.append(int(entry))
    return out


def parent_of(pid: int) -> int:
    """The parent pid of ``pid`` (0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except OSError:
        return 0


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


@dataclass
class RayNode:
    """One node: its ``ray start --block`` process (whose session holds all of the node's processes)."""

    name: str
    ip: str
    num_cpus: int
    resources: dict[str, float]
    labels: dict[str, str]
    temp_dir: str
    proc: subprocess.Popen[bytes]
    log: Path
    ports: dict[str, int] = field(default_factory=dict)

    @property
    def session(self) -> int:
        return self.proc.pid

    def pids(self) -> list[int]:
        return session_pids(self.session)

    def find(self, *needles: str) -> list[int]:
        """Pids of this node's processes whose command line contains every needle."""
        return [p for p in self.pids() if all(n in _cmdline(p) for n in needles)]

    def workers(self, *needles: str) -> list[int]:
        """The trio-orch workers serving on this node (``stages.headless`` and ``needles`` in their
        command line): a worker runs in the child of a stand-in with the same command line
        (``stages.lockdown``); the stand-ins are left out."""
        found = set(self.find("stages.headless", *needles))
        return sorted(p for p in found if parent_of(p) in found)

    def actor_of(self, worker: int) -> int:
        """The Ray actor process a worker (or its stand-in) runs under."""
        pid = worker
        while "stages.headless" in _cmdline(pid):
            pid = parent_of(pid)
        return pid


class LocalRayCluster:
    """Nodes started with ``ray start`` on this machine (see the module docstring)."""

    def __init__(self, *, start_timeout: float = 180.0) -> None:
        self.start_timeout = start_timeout
        self.nodes: dict[str, RayNode] = {}
        self.gone: list[RayNode] = []
        self.head: RayNode | None = None
        self.address = ""  # the GCS address, HOST:PORT, once the head runs
        self._next_ip = 2

    @property
    def driver_env(self) -> dict[str, str]:
        """The environment of a process that drives this cluster (``serve --ray-address ...``)."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
        return {**env, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}

    def _start(self, name: str, *, num_cpus: int, resources: dict[str, float], labels: dict[str, str],
               head: bool) -> RayNode:
        ip = f"127.0.0.{self._next_ip}"
        self._next_ip += 1
        temp = tempfile.mkdtemp(prefix="rt", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
        ports = {k: _free_port("") for k in ("node-manager-port", "object-manager-port",
                                              "dashboard-agent-listen-port", "dashboard-agent-grpc-port",
                                              "runtime-env-agent-port", "metrics-export-port")}
        argv = [RAY_BIN, "start", "--block", "--node-ip-address", ip, "--num-cpus", str(num_cpus),
                "--num-gpus", "0", "--resources", json.dumps(resources), "--temp-dir", temp,
                "--object-store-memory", str(80 * 1024 * 1024), "--min-worker-port", "0",
                "--max-worker-port", "0", "--disable-usage-stats", "--log-style", "record"]
        if labels:
            argv += ["--labels", ",".join(f"{k}={v}" for k, v in labels.items())]
        if head:
            ports["port"] = _free_port("")
            ports["dashboard-port"] = _free_port("")
            argv += ["--head", "--include-dashboard", "false"]
        else:
            argv += ["--address", self.address]
        for key, port in ports.items():
            argv += [f"--{key}", str(port)]
        log = Path(temp) / "ray-start.log"
        env = {**{k: v for k, v in os.environ.items() if not k.startswith("RAY_")}, **RAY_ENV}
        with open(log, "wb") as out:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                    env=env, start_new_session=True)
        node = RayNode(name, ip, num_cpus, resources, labels, temp, proc, log, ports)
        self.nodes[name] = node
        if head:
            self.head = node
            self.address = f"{ip}:{ports['port']}"
        self._wait_started(node)
        return node

    def _wait_started(self, node: RayNode) -> None:
        end = time.monotonic() + self.start_timeout
        while time.monotonic() < end:
            text = node.log.read_text(errors="replace")
            if "block forever" in text:
                return
            if node.proc.poll() is not None:
                break
            time.sleep(0.2)
        tail = node.log.read_text(errors="replace")[-3000:]
        raise RuntimeError(f"ray node {node.name} did not start (exit {node.proc.poll()}):\n{tail}")

    def start_head(self, name: str = "head", *, num_cpus: int, resources: dict[str, float],
                   labels: dict[str, str] | None = None) -> RayNode:
        return self._start(name, num_cpus=num_cpus, resources=resources, labels=labels or {}, head=True)

    def add_node(self, name: str, *, num_cpus: int, resources: dict[str, float],
                 labels: dict[str, str] | None = None) -> RayNode:
        """Start a worker node joining the head (a node of the same name that was stopped may come back)."""
        assert self.head is not None, "start the head first"
        return self._start(name, num_cpus=num_cpus, resources=resources, labels=labels or {}, head=False)

    def stop_node(self, name: str, *, crash: bool = False, grace: float = 30.0) -> None:
        """Take a node away (see the module docstring); returns once none of its processes is left."""
        node = self.nodes.pop(name)
        self.gone.append(node)
        if crash:
            self._signal_all(node, signal.SIGKILL)
        else:
            raylets = node.find("/raylet/raylet")
            for pid in raylets:  # the node leaves: its raylet stops its workers
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGTERM)
            end = time.monotonic() + grace
            while set(raylets) & set(node.pids()) and time.monotonic() < end:
                time.sleep(0.1)
            # the rest (the head's GCS, agents), as `ray stop`; `ray start --block` itself and the
            # autoscaler's monitor ignore SIGTERM: they get the SIGKILL below after a short wait
            self._signal_all(node, signal.SIGTERM)
            end = time.monotonic() + min(grace, 3.0)
            while node.pids() and time.monotonic() < end:
                time.sleep(0.1)
        end = time.monotonic() + grace
        while node.pids() and time.monotonic() < end:
            self._signal_all(node, signal.SIGKILL)
            time.sleep(0.1)
        with contextlib.suppress(subprocess.TimeoutExpired):
            node.proc.wait(grace)
        shutil.rmtree(node.temp_dir, ignore_errors=True)

    @staticmethod
    def _signal_all(node: RayNode, sig: int) -> None:
        for pid in node.pids():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)

    def stop(self, grace: float = 20.0) -> None:
        """Stop every node (the head last) and remove their temp dirs; safe to call twice."""
        for name in [n for n in self.nodes if self.nodes[n] is not self.head]:
            self.stop_node(name, grace=grace)
        if self.head is not None and self.head.name in self.nodes:
            self.stop_node(self.head.name, grace=grace)

    def leftovers(self) -> list[str]:
        """Processes still alive in any node's session, or naming one of the temp dirs (each as text)."""
        out = []
        nodes = [*self.nodes.values(), *self.gone]
        for node in nodes:
            out += [f"{p} (session of node {node.name}): {_cmdline(p)[:200]}" for p in node.pids()]
        dirs = [n.temp_dir for n in nodes]
        for entry in os.listdir("/proc"):
            if entry.isdigit() and int(entry) != os.getpid():
                cmd = _cmdline(int(entry))
                if any(d in cmd for d in dirs):
                    out.append(f"{entry} (names a temp dir): {cmd[:200]}")
        return sorted(set(out))
