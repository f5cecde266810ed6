"""In-loop workloads: producer and consumer are tasks inside the implementation's own event loop.

The thread workloads (:mod:`bench.perf.workloads`) hand every output over
from the main thread and back, so each of them pays two thread wake-ups
(25-80 us on a 2-vCPU VM) that no implementation can avoid -- the floor of
those runs.  Here the stage's outputs are produced and consumed by tasks of
the implementation's loop (Trio tasks for trio-orch and the floor, tasks of
the references' asyncio loop), so what is measured is the shell itself:
stage -> (reader) -> dispatcher -> output channel -> consumer task.  The
bodies are written once, with AnyIO, and run unchanged on either library
(:meth:`~bench.drivers.base.Driver.run_in_loop`); the only calls into the
implementation are the driver's ``loop_emit``, ``loop_add`` and
``loop_next_batch``.
"""

from __future__ import annotations

import time
from typing import Any

import anyio
import anyio.lowlevel

from bench.drivers.base import Driver
from trio_orch.types import StageOutput

__all__ = ["loop_chain", "loop_concurrent", "loop_seq"]

perf = time.perf_counter
WARMUP = 200
TIMEOUT = 120.0


async def _until(driver: Driver, index: int, lat: list[float] | None) -> None:
    """Consume batches until the output with ``index`` arrived; record latencies."""
    while True:
        batch = await driver.loop_next_batch()
        if batch is None:
            raise RuntimeError("the output stream ended")
        now = perf()
        hit = False
        for m in batch:
            data = m.data
            if lat is not None:
                lat.append(now - data[1])
            hit = hit or data[0] == index
        if hit:
            return


def loop_seq(driver: Driver, n: int) -> dict[str, Any]:
    """``loop_a_seq``: one request, n outputs, each produced once the previous one was consumed."""
    driver.post_request("a", "prompt", final_stage_id=0)
    driver.wait_submission()

    async def body() -> dict[str, Any]:
        for i in range(-min(WARMUP, n), 0):
            driver.loop_emit(0, [StageOutput("a", (i, perf()), False)])
            await _until(driver, i, None)
        lat: list[float] = []
        cpu0, t0 = driver.cpu_seconds(), perf()
        for i in range(n):
            driver.loop_emit(0, [StageOutput("a", (i, perf()), i == n - 1)])
            await _until(driver, i, lat)
        return {"latency": lat, "outputs": n, "elapsed_s": perf() - t0, "cpu_s": driver.cpu_seconds() - cpu0}

    return driver.run_in_loop(body, timeout=TIMEOUT)


async def _submitted(driver: Driver) -> float:
    """The next stage submit's timestamp (recorded by the stage at the submit), polled at checkpoints."""
    q = driver.submitted
    while q.empty():
        await anyio.lowlevel.checkpoint()
    return q.get_nowait()[2]


def loop_chain(driver: Driver, n: int) -> dict[str, Any]:
    """``loop_c_chain``: n requests one after another, one output per stage, all inside the loop."""

    async def body() -> dict[str, Any]:
        admission: list[float] = []
        fwd: list[float] = []
        lat: list[float] = []
        cpu0, t_start = driver.cpu_seconds(), perf()
        for i in range(n):
            rid = f"c{i}"
            t_add = perf()
            driver.loop_add(rid, "prompt")
            admission.append(await _submitted(driver) - t_add)
            for k in range(3):
                t = perf()
                driver.loop_emit(k, [StageOutput(rid, (k, t), True)])
                if k in (0, 2):  # final-output stages: the consumer gets it
                    await _until(driver, k, lat)
                if k < 2:
                    fwd.append(await _submitted(driver) - t)
        return {"latency": lat, "admission": admission, "forward": fwd, "outputs": 2 * n,
                "elapsed_s": perf() - t_start, "cpu_s": driver.cpu_seconds() - cpu0}

    return driver.run_in_loop(body, timeout=TIMEOUT)


def loop_concurrent(driver: Driver, n_requests: int, n_outputs: int) -> dict[str, Any]:
    """``loop_b_N_unbatched``: N requests x M outputs, each handed over on its own by a producer task.

    The producer emits one output per request per step, each in its own
    call, and yields to the loop once per step (a stage that makes one
    output per request per step); the consumer task takes what comes.
    """
    rids = [f"b{i}" for i in range(n_requests)]
    for rid in rids:
        driver.post_request(rid, "prompt", final_stage_id=0)
    for _ in rids:
        driver.wait_submission()
    last, total = n_outputs - 1, n_requests * n_outputs

    async def body() -> dict[str, Any]:
        lat: list[float] = []

        async def produce() -> None:
            emit = driver.loop_emit
            for step in range(n_outputs):
                for rid in rids:
                    emit(0, [StageOutput(rid, (step, perf()), step == last)])
                await anyio.lowlevel.checkpoint()

        cpu0, t0 = driver.cpu_seconds(), perf()
        async with anyio.create_task_group() as tg:
            tg.start_soon(produce)
            got = 0
            while got < total:
                batch = await driver.loop_next_batch()
                if batch is None:
                    raise RuntimeError("the output stream ended")
                now = perf()
                for m in batch:
                    lat.append(now - m.data[1])
                got += len(batch)
        elapsed = perf() - t0
        return {"latency": lat, "outputs": total, "elapsed_s": elapsed, "cpu_s": driver.cpu_seconds() - cpu0}

    return driver.run_in_loop(body, timeout=TIMEOUT)
