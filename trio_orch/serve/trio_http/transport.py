"""One accepted socket: reads and writes that yield to the scheduler only when they have to wait.

A write goes straight to the non-blocking socket (``os.write``); only when
the kernel's buffer is full does it wait for room
(:func:`trio.lowlevel.wait_writable`), so a slow reader holds the app's
``send`` back and a fast one costs no schedule point per chunk -- what
asyncio's ``transport.write`` gives uvicorn.  Writers queue in order behind
one that waits.  A peer that went away makes the transport ``broken``: writes
are then dropped (the connection's task notices and ends), never raised into
the app's ``send``.  A read likewise takes what the kernel has without a
schedule point (every 16th such read in a row still yields, for fairness).
"""

from __future__ import annotations

import os
import socket

import trio

from trio_orch.serve.framing import LINGER_BYTES, LINGER_SECONDS

__all__ = ["Transport"]

#: reads in a row that may find bytes waiting before one yields to the other tasks
READS_WITHOUT_WAIT = 16


class Transport:
    """Reads, writes and the close of one connection's socket."""

    __slots__ = ("broken", "closed", "fd", "lock", "ready_reads", "sock")

    def __init__(self, sock: trio.socket.SocketType) -> None:
        self.sock = sock
        self.fd = sock.fileno()
        self.lock = trio.Lock()  #: held by a write that waits for room; later writes queue behind it
        self.broken = False  #: the peer is gone (a write or read failed)
        self.ready_reads = 0  #: reads in a row that found bytes waiting (no schedule point)
        self.closed = False

    async def recv(self, size: int = 65536) -> bytes:
        """The next bytes from the client; ``b""`` once it closed its side or the connection broke.

        Always a cancel point; a schedule point only when it waits for bytes,
        or after :data:`READS_WITHOUT_WAIT` reads in a row that did not (a
        client that keeps the socket full cannot hold the loop).  Trio's
        ``socket.recv`` yields after every read that succeeds at once: one
        task switch per read for nothing.
        """
        if self.closed:
            return b""
        try:
            if self.ready_reads >= READS_WITHOUT_WAIT:
                self.ready_reads = 0
                await trio.lowlevel.checkpoint()
            else:
                await trio.lowlevel.checkpoint_if_cancelled()
            while True:
                try:
                    data = os.read(self.fd, size)
                except BlockingIOError:
                    self.ready_reads = 0
                    await trio.lowlevel.wait_readable(self.sock)
                    continue
                self.ready_reads += 1
                return data
        except (OSError, trio.ClosedResourceError):
            self.broken = True
            return b""

    async def write(self, data: bytes) -> None:
        """Write all of ``data``; a checkpoint only if the kernel cannot take it at once."""
        if self.broken or self.closed or not data:
            return
        view = memoryview(data)
        if not self.lock.locked():
            try:
                sent = os.write(self.fd, view)
            except BlockingIOError:
                sent = 0
            except OSError:
                self.broken = True
                return
            if sent == len(view):
                return
            view = view[sent:]
            self.lock.acquire_nowait()  # no await since the check: nothing wrote in between
        else:
            await self.lock.acquire()
        try:
            await self._write_rest(view)
        finally:
            self.lock.release()

    async def _write_rest(self, view: memoryview) -> None:
        try:
            while view and not (self.broken or self.closed):
                try:
                    view = view[os.write(self.fd, view):]
                except BlockingIOError:
                    await trio.lowlevel.wait_writable(self.sock)
        except (OSError, trio.ClosedResourceError):
            self.broken = True
        except BaseException:
            self.broken = True  # cancelled mid-write: what follows would be garbage on the wire
            raise

    def pending(self) -> bool:
        """Whether the client's bytes wait unread in the kernel (a peek on a duplicate of the socket)."""
        if self.closed or self.broken:
            return False
        try:
            with socket.fromfd(self.fd, self.sock.family, socket.SOCK_STREAM) as dup:
                return bool(dup.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT))
        except OSError:  # BlockingIOError: nothing waiting
            return False

    def write_nowait(self, data: bytes) -> None:
        """One try to write ``data`` without waiting (a last word on a connection being cancelled)."""
        if self.broken or self.closed or self.lock.locked():
            return
        try:
            os.write(self.fd, data)
        except OSError:
            self.broken = True

    async def close(self, *, linger: bool = True) -> None:
        """Close the connection; ``linger``: first end our side and drop the client's input for a moment.

        Closing a socket with unread input makes the kernel reset the
        connection, and the client could lose the answer it had not read
        yet.  Bounded (:data:`LINGER_SECONDS`, :data:`LINGER_BYTES`).
        """
        if self.closed:
            return
        try:
            if linger and not self.broken:
                try:
                    self.sock.shutdown(socket.SHUT_WR)
                except OSError:
                    return  # not connected any more: nothing to linger for
                with trio.move_on_after(LINGER_SECONDS):
                    dropped = 0
                    while dropped < LINGER_BYTES and (data := await self.recv()):
                        dropped += len(data)
        finally:
            self.abort()

    def abort(self) -> None:
        """Close the socket now (synchronous: safe in a ``finally`` under a cancel)."""
        if not self.closed:
            self.closed = True
            self.sock.close()
