"""Say what an open file descriptor is, so that a leak check names the culprit instead of ``socket:[N]``.

A leaked socket's ``readlink`` says only its inode; the kernel's socket tables
(``/proc/net/unix``, ``tcp``, ``tcp6``, ``udp``...) say what it is bound or
connected to, and the thread list says who else was running at the time.
"""

from __future__ import annotations

import os
import socket
import threading

__all__ = ["describe_fds", "open_fds"]

_TABLES = ("unix", "tcp", "tcp6", "udp", "udp6", "netlink")


def open_fds() -> set[int]:
    """This process's open descriptors (empty where /proc is missing)."""
    try:
        return {int(x) for x in os.listdir("/proc/self/fd")}
    except OSError:  # pragma: no cover - not Linux
        return set()


def describe_fds(fds: set[int]) -> list[str]:
    """One line per descriptor still open: its target, the socket-table row for a socket, and the threads."""
    lines = []
    for fd in sorted(fds):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue  # closed meanwhile: it was transient, not a leak
        line = f"fd {fd} -> {target}"
        if target.startswith("socket:["):
            line += f" [{_socket_row(target[8:-1])}; {_socket_ends(fd)}]"
        lines.append(line)
    if lines:
        lines.append("threads: " + ", ".join(sorted(t.name for t in threading.enumerate())))
    return lines


def _socket_row(inode: str) -> str:
    """The /proc/net row whose inode column is ``inode`` (with the table's name), or 'not in a table'."""
    for table in _TABLES:
        try:
            with open(f"/proc/net/{table}") as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()
            if inode in cols:
                return f"{table}: {' '.join(cols)}"
    return "not in a table"


def _socket_ends(fd: int) -> str:
    """Family, type and both ends of socket ``fd``, read through a duplicate (the original is untouched)."""
    try:
        dup = os.dup(fd)
    except OSError as exc:
        return f"unreadable: {exc}"
    try:
        with socket.socket(fileno=dup) as s:
            ends = []
            for name, get in (("local", s.getsockname), ("peer", s.getpeername)):
                try:
                    ends.append(f"{name} {get()!r}")
                except OSError as exc:
                    ends.append(f"{name} ({exc.strerror})")
            return f"{s.family.name} {s.type.name} " + " ".join(ends)
    except OSError as exc:
        os.close(dup)
        return f"unreadable: {exc}"
