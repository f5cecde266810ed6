"""Replicas that join a chaos run over TCP: a registrar on loopback and headless workers as subprocesses.

A run whose :class:`~bench.chaos.run.RunSetup` has ``listen`` opens its
pipeline with the local inboxes on 127.0.0.1 and, beside it, a registrar on
``tcp://127.0.0.1:<ephemeral>`` (:func:`open_remote_workers`).  The keys are
made for the run, in memory: the head's key pair and :data:`ALLOWED` worker
key pairs on its allow-list.  A fault starts ``python -m stages.headless``
workers (:meth:`RemoteWorkers.start`): the worker's key pair goes over the
hand-over of :mod:`stages.credentials` (``--keys-fd``) and the pipeline config
in its environment, as the Ray backend hands them over, so no secret is in any
environment, command line or pipe and nothing is written but each worker's
stderr log.  The worker goes on in a fresh child of the process started
(:mod:`stages.lockdown`): :meth:`RemoteWorkers.serving_pid` is the one to stop.
Whatever the fault did to them, they are all stopped and reaped when the run
ends, before the leak check.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import trio

from stages.auth import Keypair, scrubbed_environ
from stages.config import to_dict
from stages.credentials import Handover
from stages.headless import CONFIG_ENV
from trio_orch.cluster.credentials import hand_over
from trio_orch.cluster.launcher import Pipeline
from trio_orch.cluster.registrar import HeadKeys, Member, Registrar, open_registrar

__all__ = ["ALLOWED", "LISTEN_HOST", "RemoteWorkers", "open_remote_workers"]

LISTEN_HOST = "127.0.0.1"
#: worker key pairs on the head's allow-list
ALLOWED = 3


class RemoteWorkers:
    """The run's registrar and the headless workers a fault started (see the module docstring)."""

    def __init__(self, pipe: Pipeline, registrar: Registrar, head: Keypair, workers: list[Keypair],
                 logs: Path, join_timeout: float) -> None:
        self.pipe, self.registrar, self.head, self.workers = pipe, registrar, head, workers
        self.logs = logs
        self.join_timeout = join_timeout
        self.procs: list[trio.Process] = []
        self._log_of: dict[int, Path] = {}
        self._serving: dict[int, int] = {}  # started pid -> the pid that serves

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def serving_pid(self, proc: trio.Process) -> int:
        """The process that serves for ``proc`` (its fresh child), the one to stop or signal."""
        return self._serving.get(proc.pid, proc.pid)

    async def start(self, stage: int, *, key: int = 0, keypair: Keypair | None = None,
                    member_id: str | None = None, head_timeout: float = 1.0) -> trio.Process:
        """Start a worker for ``stage`` with allowed key pair ``key`` (or ``keypair``: any other one).

        ``member_id`` registers under a chosen identity (e.g. a spent one);
        ``head_timeout``: how long its link to the head may be down before it
        registers again with a new identity.
        """
        pair = keypair if keypair is not None else self.workers[key]
        keys = json.dumps({"public": pair.public.decode(), "secret": pair.secret.decode(),
                           "head": self.head.public.decode()})
        env = {**scrubbed_environ(), CONFIG_ENV: json.dumps(to_dict(self.pipe.config))}
        handover = Handover()
        argv = [sys.executable, "-m", "stages.headless", "--stage", str(stage),
                "--head", self.registrar.address, "--advertise", LISTEN_HOST,
                "--keys-fd", str(handover.child_fd),
                "--head-timeout", str(head_timeout), "--register-timeout", "30", "--leave-grace", "2"]
        if member_id is not None:
            argv += ["--member-id", member_id]
        log = self.logs / f"worker-{len(self.procs)}.stderr"
        try:
            with open(log, "wb") as err:  # the child keeps its own copies of the fds
                proc = await trio.lowlevel.open_process(argv, env=env, stdin=subprocess.DEVNULL,
                                                        stdout=subprocess.DEVNULL, stderr=err,
                                                        pass_fds=(handover.child_fd,))
            self.procs.append(proc)
            self._log_of[proc.pid] = log
            handover.child_started(keys.encode())
            with trio.move_on_after(self.join_timeout):
                serving = await hand_over(handover, proc.pid, keys.encode())
                if serving is not None:
                    self._serving[proc.pid] = serving
        finally:
            handover.close()
        return proc

    async def start_joined(self, stage: int, *, key: int = 0) -> tuple[trio.Process, Member]:
        """Start a worker and wait until it joined (its model loaded, eligible for new requests)."""
        before = set(self.registrar.members)
        proc = await self.start(stage, key=key)
        await self.wait_for(lambda: bool(self.live_members(stage).keys() - before)
                            or proc.returncode is not None)
        if proc.returncode is not None:
            raise RuntimeError(f"remote worker for stage {stage} exited with {proc.returncode} before it "
                               f"joined: {self.stderr_tail(proc)}")
        new = next(m for mid, m in self.live_members(stage).items() if mid not in before)
        return proc, new

    def counts(self) -> dict[str, int]:
        """The registrar's membership counters and the refused handshakes, as a row's notes."""
        out = {k.replace(".", "_"): n for k, n in self.registrar.counters.items() if n}
        refused = self.registrar.auth.refused
        out.update({f"auth_refused_{k.replace(':', '_')}": n for k, n in refused.items() if n})
        return out

    def live_members(self, stage: int) -> dict[str, Member]:
        """Joined replicas of ``stage`` that are not gone, by identity."""
        return {mid: m for mid, m in self.registrar.members.items() if m.stage_id == stage and m.gone is None}

    async def wait_for(self, pred: Callable[[], bool], timeout: float | None = None) -> None:
        """Poll ``pred`` until true; trio.TooSlowError after ``timeout`` (default: the join timeout)."""
        with trio.fail_after(self.join_timeout if timeout is None else timeout):
            while not pred():
                await trio.sleep(0.02)

    def stderr_tail(self, proc: trio.Process, lines: int = 3) -> str:
        """The last lines a worker wrote to stderr (why it exited)."""
        try:
            text = self._log_of[proc.pid].read_text(errors="replace")
        except OSError:
            return ""
        return " | ".join(text.strip().splitlines()[-lines:])

    async def stop_all(self, grace: float = 5.0) -> None:
        """Every worker gone and reaped: they exit when the head stops, else after ``grace`` SIGKILL."""
        with trio.move_on_after(grace):
            for p in self.procs:
                await p.wait()
        for p in self.procs:
            if p.returncode is None:
                p.kill()  # a stopped one too
            await p.wait()


@asynccontextmanager
async def open_remote_workers(pipe: Pipeline, *, join_timeout: float = 60.0) -> AsyncIterator[RemoteWorkers]:
    """A registrar for ``pipe`` on loopback TCP with keys made for the run; every worker stopped at the end.

    ``pipe`` must have been opened with ``inbox_host=LISTEN_HOST`` (its
    inboxes reachable by remote replicas).
    """
    head = Keypair.generate()
    workers = [Keypair.generate() for _ in range(ALLOWED)]
    keys = HeadKeys(head, frozenset(w.public for w in workers))
    logs = Path(tempfile.mkdtemp(prefix="trio-orch-chaos-remote-"))
    remote: RemoteWorkers | None = None
    try:
        async with open_registrar(pipe, f"tcp://{LISTEN_HOST}:0", keys) as reg:
            remote = RemoteWorkers(pipe, reg, head, workers, logs, join_timeout)
            yield remote
    finally:  # the registrar told its joined workers that the head is going: they exit on their own
        with trio.CancelScope(shield=True):
            if remote is not None:
                await remote.stop_all()
        shutil.rmtree(logs, ignore_errors=True)
