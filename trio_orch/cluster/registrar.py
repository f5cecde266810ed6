"""Replicas that join a running pipeline over TCP: the head's registrar.

:func:`open_registrar` binds a ROUTER socket on the head's ``--listen``
address (CurveZMQ with the head's key pair; only allow-listed worker keys
get through, refusals are counted by the pipeline's
:class:`~stages.auth.Authenticator`).  A worker (``trio-orch worker``, a
Ray actor) sends ``Register`` (:mod:`stages.membership_wire`); the join
runs through the orchestrator's core (:class:`~trio_orch.shell.join_gate.JoinGate`):

1. checks: the stage exists, the worker runs its kind and role, the key it
   registers is the key it authenticated with, it brings a session key (a
   key pair it made for this join); else ``Refused``;
2. a control socket of its own on an ephemeral TCP port of the listen host
   (only that session key passes: whoever holds the worker's own key cannot
   take a joined worker's place), a slot in the stage's pool, *cordoned*
   (no request is placed on it yet), and ``Accepted`` with the slot, the
   control address and the async-chunk peers;
3. the worker connects, loads its model and sends ``Ready``: the previous
   stage's replicas learn its inbox (``Peers``) and the slot is uncordoned:
   it takes new requests.

A key made by :meth:`Registrar.one_time_key` (the Ray backend's, one per
actor) opens the registration once: it is spent by the first ``Register``
that comes with it, so a copy of it read later opens nothing.

Shutdown cancels joins in progress (the core's rule) and each one gets
``Refused``.  A member that sends ``Leaving`` is cordoned at once and told
so; when it goes (``Dying``), or is lost (missed heartbeats, closed
connection), its pool evicts it and its open requests end with
``replica_died``; its identity is spent (a stale re-registration is
refused).  Whenever a pool's replicas change, every worker gets the peers
it streams to and the keys it accepts chunks from (``Peers``).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import msgspec
import trio
import zmq
import zmq.utils.z85

from stages import membership_wire as mw
from stages.auth import DOMAIN, Keypair, KeysError, Security, load_keypair, load_public_keys
from stages.wire import Peers
from trio_orch.cluster.launcher import Pipeline, inbox_address
from trio_orch.cluster.pool import ReplicaPool
from trio_orch.cluster.transport import ReplicaDied, ZmqStageClient
from trio_orch.core import JoinRefused

__all__ = ["HeadKeys", "Member", "Registrar", "open_registrar", "parse_listen", "prometheus_counters"]

log = logging.getLogger("trio_orch.cluster.registrar")

REGISTER_DOMAIN = f"{DOMAIN}:register"


def parse_listen(listen: str) -> tuple[str, int]:
    """``tcp://HOST:PORT`` -> (host, port); ValueError with a clear message otherwise."""
    if not listen.startswith("tcp://"):
        raise ValueError(f"--listen must be tcp://HOST:PORT, got {listen!r}")
    host, sep, port = listen[len("tcp://") :].rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"--listen must be tcp://HOST:PORT, got {listen!r}")
    if host in ("*", "0.0.0.0"):
        raise ValueError(
            "--listen needs the address workers reach the head at (not a wildcard): it is "
            "also where each joined replica's control port and the local inboxes listen"
        )
    return host.strip("[]"), int(port)


@dataclass(frozen=True)
class HeadKeys:
    """The head's key pair and the worker public keys it accepts."""

    keypair: Keypair
    allowed: frozenset[bytes]

    @classmethod
    def load(cls, directory: str | Path) -> HeadKeys:
        """From a directory made by ``trio-orch keys``: ``head.key_secret`` and ``workers/*.key``."""
        d = Path(directory)
        if not (d / "head.key_secret").exists():
            raise KeysError(f"{d} holds no head.key_secret (make the keys with: trio-orch keys {d})")
        allowed = load_public_keys(d / "workers") if (d / "workers").is_dir() else set()
        return cls(load_keypair(d / "head.key_secret"), frozenset(allowed))


