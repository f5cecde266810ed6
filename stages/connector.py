"""The async-chunk data plane: stage k's worker streams chunks straight to stage k+1's.

Every replica of stage k+1 binds a PULL *inbox*; every replica of stage k
connects one PUSH socket per downstream replica (:class:`ChunkOutbox`) and
sends a request's chunks to the replica the orchestrator's pool bound that
request to (the ``downstream`` index carried by ``Submit``).  Chunks are
keyed by request id; they may arrive before the request's prewarm submit,
so the inbox buffers them (:class:`ChunkInbox`) until the worker claims them,
and forgets orphans after ``orphan_ttl`` seconds.  A resumable request's
chunks carry the input segment they belong to (``Chunk.segment``): one
request's chunks travel over one PUSH -> PULL pair, so they arrive in the
order they were produced, and the receiving worker starts a segment only
after the one before it finished there (see :mod:`stages.segments`).  The orchestrator sees only
the control outputs; it never touches the chunks.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from typing import Any

import zmq

from trio_orch.wire import Chunk, WireCodec, WireError

__all__ = ["ChunkInbox", "ChunkOutbox"]

log = logging.getLogger("stages.connector")


class ChunkInbox:
    """PULL side: receives chunks for this replica, buffers those not claimed yet."""

    def __init__(self, ctx: zmq.Context, address: str, *, orphan_ttl: float = 60.0) -> None:
        self.sock = ctx.socket(zmq.PULL)
        self.sock.linger = 0
        self.sock.bind(address)
        self.address = address
        self.orphan_ttl = orphan_ttl
        self.codec = WireCodec(Chunk)
        self.garbage = 0
        self.received = 0
        self._pending: OrderedDict[str, tuple[float, list[tuple[Any, bool, int]]]] = OrderedDict()
        self._gone: OrderedDict[str, None] = OrderedDict()  # recently ended ids: late chunks dropped

    def drain(self) -> list[Chunk]:
        """Receive until EAGAIN; return the chunks (garbage is logged and counted)."""
        out: list[Chunk] = []
        while True:
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return out
            try:
                out.append(self.codec.decode(frames))
                self.received += 1
            except WireError as exc:
                self.garbage += 1
                log.error("connector inbox %s: dropped a garbage message: %s", self.address, exc)

    def hold(self, chunk: Chunk) -> None:
        """Keep a chunk whose request has not been submitted here yet."""
        if chunk.request_id in self._gone:
            return
        entry = self._pending.get(chunk.request_id)
        if entry is None:
            entry = self._pending[chunk.request_id] = (time.monotonic(), [])
        entry[1].append((chunk.data, chunk.end, chunk.segment))

    def claim(self, request_id: str) -> list[tuple[Any, bool, int]]:
        """The buffered ``(data, end, segment)`` of a request that just arrived, in order.

        A reused id is live again.
        """
        self._gone.pop(request_id, None)
        entry = self._pending.pop(request_id, None)
        return entry[1] if entry else []

    def forget(self, request_id: str) -> None:
        """The request ended here: drop its buffered and later chunks."""
        self._pending.pop(request_id, None)
        self._gone[request_id] = None
        while len(self._gone) > 4096:
            self._gone.popitem(last=False)

    def purge(self) -> int:
        """Drop orphan buffers older than ``orphan_ttl``; return how many."""
        cutoff = time.monotonic() - self.orphan_ttl
        n = 0
        while self._pending:
            rid, (t, _) = next(iter(self._pending.items()))
            if t >= cutoff:
                break
            del self._pending[rid]
            n += 1
            log.warning("connector inbox %s: dropped orphan chunks of %r", self.address, rid)
        return n

    @property
    def pending(self) -> int:
        return len(self._pending)

    def close(self) -> None:
        self.sock.close(linger=0)


class ChunkOutbox:
    """PUSH side: one socket per replica of the next stage."""

    def __init__(self, ctx: zmq.Context, addresses: list[str]) -> None:
        self.codec = WireCodec(Chunk)
        self.socks = []
        for addr in addresses:
            s = ctx.socket(zmq.PUSH)
            s.linger = 200
            s.setsockopt(zmq.RECONNECT_IVL, 10)  # the inbox may bind after we connect: retry fast
            s.connect(addr)
            self.socks.append(s)
        self.sent = 0

    def send(self, replica: int, request_id: str, data: Any, end: bool, segment: int = 0) -> None:
        """Queue one chunk; raise ``zmq.Again`` rather than block when the replica's queue is full.

        Never blocking matters: a dead downstream replica must not hang this
        worker (and with it the heartbeats of every request it serves).
        """
        if not 0 <= replica < len(self.socks):
            raise ValueError(f"no downstream replica {replica} (have {len(self.socks)})")
        frames = self.codec.encode(Chunk(request_id, data, end, segment))
        self.socks[replica].send_multipart(frames, zmq.NOBLOCK, copy=False)
        self.sent += 1

    def close(self) -> None:
        for s in self.socks:
            s.close(linger=100)
