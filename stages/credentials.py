"""One-time credentials for the processes a head launches, and how each one gets its own.

A head launches a process for a *slot* (a stage replica's control socket;
any process that must connect back to it and to no one else): only that
process may take the slot, and no other process of the same user can get
hold of what it is given.  Four pieces, none specific to workers:

1. **The launch ticket** (:class:`LaunchRegistry`): :meth:`LaunchRegistry.open`
   mints a random ticket for the next launch of a slot, which revokes the
   slot's previous one; :meth:`LaunchRegistry.bind` records the pid the head
   launched.  The ZAP handler (:class:`stages.auth.Authenticator`) lets a
   peer onto the slot's socket only by :func:`check_launch`: PLAIN user
   ``launch``, the slot's *current* ticket, and -- where the transport says
   who the peer is: ipc, whose ``SO_PEERCRED`` libzmq puts in the ZAP
   request's address -- the launched pid.  A ticket stolen from an earlier
   worker opens nothing, nor does the current one from any other process.
2. **The hand-over** (:class:`Handover`): the child is started with one end
   of a Unix socket pair (``--auth-fd N`` on its command line: a number,
   nothing secret).  Once the child has locked itself down
   (:func:`stages.lockdown.lock_down`) it sends a fresh socket of its own over
   that end (``SCM_RIGHTS``); the kernel stamps the message with the sender's
   pid (``SCM_CREDENTIALS``), and the head answers on the fresh socket -- the
   ticket and whatever else the child needs -- only if that pid is the one it
   launched, or that one's child (``lock_down(fresh=True)`` goes on in a
   forked child: from then on *it* is the launched process, the only pid the
   slot takes).  So nothing secret ever sits in the inherited socket (which,
   unlike a pipe, cannot be reopened through ``/proc/<pid>/fd/N`` either), and
   what is handed over goes to a process nobody else can read any more.
   :meth:`Handover.answer` serves an event loop, :meth:`Handover.serve`
   blocks (a Ray actor).
3. **The child's side**: :func:`receive_credentials` (after ``lock_down``).
4. **The peer of a message**: :func:`peer_pid` reads the pid out of libzmq's
   ipc peer address (ZAP's address frame, a message's ``Peer-Address``
   property), so a ``Ready`` is bound to the launched pid as well.

Linux has ``SO_PEERCRED`` and ``SCM_CREDENTIALS``; elsewhere the ticket alone
guards a slot (the first connection with it uses it up) and the hand-over
writes the credentials into the inherited socket at once.  This module
imports only the standard library (a worker imports it before anything else).
"""

from __future__ import annotations

import array
import hmac
import os
import secrets
import select
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

__all__ = ["LAUNCH_USER", "PID_CHECKED", "Handover", "HandoverError", "Launch", "LaunchRegistry",
           "Verdict", "check_launch", "parent_of", "peer_pid", "receive_credentials"]

#: the PLAIN user name a launched process connects with (its password: the launch's ticket)
LAUNCH_USER = b"launch"
#: can this platform tell a peer's pid (ipc peers, hand-over messages)?
PID_CHECKED = hasattr(socket, "SO_PASSCRED") and hasattr(socket, "SCM_CREDENTIALS")
_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


class HandoverError(RuntimeError):
    """The credentials could not be handed over (the message says why)."""


def peer_pid(address: bytes | str | None) -> int | None:
    """The pid in libzmq's address of an ipc peer (``localhost:UID:GID:PID``, from ``SO_PEERCRED``).

    None for any other transport (TCP: ``10.0.0.5``) or platform.
    """
    if not address:
        return None
    text = address.decode(errors="replace") if isinstance(address, bytes) else address
    parts = text.split(":")
    if len(parts) != 4 or not parts[0] or not all(p.isdigit() for p in parts[1:]):
        return None  # an IPv6 address has more colons, or empty groups
    return int(parts[3])


