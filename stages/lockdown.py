"""Close a process that holds secrets to the other processes of its user: what every process of a pipeline
does first.

A process of the same user, without extra capabilities, may read another's
``/proc/<pid>/environ``, open its ``/proc/<pid>/fd/N``, read its
``/proc/<pid>/mem``, ptrace it or copy its file descriptors (``pidfd_getfd``)
-- as long as that process is *dumpable*.  :func:`lock_down` makes it
non-dumpable (Linux ``PR_SET_DUMPABLE`` 0): from then on only a process with
``CAP_SYS_PTRACE`` (root, as a rule) can do any of that, and a crash leaves
no core file with a secret in it.

A process is dumpable from ``exec`` until that call, and what another process
opened meanwhile stays open: a ``/proc/<pid>/mem`` opened in that window
reads the process's memory for as long as it lives, secrets it gets later
included.  Hence ``lock_down(fresh=True)``: once locked, the process forks and
goes on in the child -- a new address space, non-dumpable from its first
instant, that nobody can have opened -- while the parent stays behind as its
stand-in (:func:`_stand_in`): it passes signals on, tells the child when its
own parent is gone (SIGHUP), and exits as the child does, so whoever started
the process sees no difference but one more process with the same command
line (in a process group of its own, so that a signal to the group reaches it
once).  The child dies with its stand-in (``PR_SET_PDEATHSIG``).  Workers do
this before anything else; a tracer that attached in the window would keep
its access too, so :func:`lock_down` refuses to go on under a tracer that is
not one of the process's ancestors (``strace -f`` or a debugger that started
the program may trace it: they could read everything anyway).  Elsewhere
than Linux it does nothing.

This module imports only the standard library: it runs before anything else.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import select
import signal
import sys
import time
import warnings
from typing import Any, NoReturn

__all__ = ["STAND_IN_SIGNALS", "LockdownError", "dumpable", "lock_down", "not_dumpable", "tracer"]

_PR_SET_PDEATHSIG = 1
_PR_GET_DUMPABLE = 3
_PR_SET_DUMPABLE = 4
#: what a stand-in passes on to the process it stands in for
STAND_IN_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1,
                    signal.SIGUSR2)


class LockdownError(RuntimeError):
    """The process could not be closed to the other processes of its user (the message says why)."""


def _prctl(option: int, arg: int = 0) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    return int(libc.prctl(option, arg, 0, 0, 0))


def not_dumpable() -> bool:
    """Make this process non-dumpable (``PR_SET_DUMPABLE`` 0); True if it took (Linux), else False."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        return _prctl(_PR_SET_DUMPABLE, 0) == 0 and _prctl(_PR_GET_DUMPABLE) == 0
    except (OSError, AttributeError):
        return False


def dumpable() -> bool | None:
    """Is this process dumpable (None: not Linux, nobody knows)?"""
    if not sys.platform.startswith("linux"):
        return None
    return _prctl(_PR_GET_DUMPABLE) != 0


def _status_field(pid: int | str, name: str) -> str | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(name + ":"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        return None
    return None


def _ancestors() -> set[int]:
    out: set[int] = set()
    pid = os.getppid()
    while pid > 0 and pid not in out:
        out.add(pid)
        ppid = _status_field(pid, "PPid")
        pid = int(ppid) if ppid and ppid.isdigit() else 0
    return out


def tracer() -> int | None:
    """The pid tracing this process, unless it is one of its ancestors (then None, as with no tracer)."""
    traced = _status_field("self", "TracerPid")
    pid = int(traced) if traced and traced.isdigit() else 0
    if pid == 0 or pid in _ancestors():
        return None
    return pid


def lock_down(*, fresh: bool = False) -> None:
    """Make this process non-dumpable and check that no stranger traces it; LockdownError if either fails.

    ``fresh``: then go on in a forked child, with an address space nobody could open before (see the
    module docstring); this call returns in the child only.  Call it first, before the process holds a
    secret or starts a thread of its own.  A no-op elsewhere than Linux.
    """
    if not sys.platform.startswith("linux"):
        return
    if not not_dumpable():
        raise LockdownError("cannot make this process non-dumpable (prctl PR_SET_DUMPABLE failed): "
                            "other processes of this user could read its secrets")
    pid = tracer()
    if pid is not None:
        raise LockdownError(f"process {pid}, not one of this process's ancestors, traces it (it attached "
                            "before the process was locked down): refusing to handle secrets")
    if fresh:
        _fork_fresh()


def _fork_fresh() -> None:
    """Fork: return in the child; the parent becomes its stand-in and never returns."""
    stand_in, parent = os.getpid(), os.getppid()
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, STAND_IN_SIGNALS)  # none is lost around the fork
    try:
        with warnings.catch_warnings():  # an idle pool of a library (OpenBLAS's) is fork-safe
            warnings.simplefilter("ignore", DeprecationWarning)
            child = os.fork()
    except OSError:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        raise
    if child == 0:
        _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)  # the stand-in killed: so are we (as if we were it)
        with contextlib.suppress(OSError):  # a group of its own: a signal to the stand-in's group (Ctrl-C,
            os.setpgid(0, 0)                # kill -- -PGID) reaches it once, passed on, not twice
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        if os.getppid() != stand_in:  # it died before the line above
            os._exit(1)
        return
    _stand_in(child, parent, blocked)


def _stand_in(child: int, parent: int, blocked: Any) -> NoReturn:
    """Pass signals on to ``child``, SIGHUP it once ``parent`` is gone, and end as it ends."""
    def forward(signum: int, frame: Any) -> None:
        try:
            os.kill(child, signum)
        except ProcessLookupError:
            pass

    for sig in STAND_IN_SIGNALS:
        signal.signal(sig, forward)
    signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
    pidfd = os.pidfd_open(child) if hasattr(os, "pidfd_open") else None
    told = False
    while True:
        done, status = os.waitpid(child, os.WNOHANG)
        if done:
            break
        if not told and os.getppid() != parent:  # our parent is gone: the child's is, as far as it knows
            told = True
            forward(signal.SIGHUP, None)
        if pidfd is not None:
            select.select([pidfd], [], [], 0.5)
        else:
            time.sleep(0.1)
    if os.WIFSIGNALED(status):  # die the same way: whoever waits for us sees what happened to it
        sig = os.WTERMSIG(status)
        if sig not in (signal.SIGKILL, signal.SIGSTOP):  # those two take no handler and no mask
            signal.signal(sig, signal.SIG_DFL)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, [sig])
        os.kill(os.getpid(), sig)
    os._exit(os.waitstatus_to_exitcode(status) & 0xFF)
