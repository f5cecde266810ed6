"""One stage replica in one process: ``python -m stages.worker --help``.

The worker connects a DEALER socket to the orchestrator (which bound it),
loads its model, sends ``Ready``, then loops: drain the control socket (and
the async-chunk inbox) to EAGAIN, admit new requests, run ONE batched model
step over every runnable request, send everything that step produced as one
``Outputs`` message, stream chunks downstream, retire finished requests,
heartbeat.  An ``Abort`` takes effect before the next step (with ``ack`` it
is confirmed once done).  An ``Rpc`` runs a control method between two steps
(:mod:`stages.control`: stats, pause, sleep, weight reload, profiling).  A request
submitted ``resumable`` stays after each input segment it finishes, until
its final one (``Update`` messages bring the others; see
:mod:`stages.segments`).  On SIGTERM, a
``Shutdown`` message or a fatal error it sends the ``Dying`` sentinel and
exits; it also exits when its parent process disappears (no orphans).

The fault-injection flags of tests and chaos runs (``--help`` lists them) and
what they do are :mod:`stages.faults`, over the worker's seams (``submit``,
``take_chunk``, ``run_step``, ``finish``, ``stepped``, ``before_start``,
``before_load``); a
worker given none of them runs no fault code.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import shutil
import signal
import sys
import time
from typing import Any

import zmq

from stages.auth import Authenticator, KeysError, Security
from stages.base import ReqState, StageModel, StepResult
from stages.connector import INBOX_DOMAIN, ChunkInbox, ChunkOutbox
from stages.control import WorkerControl
from stages.credentials import HandoverError
from stages.faults import FaultInjection, injected
from stages.faults import add_arguments as add_fault_arguments
from stages.lockdown import LockdownError, lock_down
from stages.registry import (
    KINDS,
    KindError,
    build_model,
    check_kind_name,
    model_class,
    sampling_schema,
    spec_for,
)
from stages.sampling_params import check_params
from stages.scheduling import WaitingQueue
from stages.schema import seconds_arg
from stages.segments import SegmentTracker
from stages.wire import (
    Abort,
    Cordoned,
    Dying,
    Heartbeat,
    InboundMsg,
    Leaving,
    OutboundMsg,
    OutItem,
    Outputs,
    Peers,
    Ready,
    RequestError,
    Rpc,
    RpcReply,
    Shutdown,
    Submit,
    Submits,
    Update,
    WireCodec,
    WireError,
)

log = logging.getLogger("stages.worker")

class StopServing(Exception):
    """Ends the serve loop; ``reason`` goes into the ``Dying`` sentinel."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class Worker:
    """The server loop of one replica (continuous batching over ``model``)."""

    def __init__(self, args: argparse.Namespace, model: StageModel, ctx: zmq.Context,
                 security: Security | None = None, authenticator: Authenticator | None = None) -> None:
        self.args = args
        self.model = model
        self.ctx = ctx
        self.security = security
        self.authenticator = authenticator
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.linger = 200
        self.sock.sndtimeo = 1000
        if security is not None:
            security.control_client(self.sock, args.connect)
        self.configure_control(self.sock)
        self.sock.connect(args.connect)
        self.in_codec = WireCodec(InboundMsg)
        self.out_codec = WireCodec(OutboundMsg)
        inbox_tcp = getattr(args, "inbox_tcp", None)
        self.inbox = (ChunkInbox(ctx, args.inbox, security=security, authenticator=authenticator,
                                 tcp=inbox_tcp) if args.inbox or inbox_tcp else None)
        self.outbox = ChunkOutbox(ctx, args.downstream, security=security) if args.downstream else None
        #: graceful leave: when the grace period ends (monotonic), once ``begin_leave`` was called
        self.leave_deadline: float | None = None
        self.cordoned = False  # the orchestrator confirmed it places nothing more here
        self.spec = spec_for(args.kind)
        #: its sampling parameters (for its options): checked again here, whoever sent them
        self.schema = sampling_schema(args.kind, json.loads(args.model_json))
        self.active: dict[str, ReqState] = {}
        #: submitted, not in the batch yet: they join it by priority, deadline, arrival (stages/scheduling.py)
        self.waiting: WaitingQueue[ReqState] = WaitingQueue()
        self.segments = SegmentTracker(model)
        # per request: when it arrived, and when the batch took it (perf_counter), for its timing
        self.t_arrived: dict[str, float] = {}
        self.t_batched: dict[str, float] = {}
        self.stats = {"submits": 0, "aborts": 0, "steps": 0, "outputs": 0, "errors": 0,
                      "garbage_in": 0, "max_batch_seen": 0, "chunks_in": 0, "chunks_out": 0,
                      "updates": 0, "segments_finished": 0}
        self.t_start = time.monotonic()
        self.parent: int = args.parent_pid
        # control methods over RPC (stages/control.py); a level-2 sleep wakes up from a rebuilt model
        self.control = WorkerControl(self, rebuild=lambda: build_model(
            args.kind, json.loads(args.model_json), device=args.device, seed=args.seed,
            slots=args.max_batch, role=args.role), scratch_dir=args.cleanup_dir,
            label=f"stage{args.stage_id}-replica{args.replica}")

    @classmethod
    def before_start(cls, args: argparse.Namespace) -> int | None:
        """Before anything (a seam: :mod:`stages.faults`); an exit code to stop with, or None."""
        return None

    @classmethod
    def before_load(cls, args: argparse.Namespace) -> None:
        """Once the credentials are in, before the model loads (a seam: :mod:`stages.faults`)."""

    def configure_control(self, sock: zmq.Socket) -> None:
        """Hook: socket options of the control link, set before it connects."""

    # ------------------------------------------------------------------ sending
    def send(self, msg: Any) -> None:
        """Send to the orchestrator; blocks while its queue is full (backpressure), but
        gives up and exits if the orchestrator process is gone (no orphan stuck in send)."""
        frames = self.out_codec.encode(msg)
        while True:
            try:
                self.sock.send_multipart(frames, copy=False)
                return
            except zmq.Again:  # SNDTIMEO expired: the orchestrator is not reading
                self.check_parent()

    def check_parent(self) -> None:
        """Stop serving once the parent process (the orchestrator, or the headless command) is gone."""
        if os.getppid() != self.parent:
            raise StopServing("parent process exited")

    # ------------------------------------------------------------------ inbound
    def drain(self) -> None:
        while True:
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            try:
                msg = self.in_codec.decode(frames)
            except WireError as exc:
                self.stats["garbage_in"] += 1
                log.error("stage %d replica %d: dropped a garbage message: %s",
                          self.args.stage_id, self.args.replica, exc)
                continue
            self.handle(msg)
        if self.inbox is not None:
            for chunk in self.inbox.drain():
                self.take_chunk(chunk)

    def take_chunk(self, chunk: Any) -> None:
        """One upstream chunk: fed to its request, or held until the request's submit comes."""
        assert self.inbox is not None
        self.stats["chunks_in"] += 1
        req = self.find(chunk.request_id)
        if req is None:
            self.inbox.hold(chunk)
        elif not self.segments.resumable(req.request_id) or self.segments.route_chunk(
                req, chunk.data, chunk.end, chunk.segment):
            self.feed(req, chunk.data, chunk.end)

    def find(self, rid: str) -> ReqState | None:
        """The active or waiting request ``rid`` (None: not on this worker)."""
        req = self.active.get(rid)
        if req is None:
            req = next((r for r in self.waiting if r.request_id == rid), None)
        return req

    def feed(self, req: ReqState, data: Any, end: bool) -> bool:
        """Hand a chunk to the model; a chunk it refuses fails that request alone (False)."""
        try:
            self.model.feed(req, data, end)
            return True
        except Exception as exc:
            self.stats["errors"] += 1
            self.send(RequestError(req.request_id, f"stage {self.args.stage_id} refused an upstream "
                                                   f"chunk: {type(exc).__name__}: {exc}"))
            self.retire(req.request_id)
            return False

    def handle(self, msg: Any) -> None:
        if type(msg) is Submit:
            self.stats["submits"] += 1
            self.submit(msg)
        elif type(msg) is Submits:
            self.stats["submits"] += len(msg.items)
            for item in msg.items:
                self.submit(item)
        elif type(msg) is Update:
            self.stats["updates"] += 1
            self.update(msg)
        elif type(msg) is Abort:
            self.stats["aborts"] += len(msg.request_ids)
            held = [rid for rid in msg.request_ids if self.find(rid) is not None]
            for rid in msg.request_ids:
                self.retire(rid)
            if msg.ack:  # an acknowledged abort: they are gone, say which ones were here
                self.send(RpcReply(msg.ack, held))
        elif type(msg) is Rpc:
            self.send(RpcReply(msg.call_id, *self.control.call(msg.method, msg.args, msg.kwargs)))
        elif type(msg) is Peers:
            self.set_peers(msg)
        elif type(msg) is Cordoned:
            self.cordoned = True
        elif type(msg) is Shutdown:
            raise StopServing(f"shutdown requested: {msg.reason}" if msg.reason else "shutdown requested")

    def set_peers(self, msg: Peers) -> None:
        """Membership changed: stream to the next stage's replicas as they are now; allow the
        previous stage's replicas (their keys) into this worker's TCP inbox."""
        if self.outbox is None:
            self.outbox = ChunkOutbox(self.ctx, [], security=self.security)
        self.outbox.set_peers(msg.downstream)
        if self.authenticator is not None:
            self.authenticator.set_allowed([k.encode() for k in msg.upstream_keys], INBOX_DOMAIN)

    def begin_leave(self, grace: float) -> None:
        """Leave the pool gracefully: announce it, serve what is held for up to ``grace`` s, stop."""
        if self.leave_deadline is None:
            self.leave_deadline = time.monotonic() + grace
            self.send(Leaving(grace, len(self.active) + len(self.waiting)))
            log.info("leaving the pool: %d requests held, up to %.1fs to finish them",
                     len(self.active) + len(self.waiting), grace)

    def tick(self, now: float) -> None:
        """Once per loop turn: end a graceful leave when nothing is held or the grace ran out."""
        if self.leave_deadline is not None:
            held = len(self.active) + len(self.waiting)
            if held == 0 and self.cordoned:
                raise StopServing("left the pool")
            if now >= self.leave_deadline:
                raise StopServing(f"left the pool; {held} requests were still held when the grace "
                                  "period ended")

    def submit(self, msg: Submit) -> None:
        rid = msg.request_id
        if self.find(rid) is not None:
            self.send(RequestError(rid, f"request {rid!r} is already active on this worker"))
            return
        req = ReqState(rid, msg.payload, msg.downstream)
        if self.inbox is not None:
            req.upstream = True
            req.input_done = False
        try:
            if req.downstream >= 0 and self.outbox is None:
                raise ValueError("submit names a downstream replica but this worker has no --downstream")
            if msg.sampling:
                req.sampling = check_params(self.spec.kind, self.schema, msg.sampling)
            self.model.admit(req)
        except Exception as exc:
            self.stats["errors"] += 1
            self.send(RequestError(rid, f"stage {self.args.stage_id} refused the request: {exc}"))
            return
        if msg.resumable:
            self.segments.open(req)
        if self.inbox is not None:
            for data, end, segment in self.inbox.claim(rid):  # chunks that came before the submit
                if (not msg.resumable or self.segments.route_chunk(req, data, end, segment)) \
                        and not self.feed(req, data, end):
                    return
        self.t_arrived[rid] = now = time.perf_counter()
        left = msg.deadline_in
        self.waiting.push(req, priority=msg.priority, deadline=None if left is None else now + left, now=now)

    def update(self, msg: Update) -> None:
        """The next input segment of a resumable request (it starts once the current one finished)."""
        rid = msg.request_id
        req = self.find(rid)
        if req is None:  # raced with its end here (abort, failure): the pool counts the error as late
            self.send(RequestError(rid, f"stage {self.args.stage_id}: update for a request this "
                                        "worker does not hold"))
            return
        try:
            if not self.segments.resumable(rid):
                raise ValueError("the request was not submitted as resumable")
            self.segments.update(req, msg.payload, msg.final)
        except Exception as exc:
            self.fail(req, f"stage {self.args.stage_id} refused the update: {exc}")

    def fail(self, req: ReqState, message: str) -> None:
        """End one request here with an error (the orchestrator gets it as its terminal output)."""
        self.stats["errors"] += 1
        self.retire(req.request_id)
        self.send(RequestError(req.request_id, message))

    def retire(self, rid: str) -> None:
        self.t_arrived.pop(rid, None)
        self.t_batched.pop(rid, None)
        req = self.active.pop(rid, None)
        if req is None:
            for r in self.waiting:
                if r.request_id == rid:
                    req = r
                    self.waiting.remove(r)
                    break
        if req is not None:
            self.model.release(req)
        self.segments.forget(rid)
        if self.inbox is not None:
            self.inbox.forget(rid)

    def release_held(self) -> None:
        """Retire every request this worker holds, active or waiting, without a word to the orchestrator.

        For a worker that stops serving while its model lives on: a headless
        worker that lost the orchestrator registers again with the same model,
        and the cache slots its held requests took would otherwise stay taken
        (the orchestrator already gave those requests up, or failed them over).
        """
        for rid in [*self.active, *(r.request_id for r in self.waiting)]:
            self.retire(rid)

    def ready_info(self) -> dict[str, Any]:
        """What ``Ready`` tells the orchestrator: the model's info, and the TCP inbox if there is one."""
        info = dict(self.model.info())
        if self.inbox is not None and self.inbox.tcp_address:
            info["inbox_tcp"] = self.inbox.tcp_address
            if self.security is not None and self.security.keypair is not None:
                info["inbox_key"] = self.security.keypair.public.decode()
        return info

    def health_info(self) -> dict[str, Any]:
        """The ``health`` RPC's answer (with the control state added by stages/control.py)."""
        return {"ok": True, "active": len(self.active), "waiting": len(self.waiting),
                "sessions": len(self.segments.sessions), "uptime": time.monotonic() - self.t_start}

    def stats_info(self) -> dict[str, Any]:
        """The ``stats`` RPC's answer (with the control state added by stages/control.py)."""
        s: dict[str, Any] = dict(self.stats)
        s.update(active=len(self.active), waiting=len(self.waiting), pid=os.getpid(),
                 sessions=len(self.segments.sessions), late_chunks=self.segments.late_chunks,
                 stage_id=self.args.stage_id, replica=self.args.replica, model=self.model.info(),
                 # where it runs: its device, and the GPUs its placement let it see (stages/placement.py)
                 device=self.args.device, cuda_visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"))
        if self.inbox is not None:
            s["inbox_pending"] = self.inbox.pending
        s["connector"] = {"inbox": self.inbox.describe() if self.inbox is not None else None,
                          "outbox": self.outbox.describe() if self.outbox is not None else None,
                          "sent": self.outbox.sent if self.outbox is not None else 0,
                          "bytes_sent": self.outbox.bytes_sent if self.outbox is not None else 0}
        return s

    # ------------------------------------------------------------------ stepping
    def step(self) -> bool:
        """Admit, run one batched step, emit, retire; return whether work was done."""
        if self.waiting and len(self.active) < self.args.max_batch:
            t = time.perf_counter()
            while self.waiting and len(self.active) < self.args.max_batch:
                req = self.waiting.pop()
                self.active[req.request_id] = req
                self.t_batched[req.request_id] = t
        batch: list[ReqState] = []
        empty: list[ReqState] = []  # on an empty input segment: closed without a model step
        segments = self.segments
        for r in self.active.values():
            if not segments.resumable(r.request_id):
                if self.model.runnable(r):
                    batch.append(r)
            elif segments.empty(r.request_id):
                empty.append(r)
            elif not segments.parked(r.request_id) and self.model.runnable(r):
                batch.append(r)
        if not batch and not empty:
            return False
        results: list[Any] = []
        if batch:
            self.stats["steps"] += 1
            self.stats["max_batch_seen"] = max(self.stats["max_batch_seen"], len(batch))
            try:
                results = self.run_step(batch)
            except Exception as exc:  # the step failed: fail its requests, keep serving
                log.exception("stage %d: model step failed", self.args.stage_id)
                results = [exc] * len(batch)
        batch += empty
        results += [StepResult(None, True, None)] * len(empty)
        now = time.perf_counter()
        items: list[OutItem] = []
        control_only = self.args.control_only
        for req, res in zip(batch, results, strict=True):
            if isinstance(res, Exception):
                self.stats["errors"] += 1
                items.append(OutItem(req.request_id, None, True, f"model step failed: {res}", now))
                self.retire(req.request_id)
                continue
            assert isinstance(res, StepResult)
            if req.downstream >= 0 and self.outbox is not None and (res.chunk is not None or res.finished):
                try:
                    self.outbox.send(req.downstream, req.request_id, res.chunk, res.finished,
                                     self.segments.segment(req.request_id))
                except (zmq.Again, ValueError):  # downstream gone or far behind: fail it, never block
                    self.stats["errors"] += 1
                    items.append(OutItem(req.request_id, None, True, f"downstream replica {req.downstream} "
                                         "of the next stage is not taking chunks (dead or full)", now))
                    self.retire(req.request_id)
                    continue
                self.stats["chunks_out"] += 1
            if res.finished:
                item = OutItem(req.request_id, None if control_only else res.data, True, None, now)
                if self.segments.resumable(req.request_id) and not self._last_segment(req, item, items):
                    continue
                item.timing = self.timing(req.request_id, now)  # the request leaves: its timing
                self.finish(req, item, items)
                self.retire(req.request_id)
            elif res.data is not None and not control_only:
                items.append(OutItem(req.request_id, res.data, False, None, now))
        if items:
            self.stats["outputs"] += len(items)
            self.send(Outputs(items))
        self.stepped()
        return True

    def run_step(self, batch: list[ReqState]) -> list[Any]:
        """One batched model step (a seam: :mod:`stages.faults` slows it down)."""
        return self.model.step(batch)

    def finish(self, req: ReqState, item: OutItem, items: list[OutItem]) -> None:
        """``req`` finished here: its terminal output goes out with this step's (a seam)."""
        items.append(item)

    def stepped(self) -> None:
        """A step that did work sent its outputs (a seam: :mod:`stages.faults` misbehaves here)."""

    def timing(self, rid: str, now: float) -> tuple[float, float] | None:
        """(seconds queued before the batch took ``rid``, seconds in the batch) for its last output."""
        arrived, batched = self.t_arrived.get(rid), self.t_batched.get(rid)
        if arrived is None or batched is None:
            return None
        return batched - arrived, now - batched

    def _last_segment(self, req: ReqState, item: OutItem, items: list[OutItem]) -> bool:
        """A resumable request finished a segment: True if it was its last (retire it as usual).

        Otherwise its segment-finished output joins ``items``; the request
        stays (parked, or on its next segment if that already arrived).
        """
        self.stats["segments_finished"] += 1
        try:
            if self.segments.segment_finished(req):
                return True
        except Exception as exc:  # the model refused the next segment: fail the request
            self.stats["errors"] += 1
            item.data, item.error = None, f"stage {self.args.stage_id} refused the next segment: {exc}"
            self.retire(req.request_id)
        items.append(item)
        return False

    # ------------------------------------------------------------------ main loop
    def serve(self) -> str:
        a = self.args
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        if self.inbox is not None:
            poller.register(self.inbox.sock, zmq.POLLIN)
        hb_every = a.heartbeat_interval if a.heartbeat_interval > 0 else 1.0  # also the parent check
        next_hb = time.monotonic() + hb_every
        next_purge = time.monotonic() + 5.0
        busy = False
        while True:
            timeout = 0 if busy else max(0.0, min(next_hb - time.monotonic(), 1.0))
            poller.poll(int(timeout * 1000))
            self.drain()
            busy = self.step() if self.control.stepping else False  # paused or asleep: no step
            now = time.monotonic()
            if now >= next_hb:
                next_hb = now + hb_every
                if a.heartbeat_interval > 0:
                    self.send(Heartbeat(time.perf_counter(), len(self.active) + len(self.waiting)))
                self.check_parent()
            self.tick(now)
            if self.inbox is not None and now >= next_purge:
                next_purge = now + 5.0
                self.inbox.purge()

    def close(self) -> None:
        self.control.close()
        if self.inbox is not None:
            self.inbox.close()
        if self.outbox is not None:
            self.outbox.close()
        self.sock.close(linger=200)


class FaultyWorker(FaultInjection, Worker):
    """A worker started with fault flags: :mod:`stages.faults` over its seams."""


def _kind_arg(value: str) -> str:
    try:
        return check_kind_name(value)
    except KindError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m stages.worker",
        description="One stage replica of a trio-orch pipeline, served over ZeroMQ. Normally started "
                    "by the orchestrator's launcher, which binds --connect and waits for Ready.",
    )
    p.add_argument("--connect", required=True, help="ZMQ address of the orchestrator's socket (DEALER)")
    p.add_argument("--auth-fd", type=int, default=None, metavar="FD",
                   help="ask the launcher for this launch's credentials over this inherited socket, once "
                        "locked down (stages/credentials.py), then close it; without it the worker's "
                        "sockets are unsecured (tests only)")
    p.add_argument("--stage-id", type=int, default=0, help="stage index in the pipeline")
    p.add_argument("--replica", type=int, default=0, help="replica index within the stage")
    p.add_argument("--kind", default="echo", type=_kind_arg, metavar="KIND",
                   help=f"model kind: {', '.join(KINDS)} (default echo), or a plug-in model "
                        "class as 'package.module:Class' (see stages/registry.py)")
    p.add_argument("--role", default="", choices=["", "prefill", "decode"],
                   help="run one role of a kind split over two stages (prefill/decode "
                        "disaggregation): prefill sends each request's KV cache to its --downstream "
                        "decode replica, decode takes them in its --inbox")
    p.add_argument("--model-json", default="{}",
                   help="model options as a JSON object: the model constructor's keyword arguments")
    p.add_argument("--python-path", action="append", default=[], metavar="DIR",
                   help="put DIR first on sys.path before the model is imported (repeatable; the "
                        "launcher passes the directory a plug-in model was found in)")
    p.add_argument("--device", default="cpu", help="torch device: cpu (default) or cuda[:N]")
    p.add_argument("--seed", type=int, default=0, help="seed of the dummy weights and sampling")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    p.add_argument("--max-batch", type=int, default=32, help="most requests in one batched step")
    p.add_argument("--heartbeat-interval", type=seconds_arg, default=0.5,
                   help="seconds between heartbeats (0: none; the launcher then cannot see a hang)")
    p.add_argument("--inbox", default=None,
                   help="async-chunk: bind a PULL inbox here; inputs then arrive as upstream chunks")
    p.add_argument("--inbox-tcp", default=None, metavar="ADDR",
                   help="async-chunk: also bind the inbox on this TCP address (e.g. tcp://10.0.0.5:0), "
                        "for upstream replicas on other hosts (CurveZMQ; reported in the ready handshake)")
    p.add_argument("--downstream", action="append", default=[],
                   help="async-chunk: inbox address of a next-stage replica (repeat, in replica order)")
    p.add_argument("--cleanup-dir", default=None, metavar="DIR",
                   help="the launcher's private ipc directory: removed by the worker if it exits because "
                        "its parent died (a SIGKILLed orchestrator leaves no ipc file behind)")
    p.add_argument("--control-only", action="store_true",
                   help="async-chunk, non-final stage: send the orchestrator only the finishing "
                        "control output")
    add_fault_arguments(p)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    fmt = f"%(asctime)s worker[{args.stage_id}.{args.replica}] %(levelname)s %(message)s"
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format=fmt)
    try:  # before it holds anything worth reading, and in an address space nobody opened before
        lock_down(fresh=True)
    except LockdownError as exc:
        print(f"worker stage {args.stage_id}: {exc}", file=sys.stderr, flush=True)
        return 3
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's job: it stops us

    def on_term(signum: int, frame: Any) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second one must not break the cleanup
        raise StopServing(f"signal {signal.Signals(signum).name}")

    def on_parent_gone(signum: int, frame: Any) -> None:  # the stand-in's word: the launcher is gone
        raise StopServing("parent process exited")

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGHUP, on_parent_gone)
    # No PR_SET_PDEATHSIG towards the launcher: it fires when the *thread* that forked us exits, and
    # trio's open_process forks from a thread-cache thread that exits after 10 s idle -- it SIGTERMed
    # healthy workers. Orphans are still caught: our stand-in (the launched process, stages/lockdown.py)
    # sends SIGHUP when the launcher is gone, and serve() exits when getppid() changes.
    args.parent_pid = os.getppid()
    cls = FaultyWorker if injected(args) else Worker
    refused = cls.before_start(args)
    if refused is not None:
        return refused
    try:  # its credentials, handed over to this pid alone: never the environment, argv or a pipe
        security = Security.from_handover(args.auth_fd) if args.auth_fd is not None else None
    except (HandoverError, KeysError) as exc:
        print(f"worker stage {args.stage_id}: {exc}", file=sys.stderr, flush=True)
        return 3
    ctx = zmq.Context()
    auth: Authenticator | None = None
    if security is not None and (args.inbox or args.inbox_tcp):  # this worker binds: it checks its peers
        auth = Authenticator(ctx, security.secret).start()
        assert security.keypair is not None
        auth.allow([security.keypair.public])
    worker: Worker | None = None
    reason = "exited"
    code = 0
    try:
        cls.before_load(args)
        options = json.loads(args.model_json)
        for d in reversed(args.python_path):
            if d not in sys.path:
                sys.path.insert(0, d)
        model_class(args.kind)  # imported first: torch is set up below if the model needs it
        if "torch" in sys.modules:
            import torch

            torch.set_num_threads(max(1, args.threads))
            if args.device.startswith("cuda") and not torch.cuda.is_available():
                print(f"worker stage {args.stage_id}: --device {args.device} requested, but CUDA is not "
                      f"available to torch {torch.__version__} on this machine; use --device cpu",
                      file=sys.stderr, flush=True)
                return 3
        model = build_model(args.kind, options, device=args.device, seed=args.seed, slots=args.max_batch,
                            role=args.role)
        model.warmup()
        worker = cls(args, model, ctx, security, auth)
        worker.send(Ready(args.stage_id, args.replica, os.getpid(), args.kind, worker.ready_info()))
        reason = worker.serve()
    except StopServing as stop:
        reason = stop.reason
    except Exception as exc:
        log.exception("fatal error")
        reason = f"fatal error: {type(exc).__name__}: {exc}"
        code = 1
    finally:
        if worker is not None:
            with contextlib.suppress(zmq.ZMQError):  # best effort, never wait for a stuck reader
                worker.sock.send_multipart(worker.out_codec.encode(Dying(reason)), zmq.NOBLOCK)
            worker.close()
        if auth is not None:
            auth.stop()
        ctx.term()
        if args.cleanup_dir and reason == "parent process exited":
            shutil.rmtree(args.cleanup_dir, ignore_errors=True)
    log.info("exiting: %s", reason)
    return code


if __name__ == "__main__":
    rc = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)  # skip interpreter teardown (a second with torch loaded): sockets are closed