def parent_of(pid: int) -> int | None:
    """The parent of process ``pid`` (``/proc/<pid>/stat`` shows it for any process), None if gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


@dataclass
class Launch:
    """One launch of a slot: its ticket, the pid launched (once known), whether it was used."""

    slot: str  #: the ZAP domain of the socket the launched process connects to
    label: str  #: what the slot is called in logs ("stage 0 (thinker) replica 0")
    ticket: bytes = field(repr=False)
    pid: int | None = None
    used: bool = False  #: a connection passed with it (where no pid can be checked, it is then spent)


@dataclass(frozen=True)
class Verdict:
    """What :func:`check_launch` decided: ``ok``, else a short ``reason`` (a metric label) and ``why``."""

    ok: bool
    reason: str = ""
    why: str = ""


def check_launch(launch: Launch | None, user: bytes, password: bytes, address: bytes) -> Verdict:
    """May this peer take the slot of ``launch``?  Its current ticket, from the launched pid.

    Reasons: ``no_launch`` (nothing is launched for the slot now), ``stale_ticket`` (not this
    launch's ticket: an earlier worker's, a guess), ``stranger`` (the right ticket from a process
    that is not the launched one), ``spent`` (no pid to check and the ticket was used already).
    """
    if launch is None:
        return Verdict(False, "no_launch", "no process is being launched for this slot")
    if user != LAUNCH_USER or not hmac.compare_digest(password, launch.ticket):
        return Verdict(False, "stale_ticket", "not the ticket of this slot's launch (an earlier one's, or "
                                              "a guess)")
    pid = peer_pid(address)
    if pid is not None:
        if pid != launch.pid:
            return Verdict(False, "stranger", f"pid {pid} is not the process launched for it "
                                              f"(pid {launch.pid})")
    elif launch.used:
        return Verdict(False, "spent", "the launch's ticket was used by a connection already")
    launch.used = True
    return Verdict(True)


class LaunchRegistry:
    """The slots that take launched processes only, and each one's current launch.

    Thread-safe: the ZAP handler's thread asks, the head sets.  A slot is
    :meth:`guard`-ed when its socket binds and :meth:`forget`-ten when it closes;
    between launches it takes nobody.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._launches: dict[str, Launch | None] = {}

    def guard(self, slot: str) -> None:
        """Sockets of ``slot`` (a ZAP domain) take the processes launched for it, and no one else."""
        with self._lock:
            self._launches.setdefault(slot, None)

    def forget(self, slot: str) -> None:
        with self._lock:
            self._launches.pop(slot, None)

    def open(self, slot: str, label: str) -> Launch:
        """A fresh ticket for the next launch of ``slot`` (guarded from now on); revokes the earlier one."""
        launch = Launch(slot, label, secrets.token_hex(32).encode())
        with self._lock:
            self._launches[slot] = launch
        return launch

    def bind(self, launch: Launch, pid: int) -> None:
        """The process launched with ``launch`` is ``pid`` (only it may connect, where pids are known)."""
        with self._lock:
            launch.pid = pid

    def close(self, launch: Launch) -> None:
        """Revoke ``launch`` (its process is gone) unless a newer launch replaced it already."""
        with self._lock:
            if self._launches.get(launch.slot) is launch:
                self._launches[launch.slot] = None

    def __contains__(self, slot: str) -> bool:
        with self._lock:
            return slot in self._launches

    def current(self, slot: str) -> Launch | None:
        """The slot's launch now (None: none, or not a guarded slot)."""
        with self._lock:
            return self._launches.get(slot)

    def check(self, slot: str, user: bytes, password: bytes, address: bytes) -> tuple[Verdict, str]:
        """:func:`check_launch` on the slot's current launch; also the slot's label (for logs)."""
        with self._lock:
            launch = self._launches.get(slot)
            return check_launch(launch, user, password, address), launch.label if launch else slot


