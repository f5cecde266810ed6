"""The asyncio references' worker launcher: the twin of :func:`trio_orch.cluster.launcher.open_pipeline`.

:func:`open_worker_stages` starts the same ``python -m stages.worker``
processes as :func:`trio_orch.cluster.launcher.open_pipeline` (one replica per stage:
the references have no replica pool; command lines from
:func:`trio_orch.cluster.launcher.worker_argv`), each behind an
:class:`~bench.refs.transport.AsyncZmqStageClient`, waits for their ``Ready``
and stops them, always, on the way out.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
from collections.abc import AsyncIterator

import zmq.asyncio

from bench.refs.transport import AsyncZmqStageClient
from stages.config import PipelineConfig
from trio_orch.cluster.launcher import worker_argv

__all__ = ["open_worker_stages"]


@contextlib.asynccontextmanager
async def open_worker_stages(config: PipelineConfig, *, stop_grace: float = 2.0
                             ) -> AsyncIterator[list[AsyncZmqStageClient]]:
    """Start one worker per stage of ``config``; yield their clients (ready); stop and reap them."""
    config.validate()
    if any(st.replicas != 1 for st in config.stages):
        raise ValueError("open_worker_stages: one replica per stage (the asyncio references have no pool)")
    tmpdir = tempfile.mkdtemp(prefix="trio-orch-asyncio-")
    ctx = zmq.asyncio.Context()
    clients: list[AsyncZmqStageClient] = []
    procs: list[asyncio.subprocess.Process] = []
    watchers: list[asyncio.Task[None]] = []
    try:
        hb = config.heartbeat_timeout if config.heartbeat_interval > 0 else None
        for k, st in enumerate(config.stages):
            addr = f"ipc://{tmpdir}/ctl-s{k}r0"
            client = AsyncZmqStageClient(ctx, addr, stage_id=k, heartbeat_timeout=hb,
                                         name=f"stage {k} ({st.label})")
            clients.append(client)
            errf = open(os.path.join(tmpdir, f"s{k}r0.stderr"), "wb")
            try:
                proc = await asyncio.create_subprocess_exec(
                    *worker_argv(config, k, 0, st, addr, tmpdir), stdin=subprocess.DEVNULL,
                    stdout=errf, stderr=errf)
            finally:
                errf.close()
            procs.append(proc)
            client.pid = proc.pid
            watchers.append(asyncio.create_task(_watch(proc, client), name=f"watch-worker-{k}"))
        async with asyncio.timeout(config.startup_timeout):
            await asyncio.gather(*(c.wait_ready() for c in clients))
        yield clients
    finally:
        for c in clients:
            await c.aclose()
        await asyncio.gather(*(_stop(p, stop_grace) for p in procs))
        for w in watchers:
            w.cancel()
        await asyncio.gather(*watchers, return_exceptions=True)
        ctx.term()
        shutil.rmtree(tmpdir, ignore_errors=True)


async def _watch(proc: asyncio.subprocess.Process, client: AsyncZmqStageClient) -> None:
    code = await proc.wait()
    client.mark_dead(f"worker process {proc.pid} exited with code {code}")


async def _stop(proc: asyncio.subprocess.Process, grace: float) -> None:
    """Wait for the worker (it was asked to shut down), SIGTERM, SIGKILL; always reap."""
    for sig in (None, signal.SIGTERM, signal.SIGKILL):
        if proc.returncode is not None:
            return
        if sig is not None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(sig)
        try:
            async with asyncio.timeout(grace):
                await proc.wait()
        except TimeoutError:
            continue
