"""A stage replica that joins a running orchestrator over TCP: ``trio-orch worker``.

It loads its keys (its own key pair, and the head's public key: a head that
cannot prove it holds the matching secret key is refused by the CurveZMQ
handshake), registers for ``--stage K`` at ``--head tcp://HOST:PORT``
(:mod:`stages.membership_wire`), and once accepted builds the stage's
model from ``--config`` (the same pipeline TOML the head reads; the stage's
``worker_args`` apply to it as to a local replica), connects to
the control port the head gave it, sends ``Ready`` and serves like a local
worker (:class:`stages.worker.Worker`), streaming async-chunk data to the
peers the head names and taking chunks only from the keys it names.

* SIGTERM or Ctrl-C: a graceful leave: it sends ``Leaving``, takes no new
  request once the head confirms, finishes what it holds within
  ``--leave-grace`` seconds, then leaves.  A second signal leaves at once.
* The head lost (connection down longer than ``--head-timeout``, or it
  evicted us): drop everything, register again with a new identity.
* ``Refused`` (a stale identity, a kind the stage does not run, shutdown):
  exit 1 with the reason.  The head shutting down (``Shutdown``): exit 0.

Keys: ``--keys DIR`` (made by ``trio-orch keys DIR``: ``head.key`` and
``workers/NAME.key_secret``), or ``--keys-fd N``: JSON ``{"public", "secret",
"head"}`` (Z85) asked for over the Unix socket the parent left open as fd N
(the hand-over of :mod:`stages.credentials`) -- the Ray backend's way, which
keeps the secret key out of the environment, the command line and any pipe
another process could open in ``/proc``.  Before it reads any key the worker
locks itself down (:func:`stages.lockdown.lock_down`, fresh: it goes on in a
forked child nobody could open while it was dumpable).

That key pair only gets it through the registration.  For each join it makes
a *session* key pair, in its own memory alone, and registers its public key:
the head lets only that key onto the replica's control socket, and the peers
stream to and accept chunks from session keys.  So whoever gets hold of the
worker's key file (or, on Ray, a one-time key) cannot take the place of a
worker that joined.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import socket
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import msgspec
import zmq
import zmq.utils.monitor as zmq_monitor

from stages import membership_wire as mw
from stages.auth import Authenticator, Keypair, KeysError, Security, load_keypair, worker_key_names
from stages.credentials import HandoverError, receive_credentials
from stages.faults import FaultInjection, injected
from stages.lockdown import LockdownError, lock_down
from stages.placement import check_devices, device_arg
from stages.registry import build_model, model_class
from stages.schema import positive_seconds_arg, seconds_arg
from stages.wire import Dying, Peers, Ready
from stages.worker import StopServing, Worker
from stages.worker import build_parser as build_worker_parser

__all__ = ["CONFIG_ENV", "HeadlessWorker", "build_parser", "main"]


#: where the Ray backend puts the pipeline config (JSON of the TOML layout)
CONFIG_ENV = "TRIO_ORCH_WORKER_CONFIG"

_LINK_EVENTS = zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_AUTH


class HeadlessWorker(Worker):
    """A :class:`Worker` that watches its link to the head (ZMTP heartbeats + socket events)."""

    head_timeout = 5.0

    def configure_control(self, sock: zmq.Socket) -> None:
        sock.heartbeat_ivl = 1000  # ZMTP pings: a silent head (partition) drops the connection
        sock.heartbeat_timeout = 3000
        sock.linger = 0
        self.monitor = sock.get_monitor_socket(_LINK_EVENTS)
        self.down_since: float | None = None

    def tick(self, now: float) -> None:
        super().tick(now)
        while True:
            try:
                ev = zmq_monitor.recv_monitor_message(self.monitor, zmq.NOBLOCK)
            except zmq.Again:
                break
            if ev["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.down_since = None
            elif self.down_since is None:
                self.down_since = now
        if self.down_since is not None and now - self.down_since > self.head_timeout:
            raise StopServing("lost the orchestrator")

    def close(self) -> None:
        self.sock.disable_monitor()
        self.monitor.close(linger=0)
        super().close()


class FaultyHeadlessWorker(FaultInjection, HeadlessWorker):
    """A headless worker given a fault flag (``--step-delay-ms``): :mod:`stages.faults` over its seams."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="trio-orch worker", description=__doc__.split("\n\n")[0])
    configure(p)
    return p


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--stage", type=int, required=True, metavar="K", help="the stage this replica serves")
    p.add_argument("--head", required=True, metavar="tcp://HOST:PORT", help="the head's --listen address")
    p.add_argument(
        "--keys",
        default=None,
        metavar="DIR",
        help="key directory made by 'trio-orch keys' (head.key and workers/NAME.key_secret)",
    )
    p.add_argument(
        "--key",
        default=None,
        metavar="NAME",
        help="which worker key pair in DIR/workers (default: the first one)",
    )
    p.add_argument("--keys-fd", type=int, default=None, metavar="N",
                   help="ask the parent for the key pair and the head's public key (JSON) over the Unix "
                        "socket it left open as fd N, once locked down (stages/credentials.py); how the "
                        "Ray backend hands them over")
    p.add_argument(
        "--config",
        "--model-config",
        dest="config",
        default=None,
        metavar="FILE",
        help="pipeline config TOML (the head's): stage K's kind, model options, batch size "
        "(default: the built-in speech pipeline)",
    )
    p.add_argument("--device", type=device_arg, default=None,
                   help="torch device: cpu or cuda[:N] (default: the stage's in the config, else the "
                        "pipeline's)")
    p.add_argument(
        "--advertise",
        default=None,
        metavar="HOST",
        help="address other hosts reach this worker's inbox at (default: the local address "
        "that routes to the head)",
    )
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: the config's)")
    p.add_argument(
        "--leave-grace",
        type=seconds_arg,
        default=30.0,
        metavar="S",
        help="on SIGTERM/Ctrl-C, seconds to finish held requests before leaving (default 30)",
    )
    p.add_argument(
        "--register-timeout",
        type=positive_seconds_arg,
        default=60.0,
        metavar="S",
        help="give up if the head does not answer the registration within S seconds",
    )
    p.add_argument(
        "--head-timeout",
        type=positive_seconds_arg,
        default=5.0,
        metavar="S",
        help="connection to the head down this long: register again with a new identity",
    )
    # the Ray backend (which member is its actor's) and tests (a chosen, stale identity)
    p.add_argument("--member-id", default=None, help=argparse.SUPPRESS)
    # tests: a slow stage
    p.add_argument("--step-delay-ms", type=seconds_arg, default=0.0, help=argparse.SUPPRESS)


