"""The server's handle on its acceptor process: spawn it, take over what it passes, share numbers.

The acceptor itself (what it does and why it is a process) is
:mod:`trio_orch.serve.acceptor`; the board and the decisions are
:mod:`trio_orch.serve.accept_gate`.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

from trio_orch.serve.accept_gate import DECODE, Board

__all__ = ["AcceptorProcess"]

_CHANNEL_TYPE = getattr(socket, "SOCK_SEQPACKET", socket.SOCK_DGRAM)


class AcceptorProcess:
    """The server's handle on one acceptor process for ``sock``.

    The board exists from the start, so that the server can publish its
    numbers before the process decides anything.  ``start()`` spawns the
    process; :meth:`received` (call it when :attr:`channel` is readable)
    returns the connections it passed over, with their decisions (a closed
    channel sets :attr:`lost`); the server writes its numbers with
    :meth:`publish` and collects the acceptor's counts with :meth:`counts`.
    ``stop()`` closes the channel and waits for the process (it may be
    started again); ``close()`` also frees the board.  Both are idempotent.
    ``nice``: added to the process's niceness.  10 gives it about a tenth of
    a core that a worker also wants; 19 starved it on a saturated core (a
    burst then took seconds to refuse, and connects waited).
    """

    def __init__(self, sock: socket.socket, *, paths: Sequence[str], response: bytes, header_timeout: float,
                 max_wait: float | None = None, nice: int = 10, retry_delay: float = 1.0,
                 max_waiting: int = 4096) -> None:
        self.sock = sock
        self.paths = sorted(paths)
        self.config: dict[str, Any] = {
            "paths": self.paths, "response": response.decode("latin-1"), "header_timeout": header_timeout,
            "max_wait": max_wait, "nice": nice, "retry_delay": retry_delay, "max_waiting": max_waiting,
            "log_level": logging.getLogger().getEffectiveLevel()}
        self.board: Board | None
        self.board, self._board_fd = Board.create(len(self.paths))
        self.channel: socket.socket | None = None
        self.proc: subprocess.Popen[bytes] | None = None
        self.lost = False  #: the channel closed without a stop: the process died
        self._folded = [0.0] * (Board.REFUSED + len(self.paths))

    def start(self) -> None:
        if self.proc is not None:
            raise RuntimeError("the acceptor is running")
        if self.board is None:
            raise RuntimeError("the acceptor was closed")
        mine, theirs = socket.socketpair(socket.AF_UNIX, _CHANNEL_TYPE)
        try:
            fds = {"listen": self.sock.fileno(), "channel": theirs.fileno(), "board": self._board_fd}
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "trio_orch.serve.acceptor", json.dumps({**self.config, **fds})],
                pass_fds=tuple(fds.values()), stdin=subprocess.DEVNULL)
        except BaseException:
            mine.close()
            raise
        finally:
            theirs.close()
        mine.setblocking(False)
        self.channel, self.lost = mine, False

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def received(self, limit: int = 256) -> list[tuple[socket.socket, str | None]]:
        """The connections passed over since the last call (up to ``limit``; never blocks)."""
        out: list[tuple[socket.socket, str | None]] = []
        chan = self.channel
        while chan is not None and len(out) < limit:
            try:
                msg, fds, _, _ = socket.recv_fds(chan, 16, 4)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                msg, fds = b"", []
            if not msg and not fds:
                self.lost = True
                break
            conns = [socket.socket(fileno=fd) for fd in fds]
            for conn in conns[1:]:  # one per message; more would be a bug: never leak them
                conn.close()
            if conns:
                out.append((conns[0], DECODE.get(msg[:1])))
        return out

    def acknowledge_held(self) -> None:
        """A "held" hand-over was counted into the server's ``HELD`` (write ``HELD`` first)."""
        if self.board is not None:
            self.board[Board.ACKED] += 1

    def publish(self, *, held: int | None = None, capacity: float | None = None,
                shedding: bool | None = None, last_refusal: float | None = None) -> None:
        b = self.board
        if b is None:
            return
        if held is not None:
            b[Board.HELD] = held
        if capacity is not None:
            b[Board.CAPACITY] = capacity
        if shedding is not None:
            b[Board.SHEDDING] = 1.0 if shedding else 0.0
        if last_refusal is not None:
            b[Board.LAST_REFUSAL] = last_refusal

    def counts(self) -> tuple[int, int, dict[str, int]]:
        """What the acceptor counted since the last call: (429s it answered, parked connections
        timed out, refusals by route)."""
        b = self.board
        if b is None:
            return 0, 0, {}
        delta = [0] * len(self._folded)
        for i in range(Board.ANSWERED, len(self._folded)):  # the acceptor's slots
            n = b[i]
            delta[i], self._folded[i] = int(n - self._folded[i]), n
        return (delta[Board.ANSWERED], delta[Board.TIMED_OUT],
                {p: delta[Board.REFUSED + i] for i, p in enumerate(self.paths) if delta[Board.REFUSED + i]})

    def stop(self, timeout: float = 5.0) -> None:
        """Close the channel (the process stops accepting, closes what it parked, exits) and wait."""
        if self.channel is not None:
            self.channel.close()
            self.channel = None
        proc, self.proc = self.proc, None
        if proc is not None:
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def close(self, timeout: float = 5.0) -> None:
        """Stop, then free the board (its counts are gone: fold them first)."""
        self.stop(timeout)
        if self.board is not None:
            self.board.close()
            self.board = None
            os.close(self._board_fd)
