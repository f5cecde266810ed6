"""Who may talk to whom: launch tickets on control sockets, CurveZMQ keys on inboxes and TCP, one ZAP handler.

Every socket that *binds* (the orchestrator's control sockets, the
registration socket, a worker's async-chunk inbox) is a ZMQ security server;
every socket that connects is a client:

* A replica's **control socket** (ipc) takes its launched worker and no one
  else: PLAIN with the one-time ticket of that launch, from the pid the head
  launched (:mod:`stages.credentials`: libzmq reports an ipc peer's
  ``SO_PEERCRED`` to the ZAP handler).  A stolen ticket of an earlier worker,
  or the pipeline secret, opens nothing there; the worker that was launched
  always gets in, whoever tried first.
  Checked once, when a peer connects: a process without the right
  credential never becomes a peer of the socket, so it can neither take
  messages meant for the worker (a DEALER round-robins to every peer) nor
  inject any (forged outputs, heartbeats, ``Dying``).  After the handshake
  the messages flow as before: no per-message cost on the hot path.  Unix
  sockets cannot be sniffed; the ticket travels in clear inside the
  handshake, but whoever might listen in the head's place gets a ticket that
  opens only its slot, and only from the launched pid.
* The async-chunk **inboxes** use CurveZMQ, on ipc too (``curve=True``): the
  *upstream* worker connects, and it must know who listens before it sends
  anything.  A process of the same user may bind the ipc path of an inbox
  whose worker died (libzmq even replaces a live one's) and wait for the
  upstream workers to reconnect: a PLAIN client would hand it the password
  and then its chunks.  With CurveZMQ the inbox proves it holds the secret
  key of the public key the upstream was given (a local worker's: the
  pipeline key pair, from the hand-over; a joined worker's: its session key,
  from the head), and the upstream proves its own key is allowed; nothing
  secret travels, and every chunk is encrypted (its cost:
  ``docs/wire-protocol.md``).  Every ``tcp://`` endpoint uses CurveZMQ the
  same way (a worker refuses any other head, the head accepts only listed
  workers).
* The remaining ``ipc://`` PLAIN servers take the *pipeline secret* (random,
  made when the pipeline starts).  Secrets and key pairs reach a local worker
  only through the hand-over of :mod:`stages.credentials`, once the worker
  has made itself non-dumpable -- never its environment, command line or a
  pipe another process could open in ``/proc``.

The checks run in a :class:`Authenticator`: one ZAP handler thread per ZMQ
context, started before any server socket binds (libzmq accepts everyone on
a socket whose ZAP handler is missing).  Refusals are counted by reason
(:meth:`Authenticator.report`) and logged, naming the socket.  Key pairs are
pyzmq's certificate files (``name.key`` public, ``name.key_secret`` both):
:func:`generate_keys` writes them, :func:`load_keypair` reads them.  Nothing
here unpickles anything.
"""

from __future__ import annotations

import hmac
import json
import logging
import os
import re
import secrets
import threading
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth
import zmq.utils.monitor as zmq_monitor
import zmq.utils.z85

from stages.credentials import LAUNCH_USER, LaunchRegistry, receive_credentials

__all__ = [
    "SECRET_NAME",
    "Authenticator",
    "Keypair",
    "KeysError",
    "Security",
    "generate_keys",
    "load_keypair",
    "load_public_keys",
    "scrubbed_environ",
    "worker_key_names",
]

log = logging.getLogger("stages.auth")

#: ZAP domain of sockets whose clients prove the pipeline secret (ipc) or an allowed key (tcp)
DOMAIN = "trio-orch"
ZAP_ADDRESS = "inproc://zeromq.zap.01"
#: failed handshakes ZAP never sees (no security, wrong mechanism); AUTH failures are ZAP's own
_HANDSHAKE_EVENTS = zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL


class KeysError(ValueError):
    """A key directory or key file that cannot be used (the message says which and why)."""


