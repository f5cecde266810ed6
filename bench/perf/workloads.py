"""Benchmark workloads (issue 6 definitions), each run against one started driver.

Every output carries ``(index, t_produced)`` as its data, so the consumer gets
the production timestamp back with the message and no lookup is needed.
Latencies are ``perf_counter`` differences in seconds; the report converts.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from typing import Any

from bench.perf.drivers import BenchDriver
from trio_orch.types import StageOutput

Result = dict[str, Any]
perf = time.perf_counter

#: untimed outputs before a sequential workload is measured: the CPU's power state
#: otherwise carries over from whatever ran before (e.g. a polling implementation)
WARMUP = 200


def _receive_until(driver: BenchDriver, want: Callable[[Any], bool], lat: list[float] | None) -> float:
    """Consume batches until a message satisfies ``want``; record latencies; return its time."""
    while True:
        batch = driver.get()
        now = perf()
        hit = None
        for msg in batch:
            data = getattr(msg, "data", None)
            if lat is not None and isinstance(data, tuple):
                lat.append(now - data[1])
            if want(msg):
                hit = now
        if hit is not None:
            return hit


def seq(driver: BenchDriver, n: int, paced: bool, seed: int = 0) -> Result:
    """``a_seq`` / ``a_paced``: one request, n outputs on final stage 0, one at a time."""
    rng = random.Random(seed)
    driver.add_request("a", "prompt", final_stage_id=0)
    driver.wait_submission()
    warm = min(WARMUP, n)
    for i in range(-warm, 0):  # untimed: the machine settles into this implementation's rhythm
        driver.hand_over(0, [StageOutput("a", (i, perf()), False)])
        _receive_until(driver, lambda m, i=i: m.data[0] == i, None)
    lat: list[float] = []
    cpu0, t_start = driver.cpu_seconds(), perf()
    for i in range(n):
        if paced:
            time.sleep(rng.uniform(0.0002, 0.003))
        t = perf()
        driver.hand_over(0, [StageOutput("a", (i, t), i == n - 1)])
        _receive_until(driver, lambda m, i=i: m.data[0] == i, lat)
    elapsed = perf() - t_start
    cpu = driver.cpu_seconds() - cpu0
    return {"latency": lat, "outputs": n, "elapsed_s": elapsed, "cpu_s": cpu}


def chain(driver: BenchDriver, n: int) -> Result:
    """``c_chain``: n requests one after another, one output per stage."""
    admission: list[float] = []
    fwd01: list[float] = []
    fwd12: list[float] = []
    lat: list[float] = []
    cpu0, t_start = driver.cpu_seconds(), perf()
    for i in range(n):
        rid = f"c{i}"
        t_add = perf()
        driver.add_request(rid, "prompt")
        _, _, t_sub = driver.wait_submission()
        admission.append(t_sub - t_add)
        t0 = perf()
        driver.hand_over(0, [StageOutput(rid, (0, t0), True)])
        _receive_until(driver, lambda m: True, lat)  # stage 0 is a final-output stage
        _, _, t_sub = driver.wait_submission()
        fwd01.append(t_sub - t0)
        t1 = perf()
        driver.hand_over(1, [StageOutput(rid, (1, t1), True)])
        _, _, t_sub = driver.wait_submission()
        fwd12.append(t_sub - t1)
        t2 = perf()
        driver.hand_over(2, [StageOutput(rid, (2, t2), True)])
        _receive_until(driver, lambda m: m.finished, lat)
    elapsed = perf() - t_start
    return {"latency": lat, "admission": admission, "forward_0_1": fwd01, "forward_1_2": fwd12,
            "forward": fwd01 + fwd12, "outputs": 2 * n, "elapsed_s": elapsed,
            "cpu_s": driver.cpu_seconds() - cpu0}


def concurrent(driver: BenchDriver, n_requests: int, n_outputs: int, batched: bool) -> Result:
    """``b_N_batched`` / ``b_N_unbatched``: N requests x M outputs, produced by another thread.

    Batched: one hand-over per step carries an output for every request (one
    ``receive`` returns the whole step).  Unbatched: every output is handed
    over on its own.  The main thread only consumes.
    """
    rids = [f"b{i}" for i in range(n_requests)]
    for rid in rids:
        driver.add_request(rid, "prompt", final_stage_id=0)
    for _ in rids:
        driver.wait_submission()
    last = n_outputs - 1

    def produce() -> None:
        for step in range(n_outputs):
            if batched:
                t = perf()
                driver.hand_over(0, [StageOutput(rid, (step, t), step == last) for rid in rids])
            else:
                for rid in rids:
                    driver.hand_over(0, [StageOutput(rid, (step, perf()), step == last)])

    total = n_requests * n_outputs
    lat: list[float] = []
    cpu0, t_start = driver.cpu_seconds(), perf()
    producer = threading.Thread(target=produce, name="bench-producer", daemon=True)
    producer.start()
    got = 0
    while got < total:
        batch = driver.get()
        now = perf()
        for msg in batch:
            lat.append(now - msg.data[1])
        got += len(batch)
    elapsed = perf() - t_start
    producer.join()
    return {"latency": lat, "outputs": total, "elapsed_s": elapsed, "cpu_s": driver.cpu_seconds() - cpu0}


def idle(driver: BenchDriver, seconds: float) -> Result:
    """CPU used by the orchestrator thread while no request exists."""
    cpu0, t0 = driver.cpu_seconds(), perf()
    time.sleep(seconds)
    return {"idle_cpu_s": driver.cpu_seconds() - cpu0, "idle_wall_s": perf() - t0}
