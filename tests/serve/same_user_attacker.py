"""A process of the same user, without capabilities, reading what it can of other processes' secrets.

``python -m tests.serve.same_user_attacker --needles FILE --out FILE [--pids PID ...] [--children-of PID
--duration S] [--control PID]``

For each target it tries what such a process may try: ``/proc/<pid>/environ``,
``/proc/<pid>/mem`` (every readable region listed in ``maps``, the writable
ones first) and every ``/proc/<pid>/fd/N`` (opened and read, non-blocking).
A ``mem`` and ``maps`` it could open stay open: every later turn reads the
process's current regions through them (channel ``held``), which works for
as long as the process lives, locked down or not.  ``--children-of``: it
also watches for new descendants of that pid and attacks each as soon as it
appears, again and again while it lives (a worker starting up, before it
locks itself down), and the ``--pids`` again with them.  ``--ready-file`` holds how many passes over them it
made.  ``--control``: a dumpable process of the same user, to show that the
attacks work where nothing stops them.  The needles (JSON: name -> secret)
are re-read every turn, so whoever runs it may add secrets made later (a
replacement's ticket).

Writes JSON to ``--out``: its own ``uid`` and effective capabilities, per
pid and channel what happened (``denied``, ``read``, ``unopenable``,
``gone``), and ``found``: which needle showed up where.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import time
from pathlib import Path
from typing import Any

CHUNK = 1 << 20
MEM_BUDGET = 256 << 20  # bytes of memory read per attempt on one process


def _status(exc: OSError) -> str:
    if exc.errno in (errno.EACCES, errno.EPERM):
        return "denied"
    if exc.errno == errno.ENXIO:  # a socket: /proc cannot reopen it
        return "unopenable"
    if exc.errno in (errno.ENOENT, errno.ESRCH):
        return "gone"
    return f"error {errno.errorcode.get(exc.errno or 0, exc.errno)}"


class Attacker:
    def __init__(self, needles_path: str) -> None:
        self.needles_path = needles_path
        self.needles: dict[str, bytes] = {}
        self.results: dict[str, dict[str, dict[str, int]]] = {}
        self.found: dict[str, list[str]] = {}
        #: /proc/<pid>/mem and maps kept open once they opened: read again every turn
        self.held: dict[int, tuple[int, int]] = {}

    def reload(self) -> None:
        try:
            self.needles = {k: v.encode() for k, v in json.loads(Path(self.needles_path).read_text()).items()}
        except (OSError, ValueError):
            pass

    def note(self, pid: int, channel: str, status: str, data: bytes = b"") -> None:
        counts = self.results.setdefault(str(pid), {}).setdefault(channel, {})
        counts[status] = counts.get(status, 0) + 1
        for name, needle in self.needles.items():
            if needle and needle in data:
                self.found.setdefault(name, []).append(f"{pid}/{channel}")

    def environ(self, pid: int) -> None:
        try:
            data = Path(f"/proc/{pid}/environ").read_bytes()
        except OSError as exc:
            return self.note(pid, "environ", _status(exc))
        self.note(pid, "environ", "read", data)

    def mem(self, pid: int) -> None:
        if pid in self.held:  # opened while it was dumpable: does it still read?
            fd, maps_fd = self.held[pid]
            try:
                maps = os.pread(maps_fd, 1 << 22, 0).decode(errors="replace").splitlines()
            except OSError:
                maps = []
            return self.read_mem(pid, fd, maps, "held")
        try:
            maps_fd = os.open(f"/proc/{pid}/maps", os.O_RDONLY)
        except OSError as exc:
            return self.note(pid, "mem", _status(exc))
        try:
            maps = os.pread(maps_fd, 1 << 22, 0).decode(errors="replace").splitlines()
            fd = os.open(f"/proc/{pid}/mem", os.O_RDONLY)
        except OSError as exc:
            os.close(maps_fd)
            return self.note(pid, "mem", _status(exc))
        self.held[pid] = (fd, maps_fd)
        self.read_mem(pid, fd, maps, "mem")

    def read_mem(self, pid: int, fd: int, maps: list[str], channel: str) -> None:
        """Every readable region of ``maps``, the writable ones (where a process keeps what it got) first,
        up to :data:`MEM_BUDGET`; a needle across two reads is found too."""
        regions = []
        for line in maps:
            fields = line.split()
            if len(fields) < 2 or not fields[1].startswith("r") or line.endswith(("[vvar]", "[vsyscall]")):
                continue
            start, end = (int(x, 16) for x in fields[0].split("-"))
            regions.append((fields[1][1] != "w", start, end))
        budget, got = MEM_BUDGET, 0
        overlap = max((len(n) for n in self.needles.values()), default=1) - 1
        for _, start, end in sorted(regions):
            at, tail = start, b""
            while at < end and budget > 0:
                try:
                    data = os.pread(fd, min(CHUNK, end - at, budget), at)
                except OSError:
                    break
                if not data:
                    break
                got += len(data)
                budget -= len(data)
                self.note(pid, channel, "read", tail + data)
                tail = data[-overlap:] if overlap else b""
                at += len(data)
        self.note(pid, channel, "read" if got else "empty")

    def fds(self, pid: int) -> None:
        try:
            names = os.listdir(f"/proc/{pid}/fd")
        except OSError as exc:
            return self.note(pid, "fd", _status(exc))
        for name in names:
            try:
                fd = os.open(f"/proc/{pid}/fd/{name}", os.O_RDONLY | os.O_NONBLOCK)
            except OSError as exc:
                self.note(pid, "fd", _status(exc))
                continue
            try:
                data = os.read(fd, CHUNK)
                self.note(pid, "fd", "read", data)
            except OSError as exc:
                self.note(pid, "fd", "opened" if exc.errno == errno.EAGAIN else _status(exc))
            finally:
                os.close(fd)

    def attack(self, pid: int) -> None:
        self.reload()
        self.environ(pid)
        self.fds(pid)
        self.mem(pid)


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (children first)."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
                parents[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    out, frontier = [], [pid]
    while frontier:
        frontier = [child for child, parent in parents.items() if parent in frontier]
        out += frontier
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--needles", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--pids", type=int, nargs="*", default=[])
    p.add_argument("--control", type=int, default=None)
    p.add_argument("--children-of", type=int, default=None)
    p.add_argument("--duration", type=float, default=0.0)
    p.add_argument("--stop-file", default=None, help="watch until this file exists (or --duration ends)")
    p.add_argument("--ready-file", default=None, help="holds how many passes over the descendants were made")
    args = p.parse_args()
    a = Attacker(args.needles)
    if args.control is not None:
        a.attack(args.control)
    for pid in args.pids:
        a.attack(pid)
    end = time.monotonic() + args.duration
    passes = 0
    while args.children_of is not None and time.monotonic() < end:
        if args.stop_file and Path(args.stop_file).exists():
            break
        for pid in [*args.pids, *descendants(args.children_of)]:
            a.attack(pid)
        passes += 1
        if args.ready_file:
            Path(f"{args.ready_file}.tmp").write_text(str(passes))
            os.replace(f"{args.ready_file}.tmp", args.ready_file)
    status = dict(ln.split(":", 1) for ln in Path("/proc/self/status").read_text().splitlines() if ":" in ln)
    out: dict[str, Any] = {"uid": os.getuid(), "cap_eff": status["CapEff"].strip(), "results": a.results,
                           "found": a.found}
    Path(args.out).write_text(json.dumps(out))


if __name__ == "__main__":
    main()
