"""The faults of the chaos matrix: each one an ``inject`` coroutine plus its run options.

An ``inject(run)`` waits for its moment (a fraction of the load submitted),
does its damage, and marks ``t_fault`` / ``t_detect`` / ``t_recover`` on the
:class:`~bench.chaos.run.ChaosRun` from what it observes (the supervisor's
restart events, counters, the output backlog).  The HTTP faults live in
:mod:`bench.chaos.server`.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import trio

from bench.chaos.run import ChaosRun, Inject
from trio_orch.types import StageOutput

__all__ = ["FAULTS", "Fault", "GatedStage"]


@dataclass
class Fault:
    name: str
    description: str
    inject: Inject
    options: dict[str, Any] = field(default_factory=dict)  # run_fault keyword arguments


async def kill9(run: ChaosRun) -> None:
    await run.submitted_at_least(0.3)
    run.mark_fault()
    os.kill(run.worker_pid(1, 0), signal.SIGKILL)
    await run.mark_restart(1, 0)


async def sigstop(run: ChaosRun) -> None:
    await run.submitted_at_least(0.3)
    run.mark_fault()
    os.kill(run.worker_pid(2, 1), signal.SIGSTOP)  # the supervisor kills it after the heartbeat timeout
    await run.mark_restart(2, 1)


def _garbage_config(cfg: Any) -> None:
    # Early steps of replica 0 (the first placement of every stage): sure to happen under any load.
    cfg.stages[0].replica_args[0] = ["--garbage-after-steps", "2", "--unknown-rid-after-steps", "3"]
    cfg.stages[2].replica_args[0] = ["--garbage-after-steps", "1"]


async def garbage(run: ChaosRun) -> None:
    # The workers send their bad messages themselves (replica_args); we watch the counters.
    def total() -> int:
        return sum(n for (_, kind), n in run.sup.bad_input().items() if kind in ("garbage", "unknown"))

    while total() == 0:
        await trio.sleep(0.005)
    run.mark_fault()
    run.notes["healthy_replicas_kept"] = sum(len(p.live_replicas()) for p in run.pipe.stages)


async def slow_consumer(run: ChaosRun) -> None:
    await run.submitted_at_least(0.3)
    run.mark_fault()
    run.consumer_delay = 0.002  # 2 ms per message for 2 s ...
    await trio.sleep(2.0)
    run.consumer_delay = 0.0
    run.consumer_gate = gate = trio.Event()  # ... then not reading at all for 2 s
    backlog = run.orch._out_recv  # the orchestrator's unbounded output channel
    peak = 0
    with trio.move_on_after(2.0):
        while True:
            peak = max(peak, backlog.statistics().current_buffer_used)
            await trio.sleep(0.01)
    gate.set()
    run.consumer_gate = None
    run.mark_fault()  # from here: how long until the backlog is gone
    while backlog.statistics().current_buffer_used > 0:
        await trio.sleep(0.005)
    run.notes["peak_backlog_msgs"] = peak
    run.mark_recover()


async def abort_storm(run: ChaosRun) -> None:
    send, recv = trio.open_memory_channel[tuple[str, float]](float("inf"))
    aborted = 0

    def maybe_abort(rid: str) -> None:
        if run.rng.random() < 0.5:
            send.send_nowait((rid, run.rng.uniform(0.0, 0.2)))

    async def abort_later(rid: str, delay: float) -> None:
        nonlocal aborted
        await trio.sleep(delay)
        await run.orch.abort(rid)
        aborted += 1

    async def close_after_load() -> None:
        await run.load_done.wait()
        send.close()

    run.on_accepted = maybe_abort
    run.mark_fault()
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(close_after_load)
            async for rid, delay in recv:
                nursery.start_soon(abort_later, rid, delay)
    finally:
        run.notes["aborts_sent"] = aborted


async def shutdown_under_load(run: ChaosRun) -> None:
    await run.submitted_at_least(0.5)
    run.stopped_on_purpose = True
    run.mark_fault()
    active = run.orch.active_requests
    await run.orch.shutdown()
    run.mark_detect()
    run.mark_recover()  # recover = how long shutdown took
    run.notes["active_at_shutdown"] = active


def _fail_twice(stage: int, replica: int, attempt: int) -> list[str]:
    return ["--fail-at-startup", "injected: cannot load weights"] if attempt <= 2 else []


async def startup_failure(run: ChaosRun) -> None:
    await run.submitted_at_least(0.3)
    run.mark_fault()
    os.kill(run.worker_pid(0, 1), signal.SIGKILL)  # its first two replacements fail at startup
    await run.mark_restart(0, 1)


class GatedStage:
    """A stage client whose ``submit`` waits while the gate is closed (a stalled submit path)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.open = trio.Event()
        self.open.set()

    async def submit(self, request_id: str, payload: Any) -> None:
        await self.open.wait()
        await self.inner.submit(request_id, payload)

    async def abort(self, request_ids: list[str]) -> None:
        await self.inner.abort(request_ids)

    async def receive(self) -> list[StageOutput]:
        return await self.inner.receive()

    async def aclose(self) -> None:
        self.open.set()
        await self.inner.aclose()