def _keys(args: argparse.Namespace) -> tuple[Keypair, bytes]:
    if args.keys_fd is not None:
        try:
            d = json.loads(receive_credentials(args.keys_fd))
            return Keypair(d["public"].encode(), d["secret"].encode()), d["head"].encode()
        except HandoverError as exc:
            raise KeysError(f"--keys-fd {args.keys_fd}: {exc}") from None
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise KeysError(f"malformed keys from --keys-fd {args.keys_fd}: {exc}") from None
    if args.keys is None:
        raise KeysError("give --keys DIR (made by 'trio-orch keys DIR')")
    d = Path(args.keys)
    names = worker_key_names(d)
    name = args.key or (names[0] if names else None)
    if name is None:
        raise KeysError(f"{d}/workers holds no worker key pair")
    pair = load_keypair(d / "workers" / f"{name}.key_secret")
    head = load_keypair_public(d / "head.key")
    return pair, head


def load_keypair_public(path: Path) -> bytes:
    import zmq.auth

    try:
        public, _ = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise KeysError(f"cannot read the head's public key {path}: {exc}") from None
    return public


def _advertise(head: str) -> str:
    host = head[len("tcp://") :].rpartition(":")[0].strip("[]")
    s = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_DGRAM)
    try:
        s.connect((host, 9))
        return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"
    finally:
        s.close()


def register(
    ctx: zmq.Context, security: Security, head: str, reg: mw.Register, timeout: float
) -> mw.Accepted | mw.Refused | str:
    """Send ``reg``; the head's answer, or a string saying why there is none."""
    sock = ctx.socket(zmq.DEALER)
    sock.linger = 0
    security.client(sock, head)
    mon = sock.get_monitor_socket(
        zmq.EVENT_HANDSHAKE_FAILED_AUTH
        | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
        | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    )
    try:
        sock.connect(head)
        sock.send(mw.encode(reg))
        deadline = time.monotonic() + timeout
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(mon, zmq.POLLIN)
        while (left := deadline - time.monotonic()) > 0:
            events = dict(poller.poll(int(min(left, 1.0) * 1000)))
            if mon in events:
                ev = zmq_monitor.recv_monitor_message(mon)
                if ev["event"] == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                    return "the head refused this worker's key (it is not in the head's allow-list)"
                return (
                    "the security handshake with the head failed: it does not hold the key in the "
                    "head.key this worker was given, or it is not a trio-orch head"
                )
            if sock in events:
                try:
                    msg = mw.decode(sock.recv())
                except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                    return f"undecodable answer from the head: {exc}"
                if type(msg) in (mw.Accepted, mw.Refused) and msg.member_id == reg.member_id:
                    return msg
        return f"no answer from {head} within {timeout:g}s"
    finally:
        sock.disable_monitor()
        mon.close(linger=0)
        sock.close(linger=0)