@dataclass(frozen=True)
class Keypair:
    """A CurveZMQ key pair, both halves Z85-encoded (40 bytes each)."""

    public: bytes
    secret: bytes

    @classmethod
    def generate(cls) -> Keypair:
        public, secret = zmq.curve_keypair()
        return cls(public, secret)


def load_keypair(path: str | os.PathLike[str]) -> Keypair:
    """The key pair in ``path`` (a ``.key_secret`` certificate file); KeysError if unusable."""
    p = Path(path)
    try:
        public, secret = zmq.auth.load_certificate(p)
    except (OSError, ValueError) as exc:
        raise KeysError(f"cannot read key pair {p}: {exc}") from None
    if not secret:
        raise KeysError(f"{p} holds no secret key (use the .key_secret file)")
    return Keypair(public, secret)


def load_public_keys(directory: str | os.PathLike[str]) -> set[bytes]:
    """Every public key of the ``*.key`` files in ``directory`` (an allow-list)."""
    d = Path(directory)
    if not d.is_dir():
        raise KeysError(f"no key directory {d}")
    keys: set[bytes] = set()
    for f in sorted(d.glob("*.key")):
        try:
            public, _ = zmq.auth.load_certificate(f)
        except (OSError, ValueError) as exc:
            raise KeysError(f"cannot read public key {f}: {exc}") from None
        keys.add(public)
    return keys


def worker_key_names(directory: str | os.PathLike[str]) -> list[str]:
    """Names of the worker key pairs in a key directory (``workers/NAME.key_secret``)."""
    return sorted(p.name[: -len(".key_secret")] for p in (Path(directory) / "workers").glob("*.key_secret"))


def generate_keys(directory: str | os.PathLike[str], workers: int = 2, *, force: bool = False) -> list[Path]:
    """Write a head key pair and ``workers`` worker key pairs under ``directory``; return the files.

    Layout: ``head.key`` / ``head.key_secret``; ``workers/worker-N.key`` /
    ``workers/worker-N.key_secret``.  The head's allow-list is the
    ``workers/*.key`` files; a worker needs ``head.key`` and its own
    ``.key_secret``.  Refuses to overwrite existing keys unless ``force``.
    """
    d = Path(directory)
    if workers < 0:
        raise KeysError(f"need workers >= 0, got {workers}")
    if not force and (d / "head.key_secret").exists():
        raise KeysError(f"{d} already holds keys (head.key_secret); pass force to replace them")
    (d / "workers").mkdir(parents=True, exist_ok=True)
    os.chmod(d, 0o700)
    written = [Path(p) for p in zmq.auth.create_certificates(d, "head")]
    for i in range(1, workers + 1):
        written += [Path(p) for p in zmq.auth.create_certificates(d / "workers", f"worker-{i}")]
    for p in written:
        if p.name.endswith(".key_secret"):
            os.chmod(p, 0o600)
    return written


