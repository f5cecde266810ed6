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
line.  The child takes a process group of its own, so that a signal to the
stand-in's group (``kill -- -PGID``, ``timeout``, a service manager) reaches
it once, passed on, not twice -- except in the foreground of a terminal: there
the child stays in the stand-in's group, so that it may read the terminal and
Ctrl-Z stops both, and the stand-in passes on no signal the terminal sent
(Ctrl-C reached the child already).  The child dies with its stand-in
(``PR_SET_PDEATHSIG``); :func:`serving_pid` finds it from the stand-in's pid
(what a benchmark measures, what a test signals directly).  ``trio-orch``
(every command, ``serve`` first) and the workers do this before anything
else; a second ``lock_down(fresh=True)`` in the child forks no more.  A
tracer that attached in the window would keep its access too, so
:func:`lock_down` refuses to go on under a tracer that is not one of the
process's ancestors (``strace -f`` or a debugger that started the program may
trace it: they could read everything anyway).  Elsewhere than Linux it does
nothing.

This module imports only the standard library: it runs before anything else.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import warnings
from typing import NoReturn

__all__ = ["STAND_IN_SIGNALS", "LockdownError", "dumpable", "lock_down", "not_dumpable", "serving_pid",
           "tracer"]

_PR_SET_PDEATHSIG = 1
_PR_GET_DUMPABLE = 3
_PR_SET_DUMPABLE = 4
#: what a stand-in passes on to the process it stands in for
STAND_IN_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1,
                    signal.SIGUSR2)
#: ``si_code`` of a signal the kernel sent (a terminal's Ctrl-C, Ctrl-\, hang-up): Linux's ``SI_KERNEL``
_SI_KERNEL = 0x80
#: this process is a stand-in's fresh child (or a copy of one): ``lock_down(fresh=True)`` forks no more
_fresh = False


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
    module docstring); this call returns in the child only (at once where this process is such a child
    already).  Call it first, before the process holds a secret or starts a thread of its own.  A no-op
    elsewhere than Linux.
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
    if fresh and not _fresh:
        _fork_fresh()


def serving_pid(pid: int) -> int:
    """The process that does the work of ``pid``: its fresh child if ``pid`` is a stand-in, else ``pid``.

    A stand-in's child is the one child with its command line (a fork).  Before the fork (or on a
    process that never forks) it is ``pid`` itself.
    """
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read()
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            children = [int(c) for c in f.read().split()]
    except (OSError, ValueError):
        return pid
    same = []
    for child in children:
        try:
            with open(f"/proc/{child}/cmdline", "rb") as f:
                if f.read() == cmdline:
                    same.append(child)
        except OSError:
            continue
    return same[0] if len(same) == 1 else pid


def _terminal_foreground() -> bool:
    """Is this process's group the foreground group of its controlling terminal (Ctrl-C reaches it)?"""
    try:
        fd = os.open("/dev/tty", os.O_RDONLY | os.O_NOCTTY)
    except OSError:  # no controlling terminal
        return False
    try:
        return os.tcgetpgrp(fd) == os.getpgrp()
    except OSError:
        return False
    finally:
        os.close(fd)


def _fork_fresh() -> None:
    """Fork: return in the child; the parent becomes its stand-in and never returns."""
    global _fresh
    stand_in, parent = os.getpid(), os.getppid()
    same_group = _terminal_foreground()
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, STAND_IN_SIGNALS)  # none is lost around the fork
    # a SIGCHLD ignored by whoever launched us would have the kernel reap the child behind the stand-in's
    # back (its waitpid then fails): the stand-in takes the default, the child gets the launcher's back
    launcher_chld = signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    try:
        with warnings.catch_warnings():  # an idle pool of a library (OpenBLAS's) is fork-safe
            warnings.simplefilter("ignore", DeprecationWarning)
            child = os.fork()
    except OSError:
        signal.signal(signal.SIGCHLD, launcher_chld if launcher_chld is not None else signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        raise
    if child == 0:
        _fresh = True
        signal.signal(signal.SIGCHLD, launcher_chld if launcher_chld is not None else signal.SIG_DFL)
        _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)  # the stand-in killed: so are we (as if we were it)
        if not same_group:
            with contextlib.suppress(OSError):  # a group of its own: a signal to the stand-in's group
                os.setpgid(0, 0)                # reaches it once, passed on, not twice
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        if os.getppid() != stand_in:  # it died before the line above
            os._exit(1)
        return
    _stand_in(child, parent, same_group)


def _stand_in(child: int, parent: int, same_group: bool) -> NoReturn:
    """Pass signals on to ``child``, SIGHUP it once ``parent`` is gone, and end as it ends.

    ``same_group``: the child shares this process's group in a terminal's foreground, so a signal the
    terminal sent (``SI_KERNEL``: Ctrl-C, Ctrl-\\, a hang-up) reached it already and is not passed on.
    """
    def forward(signum: int) -> None:
        try:
            os.kill(child, signum)
        except ProcessLookupError:
            pass

    waited = (*STAND_IN_SIGNALS, signal.SIGCHLD)  # taken one by one, with who sent them; SIGCHLD wakes us
    signal.pthread_sigmask(signal.SIG_BLOCK, waited)
    told = False
    while True:
        done, status = os.waitpid(child, os.WNOHANG)
        if done:
            break
        if not told and os.getppid() != parent:  # our parent is gone: the child's is, as far as it knows
            told = True
            forward(signal.SIGHUP)
        info = signal.sigtimedwait(waited, 0.5)
        if info is None or info.si_signo == signal.SIGCHLD:
            continue
        if not (same_group and info.si_code == _SI_KERNEL):
            forward(info.si_signo)
    if os.WIFSIGNALED(status):  # die the same way: whoever waits for us sees what happened to it
        sig = os.WTERMSIG(status)
        if sig not in (signal.SIGKILL, signal.SIGSTOP):  # those two take no handler and no mask
            signal.signal(sig, signal.SIG_DFL)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, [sig])
        os.kill(os.getpid(), sig)
    os._exit(os.waitstatus_to_exitcode(status) & 0xFF)
