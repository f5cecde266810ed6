"""The asyncio references' ZMQ client counts heartbeats as the Trio client does: once the worker is ready.

A worker that imports torch on a busy machine can be silent for longer than a
heartbeat timeout before its ``Ready``; the launcher's startup timeout bounds
that wait, not the heartbeat.  (A loaded CI run saw both asyncio references
declare a starting worker dead, "missed heartbeats", 5 s into its start-up.)
A real ipc socket and a peer that speaks the wire protocol; no worker process.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import zmq
import zmq.asyncio

from bench.refs.transport import AsyncZmqStageClient
from stages.wire import OutboundMsg, Ready, WireCodec


def test_a_worker_silent_before_its_ready_is_not_declared_dead(tmp_path: Path) -> None:
    async def run() -> tuple[Ready, str | None]:
        ctx = zmq.asyncio.Context()
        address = f"ipc://{tmp_path}/ctl"
        # a heartbeat timeout that has run out by the loop's next turn
        client = AsyncZmqStageClient(ctx, address, heartbeat_timeout=1e-9, name="starting")
        try:
            waiting = asyncio.ensure_future(client.wait_ready())
            for _ in range(5):  # the client waits, silent, past its heartbeat timeout (a few turns)
                await asyncio.sleep(0)
            assert not waiting.done()
            worker = ctx.socket(zmq.DEALER)
            worker.connect(address)
            out = WireCodec(OutboundMsg)
            await worker.send_multipart(out.encode(Ready(0, 0, os.getpid(), "echo")))
            ready = await waiting
            worker.close(linger=0)
            return ready, client.dead_reason
        finally:
            await client.aclose()
            ctx.term()

    ready, dead = asyncio.run(run())
    assert ready.kind == "echo" and dead is None