class Security:
    """How one process secures its sockets (see the module docstring).

    ``secret``: the pipeline secret (PLAIN on ipc).  ``keypair``: this
    process's CurveZMQ key pair (TCP).  ``server_key``: the public key of the
    head this process talks to (a worker's control link).  ``ticket``: a
    launched worker's one-time ticket, its credential on its ipc control link.
    """

    def __init__(
        self, secret: bytes, keypair: Keypair | None = None, *, server_key: bytes | None = None,
        ticket: bytes | None = None,
    ) -> None:
        self.secret = secret
        self.keypair = keypair
        self.server_key = server_key
        self.ticket = ticket

    @classmethod
    def new_pipeline(cls) -> Security:
        """A fresh pipeline secret and key pair (the head, at pipeline start)."""
        return cls(secrets.token_hex(32).encode(), Keypair.generate())

    def to_text(self, ticket: bytes | None = None) -> str:
        """What a local worker is handed: the pipeline secret and key pair, and its launch ``ticket``.

        Handed over by :class:`stages.credentials.Handover`, never in an environment
        variable or an argument: any process of the same user can read another's
        ``/proc/<pid>/environ`` and command line.
        """
        assert self.keypair is not None
        return json.dumps(
            {
                "secret": self.secret.decode(),
                "public": self.keypair.public.decode(),
                "secret_key": self.keypair.secret.decode(),
                "ticket": (ticket or b"").decode(),
            }
        )

    @classmethod
    def from_text(cls, raw: str) -> Security:
        """The inverse of :meth:`to_text` (KeysError if malformed)."""
        try:
            d = json.loads(raw)
            return cls(
                d["secret"].encode(),
                Keypair(d["public"].encode(), d["secret_key"].encode()),
                server_key=d["public"].encode(),
                ticket=d.get("ticket", "").encode() or None,
            )
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise KeysError(f"malformed pipeline credentials: {exc}") from None

    @classmethod
    def from_handover(cls, fd: int, timeout: float = 60.0) -> Security:
        """Ask the launcher for :meth:`to_text` over the inherited socket ``fd`` (closed after).

        Only after :func:`stages.lockdown.lock_down`: see :func:`stages.credentials.receive_credentials`.
        """
        return cls.from_text(receive_credentials(fd, timeout).decode())

    def server(self, sock: zmq.Socket, address: str, *, domain: str = DOMAIN, curve: bool = False) -> None:
        """Make ``sock`` a security server for its next ``bind(address)``: CurveZMQ on tcp, and on ipc
        too with ``curve`` (a socket whose clients must know who listens: an inbox), else PLAIN.

        Options are read when ``bind`` creates the listener, so one socket may
        listen on ipc (PLAIN) and on tcp (CURVE) with a call before each bind.
        """
        sock.zap_domain = domain.encode()
        if curve or address.startswith("tcp://"):
            if self.keypair is None:
                raise KeysError(f"cannot listen on {address}: no key pair (give --keys)")
            sock.plain_server = False
            sock.curve_server = True
            sock.curve_publickey = self.keypair.public
            sock.curve_secretkey = self.keypair.secret
        else:
            sock.curve_server = False
            sock.plain_server = True

    def client(self, sock: zmq.Socket, address: str, server_key: bytes | None = None, *,
               curve: bool = False) -> None:
        """Make ``sock`` a security client for its next ``connect(address)``: CurveZMQ on tcp, and on
        ipc too with ``curve`` (see :meth:`server`), else PLAIN.

        ``server_key``: the public key the server must prove it holds (CurveZMQ;
        default: this process's head -- a local worker's is the pipeline's key, its peers' inboxes' too).
        """
        if curve or address.startswith("tcp://"):
            key = server_key or self.server_key
            if self.keypair is None or key is None:
                raise KeysError(f"cannot connect to {address}: no key pair or no server key")
            sock.curve_serverkey = key
            sock.curve_publickey = self.keypair.public
            sock.curve_secretkey = self.keypair.secret
        else:
            sock.plain_username = b"pipeline"
            sock.plain_password = self.secret

    def control_client(self, sock: zmq.Socket, address: str) -> None:
        """Make ``sock`` the client of this process's control link: on ipc with its launch ticket."""
        if address.startswith("tcp://") or self.ticket is None:
            self.client(sock, address)
        else:
            sock.plain_username = LAUNCH_USER
            sock.plain_password = self.ticket


#: environment variable names that look like a secret (an API key, an admin token, a password)
SECRET_NAME = re.compile(r"auth|secret|token|passw|key|credential", re.IGNORECASE)


