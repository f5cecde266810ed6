"""The ZMQ floor behind a :class:`~bench.drivers.base.Driver`: a bare pyzmq round trip, no event loop.

The same ``stages.worker`` process, the same DEALER socket and wire framing
(:mod:`stages.wire`) as a replica pool's client, but the benchmark's own
thread sends the ``Submit`` and blocks in ``recv_multipart`` for the
outputs: no orchestrator, no event loop, no thread hand-off.  What the ZMQ
workloads measure above it is what the orchestrator and its transport add.
Stage 0 only (``zmq_a_seq``, ``zmq_b_N``: final stage 0).
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import threading
from typing import Any

import zmq

from bench.drivers.base import Driver, thread_cpu_seconds
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

__all__ = ["ZmqFloorDriver"]


class ZmqFloorDriver(Driver):
    """One echo worker of stage 0, driven by a blocking DEALER socket in the caller's thread."""

    framework = "pyzmq"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.workers is None:
            raise ValueError("the zmq floor needs a worker pipeline config (workers=...)")
        self.ctx: zmq.Context | None = None
        self.sock: zmq.Socket | None = None
        self.proc: subprocess.Popen[bytes] | None = None
        self.caller: threading.Thread | None = None
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
        argv = worker_argv(cfg, 0, 0, cfg.stages[0], addr, self.worker_dir)
        self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
        self.worker_pids = [self.proc.pid]
        self.caller = threading.current_thread()
        self.sock.rcvtimeo = int(timeout * 1000)
        try:
            while not isinstance(self.in_codec.decode(self.sock.recv_multipart(copy=False)), Ready):
                pass
        except zmq.Again:
            self.close()
            raise TimeoutError(f"{self.name}: the worker did not start within {timeout}s") from None
        self.sock.rcvtimeo = -1
        return self

    def cpu_seconds(self) -> float:
        return thread_cpu_seconds(self.caller)  # the whole floor runs in the caller's thread

    def post_request(self, request_id: str, prompt: Any, final_stage_id: int | None = None) -> None:
        assert self.sock is not None
        self.sock.send_multipart(self.out_codec.encode(Submit(request_id, prompt)), copy=False)

    def next_batch(self, timeout: float = 10.0) -> list[Message]:
        assert self.sock is not None
        poll_ms = int(timeout * 1000)
        while True:
            if not self.sock.poll(poll_ms):
                raise TimeoutError(f"no output within {timeout}s")
            msg = self.in_codec.decode(self.sock.recv_multipart(copy=False))
            if type(msg) is Outputs:
                return [OrchOutput(it.request_id, 0, it.data, it.finished, t_produced=it.t_produced)
                        for it in msg.items]
            if type(msg) is RequestError:
                return [OrchError(msg.request_id, 0, "stage_failed", msg.message)]
            if type(msg) is not Heartbeat:
                continue

    def close(self, wait: float = 30.0) -> None:
        if self.sock is not None:
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
        if self.ctx is not None:
            self.ctx.term()
            self.ctx = None
        if self.worker_dir is not None:
            shutil.rmtree(self.worker_dir, ignore_errors=True)
        self.set_returned()
