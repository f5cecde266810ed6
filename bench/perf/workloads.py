"""The benchmark's workloads: one registry (:data:`WORKLOADS`), each run against one started driver.

In-process workloads (``needs="fed"``) hand outputs to scripted stages from
the main thread; every output carries ``(index, t_produced)`` as its data, so
the consumer gets the production timestamp back with the message and no
lookup is needed.  Worker workloads run real ``stages.worker`` processes:
echo workers (``needs="workers"``: trio-orch and the asyncio references) or
the default torch pipeline (``needs="pipeline"``: trio-orch only, it needs
the async-chunk connector); their outputs carry the worker's ``t_produced``
(the monotonic clock is system-wide on Linux, so a worker's stamp compares
with the consumer's), so dispatch latency there is worker -> socket ->
transport -> orchestrator -> consumer thread.  Latencies are
``perf_counter`` differences in seconds; the report converts.
"""

from __future__ import annotations

import gc
import math
import random
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from bench.drivers.base import Driver
from bench.implementations import make_driver
from bench.perf.loop_workloads import loop_chain, loop_concurrent, loop_seq
from stages.config import PipelineConfig, default_config, echo_config
from trio_orch.types import Message, PushStageClient, StageOutput

__all__ = ["WORKLOADS", "Workload", "path_of", "run_workload", "uses_push"]

Result = dict[str, Any]
perf = time.perf_counter

#: untimed outputs before a sequential workload is measured: the CPU's power state
#: otherwise carries over from whatever ran before (e.g. a polling implementation)
WARMUP = 200

#: a full run's sizes: with its 3 rounds at least 10,000 latency samples per implementation and
#: workload, enough for a p99 whose interval is a few per cent wide (``--quick`` stays small)
FULL_SEQ = 3400
FULL_CHAIN = 1700  #: two latency samples per request (its two final-output stages)

def _receive_until(driver: Driver, want: Callable[[Any], bool], lat: list[float] | None) -> float:
    """Consume batches until a message satisfies ``want``; record latencies; return its time."""
    while True:
        batch = driver.next_batch()
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


def seq(driver: Driver, n: int, paced: bool, seed: int = 0) -> Result:
    """``a_seq`` / ``a_paced``: one request, n outputs on final stage 0, one at a time."""
    rng = random.Random(seed)
    driver.post_request("a", "prompt", final_stage_id=0)
    driver.wait_submission()
    warm = min(WARMUP, n)
    for i in range(-warm, 0):  # untimed: the machine settles into this implementation's rhythm
        driver.emit_batch(0, [StageOutput("a", (i, perf()), False)])
        _receive_until(driver, lambda m, i=i: m.data[0] == i, None)
    lat: list[float] = []
    cpu0, t_start = driver.cpu_seconds(), perf()
    for i in range(n):
        if paced:
            time.sleep(rng.uniform(0.0002, 0.003))
        t = perf()
        driver.emit_batch(0, [StageOutput("a", (i, t), i == n - 1)])
        _receive_until(driver, lambda m, i=i: m.data[0] == i, lat)
    elapsed = perf() - t_start
    cpu = driver.cpu_seconds() - cpu0
    return {"latency": lat, "outputs": n, "elapsed_s": elapsed, "cpu_s": cpu}


def chain(driver: Driver, n: int) -> Result:
    """``c_chain``: n requests one after another, one output per stage."""
    admission: list[float] = []
    fwd01: list[float] = []
    fwd12: list[float] = []
    lat: list[float] = []
    cpu0, t_start = driver.cpu_seconds(), perf()
    for i in range(n):
        rid = f"c{i}"
        t_add = perf()
        driver.post_request(rid, "prompt")
        _, _, t_sub = driver.wait_submission()
        admission.append(t_sub - t_add)
        t0 = perf()
        driver.emit_batch(0, [StageOutput(rid, (0, t0), True)])
        _receive_until(driver, lambda m: True, lat)  # stage 0 is a final-output stage
        _, _, t_sub = driver.wait_submission()
        fwd01.append(t_sub - t0)
        t1 = perf()
        driver.emit_batch(1, [StageOutput(rid, (1, t1), True)])
        _, _, t_sub = driver.wait_submission()
        fwd12.append(t_sub - t1)
        t2 = perf()
        driver.emit_batch(2, [StageOutput(rid, (2, t2), True)])
        _receive_until(driver, lambda m: m.finished, lat)
    elapsed = perf() - t_start
    return {"latency": lat, "admission": admission, "forward_0_1": fwd01, "forward_1_2": fwd12,
            "forward": fwd01 + fwd12, "outputs": 2 * n, "elapsed_s": elapsed,
            "cpu_s": driver.cpu_seconds() - cpu0}


