"""What the acceptor process decides with: the request-line rules, the board it shares with the server.

All of it is free of I/O but for :func:`waited` (one ``getsockopt``) and
the board's mapping, so the decisions are unit-testable as they are.  The
server (:mod:`trio_orch.serve.acceptor_process`) and the acceptor process
(:mod:`trio_orch.serve.acceptor`) both import it; it imports nothing of the
package (the acceptor process stays small).
"""

from __future__ import annotations

import contextlib
import math
import mmap
import os
import socket
import struct
import tempfile
import time
from collections.abc import Sequence

__all__ = ["DECISIONS", "DECODE", "Board", "Gate", "refuses", "request_complete", "shed_route", "waited"]

#: a connection's decision on the Unix socket, one byte: let through and counted ("held"), to
#: be answered 429 ("shed"), for the server to decide at its request line (None), or that too
#: but nothing was sent yet ("silent": an idle connection, which the server's limits may close)
DECISIONS: dict[str | None, bytes] = {None: b"-", "held": b"h", "shed": b"s", "silent": b"0"}
DECODE = {v: k for k, v in DECISIONS.items()}


def request_complete(data: bytes) -> bool:
    """Whether ``data`` holds a whole HTTP/1.1 request with a ``Content-Length`` body (or none)."""
    end = data.find(b"\r\n\r\n")
    if end < 0:
        return False
    head = data[:end].lower()
    if b"\r\ntransfer-encoding:" in head:
        return False
    at = head.find(b"\r\ncontent-length:")
    if at < 0:
        return len(data) >= end + 4
    stop = head.find(b"\r\n", at + 17)
    value = head[at + 17:stop if stop >= 0 else len(head)].strip()
    if not value.isdigit():
        return False
    return len(data) >= end + 4 + int(value)


def shed_route(data: bytes, paths: frozenset[str]) -> str | None:
    """The route of ``data``'s request line if it is a POST to one of ``paths`` (which load sheds).

    Only the request line is looked at (``POST /path``): no headers parsed,
    no body read.  None: another request, or the line is not complete yet.
    """
    if not data.startswith(b"POST "):
        return None
    end = data.find(b" ", 5)
    if end < 0:
        return None
    route = data[5:end].split(b"?", 1)[0].decode("latin-1")
    return route if route in paths else None


def waited(conn: socket.socket) -> float:
    """Seconds since the last bytes of ``conn`` arrived (Linux ``TCP_INFO``; 0.0 where unknown).

    For a request read at once, how long it waited in the server's queues
    before anybody looked at it.
    """
    try:
        info = conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 104)
    except (AttributeError, OSError):
        return 0.0
    if len(info) < 56:
        return 0.0
    return struct.unpack_from("I", info, 52)[0] / 1000  # tcpi_last_data_recv, in ms


class Board:
    """Numbers shared by the server and its acceptor process (a mapped file; one writer per slot).

    Slots, by who writes them -- the server: ``HELD`` (requests to a shed
    path it let through and has not answered), ``ACKED`` (how many of the
    acceptor's "held" hand-overs it has counted into ``HELD``), ``CAPACITY``,
    ``SHEDDING`` (1.0 while the engine sheds), ``LAST_REFUSAL`` (its own,
    ``time.monotonic()``); the acceptor: ``ANSWERED`` (429s it sent itself),
    ``TIMED_OUT`` (parked connections closed at the header timeout), and one
    ``REFUSED`` count per shed path.  Aligned 8-byte slots: a reader sees
    a whole old or new value.
    """

    HELD, ACKED, CAPACITY, SHEDDING, LAST_REFUSAL, ANSWERED, TIMED_OUT, REFUSED = range(8)

    def __init__(self, fd: int, paths: int) -> None:
        self.size = 8 * (self.REFUSED + paths)
        self._map = mmap.mmap(fd, self.size)
        self.slots = memoryview(self._map).cast("d")

    @classmethod
    def create(cls, paths: int) -> tuple[Board, int]:
        """A new board (all zero, ``CAPACITY`` unbounded) and the descriptor a child maps it by."""
        with tempfile.TemporaryFile() as f:  # unlinked: nothing is left on disk
            fd = os.dup(f.fileno())
        os.ftruncate(fd, 8 * (cls.REFUSED + paths))
        board = cls(fd, paths)
        board.slots[cls.CAPACITY] = math.inf
        board.slots[cls.LAST_REFUSAL] = -math.inf
        return board, fd

    def __getitem__(self, slot: int) -> float:
        return self.slots[slot]

    def __setitem__(self, slot: int, value: float) -> None:
        self.slots[slot] = value

    def close(self) -> None:
        with contextlib.suppress(BufferError):
            self.slots.release()
            self._map.close()


class Gate:
    """The acceptor's admission view: the server's numbers on the board, plus its own hand-overs.

    ``pending`` = the server's ``HELD`` + the "held" hand-overs the server has
    not counted yet; a request to a shed path is refused once the engine
    sheds or ``pending`` reaches the capacity (the same rule as the server's
    :class:`~trio_orch.http.limits.Shedder`, :func:`refuses`).
    """

    def __init__(self, board: Board, paths: Sequence[str], response: bytes, header_timeout: float) -> None:
        self.board = board
        self.paths = frozenset(paths)
        self.slot = {p: Board.REFUSED + i for i, p in enumerate(paths)}
        self.response = response
        self.header_timeout = header_timeout
        self.handed_held = board[Board.ACKED]  # a restarted acceptor: what its forerunner passed is counted
        self.last_refusal = -math.inf

    def pending(self) -> float:
        b = self.board
        return b[Board.HELD] + self.handed_held - b[Board.ACKED]

    def full(self) -> bool:
        """Whether a request to a shed path would be refused now."""
        b = self.board
        return refuses(b[Board.SHEDDING] > 0, self.pending(), b[Board.CAPACITY])

    def flooded(self, window: float = 1.0) -> bool:
        """Full now, or a request was refused (here or by the server) within the last ``window`` s."""
        last = max(self.last_refusal, self.board[Board.LAST_REFUSAL])
        return self.full() or time.monotonic() - last < window

    def line_decision(self, data: bytes, shed: bool = False) -> str | None:
        """``"shed"`` (answer 429), ``"held"`` (a request to a shed path let through), or None
        (another request, or its line is incomplete: the server decides).  ``shed``: refuse it
        regardless (it waited too long during a flood)."""
        route = shed_route(data, self.paths)
        if route is None:
            return None
        if shed or self.full():
            self.last_refusal = time.monotonic()
            self.board[self.slot[route]] += 1
            return "shed"
        self.handed_held += 1
        return "held"

    def count(self, slot: int) -> None:
        self.board[slot] += 1


def refuses(shedding: bool, pending: float, capacity: float) -> bool:
    """The shed rule: refuse while the engine sheds, or once ``pending`` requests fill its capacity."""
    return shedding or pending >= capacity
