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

Every link is CurveZMQ, on ipc too: the upstream sends a chunk only to an
inbox that proved it holds the key it was told of (:meth:`stages.auth.Security.server`,
``curve``), never to a process that bound a dead inbox's path in its place.
libzmq gives up on an endpoint whose listener failed the handshake that way
(no reconnection): the outbox notices it at its next chunk for that slot
(each socket's monitor), says so (a WARNING, ``refused`` in the stats) and
connects afresh, so the replacement that binds the path next gets its chunks.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from typing import Any

import zmq
import zmq.utils.monitor as zmq_monitor

from stages.auth import DOMAIN, Authenticator, Security
from stages.wire import Chunk, WireCodec, WireError

__all__ = ["ChunkInbox", "ChunkOutbox"]

log = logging.getLogger("stages.connector")

#: ZAP domain of the inboxes: only the pipeline's key and those the head named as upstream replicas pass
INBOX_DOMAIN = f"{DOMAIN}:inbox"
#: handshake failures after which libzmq never reconnects (the listener did not prove it holds the key)
_GIVEN_UP = zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH


class ChunkInbox:
    """PULL side: receives chunks for this replica, buffers those not claimed yet."""

    def __init__(self, ctx: zmq.Context, address: str | None, *, orphan_ttl: float = 60.0,
                 security: Security | None = None, authenticator: Authenticator | None = None,
                 tcp: str | None = None) -> None:
        self.sock = ctx.socket(zmq.PULL)
        self.sock.linger = 0
        #: the TCP endpoint (``tcp``, bound on top of the ipc one, for upstream replicas on other hosts)
        self.tcp_address: str | None = None
        for addr in (address, tcp):
            if addr is None:
                continue
            if security is not None:
                security.server(self.sock, addr, domain=INBOX_DOMAIN, curve=True)
            self.sock.bind(addr)
            if addr.startswith("tcp://"):
                self.tcp_address = self.sock.last_endpoint.decode()
        if authenticator is not None:
            authenticator.watch(self.sock)
        self.address = address or self.tcp_address or ""
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

    def describe(self) -> dict[str, Any]:
        """Where it listens and how it checks its peers, from the socket's own options (``stats``)."""
        return {"address": self.address, "tcp": self.tcp_address, "received": self.received,
                "curve_server": bool(self.sock.curve_server), "plain_server": bool(self.sock.plain_server)}

    def close(self) -> None:
        self.sock.close(linger=0)


class ChunkOutbox:
    """PUSH side: one socket per replica of the next stage."""

    def __init__(self, ctx: zmq.Context, addresses: list[str], *, security: Security | None = None) -> None:
        self.ctx = ctx
        self.security = security
        self.codec = WireCodec(Chunk)
        self.socks: list[zmq.Socket | None] = []
        #: each socket's monitor: its failed handshakes (libzmq gives up on the endpoint after one)
        self.monitors: list[zmq.Socket | None] = []
        self.peers: list[tuple[str, str] | None] = []
        self.sent = 0
        self.bytes_sent = 0
        #: listeners that failed the handshake (not the inbox they claimed to be), by slot
        self.refused: dict[int, int] = {}
        self._gave_up: set[int] = set()  # slots whose socket libzmq gave up on
        self.set_peers([[a, ""] for a in addresses])

    def _connect(self, addr: str, key: str) -> tuple[zmq.Socket, zmq.Socket | None]:
        s = self.ctx.socket(zmq.PUSH)
        s.linger = 200
        s.setsockopt(zmq.RECONNECT_IVL, 10)  # the inbox may bind after we connect: retry fast
        mon = None
        if self.security is not None:
            self.security.client(s, addr, key.encode() or None, curve=True)
            mon = s.get_monitor_socket(_GIVEN_UP)
        s.connect(addr)
        return s, mon

    def _close(self, i: int) -> None:
        sock, mon = self.socks[i], self.monitors[i]
        if sock is not None:
            if mon is not None:
                sock.disable_monitor()
                mon.close(linger=0)
            sock.close(linger=100)
        self.socks[i] = self.monitors[i] = None
        self._gave_up.discard(i)

    def set_peers(self, downstream: list[list[str] | None]) -> None:
        """Connect to the next stage's replicas as they are now (index = replica slot).

        A slot whose address or key changed gets a new socket; an emptied one
        is closed (a chunk sent there fails its request, as for a full queue).
        """
        for i, entry in enumerate(downstream):
            peer = (entry[0], entry[1] if len(entry) > 1 else "") if entry else None
            if i < len(self.peers) and self.peers[i] == peer:
                continue
            if i < len(self.socks):
                self._close(i)
            sock, mon = self._connect(*peer) if peer is not None else (None, None)
            if i < len(self.socks):
                self.socks[i], self.monitors[i], self.peers[i] = sock, mon, peer
            else:
                self.socks.append(sock)
                self.monitors.append(mon)
                self.peers.append(peer)

    def send(self, replica: int, request_id: str, data: Any, end: bool, segment: int = 0) -> None:
        """Queue one chunk; raise ``zmq.Again`` rather than block when the replica's queue is full.

        Never blocking matters: a dead downstream replica must not hang this
        worker (and with it the heartbeats of every request it serves).  A
        socket whose last listener failed the handshake is connected afresh
        first (see the module docstring): its monitor says so, one look per
        chunk.
        """
        sock = self.socks[replica] if 0 <= replica < len(self.socks) else None
        if sock is None:
            raise ValueError(f"no downstream replica {replica} (have {len(self.socks)} slots)")
        frames = self.codec.encode(Chunk(request_id, data, end, segment))
        mon = self.monitors[replica]
        if mon is not None and mon.getsockopt(zmq.EVENTS) & zmq.POLLIN and self._given_up(replica):
            sock = self._reconnect(replica)  # before a send into a pipe libzmq is dropping
        try:
            sock.send_multipart(frames, zmq.NOBLOCK, copy=False)
        except zmq.Again:
            if not self._given_up(replica):
                raise
            sock = self._reconnect(replica)
            sock.send_multipart(frames, zmq.NOBLOCK, copy=False)
        self.sent += 1
        self.bytes_sent += sum(memoryview(f).nbytes for f in frames)

    def _given_up(self, i: int) -> bool:
        """Did the listener at slot ``i`` fail a handshake since this socket connected (then libzmq gave
        up on it)?  Counts and reports each failure once."""
        mon, peer = self.monitors[i], self.peers[i]
        failed = 0
        while mon is not None:
            try:
                event = zmq_monitor.parse_monitor_message(mon.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                break
            failed += bool(event["event"] & _GIVEN_UP)
        if failed and peer is not None:
            self._gave_up.add(i)
            n = self.refused[i] = self.refused.get(i, 0) + failed
            if n - failed < 5 or n // 100 > (n - failed) // 100:  # the first few, then every 100th
                log.warning("connector: the process listening at %s (downstream replica %d's inbox) failed "
                            "the CurveZMQ handshake -- it does not hold the inbox's key -- and got nothing; "
                            "connecting afresh at the next chunk (%d refused so far)", peer[0], i, n)
        return i in self._gave_up

    def _reconnect(self, i: int) -> zmq.Socket:
        peer = self.peers[i]
        assert peer is not None
        self._close(i)
        sock, self.monitors[i] = self._connect(*peer)
        self.socks[i] = sock
        self._gave_up.discard(i)
        return sock

    def describe(self) -> list[dict[str, Any] | None]:
        """Each downstream slot's address, security mechanism (read from its socket) and listeners refused
        (``stats``)."""
        names = {zmq.NULL: "NULL", zmq.PLAIN: "PLAIN", zmq.CURVE: "CURVE"}
        out: list[dict[str, Any] | None] = []
        for i, (sock, peer) in enumerate(zip(self.socks, self.peers, strict=True)):
            if sock is None or peer is None:
                out.append(None)
                continue
            mech = sock.getsockopt(zmq.MECHANISM)
            self._given_up(i)
            out.append({"address": peer[0], "mechanism": names.get(mech, str(mech)),
                        "refused": self.refused.get(i, 0)})
        return out

    def close(self) -> None:
        for i in range(len(self.socks)):
            self._close(i)
