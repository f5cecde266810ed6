"""A process that tries to take a stage worker's place: ``python -m trio_orch.testing.rogue``.

The attacker of the tests and of ``trio-orch chaos``'s ``rogue_worker`` row: a
process of the same user that kills a worker, then connects to the replica's
control socket as the head rebinds it, hoping to be the one that serves the
slot.  It tries every password in ``--passwords FILE`` (one per line, as
hex or text: whatever it stole -- an earlier worker's ticket, the pipeline
secret, even the current ticket; the file is re-read every turn, so a test
can add one while it runs), each on a DEALER that reconnects every
``--interval-ms``.  Once a handshake succeeds it sends ``Ready`` and
heartbeats and answers each ``Submit`` with text of its own.

It reports on stdout, one JSON object per line: ``{"event": "refused"}`` for
each refused handshake, ``"connected"``, ``"submit"`` (with the request id),
and at the end (SIGTERM, SIGINT or ``--duration``) ``{"event": "done",
"refused": N, "connected": N, "submits": N}``.  Uses ZMQ and the wire
codec only (no trio, no torch).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import zmq
import zmq.utils.monitor as zmq_monitor

from stages.wire import (
    Heartbeat,
    InboundMsg,
    OutboundMsg,
    OutItem,
    Outputs,
    Ready,
    Submit,
    WireCodec,
    WireError,
)

__all__ = ["ROGUE_TEXT", "Stopped", "main", "read_report", "run_until_stopped", "say", "stop_on_signals"]

#: what the rogue answers every request with (a user who sees it got the rogue's answer)
ROGUE_TEXT = "rogue-answer"

_EVENTS = (zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_AUTH
           | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)


def say(event: str, **fields: Any) -> None:
    """One event of a rogue's report: a JSON object on a line of stdout."""
    print(json.dumps({"event": event, **fields}), flush=True)


def read_report(stdout: str) -> list[dict[str, Any]]:
    """The rogue's events from its stdout (the last one is ``done`` if it stopped cleanly)."""
    return [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]


class Rogue:
    """The sockets of one rogue, one per password (see the module docstring)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.ctx = zmq.Context()
        self.poller = zmq.Poller()
        self.sockets: dict[bytes, zmq.Socket] = {}
        self.monitors: dict[zmq.Socket, zmq.Socket] = {}  # monitor -> its socket
        self.connected: set[zmq.Socket] = set()
        self.counts = {"refused": 0, "connected": 0, "submits": 0}
        self.out = WireCodec(OutboundMsg)
        self.inbound = WireCodec(InboundMsg)

    def passwords(self) -> list[bytes]:
        try:
            lines = Path(self.args.passwords).read_text().split()
        except OSError:
            return []
        return [line.encode() for line in lines if line]

    def add(self, password: bytes) -> None:
        sock = self.ctx.socket(zmq.DEALER)
        sock.linger = 0
        sock.reconnect_ivl = sock.reconnect_ivl_max = max(1, self.args.interval_ms)
        sock.plain_username = self.args.user.encode()
        sock.plain_password = password
        mon = sock.get_monitor_socket(_EVENTS)
        sock.connect(self.args.connect)
        self.sockets[password] = sock
        self.monitors[mon] = sock
        self.poller.register(sock, zmq.POLLIN)
        self.poller.register(mon, zmq.POLLIN)

    def handle_monitor(self, mon: zmq.Socket) -> None:
        sock = self.monitors[mon]
        ev = zmq_monitor.recv_monitor_message(mon)
        if ev["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self.counts["connected"] += 1
            say("connected")
            self.connected.add(sock)
            a = self.args
            sock.send_multipart(self.out.encode(Ready(a.stage_id, a.replica, os.getpid(), a.kind, {})))
        else:
            self.counts["refused"] += 1
            if self.counts["refused"] <= 20:  # the count says the rest
                say("refused", code=ev["value"])

    def handle_socket(self, sock: zmq.Socket) -> None:
        while True:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                msg = self.inbound.decode(frames)
            except WireError:
                continue
            if type(msg) is Submit:
                self.counts["submits"] += 1
                say("submit", request_id=msg.request_id)
                sock.send_multipart(self.out.encode(Outputs([OutItem(msg.request_id, ROGUE_TEXT, True, None,
                                                                     time.perf_counter())])))

    def run(self) -> None:
        end = time.monotonic() + self.args.duration
        next_hb = 0.0
        while time.monotonic() < end:
            for password in self.passwords():
                if password not in self.sockets:
                    self.add(password)
            for s, _ in self.poller.poll(50):
                if s in self.monitors:
                    self.handle_monitor(s)
                else:
                    self.handle_socket(s)
            now = time.monotonic()
            if now >= next_hb:
                next_hb = now + 0.1
                for sock in self.connected:
                    sock.send_multipart(self.out.encode(Heartbeat(time.perf_counter(), 0)), zmq.NOBLOCK)

    def close(self) -> None:
        for sock in self.sockets.values():
            sock.disable_monitor()
        for mon in self.monitors:
            mon.close(linger=0)
        self.ctx.destroy(linger=0)


class Stopped(Exception):
    """SIGTERM or SIGINT: the rogue reports and ends."""


def _stop(signum: int, frame: Any) -> None:
    raise Stopped


def stop_on_signals() -> None:
    """From now on SIGTERM and SIGINT raise :class:`Stopped`."""
    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)


def run_until_stopped(run: Callable[[], None], close: Callable[[], None], counts: dict[str, int]) -> int:
    """``run()`` until it returns or :class:`Stopped`; ``close()``; report ``done`` with ``counts``."""
    try:
        run()
    except Stopped:
        pass
    finally:
        close()
    say("done", **counts)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m trio_orch.testing.rogue",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--connect", required=True, help="the control socket to take (ipc://...)")
    p.add_argument("--passwords", required=True, metavar="FILE", help="what it stole: one password a line")
    p.add_argument("--user", default="launch", help="PLAIN user name (default: launch)")
    p.add_argument("--stage-id", type=int, default=0)
    p.add_argument("--replica", type=int, default=0)
    p.add_argument("--kind", default="echo", help="the kind its Ready claims")
    p.add_argument("--interval-ms", type=int, default=5, help="reconnect every this many ms (default 5)")
    p.add_argument("--duration", type=float, default=120.0, help="give up after this many seconds")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    stop_on_signals()
    rogue = Rogue(args)
    return run_until_stopped(rogue.run, rogue.close, rogue.counts)


if __name__ == "__main__":
    sys.exit(main())