def concurrent(driver: Driver, n_requests: int, n_outputs: int, batched: bool, prefix: str = "b") -> Result:
    """``b_N_batched`` / ``b_N_unbatched``: N requests x M outputs, produced by another thread.

    Batched: one hand-over per step carries an output for every request (one
    ``receive`` returns the whole step).  Unbatched: every output is handed
    over on its own.  The main thread only consumes.  ``prefix``: of the
    request ids (one driver may run several of these, each with its own ids).
    """
    rids = [f"{prefix}{i}" for i in range(n_requests)]
    for rid in rids:
        driver.post_request(rid, "prompt", final_stage_id=0)
    for _ in rids:
        driver.wait_submission()
    last = n_outputs - 1

    def produce() -> None:
        for step in range(n_outputs):
            if batched:
                t = perf()
                driver.emit_batch(0, [StageOutput(rid, (step, t), step == last) for rid in rids])
            else:
                for rid in rids:
                    driver.emit_batch(0, [StageOutput(rid, (step, perf()), step == last)])

    total = n_requests * n_outputs
    lat: list[float] = []
    cpu0, t_start = driver.cpu_seconds(), perf()
    producer = threading.Thread(target=produce, name="bench-producer", daemon=True)
    producer.start()
    got = 0
    while got < total:
        batch = driver.next_batch()
        now = perf()
        for msg in batch:
            lat.append(now - msg.data[1])
        got += len(batch)
    elapsed = perf() - t_start
    producer.join()
    return {"latency": lat, "outputs": total, "elapsed_s": elapsed, "cpu_s": driver.cpu_seconds() - cpu0}


#: the throughput curve's concurrencies (``b_sweep``) and the outputs at each, full run / --quick
SWEEP = (1, 4, 16, 64, 256, 512)
SWEEP_OUTPUTS, SWEEP_OUTPUTS_QUICK = 16_384, 8_192


