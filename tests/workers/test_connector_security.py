"""The async-chunk links check who listens: real ZMQ sockets on ipc, a raw Unix listener as the stranger.

A stranger that binds an inbox's path and answers like a ZMQ peer gets no
credential and no chunk (CurveZMQ: nothing secret goes first, the listener
must prove its key); libzmq then gives up on the endpoint for good, and the
outbox connects afresh at the next chunk, so the real inbox that binds the
path afterwards gets it.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import zmq

from stages.auth import Authenticator, Keypair, Security
from stages.connector import ChunkInbox, ChunkOutbox
from tests.waiting import HANG, wait_until

#: a ZMTP 3.0 greeting from a server that offers the NULL mechanism (64 bytes)
NULL_GREETING = (b"\xff" + b"\x00" * 8 + b"\x7f" + b"\x03\x00"  # signature, version 3.0
                 + b"NULL".ljust(20, b"\x00") + b"\x01" + b"\x00" * 31)  # mechanism, as-server, filler


class RawStranger:
    """A Unix listener that greets every connection as a ZMQ server offering NULL, keeps it open, and
    records everything it is sent."""

    def __init__(self, path: Path) -> None:
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(str(path))
        self.listener.listen(8)
        self.received: list[bytes] = []
        self.closed_by_peer = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        self.listener.settimeout(0.05)
        while not self._stop.is_set():
            try:
                conn, _ = self.listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with conn:
                conn.sendall(NULL_GREETING)
                conn.settimeout(0.05)
                data = b""
                while not self._stop.is_set():
                    try:
                        chunk = conn.recv(65536)
                    except TimeoutError:
                        continue
                    if not chunk:
                        self.closed_by_peer += 1
                        break
                    data += chunk
                self.received.append(data)

    def close(self) -> None:
        self._stop.set()
        self.listener.close()
        self._thread.join(HANG)


def test_a_stranger_at_an_inbox_path_gets_nothing_and_the_real_inbox_gets_the_chunk_after_it(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="stages.connector")
    keys = Keypair.generate()
    security = Security(b"a-pipeline-secret", keys, server_key=keys.public)
    path = tmp_path / "in-s1r0"
    address = f"ipc://{path}"
    ctx = zmq.Context()
    stranger = RawStranger(path)
    outbox = inbox = None
    try:
        with Authenticator(ctx, security.secret) as auth:
            auth.allow([keys.public])
            outbox = ChunkOutbox(ctx, [address], security=security)
            # the outbox knocked, read a greeting that is not the inbox's, and hung up for good
            wait_until(lambda: stranger.closed_by_peer >= 1, "the outbox hung up on the stranger", hang=HANG)
            path.unlink()  # the real inbox takes the path (libzmq would replace the file anyway)
            inbox = ChunkInbox(ctx, address, security=security, authenticator=auth)
            outbox.send(0, "r1", np.arange(4, dtype=np.int32), True)  # found no peer: connected afresh
            got = []
            end = time.monotonic() + HANG
            while not got and time.monotonic() < end:
                if inbox.sock.poll(100):
                    got += inbox.drain()
            assert [(c.request_id, list(c.data), c.end) for c in got] == [("r1", [0, 1, 2, 3], True)]
            assert outbox.refused == {0: 1} and outbox.describe()[0]["refused"] == 1
            assert outbox.describe()[0]["mechanism"] == "CURVE"
    finally:
        stranger.close()
        for s in (outbox, inbox):
            if s is not None:
                s.close()
        ctx.term()
    # all the stranger ever got: (part of) a greeting -- no password, no key, no chunk
    assert stranger.received and all(len(d) <= 64 and d[:1] in (b"", b"\xff") for d in stranger.received)
    assert all(security.secret not in d and keys.public not in d for d in stranger.received)
    warnings = [r.getMessage() for r in caplog.records]
    assert any(address in w and "failed the CurveZMQ handshake" in w for w in warnings), warnings
