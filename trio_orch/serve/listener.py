"""Closing the listening socket at the end of a drain without resetting the connections queued on it.

When a server stops accepting and closes its listening socket, the kernel
resets every connection still in the socket's accept queue: clients that
connected a moment before the close get a reset instead of an answer.  So
each front keeps a duplicate of the listening socket (:func:`spare`) while
its server closes its own; then :func:`close_spare` accepts what is still
queued, answers each with the drain's 503 (``draining``, ``Connection:
close``), and closes the duplicate -- from then on a new connection is
refused by the kernel.  Bounded: at most ``budget`` seconds and
``max_answers`` connections; what is left after that is reset as before, and
so is a connection that completes its handshake in the instant between the
last look at the queue and the close (the kernel's race, not closable here).
"""

from __future__ import annotations

import contextlib
import socket
import time

from trio_orch.http.limits import LimitsMiddleware, json_response

__all__ = ["close_spare", "draining_answer", "spare"]


def draining_answer() -> bytes:
    """The raw HTTP/1.1 answer the middleware gives new work while draining."""
    refusal = LimitsMiddleware.DRAINING
    headers, body = json_response(refusal.status, refusal.body(), refusal.headers)
    head = [b"HTTP/1.1 503 Service Unavailable"] + [k + b": " + v for k, v in headers]
    return b"\r\n".join(head) + b"\r\n\r\n" + body


def spare(sock: socket.socket) -> socket.socket:
    """A duplicate of the listening ``sock``: it keeps the listener open while the server closes ``sock``."""
    return sock.dup()


def close_spare(listener: socket.socket, *, budget: float = 0.25, max_answers: int = 4096,
                read_timeout: float = 0.5) -> int:
    """Answer every connection queued on ``listener`` with 503 ``draining``, then close it.

    Blocking (run it in a thread).  Returns how many were answered.  Each
    connection's request head is read (and dropped) first and its close is
    lingering: closing a socket with unread input would reset it too.
    """
    answer = draining_answer()
    end = time.monotonic() + budget
    answered = 0
    try:
        listener.setblocking(False)
        while answered < max_answers and time.monotonic() < end:
            try:
                conn, _ = listener.accept()
            except (BlockingIOError, InterruptedError):
                break  # nothing queued any more
            except OSError:
                break
            with conn:
                conn.settimeout(read_timeout)
                with contextlib.suppress(OSError):
                    conn.recv(65536)  # the request head, if it came already
                with contextlib.suppress(OSError):
                    conn.sendall(answer)
                    conn.shutdown(socket.SHUT_WR)
                    while conn.recv(65536):  # until the client closes (or the timeout): no reset
                        pass
            answered += 1
    finally:
        listener.close()
    return answered
