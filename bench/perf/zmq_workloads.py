"""Benchmark workloads over real worker processes (ZeroMQ transport + orchestrator).

The echo workloads run trio-orch (its ZMQ client and replica pools) and the
asyncio references (``bench.refs.transport``: pyzmq asyncio sockets, one worker
per stage); the end-to-end torch pipeline needs pools and the async-chunk
connector, so it runs trio-orch only.  Outputs carry the worker's ``t_produced`` (the
monotonic clock is system-wide on Linux, so a worker's stamp compares with
the consumer's), so dispatch latency here is worker -> socket -> transport
-> orchestrator -> consumer thread.
"""

from __future__ import annotations

import asyncio
import math
import time
from functools import partial
from typing import Any

import trio

from bench.perf.asyncio_drivers import ASYNCIO_DRIVERS, AsyncioDriver
from bench.perf.drivers import BenchDriver, Message, TrioDriver
from bench.refs.orchestrator import AsyncioOrchestrator
from bench.refs.transport import open_worker_stages
from trio_orch.config import PipelineConfig, default_config, echo_config
from trio_orch.launcher import open_pipeline
from trio_orch.orchestrator import Orchestrator
from trio_orch.types import StageOutput

__all__ = ["ZmqTrioDriver", "e2e", "zmq_concurrent", "zmq_seq"]

perf = time.perf_counter


class ZmqTrioDriver(TrioDriver):
    """The Trio orchestrator over a pipeline of worker processes, in a thread."""

    description = "trio-orch over ZMQ worker processes"
    startup_timeout = 60.0

    def __init__(self, config: PipelineConfig) -> None:
        super().__init__()
        self.config = config

    def start(self, num_stages: int = 0, final_stage_ids: set[int] | None = None) -> None:
        super().start(len(self.config.stages), set(self.config.final_stage_ids))

    async def _trio_main(self, num_stages: int, final_stage_ids: set[int]) -> None:
        self.token = trio.lowlevel.current_trio_token()
        async with open_pipeline(self.config) as pipe:
            self.pipe = pipe
            self.orch = Orchestrator(pipe.stages, output_sink=self.outputs.put, **pipe.orchestrator_kwargs())
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                await nursery.start(self.orch.run)
                self._ready.set()
                await self.orch.wait_stopped()

    def hand_over(self, stage_id: int, outputs: list[StageOutput]) -> None:
        raise NotImplementedError("worker processes produce the outputs")


def _latency(msg: Message, now: float) -> float | None:
    t = getattr(msg, "t_produced", 0.0)
    return now - t if t else None


def zmq_seq(driver: BenchDriver, n: int) -> dict[str, Any]:
    """``zmq_a_seq``: n requests one after another, each echoed once by a stage-0 worker."""
    lat: list[float] = []
    cpu0, t0 = driver.cpu_seconds(), perf()
    for i in range(n):
        driver.add_request(f"z{i}", i, final_stage_id=0)
        done = False
        while not done:
            batch = driver.get()
            now = perf()
            for msg in batch:
                d = _latency(msg, now)
                if d is not None:
                    lat.append(d)
                done = done or msg.finished
    return {"latency": lat, "outputs": n, "elapsed_s": perf() - t0, "cpu_s": driver.cpu_seconds() - cpu0}


def zmq_concurrent(driver: BenchDriver, n_requests: int, n_outputs: int) -> dict[str, Any]:
    """``zmq_b_N``: N concurrent requests, each echoed ``n_outputs`` times (one per worker step)."""
    lat: list[float] = []
    cpu0, t0 = driver.cpu_seconds(), perf()
    for i in range(n_requests):
        driver.add_request(f"zb{i}", i, final_stage_id=0)
    left = n_requests
    got = 0
    while left:
        batch = driver.get()
        now = perf()
        for msg in batch:
            d = _latency(msg, now)
            if d is not None:
                lat.append(d)
            got += 1
            left -= msg.finished
    return {"latency": lat, "outputs": got, "elapsed_s": perf() - t0, "cpu_s": driver.cpu_seconds() - cpu0,
            "expected_outputs": n_requests * n_outputs}


