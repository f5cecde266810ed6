"""Fault-injection helpers shared by ``trio-orch chaos`` and the fault tests.

* :func:`rogue_main` -- ``python -m bench.faults --connect ADDR --mode MODE``: a
  worker that speaks the wire protocol but misbehaves on purpose (answers for
  request ids it was never given, reports a request finished twice, sends
  oversized or undecodable messages).  The real worker (``stages.worker``)
  stays clean of these; its own fault flags cover crashes, hangs and garbage.
* :func:`open_stage` -- one stage of replicas started from explicit argv lists
  (real or rogue workers) under the launcher's lifecycle, as a
  :class:`~trio_orch.pool.ReplicaPool`.
* :class:`LeakProbe` -- child processes, open fds and ipc directories before
  and after a run, so a run can prove it left nothing behind.
"""

from __future__ import annotations

import argparse
import glob
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import numpy as np
import trio
import zmq

from trio_orch.config import PipelineConfig, StageConfig
from trio_orch.launcher import WorkerHandle, _run_worker
from trio_orch.pool import ReplicaPool
from trio_orch.transport import ZmqStageClient
from trio_orch.wire import (
    Abort,
    Dying,
    Heartbeat,
    InboundMsg,
    OutboundMsg,
    OutItem,
    Outputs,
    Ready,
    Shutdown,
    Submit,
    WireCodec,
    WireError,
)

__all__ = ["ROGUE_MODES", "LeakProbe", "TerminalLedger", "child_pids", "echo_argv", "open_stage",
           "rogue_argv", "rogue_main"]

#: what a rogue worker does wrong (on every request whose payload contains "bad", or always)
ROGUE_MODES = ("unknown_rid", "duplicate_finish", "oversized", "garbage")


# ---------------------------------------------------------------------------------- the rogue worker
def rogue_main(argv: list[str] | None = None) -> int:
    """A misbehaving echo worker (see :data:`ROGUE_MODES`); exits on SIGTERM or Shutdown."""
    p = argparse.ArgumentParser(prog="python -m bench.faults",
                                description="A stage worker that misbehaves on purpose (fault tests).")
    p.add_argument("--connect", required=True)
    p.add_argument("--stage-id", type=int, default=0)
    p.add_argument("--replica", type=int, default=0)
    p.add_argument("--mode", choices=ROGUE_MODES, required=True)
    p.add_argument("--only-bad", action="store_true",
                   help="misbehave only for requests whose payload contains 'bad'")
    p.add_argument("--oversized-bytes", type=int, default=2 << 20)
    args = p.parse_args(argv)
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append("SIGTERM"))
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 500
    sock.connect(args.connect)
    dec, enc = WireCodec(InboundMsg), WireCodec(OutboundMsg)

    def send(msg: Any) -> None:
        sock.send_multipart(enc.encode(msg), copy=False)

    send(Ready(args.stage_id, args.replica, os.getpid(), "echo", {"rogue": args.mode}))
    next_hb = time.monotonic()
    n = 0
    try:
        while not stop:
            if sock.poll(100):
                try:
                    msg = dec.decode(sock.recv_multipart(copy=False))
                except WireError:
                    continue
                if type(msg) is Shutdown:
                    break
                if type(msg) is Abort or type(msg) is not Submit:
                    continue
                n += 1
                rid, now = msg.request_id, time.perf_counter()
                bad = not args.only_bad or "bad" in repr(msg.payload)
                if bad and args.mode == "unknown_rid":
                    send(Outputs([OutItem(f"never-given-{n}", "stray", True, None, now)]))
                if bad and args.mode == "garbage":
                    sock.send_multipart([b"\xc1 not msgpack", b"junk"])
                if bad and args.mode == "oversized":
                    big = np.zeros(args.oversized_bytes, dtype=np.uint8)
                    send(Outputs([OutItem(rid, {"blob": big}, True, None, now)]))
                    continue
                send(Outputs([OutItem(rid, msg.payload, True, None, now)]))
                if bad and args.mode == "duplicate_finish":
                    send(Outputs([OutItem(rid, "again", True, None, now)]))
            if time.monotonic() >= next_hb:
                send(Heartbeat(time.perf_counter(), 0))
                next_hb = time.monotonic() + 0.2
        send(Dying(f"rogue worker stopping: {stop[0] if stop else 'shutdown'}"))
    finally:
        sock.close(linger=500)
        ctx.term()
    return 0


def rogue_argv(addr: str, mode: str, *, stage_id: int = 0, replica: int = 0, only_bad: bool = True,
               oversized_bytes: int = 2 << 20) -> list[str]:
    argv = [sys.executable, "-m", "bench.faults", "--connect", addr, "--stage-id", str(stage_id),
            "--replica", str(replica), "--mode", mode, "--oversized-bytes", str(oversized_bytes)]
    return argv + (["--only-bad"] if only_bad else [])


def echo_argv(addr: str, *, stage_id: int = 0, replica: int = 0, extra: list[str] | None = None) -> list[str]:
    """A real ``stages.worker`` echo replica (heartbeat 0.2 s)."""
    return [sys.executable, "-m", "stages.worker", "--connect", addr, "--stage-id", str(stage_id),
            "--replica", str(replica), "--kind", "echo", "--heartbeat-interval", "0.2", *(extra or [])]