def scrubbed_environ(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """``environ`` (default: this process's) without the variables named like a secret, nor Ray's.

    What a worker inherits: it needs none of the head's credentials (an admin
    token, a cloud key), and any process of the same user can read a
    process's environment in ``/proc``.  Nor the settings of a Ray driver the
    head may be (``RAY_ADDRESS``, its auth mode): a local worker is no Ray
    process.  (Workers given Ray's variables without its auth mode were seen
    to leave a socket opening in the head after a Ray run; the cause inside
    Ray was not traced.)
    """
    env = os.environ if environ is None else environ
    return {k: v for k, v in env.items() if not SECRET_NAME.search(k) and not k.startswith("RAY_")}


class Authenticator:
    """The ZAP handler of one ZMQ context: a thread that answers every security handshake.

    PLAIN (ipc) passes on a launched process's slot (a domain guarded in
    :attr:`launches`) with that launch's ticket from the launched pid, and
    elsewhere with the pipeline secret; CURVE (tcp) passes with a client key
    allowed for the socket's ZAP domain (:meth:`allow`; the domain
    :data:`DOMAIN` holds the keys allowed everywhere).  Anything else is
    refused, counted in :attr:`refused` by reason and logged (the first few of
    each reason, then every 100th: :meth:`report`).  Use as a context manager,
    entered before any server socket binds and left after they closed.
    """

    def __init__(self, ctx: zmq.Context, secret: bytes | None = None) -> None:
        self.ctx = ctx
        self.secret = secret
        self.refused: Counter[str] = Counter()
        self.accepted = 0
        self._allowed: dict[str, set[bytes]] = {}
        #: the slots of launched processes (a replica's control socket) and their current launches
        self.launches = LaunchRegistry()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stop_addr = f"inproc://trio-orch-zap-stop-{id(self)}"
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._watch_seq = 0

    def allow(self, keys: Iterable[bytes], domain: str = DOMAIN) -> None:
        """Allow these client public keys on sockets of ``domain`` (added to those allowed)."""
        with self._lock:
            self._allowed.setdefault(domain, set()).update(keys)

    def set_allowed(self, keys: Iterable[bytes], domain: str) -> None:
        """Replace the client keys allowed on sockets of ``domain``."""
        with self._lock:
            self._allowed[domain] = set(keys)

    def forget(self, domain: str) -> None:
        """The sockets of ``domain`` closed: drop its allowed keys and, for a slot, its launches."""
        with self._lock:
            self._allowed.pop(domain, None)
        self.launches.forget(domain)

    def report(self, reason: str, message: str) -> None:
        """Count a refusal under ``reason`` (``mechanism:kind``) and log it: the first five of each
        reason, then every 100th (a flood must not flood the log)."""
        with self._lock:
            n = self.refused[reason] = self.refused[reason] + 1
        if n <= 5 or n % 100 == 0:
            log.warning("%s (%s; %d refused so far)", message, reason, n)

    def watch(self, sock: zmq.Socket) -> None:
        """Also count (and log) the failed handshakes on a server socket that never reach ZAP.

        A peer with no security at all (a plain DEALER, say) fails on the
        mechanism mismatch before any ZAP request; the socket's monitor reports it.
        """
        if self._thread is None:
            return
        with self._lock:
            self._watch_seq += 1
            addr = f"inproc://trio-orch-zap-mon-{id(self)}-{self._watch_seq}"
        sock.monitor(addr, _HANDSHAKE_EVENTS | zmq.EVENT_MONITOR_STOPPED)
        self._command(b"watch " + addr.encode())

    def _command(self, cmd: bytes) -> None:
        s = self.ctx.socket(zmq.PUSH)  # PUSH/PULL: any number of short-lived senders
        s.linger = 1000
        s.sndtimeo = 5000
        try:
            s.connect(self._stop_addr)
            s.send(cmd)
        finally:
            s.close()

    @property
    def refusals(self) -> int:
        return sum(self.refused.values())

    def start(self) -> Authenticator:
        self._thread = threading.Thread(target=self._serve, name="trio-orch-zap", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            raise RuntimeError(f"ZAP handler failed to start: {self._error}") from self._error
        return self

    def stop(self) -> None:
        if self._thread is None:
            return
        self._command(b"stop")
        self._thread.join(5.0)
        self._thread = None

    def __enter__(self) -> Authenticator:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------------ the thread
    def _serve(self) -> None:
        try:
            zap = self.ctx.socket(zmq.REP)
            zap.linger = 0
            zap.bind(ZAP_ADDRESS)
            stop = self.ctx.socket(zmq.PULL)
            stop.linger = 0
            stop.bind(self._stop_addr)
        except zmq.ZMQError as exc:
            self._error = exc
            self._ready.set()
            return
        self._ready.set()
        poller = zmq.Poller()
        poller.register(zap, zmq.POLLIN)
        poller.register(stop, zmq.POLLIN)
        monitors: dict[zmq.Socket, str] = {}
        try:
            while True:
                events = dict(poller.poll())
                if stop in events:
                    cmd = stop.recv()
                    if cmd == b"stop":
                        return
                    if cmd.startswith(b"watch "):
                        mon = self.ctx.socket(zmq.PAIR)
                        mon.linger = 0
                        mon.connect(cmd[6:].decode())
                        monitors[mon] = cmd[6:].decode()
                        poller.register(mon, zmq.POLLIN)
                if zap in events:
                    zap.send_multipart(self._answer(zap.recv_multipart()))
                for mon in [m for m in monitors if m in events]:
                    if self._monitor_event(mon.recv_multipart()):
                        poller.unregister(mon)
                        mon.close()
                        del monitors[mon]
        finally:
            zap.close()
            stop.close()
            for mon in monitors:
                mon.close()

    def _monitor_event(self, frames: list[bytes]) -> bool:
        """Count a failed handshake; True when the monitor stopped (its socket closed)."""
        event = zmq_monitor.parse_monitor_message(frames)
        if event["event"] == zmq.EVENT_MONITOR_STOPPED:
            return True
        if event["event"] & (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL):
            endpoint = event["endpoint"].decode(errors="replace")
            self.report(f"handshake:{endpoint.split(':', 1)[0]}",
                        f"refused a connection on {endpoint}: its security handshake failed "
                        f"(code {event['value']})")
        return False

    def _answer(self, msg: list[bytes]) -> list[bytes]:
        """One ZAP request -> its reply (RFC 27)."""
        if len(msg) < 6:
            return [b"1.0", b"", b"400", b"malformed ZAP request", b"", b""]
        version, request_id, domain_b, address, _identity, mechanism = msg[:6]
        creds = msg[6:]
        domain = domain_b.decode(errors="replace")
        peer = _peer_name(address.decode(errors="replace") or "?")
        kind = domain.split(":")[1] if domain.count(":") else "pipeline"
        ok, user = False, b""
        if mechanism == b"PLAIN" and len(creds) == 2 and domain in self.launches:
            verdict, label = self.launches.check(domain, creds[0], creds[1], address)
            ok, user, why, reason = verdict.ok, LAUNCH_USER, verdict.why, f"launch:{verdict.reason}"
            where = f"{label}'s control socket"
        elif mechanism == b"PLAIN" and len(creds) == 2:
            ok = self.secret is not None and hmac.compare_digest(creds[1], self.secret)
            user, why, where = b"pipeline", "wrong pipeline secret", domain
            reason = "plain:pipeline"  # one secret for the whole pipeline, whatever the socket
        elif mechanism == b"CURVE" and len(creds) == 1:
            key = zmq.utils.z85.encode(creds[0])
            with self._lock:
                ok = key in self._allowed.get(domain, ()) or key in self._allowed.get(DOMAIN, ())
            user, why, where = key, f"client key {key.decode()} is not allowed", domain
            reason = f"curve:{kind}"
        else:
            mech = mechanism.decode(errors="replace")
            why, where, reason = f"mechanism {mech} is refused", domain, f"{mech.lower()}:{kind}"
        if ok:
            with self._lock:
                self.accepted += 1
            return [version, request_id, b"200", b"OK", user, b""]
        self.report(reason, f"refused a {mechanism.decode(errors='replace')} connection to {where} from "
                            f"{peer}: {why}")
        return [version, request_id, b"400", why.encode(), b"", b""]


def _peer_name(address: str) -> str:
    """An ipc peer as ``pid P (uid U)`` (libzmq's ``localhost:UID:GID:PID``), anything else as is."""
    parts = address.rsplit(":", 3)
    if len(parts) == 4 and all(p.isdigit() for p in parts[1:]):
        return f"pid {parts[3]} (uid {parts[1]})"
    return address