def e2e(driver: BenchDriver, prompts: list[str]) -> dict[str, Any]:
    """Default torch pipeline: time to first text token and to first audio chunk, per request."""
    ttft: list[float] = []
    ttfa: list[float] = []
    total: list[float] = []
    for i, prompt in enumerate(prompts):
        t_add = perf()
        driver.add_request(f"e{i}", prompt)
        first_text = first_audio = math.nan
        done = False
        while not done:
            for msg in driver.get(timeout=120):
                now = perf()
                if msg.stage_id == 0 and math.isnan(first_text):
                    first_text = now - t_add
                if msg.stage_id == 2 and math.isnan(first_audio):
                    first_audio = now - t_add
                if msg.finished:
                    done = True
                    if getattr(msg, "kind", None):
                        raise RuntimeError(f"e2e request failed: {msg}")
        ttft.append(first_text)
        ttfa.append(first_audio)
        total.append(perf() - t_add)
    return {"first_text": ttft, "first_audio": ttfa, "total": total, "outputs": 0}


def echo_pipeline(outputs: int) -> PipelineConfig:
    return echo_config(3, final_stage_ids=[0, 2], outputs=outputs)


def torch_pipeline(async_chunk: bool) -> PipelineConfig:
    return default_config().with_overrides(async_chunk=async_chunk)


class AsyncioZmqDriver(AsyncioDriver):
    """An asyncio reference over the same worker processes (pyzmq asyncio sockets).

    ``bench.refs.transport`` starts one worker per stage (the references have no
    replica pool), so only single-replica echo pipelines run here.
    """

    startup_timeout = 60.0

    def __init__(self, orchestrator_cls: type[AsyncioOrchestrator], name: str,
                 config: PipelineConfig) -> None:
        super().__init__()
        self.orchestrator_cls = orchestrator_cls
        self.name = name
        self.config = config

    def start(self, num_stages: int = 0, final_stage_ids: set[int] | None = None) -> None:
        super().start(len(self.config.stages), set(self.config.final_stage_ids))

    async def _amain(self, num_stages: int, final_stage_ids: set[int]) -> None:
        self.loop = asyncio.get_running_loop()
        async with open_worker_stages(self.config) as stages:
            self.stages = stages
            self.orch = self.orchestrator_cls(stages, final_stage_ids)
            self._ready.set()
            try:
                await self.orch.run()
            finally:
                self.orch.output_queue.shutdown()


#: implementations that can run the echo-worker workloads (e2e: trio-orch only)
ZMQ_IMPLEMENTATIONS = ("trio", *ASYNCIO_DRIVERS)


def _driver(impl: str, config: PipelineConfig) -> BenchDriver:
    if impl == "trio":
        return ZmqTrioDriver(config)
    ref = ASYNCIO_DRIVERS[impl]
    return AsyncioZmqDriver(ref.orchestrator_cls, impl, config)  # type: ignore[attr-defined]


def run_zmq_workload(name: str, quick: bool, impl: str = "trio") -> dict[str, Any]:
    """Start the right pipeline, run the workload, stop; returns the raw result."""
    if name == "zmq_a_seq":
        driver = _driver(impl, echo_pipeline(1))
        fn: Any = partial(zmq_seq, n=200 if quick else 1000)
    elif name == "zmq_b_64":
        n_out = 20 if quick else 50
        driver = _driver(impl, echo_pipeline(n_out))
        fn = partial(zmq_concurrent, n_requests=64, n_outputs=n_out)
    elif name in ("e2e", "e2e_async_chunk"):
        if impl != "trio":
            raise ValueError("the end-to-end torch pipeline runs with trio-orch only")
        driver = ZmqTrioDriver(torch_pipeline(name == "e2e_async_chunk"))
        prompts = ["Hello there", "Structured concurrency"][: 1 if quick else 2] * (1 if quick else 2)
        fn = partial(e2e, prompts=prompts)
    else:
        raise ValueError(name)
    driver.start()
    try:
        res = fn(driver)
    finally:
        t = perf()
        driver.shutdown()
        res["shutdown_s"] = perf() - t
    return res


