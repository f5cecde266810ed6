"""A process that listens in a dead worker's place: ``python -m trio_orch.testing.rogue_inbox``.

The attacker of the tests and of ``trio-orch chaos``'s ``rogue_inbox`` row: a
process of the same user that binds the ipc path of an async-chunk inbox
whose worker just died (``--bind ipc://...``, as soon as ``--after-death
PID`` is gone; libzmq replaces whatever file is there) and waits for the
upstream workers, which reconnect to that path, to hand it what they would
hand the inbox: their credentials and the chunks of the requests that
stream through it.  It is as welcoming as it can be: a PLAIN server whose
ZAP handler accepts everyone and writes down the user name and password it
was offered (a CURVE client key too), on a PULL that takes every message.

It reports on stdout, one JSON object per line: ``{"event": "bound"}`` once
it listens, ``"accepted"`` for each connection, ``"handshake_failed"`` (the
first 20; the count says the rest), ``"credentials"`` (what a client
offered), ``"chunk"`` (a message it received, its size), and at the end
(SIGTERM, SIGINT or ``--duration``) ``{"event": "done", "accepted": N,
"handshake_failed": N, "credentials": N, "chunks": N}``.  Uses ZMQ only (no
trio, no torch).
"""

from __future__ import annotations

import argparse
import sys
import time

import zmq
import zmq.utils.monitor as zmq_monitor
import zmq.utils.z85

from trio_orch.testing.rogue import Stopped, run_until_stopped, say, stop_on_signals

__all__ = ["main"]

ZAP_ADDRESS = "inproc://zeromq.zap.01"
_EVENTS = (zmq.EVENT_ACCEPTED | zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_AUTH
           | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)


class RogueInbox:
    """The rogue's PULL, its accept-everyone ZAP handler and its monitor (see the module docstring)."""

    def __init__(self, address: str) -> None:
        self.ctx = zmq.Context()
        self.zap = self.ctx.socket(zmq.REP)  # before the bind: libzmq asks ZAP only if a handler is there
        self.zap.linger = 0
        self.zap.bind(ZAP_ADDRESS)
        self.sock = self.ctx.socket(zmq.PULL)
        self.sock.linger = 0
        self.sock.plain_server = True
        self.sock.zap_domain = b"rogue"
        self.mon = self.sock.get_monitor_socket(_EVENTS)
        self.sock.bind(address)
        self.counts = {"accepted": 0, "handshake_failed": 0, "handshake_succeeded": 0, "credentials": 0,
                       "chunks": 0}
        say("bound", address=address)

    def answer_zap(self) -> None:
        msg = self.zap.recv_multipart()
        version, request_id, _domain, _address, _identity, mechanism, *creds = msg
        self.counts["credentials"] += 1
        shown = [zmq.utils.z85.encode(c).decode() if mechanism == b"CURVE" else c.decode(errors="replace")
                 for c in creds]
        say("credentials", mechanism=mechanism.decode(errors="replace"), offered=shown)
        self.zap.send_multipart([version, request_id, b"200", b"OK", b"rogue", b""])

    def take_chunks(self) -> None:
        while True:
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self.counts["chunks"] += 1
            say("chunk", frames=len(frames), bytes=sum(len(f) for f in frames))

    def note_event(self) -> None:
        ev = zmq_monitor.recv_monitor_message(self.mon)
        if ev["event"] == zmq.EVENT_ACCEPTED:
            self.counts["accepted"] += 1
            if self.counts["accepted"] <= 20:
                say("accepted")
        elif ev["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self.counts["handshake_succeeded"] += 1
            say("handshake_succeeded")
        else:
            self.counts["handshake_failed"] += 1
            if self.counts["handshake_failed"] <= 20:
                say("handshake_failed", code=ev["value"])

    def run(self, duration: float) -> None:
        poller = zmq.Poller()
        for s in (self.zap, self.sock, self.mon):
            poller.register(s, zmq.POLLIN)
        end = time.monotonic() + duration
        while time.monotonic() < end:
            for s, _ in poller.poll(50):
                if s is self.zap:
                    self.answer_zap()
                elif s is self.sock:
                    self.take_chunks()
                else:
                    self.note_event()

    def close(self) -> None:
        self.sock.disable_monitor()
        self.ctx.destroy(linger=0)


def _dead(pid: int) -> bool:
    """``pid`` is gone or a zombie (it no longer listens anywhere)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (OSError, IndexError):
        return True


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m trio_orch.testing.rogue_inbox",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--bind", required=True, help="the inbox to listen in place of (ipc://...)")
    p.add_argument("--after-death", type=int, default=None, metavar="PID",
                   help="bind the moment this process (the inbox's worker) is gone")
    p.add_argument("--duration", type=float, default=120.0, help="give up after this many seconds")
    args = p.parse_args(argv)
    stop_on_signals()
    say("started")
    try:
        while args.after_death is not None and not _dead(args.after_death):
            time.sleep(0.001)
        rogue = RogueInbox(args.bind)
    except Stopped:
        say("done")
        return 0
    return run_until_stopped(lambda: rogue.run(args.duration), rogue.close, rogue.counts)

if __name__ == "__main__":
    sys.exit(main())