@dataclass
class Member:
    """A replica that joined: its identity, slot, key and client."""

    member_id: str
    stage_id: int
    replica: int
    public_key: str
    client: ZmqStageClient
    capabilities: dict[str, Any] = field(default_factory=dict)
    gone: str | None = None
    #: the key pair it made for this join: its control link's only key, its key on the data plane
    session_key: str = ""


class Registrar:
    """Accepts replicas that join ``pipe`` at runtime (see the module docstring).

    ``counters``: ``registrations``, ``joined``, ``left``, ``lost`` and
    ``refused.<reason>``; refused keys are counted by the pipeline's
    authenticator (``pipe.authenticator.refused``).
    """

    def __init__(
        self, pipe: Pipeline, listen: str, keys: HeadKeys, *, orchestrator_wait: float = 30.0
    ) -> None:
        assert pipe.security is not None and pipe.authenticator is not None and pipe.ctx is not None
        self.pipe = pipe
        self.host, self.port = parse_listen(listen)
        self.keys = keys
        self.orchestrator_wait = orchestrator_wait
        # our TCP identity is the head key pair; ipc peers still prove the pipeline secret
        self.security = Security(pipe.security.secret, keys.keypair)
        self.auth = pipe.authenticator
        self.members: dict[str, Member] = {}
        self.counters: Counter[str] = Counter()
        self.address = ""
        self._sock: zmq.Socket | None = None
        self._nursery: trio.Nursery | None = None
        self._sent_peers: dict[int, Peers] = {}
        self._joining: dict[str, tuple[int, str]] = {}  # member id -> (stage, session key) while it joins
        #: registration keys that open it once (:meth:`one_time_key`), not spent yet
        self._one_time: set[bytes] = set()

    def one_time_key(self) -> Keypair:
        """A key pair whose key opens the registration once: spent by the first ``Register`` with it."""
        pair = Keypair.generate()
        self._one_time.add(pair.public)
        self.auth.set_allowed(self.keys.allowed | self._one_time, REGISTER_DOMAIN)
        return pair

    def _spend(self, key: bytes) -> None:
        if key in self._one_time:
            self._one_time.discard(key)
            self.auth.set_allowed(self.keys.allowed | self._one_time, REGISTER_DOMAIN)
            self.counters["one_time_keys_spent"] += 1

    # ------------------------------------------------------------------ running
    async def run(self, *, task_status: trio.TaskStatus[Registrar] = trio.TASK_STATUS_IGNORED) -> None:
        ctx = self.pipe.ctx
        assert ctx is not None
        sock = ctx.socket(zmq.ROUTER)
        sock.linger = 0
        self.auth.set_allowed(self.keys.allowed | self._one_time, REGISTER_DOMAIN)
        self.security.server(sock, f"tcp://{self.host}:{self.port}", domain=REGISTER_DOMAIN)
        try:
            sock.bind(f"tcp://{self.host}:{self.port}")
        except zmq.ZMQError as exc:
            sock.close()
            raise OSError(f"cannot listen for workers on tcp://{self.host}:{self.port}: {exc}") from None
        self.auth.watch(sock)
        self.address = sock.last_endpoint.decode()
        self._sock = sock
        for pool in self.pipe.stages:
            pool.supervised = True  # a stage with no replica waits for one to join
            pool.watch_replicas(lambda live, total: self.refresh_peers())
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                log.info("accepting workers on %s (%d allowed keys)", self.address, len(self.keys.allowed))
                task_status.started(self)
                fd = sock.getsockopt(zmq.FD)
                while True:
                    self._drain(sock)
                    with trio.move_on_after(0.1):  # registrations are rare: a short poll stays simple
                        await trio.lowlevel.wait_readable(fd)
        finally:
            self._nursery = None
            self._sock = None
            sock.close(linger=0)

    def _drain(self, sock: zmq.Socket) -> None:
        while True:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            if len(frames) != 2:
                self.counters["refused.garbage"] += 1
                continue
            ident, head = frames
            try:
                msg = mw.decode(head.buffer)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                self.counters["refused.garbage"] += 1
                log.error("dropped a garbage registration message: %s", exc)
                continue
            if type(msg) is not mw.Register:
                continue
            self.counters["registrations"] += 1
            key = head.get("User-Id") or ""  # the key the ZAP handler let in
            self._spend(key.encode())  # a one-time key is spent now, whatever comes of this join
            assert self._nursery is not None
            self._nursery.start_soon(self._admit, ident.bytes, msg, key, name=f"join[{msg.member_id[:8]}]")

    def _reply(self, ident: bytes, msg: mw.RegistrationMsg) -> None:
        if self._sock is not None:
            try:
                self._sock.send_multipart([ident, mw.encode(msg)], zmq.NOBLOCK)
            except zmq.ZMQError as exc:
                log.warning("could not answer a registration: %s", exc)

    def _refuse(self, ident: bytes, reg: mw.Register, reason: str, message: str) -> None:
        self.counters[f"refused.{reason}"] += 1
        log.warning("refused worker %s for stage %d: %s", reg.member_id, reg.stage_id, message)
        self._reply(ident, mw.Refused(reg.member_id, reason, message))

    # ------------------------------------------------------------------ one join
    async def _admit(self, ident: bytes, reg: mw.Register, key: str) -> None:
        cfg = self.pipe.config
        k = reg.stage_id
        if not (0 <= k < len(cfg.stages)):
            return self._refuse(ident, reg, "bad_stage", f"no stage {k}: stages are 0..{len(cfg.stages) - 1}")
        if reg.public_key != key:
            return self._refuse(
                ident, reg, "key_mismatch", "registered a key other than the one it authenticated with"
            )
        if not _is_key(reg.session_key) or reg.session_key == reg.public_key:
            return self._refuse(
                ident, reg, "no_session_key", "register with a session key of its own (a worker older than "
                "this head does not: update it)"
            )
        st = cfg.stages[k]
        if (reg.kind, reg.role) != (st.kind, st.role):
            return self._refuse(
                ident,
                reg,
                "kind_mismatch",
                f"stage {k} runs {st.label!r}, the worker runs "
                f"{reg.kind + (' ' + reg.role if reg.role else '')!r}",
            )
        pool = self.pipe.stages[k]
        with trio.move_on_after(self.orchestrator_wait):
            while pool.join_gate is None:  # the orchestrator is not routing through the pool yet
                await trio.sleep(0.05)
        if pool.join_gate is None:
            return self._refuse(ident, reg, "no_orchestrator", "no orchestrator routes through this pipeline")
        client = ZmqStageClient(
            self.pipe.ctx,
            f"tcp://{self.host}:0",
            stage_id=k,
            sink=pool.sink,
            heartbeat_timeout=cfg.heartbeat_timeout if cfg.heartbeat_interval > 0 else None,
            heartbeat_interval=cfg.heartbeat_interval or None,
            name=f"stage {k} ({st.label}) member {reg.member_id[:8]}",
            max_message_bytes=256 << 20,
            security=self.security,
            authenticator=self.auth,
        )
        domain = client.zap_domain(client.address)
        self.auth.set_allowed([reg.session_key.encode()], domain)  # this join's key alone
        client.farewell = "the orchestrator shut down"
        client.close_linger_ms = 500
        assert self._nursery is not None
        await self._nursery.start(client.run)
        try:
            idx = await pool.join_gate.join(
                k, reg.member_id, partial(self._handshake, ident, reg, client, pool)
            )
        except JoinRefused as exc:
            self._joining.pop(reg.member_id, None)
            self._refuse(ident, reg, exc.reason, str(exc))
            await self._discard(client, domain, "join refused")
            return
        except (trio.TooSlowError, ReplicaDied) as exc:
            why = (
                f"not ready within {cfg.startup_timeout:g}s"
                if isinstance(exc, trio.TooSlowError)
                else f"died before it was ready: {client.dead_reason}"
            )
            self._refuse(ident, reg, "not_ready", why)
            await self._discard(client, domain, why)
            return
        m = Member(reg.member_id, k, idx, key, client, dict(reg.capabilities), session_key=reg.session_key)
        self.members[reg.member_id] = m
        self._joining.pop(reg.member_id, None)  # a member now: its key stays allowed as one
        client.on_leaving = partial(self._on_leaving, m)
        self.refresh_peers()  # upstream replicas learn its inbox before anything is placed on it
        pool.uncordon(idx)
        self.counters["joined"] += 1
        log.warning(
            "stage %d: worker %s joined as replica %d (%s)",
            k,
            reg.member_id[:8],
            idx,
            reg.capabilities.get("host", "?"),
        )
        self._nursery.start_soon(self._watch_member, m, domain, name=f"member[{reg.member_id[:8]}]")

    async def _handshake(
        self, ident: bytes, reg: mw.Register, client: ZmqStageClient, pool: ReplicaPool
    ) -> int:
        """Claim a cordoned slot, send Accepted, wait for Ready; the slot index."""
        cfg = self.pipe.config
        k = reg.stage_id
        idx = self._claim_slot(pool, client)
        down, up = self._peers(k, local=False)
        # The next stage's workers take chunks from its key before it can send any: it connects to
        # their inboxes as soon as its model is loaded, before its Ready (a refused CurveZMQ
        # handshake is not retried), and the key of a join that fails is dropped again.
        self._joining[reg.member_id] = (k, reg.session_key)
        self.refresh_peers()
        self._sent_peers[id(client)] = Peers(down, up)  # what it is told with Accepted (below)
        try:
            self._reply(
                ident,
                mw.Accepted(
                    reg.member_id,
                    idx,
                    client.address,
                    cfg.heartbeat_interval,
                    seed=cfg.model_seed(k),
                    inbox=k > 0 and cfg.hands_off(k - 1),
                    control_only=cfg.async_chunk and k not in cfg.final_stage_ids,
                    downstream=down,
                    upstream_keys=up,
                ),
            )
            with trio.fail_after(cfg.startup_timeout):
                await client.wait_ready()
        except BaseException:
            client.mark_dead("its join did not complete")  # its slot is evicted (nothing was placed on it)
            self._joining.pop(reg.member_id, None)
            self.refresh_peers()
            raise
        return idx  # its key stays in _joining until _admit made it a member

    def _claim_slot(self, pool: ReplicaPool, client: ZmqStageClient) -> int:
        """A cordoned slot for a joining replica: a dead member's, else a new one."""
        for m in self.members.values():
            if m.stage_id == pool.stage_id and m.gone is not None and pool.replicas[m.replica] is m.client:
                idx = m.replica
                pool.cordon(idx)
                pool.replace_replica(idx, client, "slot reused by a new member")
                return idx
        idx = pool.add_replica(client)
        pool.cordon(idx)
        return idx

    async def _discard(self, client: ZmqStageClient, domain: str, why: str) -> None:
        client.farewell = None
        client.mark_dead(why)
        await client.aclose()
        self._sent_peers.pop(id(client), None)
        self.auth.forget(domain)

    def _on_leaving(self, m: Member, client: ZmqStageClient) -> None:
        pool = self.pipe.stages[m.stage_id]
        pool.cordon(m.replica)
        client.confirm_cordoned()
        log.warning(
            "stage %d: worker %s (replica %d) is leaving; no new requests go to it",
            m.stage_id,
            m.member_id[:8],
            m.replica,
        )

    async def _watch_member(self, m: Member, domain: str) -> None:
        await m.client.dead_event.wait()
        m.gone = m.client.dead_reason or "gone"
        left = "left the pool" in m.gone
        self.counters["left" if left else "lost"] += 1
        gate = self.pipe.stages[m.stage_id].join_gate
        if gate is not None:
            gate.left(m.member_id)
        log.warning(
            "stage %d: worker %s (replica %d) %s: %s",
            m.stage_id,
            m.member_id[:8],
            m.replica,
            "left" if left else "was lost",
            m.gone.splitlines()[0],
        )
        m.client.farewell = None
        await m.client.aclose()
        self._sent_peers.pop(id(m.client), None)  # (a later client may get its id)
        self.auth.forget(domain)
        self.refresh_peers()

    # ------------------------------------------------------------------ peers
    def _endpoint(self, k: int, i: int) -> tuple[str | None, str | None, str] | None:
        """(ipc inbox, tcp inbox, its key) of slot ``i`` of stage ``k`` while it serves, else None."""
        pool = self.pipe.stages[k]
        c = pool.replicas[i]
        if not c.alive or c.ready is None or i not in pool.live_replicas():
            return None
        info = c.ready.info
        ipc = inbox_address(self.pipe.tmpdir, k, i) if c.address.startswith("ipc://") else None
        return ipc, info.get("inbox_tcp"), str(info.get("inbox_key", ""))

    def _peers(self, k: int, *, local: bool) -> tuple[list[list[str] | None], list[str]]:
        cfg = self.pipe.config
        down: list[list[str] | None] = []
        if k + 1 < len(cfg.stages) and cfg.hands_off(k):
            for i in range(len(self.pipe.stages[k + 1].replicas)):
                ep = self._endpoint(k + 1, i)
                if ep is None:
                    down.append(None)
                elif local and ep[0]:
                    down.append([ep[0], ""])
                elif ep[1]:
                    down.append([ep[1], ep[2]])
                else:
                    down.append(None)
        up: list[str] = []
        if k > 0 and cfg.hands_off(k - 1):
            live = {m.session_key for m in self.members.values() if m.stage_id == k - 1 and m.gone is None}
            up = sorted(live | {key for stage, key in self._joining.values() if stage == k - 1})
        return down, up

    def refresh_peers(self) -> None:
        """Send every ready replica the peers it streams to and the keys it takes chunks from, if changed."""
        for k, pool in enumerate(self.pipe.stages):
            for c in pool.replicas:
                if not c.alive or c.ready is None:
                    continue
                down, up = self._peers(k, local=c.address.startswith("ipc://"))
                peers = Peers(down, up)
                if self._sent_peers.get(id(c)) != peers:
                    self._sent_peers[id(c)] = peers
                    c.send_peers(peers)

    def stage_members(self) -> list[int]:
        """Joined replicas serving now, per stage."""
        out = [0] * len(self.pipe.stages)
        for m in self.members.values():
            if m.gone is None:
                out[m.stage_id] += 1
        return out


def _is_key(text: str) -> bool:
    """A Z85 CurveZMQ public key (40 characters, 32 bytes)?"""
    try:
        return len(text) == 40 and len(zmq.utils.z85.decode(text.encode())) == 32
    except (ValueError, KeyError):
        return False


def prometheus_counters(reg: Registrar) -> dict[str, tuple[str, dict[tuple[tuple[str, str], ...], int]]]:
    """Membership counters in the ``/metrics`` extra-counters shape (the pipeline's supervisor reports
    the authentication refusals, these included)."""
    counts = dict(reg.counters)
    return {
        "trio_orch_membership_events": (
            "replicas that registered, joined, left, were lost, or were refused (by reason)",
            {(("event", name),): n for name, n in sorted(counts.items())},
        ),
    }


@asynccontextmanager
async def open_registrar(
    pipe: Pipeline, listen: str, keys: HeadKeys, **kwargs: Any
) -> AsyncIterator[Registrar]:
    """Accept joining replicas for the duration of the block (nest it inside ``open_pipeline``)."""
    reg = Registrar(pipe, listen, keys, **kwargs)
    async with trio.open_nursery() as nursery:
        await nursery.start(reg.run)
        try:
            yield reg
        finally:
            nursery.cancel_scope.cancel()
