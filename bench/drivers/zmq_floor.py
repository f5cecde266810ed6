"""The ZMQ floor behind a :class:`~bench.drivers.base.Driver`: the ZMQ path's hops and nothing else.

The same ``stages.worker`` process, the same DEALER socket and wire framing
(:mod:`stages.wire`) as a replica pool's client, and the two thread hops
every implementation's bridge takes: the caller's request goes to the floor's
thread (a ``SimpleQueue`` and an inproc doorbell), that thread encodes and
sends the ``Submit``, waits on the socket with ``zmq.Poller`` (no event
loop), decodes the outputs and hands them to the caller through a
``SimpleQueue`` -- what arrived together leaving as one batch.  No routing,
no tasks.  What the ZMQ workloads measure above it is what the
orchestrator, its loop and its transport add.  Stage 0 only
(``zmq_a_seq``, ``zmq_b_N``: final stage 0).
"""

from __future__ import annotations

import itertools
import queue
import shutil
import subprocess
import tempfile
import threading
from typing import Any

import zmq

from bench.drivers.base import Driver
from stages.wire import (
    Heartbeat,
    InboundMsg,
    OutboundMsg,
    Outputs,
    Ready,
    RequestError,
    Shutdown,
    Submit,
    WireCodec,
)
from trio_orch.cluster.launcher import worker_argv
from trio_orch.types import Message, OrchError, OrchOutput

__all__ = ["PATH", "ZmqFloorDriver"]

#: what this floor bounds
PATH = ("caller thread -> floor thread -> DEALER -> worker -> DEALER -> floor thread -> caller "
        "thread (two futex wake-ups, the socket round trip, no loop)")

_ids = itertools.count()
_STOP = object()


class ZmqFloorDriver(Driver):
    """One echo worker of stage 0, driven by a plain thread that owns its DEALER socket."""

    framework = "pyzmq"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.workers is None:
            raise ValueError("the zmq floor needs a worker pipeline config (workers=...)")
        self.path = "zmq"
        self.ctx: zmq.Context | None = None
        self.sock: zmq.Socket | None = None
        self.bell: zmq.Socket | None = None  # the caller's end of the doorbell
        self.bell_addr = f"inproc://zmq-floor-{next(_ids)}"
        self.proc: subprocess.Popen[bytes] | None = None
        self._inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._batches: queue.SimpleQueue[list[Message] | None] = queue.SimpleQueue()
        self.out_codec = WireCodec(InboundMsg)
        self.in_codec = WireCodec(OutboundMsg)

    def start(self, timeout: float | None = None) -> Driver:
        cfg = self.workers
        assert cfg is not None
        timeout = self.startup_timeout if timeout is None else timeout
        self.worker_dir = tempfile.mkdtemp(prefix="trio-orch-zfloor-")
        addr = f"ipc://{self.worker_dir}/s0.ipc"
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.linger = 0
        self.sock.bind(addr)
        self.bell = self.ctx.socket(zmq.PAIR)
        self.bell.linger = 0
        self.bell.bind(self.bell_addr)
        argv = worker_argv(cfg, 0, 0, cfg.stages[0], addr, self.worker_dir)
        self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
        self.worker_pids = [self.proc.pid]
        self.sock.rcvtimeo = int(timeout * 1000)
        try:
            while not isinstance(self.in_codec.decode(self.sock.recv_multipart(copy=False)), Ready):
                pass
        except zmq.Again:
            self.close()
            raise TimeoutError(f"{self.name}: the worker did not start within {timeout}s") from None
        self.sock.rcvtimeo = -1
        # the socket changes hands once, before the thread starts (a full barrier, as zmq asks)
        self.thread = threading.Thread(target=self._thread_main, name=f"orchestrator-{self.name}",
                                       daemon=True)
        self.thread.start()
        return self

    def _thread_main(self) -> None:
        assert self.ctx is not None and self.sock is not None
        sock, inbox, out = self.sock, self._inbox, self._batches
        bell = self.ctx.socket(zmq.PAIR)
        bell.linger = 0
        bell.connect(self.bell_addr)
        poller = zmq.Poller()
        poller.register(bell, zmq.POLLIN)
        poller.register(sock, zmq.POLLIN)
        encode, decode = self.out_codec.encode, self.in_codec.decode
        try:
            while True:
                ready = dict(poller.poll())
                if bell in ready:
                    while bell.poll(0):
                        bell.recv()
                    while True:
                        try:
                            item = inbox.get_nowait()
                        except queue.Empty:
                            break
                        if item is _STOP:
                            sock.send_multipart(encode(Shutdown("bench done")), zmq.NOBLOCK)
                            return
                        sock.send_multipart(encode(Submit(*item)), copy=False)
                if sock in ready:
                    batch: list[Message] = []
                    while True:
                        try:
                            msg = decode(sock.recv_multipart(zmq.NOBLOCK, copy=False))
                        except zmq.Again:
                            break
                        if type(msg) is Outputs:
                            batch.extend(OrchOutput(it.request_id, 0, it.data, it.finished,
                                                    t_produced=it.t_produced) for it in msg.items)
                        elif type(msg) is RequestError:
                            batch.append(OrchError(msg.request_id, 0, "stage_failed", msg.message))
                        elif type(msg) is not Heartbeat:
                            continue
                    if batch:
                        out.put(batch)
        except BaseException as exc:
            self.run_error = exc
        finally:
            out.put(None)
            bell.close(linger=0)  # the DEALER closes in close(), once the worker had its Shutdown

    def post_request(self, request_id: str, prompt: Any, final_stage_id: int | None = None) -> None:
        assert self.bell is not None
        self._inbox.put((request_id, prompt))
        self.bell.send(b"")

    def take_batch(self, timeout: float) -> list[Message] | None:
        try:
            return self._batches.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"no output within {timeout}s") from None

    def close(self, wait: float = 30.0) -> None:
        if self.thread is not None and self.thread.is_alive() and self.bell is not None:
            self._inbox.put(_STOP)
            self.bell.send(b"")
            self.thread.join(wait)
        elif self.thread is None and self.sock is not None:  # the worker never got ready
            try:
                self.sock.send_multipart(self.out_codec.encode(Shutdown("bench done")), zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
        if self.proc is not None:
            try:
                self.proc.wait(wait)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.sock is not None:
            self.sock.close(linger=0)
            self.sock = None
        if self.bell is not None:
            self.bell.close(linger=0)
            self.bell = None
        if self.ctx is not None:
            self.ctx.term()
            self.ctx = None
        if self.worker_dir is not None:
            shutil.rmtree(self.worker_dir, ignore_errors=True)
        self.set_returned()