def sweep(driver: Driver, outputs: int) -> Result:
    """``b_sweep``: the unbatched concurrent workload at each of :data:`SWEEP`, ~``outputs`` outputs each.

    One driver runs every concurrency in turn, smallest first; each point is
    timed on its own (``curve``: concurrency -> outputs, seconds, CPU seconds).
    """
    curve: dict[str, dict[str, float]] = {}
    for n in SWEEP:
        res = concurrent(driver, n, max(2, outputs // n), batched=False, prefix=f"s{n}-")
        curve[str(n)] = {k: res[k] for k in ("outputs", "elapsed_s", "cpu_s")}
    totals = {k: sum(p[k] for p in curve.values()) for k in ("outputs", "elapsed_s", "cpu_s")}
    return {"curve": curve, **totals}


def idle(driver: Driver, seconds: float) -> Result:
    """CPU used by the orchestrator thread while no request exists."""
    cpu0, t0 = driver.cpu_seconds(), perf()
    time.sleep(seconds)
    return {"idle_cpu_s": driver.cpu_seconds() - cpu0, "idle_wall_s": perf() - t0}


def _latency(msg: Message, now: float) -> float | None:
    t = getattr(msg, "t_produced", 0.0)
    return now - t if t else None


def zmq_seq(driver: Driver, n: int) -> dict[str, Any]:
    """``zmq_a_seq``: n requests one after another, each echoed once by a stage-0 worker."""
    lat: list[float] = []
    cpu0, t0 = driver.cpu_seconds(), perf()
    for i in range(n):
        driver.post_request(f"z{i}", i, final_stage_id=0)
        done = False
        while not done:
            batch = driver.next_batch()
            now = perf()
            for msg in batch:
                d = _latency(msg, now)
                if d is not None:
                    lat.append(d)
                done = done or msg.finished
    return {"latency": lat, "outputs": n, "elapsed_s": perf() - t0, "cpu_s": driver.cpu_seconds() - cpu0}


def zmq_concurrent(driver: Driver, n_requests: int, n_outputs: int) -> dict[str, Any]:
    """``zmq_b_N``: N concurrent requests, each echoed ``n_outputs`` times (one per worker step)."""
    lat: list[float] = []
    cpu0, t0 = driver.cpu_seconds(), perf()
    for i in range(n_requests):
        driver.post_request(f"zb{i}", i, final_stage_id=0)
    left = n_requests
    got = 0
    while left:
        batch = driver.next_batch()
        now = perf()
        for msg in batch:
            d = _latency(msg, now)
            if d is not None:
                lat.append(d)
            got += 1
            left -= msg.finished
    return {"latency": lat, "outputs": got, "elapsed_s": perf() - t0, "cpu_s": driver.cpu_seconds() - cpu0,
            "expected_outputs": n_requests * n_outputs}


def e2e(driver: Driver, prompts: list[str]) -> dict[str, Any]:
    """Default torch pipeline: time to first text token and to first audio chunk, per request."""
    ttft: list[float] = []
    ttfa: list[float] = []
    total: list[float] = []
    for i, prompt in enumerate(prompts):
        t_add = perf()
        driver.post_request(f"e{i}", prompt)
        first_text = first_audio = math.nan
        done = False
        while not done:
            for msg in driver.next_batch(timeout=120):
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


# ---------------------------------------------------------------------------- the registry
Measure = Callable[[Driver, bool], Result]


@dataclass(frozen=True, slots=True)
class Workload:
    """One workload: what it needs of an implementation, how to set up its driver, what it measures."""

    name: str
    description: str
    needs: str  #: the capability (bench.implementations.CAPABILITIES) an implementation must have
    setup: Callable[[bool], dict[str, Any]]  #: quick -> the driver's options
    measure: Measure  #: (started driver, quick) -> raw result
    once: bool = False  #: measured once per run, not once per round (idle CPU, the torch pipeline)


def _in_process(quick: bool) -> dict[str, Any]:
    return {"num_stages": 3, "final_stage_ids": {0, 2}, "push": True}


def _in_loop(quick: bool) -> dict[str, Any]:
    return {"num_stages": 3, "final_stage_ids": {0, 2}, "push": True, "in_loop_consumer": True}


def _echo_workers(outputs_full: int, outputs_quick: int) -> Callable[[bool], dict[str, Any]]:
    return lambda quick: {"workers": echo_pipeline(outputs_quick if quick else outputs_full)}


def _torch(async_chunk: bool) -> Callable[[bool], dict[str, Any]]:
    return lambda quick: {"workers": torch_pipeline(async_chunk)}


def _e2e(driver: Driver, quick: bool) -> Result:
    prompts = ["Hello there", "Structured concurrency"][: 1 if quick else 2] * (1 if quick else 2)
    return e2e(driver, prompts)


WORKLOADS: dict[str, Workload] = {w.name: w for w in (
    Workload("a_seq", f"one request, {FULL_SEQ:,} outputs on a final stage, each handed over when "
             "the previous arrived", "fed", _in_process,
             lambda d, q: seq(d, 300 if q else FULL_SEQ, paced=False)),
    Workload("a_paced", "a_seq with a uniform random 0.2-3 ms gap before each output", "fed", _in_process,
             lambda d, q: seq(d, 100 if q else FULL_SEQ, paced=True)),
    Workload("c_chain", f"{FULL_CHAIN:,} requests one after another, one output per stage: admission, "
             "forward, final", "fed", _in_process, lambda d, q: chain(d, 50 if q else FULL_CHAIN)),
    Workload("b_64_batched", "64 concurrent requests x 60 outputs, one batch per step", "fed", _in_process,
             lambda d, q: concurrent(d, 64, 20 if q else 60, batched=True)),
    Workload("b_64_unbatched", "64 concurrent requests x 60 outputs, each output on its own", "fed",
             _in_process, lambda d, q: concurrent(d, 64, 20 if q else 60, batched=False)),
    Workload("b_512_batched", "512 concurrent requests x 50 outputs, one batch per step", "fed", _in_process,
             lambda d, q: concurrent(d, 512, 10 if q else 50, batched=True)),
    Workload("b_512_unbatched", "512 concurrent requests x 50 outputs, each output on its own", "fed",
             _in_process, lambda d, q: concurrent(d, 512, 10 if q else 50, batched=False)),
    Workload("b_sweep", "the throughput curve: b_N_unbatched at N = " + ", ".join(map(str, SWEEP))
             + f", {SWEEP_OUTPUTS:,} outputs each", "fed", _in_process,
             lambda d, q: sweep(d, SWEEP_OUTPUTS_QUICK if q else SWEEP_OUTPUTS)),
    Workload("loop_a_seq", "a_seq with producer and consumer as tasks in the implementation's own loop "
             "(no thread hand-off)", "in_loop", _in_loop, lambda d, q: loop_seq(d, 300 if q else FULL_SEQ)),
    Workload("loop_c_chain", "c_chain inside the implementation's own loop", "in_loop", _in_loop,
             lambda d, q: loop_chain(d, 50 if q else FULL_CHAIN)),
    Workload("loop_b_512_unbatched", "b_512_unbatched with a producer task and a consumer task in the "
             "implementation's own loop", "in_loop", _in_loop,
             lambda d, q: loop_concurrent(d, 512, 10 if q else 50)),
    Workload("idle", "orchestrator-thread CPU with no requests (5 s)", "fed", _in_process,
             lambda d, q: idle(d, 1.0 if q else 5.0), once=True),
    Workload("zmq_a_seq", f"a_seq over ZMQ echo workers: {FULL_SEQ:,} requests one after another, one "
             "output each",
             "workers", _echo_workers(1, 1), lambda d, q: zmq_seq(d, 200 if q else FULL_SEQ)),
    Workload("zmq_b_64", "64 concurrent requests x 60 outputs from ZMQ echo workers (worker batches per "
             "step)", "workers", _echo_workers(60, 20),
             lambda d, q: zmq_concurrent(d, 64, 20 if q else 60)),
    Workload("e2e", "default torch pipeline, stage by stage: time to first text and to first audio",
             "pipeline", _torch(False), _e2e, once=True),
    Workload("e2e_async_chunk", "default torch pipeline with async-chunk: time to first text and to first "
             "audio", "pipeline", _torch(True), _e2e, once=True),
)}


def path_of(workload: str) -> str:
    """Which path a workload runs: ``thread`` (hand-off from threads), ``loop`` (in the loop) or ``zmq``."""
    needs = WORKLOADS[workload].needs
    return {"in_loop": "loop", "workers": "zmq", "pipeline": "zmq"}.get(needs, "thread")


def uses_push(driver: Driver) -> bool:
    """Whether a started driver's shell takes the push path (its stages offer ``pump`` and it uses it).

    The Trio shell pumps every stage client that offers it; an asyncio
    reference only where its class says so (``push_path``).
    """
    takes = getattr(type(getattr(driver, "orch", None)), "push_path", True)
    return bool(takes) and any(isinstance(s, PushStageClient) for s in driver.stages)


def run_workload(name: str, impl: str, quick: bool) -> Result:
    """Start a fresh driver for ``impl``, run the workload, stop it; the raw result (with ``shutdown_s``)."""
    wl = WORKLOADS[name]
    driver = make_driver(impl, **wl.setup(quick))
    try:
        driver.start()
    except (RuntimeError, TimeoutError) as exc:  # worker processes starting on a loaded machine
        print(f"{name} {impl}: start failed ({exc}: {exc.__cause__}); starting once more", file=sys.stderr)
        driver.close()
        driver = make_driver(impl, **wl.setup(quick))
        driver.start()
    push = None if getattr(driver, "path", None) else uses_push(driver)  # a floor has a path, no shell
    # what a serving process does once started (vLLM freezes its heap after start-up): the objects
    # alive now -- imported modules, earlier rounds -- move out of the collector's reach, so a full
    # collection during the measurement scans only what the workload made, for every implementation
    gc.collect()
    gc.freeze()
    try:
        res = wl.measure(driver, quick)
    finally:
        t = perf()
        driver.close()
        shutdown_s = perf() - t
        gc.unfreeze()
    res["shutdown_s"] = shutdown_s
    if push is not None:
        res["push"] = push
    return res