_gates: list[GatedStage] = []


def _gate_stage0(stages: list[Any]) -> list[Any]:
    gated = GatedStage(stages[0])
    _gates[:] = [gated]
    return [gated, *stages[1:]]


async def channel_full(run: ChaosRun) -> None:
    gate = _gates[0]
    await run.submitted_at_least(0.3)
    run.mark_fault()
    gate.open = trio.Event()  # the request handler now blocks: the bounded channel fills up
    refused = burst = 0
    with trio.move_on_after(3.0):
        while True:
            rid = f"{run.name}-burst-{burst}"
            try:
                run.ledger.accepted.add(rid)
                run.orch.add_request_nowait(rid, "burst" if run.opts.echo else
                                            {"text": "burst", "max_new_tokens": run.opts.max_new_tokens})
                burst += 1
            except trio.WouldBlock:
                run.ledger.accepted.discard(rid)
                refused += 1
                run.mark_detect()
            await trio.sleep(0.01)
    gate.open.set()
    while run.orch.queued_requests > 0:
        await trio.sleep(0.005)
    run.mark_recover()
    run.notes.update(refused_channel_full=refused, accepted_during_stall=burst)


async def connector_peer_killed(run: ChaosRun) -> None:
    await run.submitted_at_least(0.3)
    run.mark_fault()
    os.kill(run.worker_pid(2, 0), signal.SIGKILL)  # the code2wav replica stage 1 streams chunks to
    await run.mark_restart(2, 0)


async def leave_rejoin(run: ChaosRun) -> None:
    await run.submitted_at_least(0.3)
    run.mark_fault()
    await run.sup.leave(1, 0)
    run.mark_detect()  # left: drained and stopped
    await run.submitted_at_least(0.6)
    await run.sup.rejoin(1, 0)
    run.mark_recover()  # back in the pool and placed on


def _faults() -> list[Fault]:
    cfg_hook: Callable[[Any], None] = _garbage_config
    return [
        Fault("kill9", "kill -9 a talker replica under load", kill9),
        Fault("sigstop", "SIGSTOP a code2wav replica (hung: no heartbeats)", sigstop),
        Fault("garbage", "workers send undecodable frames and outputs for unknown request ids", garbage,
              {"config_hook": cfg_hook}),
        Fault("slow_consumer", "the consumer reads slowly for 2 s, then not at all for 2 s (recover: from "
              "resuming to an empty output backlog)", slow_consumer),
        Fault("abort_storm", "half the requests aborted at random points (0-200 ms after accept)",
              abort_storm),
        Fault("shutdown", "orchestrator shutdown (no drain) with half the load sent", shutdown_under_load),
        Fault("startup_failure", "kill a thinker replica; its first two replacements fail at startup",
              startup_failure, {"sup_kwargs": {"extra_args": _fail_twice}}),
        Fault("channel_full", "stage 0 submits stall 3 s: the request channel (16) stays full",
              channel_full, {"orch_kwargs": {"request_queue_size": 16}, "wrap_stages": _gate_stage0}),
        Fault("connector_peer_killed", "async-chunk: kill -9 the code2wav replica receiving chunks",
              connector_peer_killed, {"async_chunk": True}),
        Fault("leave_rejoin", "a talker replica leaves gracefully (drained) and rejoins later", leave_rejoin),
    ]


FAULTS: dict[str, Fault] = {f.name: f for f in _faults()}