def say(line: str) -> None:
    """One progress line on stderr: what a person running the worker by hand wants to see."""
    print(f"trio-orch worker: {line}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None, args: argparse.Namespace | None = None) -> int:
    args = args if args is not None else build_parser().parse_args(argv)
    from stages.config import builtin_config, from_dict, load_config

    try:  # before it reads a key, and in an address space nobody opened while it was dumpable
        lock_down(fresh=True)
    except LockdownError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    try:
        keypair, head_key = _keys(args)
        if args.config:
            cfg = load_config(args.config)
        elif os.environ.get(CONFIG_ENV):  # the Ray backend hands the head's config over
            cfg = from_dict(json.loads(os.environ[CONFIG_ENV]))
        else:
            cfg = builtin_config("speech")
        if not 0 <= args.stage < len(cfg.stages):
            raise ValueError(f"--stage {args.stage}: the pipeline has stages 0..{len(cfg.stages) - 1}")
        # --device, else the stage's own (one for all its replicas), else the pipeline's; this host has it
        device = args.device or cfg.stage_device(args.stage)
        check_devices([(f"stage {args.stage} ({cfg.stages[args.stage].label})", device)])
    except (KeysError, ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    st = cfg.stages[args.stage]
    advertise = args.advertise or _advertise(args.head)
    security = Security(b"", keypair, server_key=head_key)
    ctx = zmq.Context()
    auth = Authenticator(ctx, None).start()  # checks who connects to our TCP inbox
    worker: HeadlessWorker | None = None
    signals: list[int] = []

    def on_signal(signum: int, frame: Any) -> None:
        signals.append(signum)
        if worker is not None and len(signals) == 1:
            name = signal.Signals(signum).name
            say(f"{name}: leaving, finishing what it holds within {args.leave_grace:g} s (again to stop now)")
            worker.begin_leave(args.leave_grace)
            return
        raise StopServing(f"signal {signal.Signals(signum).name}")

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    model: Any = None
    model_seed: int | None = None
    member_id = args.member_id
    code = 0
    try:
        while True:
            member_id = member_id or uuid.uuid4().hex
            session = Keypair.generate()  # this join's identity on the control link and the data plane
            caps = {"host": advertise, "pid": os.getpid(), "device": device, "max_batch": st.max_batch}
            reg = mw.Register(member_id, args.stage, st.kind, st.role, keypair.public.decode(), caps,
                              session_key=session.public.decode())
            answer = register(ctx, security, args.head, reg, args.register_timeout)
            if isinstance(answer, str):
                print(f"error: cannot join {args.head}: {answer}", file=sys.stderr, flush=True)
                return 1
            if type(answer) is mw.Refused:
                print(
                    f"error: the head refused this worker ({answer.reason}): {answer.message}",
                    file=sys.stderr,
                    flush=True,
                )
                return 1
            assert type(answer) is mw.Accepted
            say(f"joined {args.head} as stage {args.stage} ({st.kind}) replica {answer.replica} "
                f"(member {member_id[:8]})")
            if model is None or model_seed != answer.seed:
                model_class(st.kind)
                if "torch" in sys.modules:
                    import torch

                    torch.set_num_threads(max(1, args.threads or st.threads))
                model = build_model(
                    st.kind, st.model, device=device, seed=answer.seed, slots=st.max_batch, role=st.role
                )
                model.warmup()
                model_seed = answer.seed
            # the local worker's options, defaults and all, the stage's worker_args from the config
            # (as a local replica of it gets them), then what the head and our config say
            ns = build_worker_parser().parse_args(["--connect", answer.control, *st.worker_args])
            ns.stage_id, ns.replica, ns.kind, ns.role = args.stage, answer.replica, st.kind, st.role
            ns.inbox_tcp = f"tcp://{advertise}:0" if answer.inbox else None
            ns.control_only, ns.heartbeat_interval = answer.control_only, answer.heartbeat_interval
            ns.max_batch, ns.device, ns.seed = st.max_batch, device, answer.seed
            ns.threads = args.threads or st.threads
            ns.parent_pid, ns.step_delay_ms = os.getppid(), args.step_delay_ms or ns.step_delay_ms
            HeadlessWorker.head_timeout = args.head_timeout
            cls = FaultyHeadlessWorker if injected(ns) else HeadlessWorker
            worker = cls(ns, model, ctx, Security(b"", session, server_key=head_key), auth)
            worker.set_peers(Peers(answer.downstream, answer.upstream_keys))
            reason = "exited"
            try:
                worker.send(Ready(args.stage, answer.replica, os.getpid(), st.kind, worker.ready_info()))
                if signals:  # a signal came while we registered: leave right away
                    worker.begin_leave(args.leave_grace)
                reason = worker.serve()
            except StopServing as stop:
                reason = stop.reason
            finally:
                try:
                    worker.sock.send_multipart(worker.out_codec.encode(Dying(reason)), zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass
                worker.release_held()  # the model serves the next registration: free its cache slots
                worker.close()
                worker = None
            say(f"stopped serving: {reason}")
            if reason == "lost the orchestrator" and not signals:
                member_id = None  # a new identity: the old one is spent at the head
                continue
            return 0
    except StopServing as stop:
        say(f"stopped: {stop.reason}")
        return code
    finally:
        auth.stop()
        ctx.destroy(linger=0)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s worker %(levelname)s %(message)s")
    sys.exit(main())