class Handover:
    """The head's end of a hand-over (see the module docstring); one per launch.

    Start the child with :attr:`child_fd` in its ``pass_fds`` (and ``--auth-fd``
    naming it), then call :meth:`child_started`; then :meth:`answer` each time
    :meth:`fileno` is readable until it returns True.  :meth:`close` always.
    """

    def __init__(self) -> None:
        kind = socket.SOCK_SEQPACKET if hasattr(socket, "SOCK_SEQPACKET") else socket.SOCK_STREAM
        self._sock, child = socket.socketpair(socket.AF_UNIX, kind)
        if PID_CHECKED:
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        self._sock.setblocking(False)
        self._child: socket.socket | None = child
        self.child_fd = child.fileno()

    def fileno(self) -> int:
        return self._sock.fileno()

    def child_started(self, payload: bytes) -> None:
        """The child runs with its end: close ours of it (its exit is then seen as the end of the socket).

        Without pid checks (not Linux) the payload goes into the socket now.
        """
        if self._child is not None:
            self._child.close()
            self._child = None
        if not PID_CHECKED:
            self._sock.setblocking(True)
            self._sock.sendall(payload)
            self._sock.setblocking(False)

    def answer(self, pid: int, payload: bytes,
               on_accept: Callable[[int], None] | None = None) -> tuple[bool, int | None]:
        """Serve one request: ``(True, asker)`` once ``payload`` went to process ``pid`` or to its child
        (a process that locked itself down in a fresh address space, :func:`stages.lockdown.lock_down`:
        the one that serves, and the only pid that may take the slot from then on); ``(False, other)``
        when any other process asked (refused: the caller reports it); ``(False, None)`` when nothing
        was there yet.  Raises :class:`HandoverError` when the child's end closed (it exited).
        ``on_accept(asker)`` runs before the payload is written: whoever checks pids must know the
        serving one before it can use what it is sent to connect.
        """
        if not PID_CHECKED:
            return True, pid  # delivered in child_started
        try:
            data, ancdata, _flags, _addr = self._sock.recvmsg(
                16, socket.CMSG_SPACE(_UCRED.size) + socket.CMSG_SPACE(4 * 4))
        except BlockingIOError:
            return False, None
        sender: int | None = None
        fds: list[int] = []
        for level, kind, body in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS:
                sender = _UCRED.unpack(body[:_UCRED.size])[0]
            elif level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.extend(array.array("i", body[: len(body) - len(body) % 4]))
        if not data and not ancdata:
            raise HandoverError("the launched process exited before it asked for its credentials")
        try:
            if sender is None or len(fds) != 1 or pid not in (sender, parent_of(sender)):
                return False, sender
            if on_accept is not None:
                on_accept(sender)
            with socket.socket(fileno=os.dup(fds[0])) as reply:
                reply.setblocking(True)
                reply.sendall(payload)
            return True, sender
        finally:
            for fd in fds:
                os.close(fd)

    def serve(self, pid: int, payload: bytes, timeout: float = 60.0,
              on_stranger: Callable[[int], None] | None = None) -> int:
        """Blocking :meth:`answer` until ``pid`` (or its fresh child) got ``payload``; the pid that got it.

        For a parent without an event loop (a Ray actor).  ``on_stranger(pid)`` for each refused
        asker.  Raises :class:`HandoverError` if the child exited first or nothing came in ``timeout``.
        """
        end = time.monotonic() + timeout
        while (left := end - time.monotonic()) > 0:
            select.select([self.fileno()], [], [], left)
            delivered, asker = self.answer(pid, payload)
            if delivered and asker is not None:
                return asker
            if asker is not None and on_stranger is not None:
                on_stranger(asker)
        raise HandoverError(f"process {pid} did not ask for its credentials within {timeout:g}s")

    def close(self) -> None:
        if self._child is not None:
            self._child.close()
            self._child = None
        self._sock.close()


def receive_credentials(fd: int, timeout: float = 60.0) -> bytes:
    """The child's side of a hand-over: ask over the inherited socket ``fd``, return what the head sends.

    Call it after :func:`stages.lockdown.lock_down`: the head answers on a socket made
    here and now, so whoever might have copied ``fd`` before gets nothing.  Closes ``fd``.
    Raises :class:`HandoverError` if the head does not answer (it refused us, or is gone).
    """
    with socket.socket(fileno=fd) as inherited:
        inherited.setblocking(True)
        if not PID_CHECKED:  # the head wrote the credentials into the socket itself
            inherited.settimeout(timeout)
            return _read_all(inherited, "the inherited socket")
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        with mine:
            try:
                creds = _UCRED.pack(os.getpid(), os.getuid(), os.getgid())
                inherited.sendmsg([b"?"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                                            array.array("i", [theirs.fileno()])),
                                           (socket.SOL_SOCKET, socket.SCM_CREDENTIALS, creds)])
            except OSError as exc:
                raise HandoverError(f"cannot ask the launcher for credentials over fd {fd}: {exc}") from None
            finally:
                theirs.close()
            mine.settimeout(timeout)
            return _read_all(mine, "the launcher")


def _read_all(sock: socket.socket, who: str) -> bytes:
    chunks: list[bytes] = []
    try:
        while data := sock.recv(65536):
            chunks.append(data)
    except TimeoutError:
        raise HandoverError(f"{who} sent no credentials in time") from None
    if not chunks:
        raise HandoverError(f"{who} sent no credentials (it refused this process, or it is gone)")
    return b"".join(chunks)