# ---------------------------------------------------------------------------------- a hand-built stage
@asynccontextmanager
async def open_stage(argv_for: list[Any], *, stage_id: int = 0, heartbeat_timeout: float = 2.0,
                     max_message_bytes: int | None = 1 << 20, probe: LeakProbe | None = None
                     ) -> AsyncIterator[tuple[ReplicaPool, list[WorkerHandle]]]:
    """Start one replica per ``argv_for`` entry (``addr -> argv``) behind a pool; stop them all."""
    tmpdir = tempfile.mkdtemp(prefix="trio-orch-faults-")
    if probe is not None:
        probe.saw_dir(tmpdir)
    ctx = zmq.Context()
    cfg = PipelineConfig([StageConfig("echo")], startup_timeout=20.0, stop_grace=1.0)
    pool = ReplicaPool(stage_id)
    handles: list[WorkerHandle] = []
    try:
        async with trio.open_nursery() as nursery:
            for r, make in enumerate(argv_for):
                addr = f"ipc://{tmpdir}/ctl-r{r}"
                client = ZmqStageClient(ctx, addr, stage_id=stage_id, replica=r, sink=pool.sink,
                                        heartbeat_timeout=heartbeat_timeout, name=f"stage {stage_id} r{r}",
                                        max_message_bytes=max_message_bytes)
                pool.add_replica(client)
                await nursery.start(client.run)
                h = WorkerHandle(stage_id, r, "echo", client, os.path.join(tmpdir, f"r{r}.stderr"))
                handles.append(h)
                await nursery.start(_run_worker, h, make(addr), cfg)
                if probe is not None:
                    probe.saw([h.pid])
            try:
                yield pool, handles
            finally:
                nursery.cancel_scope.cancel()
    finally:
        ctx.destroy(linger=0)
        shutil.rmtree(tmpdir, ignore_errors=True)


# ---------------------------------------------------------------------------------- terminal accounting
class TerminalLedger:
    """Checks DESIGN §3's "exactly one terminal, and it is the last message" per request.

    ``record`` every message a consumer receives; ``accepted`` every request id
    the orchestrator accepted.  ``without_terminal()`` / ``duplicates`` /
    ``after_terminal`` must all be zero after a run.
    """

    def __init__(self) -> None:
        self.accepted: set[str] = set()
        self.terminal: dict[str, str] = {}  # rid -> "ok" or the error kind
        self.duplicates = 0
        self.after_terminal = 0
        self.messages = 0
        self.t_last_ok = 0.0

    def record(self, msg: Any) -> None:
        self.messages += 1
        rid = msg.request_id
        if rid in self.terminal:
            if msg.finished:
                self.duplicates += 1
            else:
                self.after_terminal += 1
            return
        if msg.finished:
            kind = getattr(msg, "kind", None) or "ok"
            self.terminal[rid] = kind
            if kind == "ok":
                self.t_last_ok = time.monotonic()

    def without_terminal(self) -> int:
        return len(self.accepted - self.terminal.keys())

    def by_kind(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for rid, kind in self.terminal.items():
            if rid in self.accepted:
                out[kind] = out.get(kind, 0) + 1
        return dict(sorted(out.items()))


# ---------------------------------------------------------------------------------- leak accounting
def child_pids() -> set[int]:
    """Live (or zombie) child processes of this process, from /proc."""
    pids: set[int] = set()
    for path in glob.glob(f"/proc/{os.getpid()}/task/*/children"):
        try:
            with open(path) as f:
                pids.update(int(x) for x in f.read().split())
        except OSError:
            pass
    return pids


def _fd_count() -> int:
    try:
        return len(os.listdir(f"/proc/{os.getpid()}/fd"))
    except OSError:  # pragma: no cover - not Linux
        return 0


class LeakProbe:
    """Snapshot before a run; :meth:`leaks` after it says what the run left behind."""

    def __init__(self) -> None:
        self.children = child_pids()
        self.fds = _fd_count()
        self.dirs: set[str] = set()
        self.pids_seen: set[int] = set()

    def saw_dir(self, path: str) -> None:
        """Remember a run's private directory (ipc sockets, logs): it must be gone after the run."""
        self.dirs.add(path)

    def saw(self, pids: Any) -> None:
        """Remember worker pids started during the run (they must all be gone after it)."""
        self.pids_seen.update(p for p in pids if p)

    def leaks(self) -> dict[str, int]:
        """``processes`` (children or seen workers still alive), ``fds`` (net growth), ``ipc_files``."""
        alive = (child_pids() - self.children) | {p for p in self.pids_seen if _alive(p)}
        ipc = 0
        for d in self.dirs:
            if os.path.exists(d):
                ipc += max(1, len(os.listdir(d))) if os.path.isdir(d) else 1
        return {"processes": len(alive), "fds": max(0, _fd_count() - self.fds), "ipc_files": ipc}


def _alive(pid: int) -> bool:
    """A worker process of ours with this pid still exists (zombies count: nobody reaped them)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read()
    except OSError:
        return False
    return b"stages.worker" in cmd or b"bench.faults" in cmd or cmd == b""


if __name__ == "__main__":
    sys.exit(rogue_main())
