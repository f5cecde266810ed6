"""The chaos matrix's faults: the :class:`Fault` protocol and the one registry, :data:`FAULTS`.

A fault is a row of the matrix: ``await fault.run(opts)`` starts what it
needs, injects itself under load, measures and stops, and returns a
:class:`~bench.chaos.run.ChaosResult` (it never raises: a crash is a failed
row).  Two kinds satisfy the protocol:

* :class:`PipelineFault` -- an ``inject(run)`` coroutine run beside the load
  of a pipeline under the supervisor (:func:`bench.chaos.run.run_fault`); it
  waits for its moment (a fraction of the load submitted), does its damage
  and marks ``t_fault`` / ``t_detect`` / ``t_recover`` on the
  :class:`~bench.chaos.run.ChaosRun` from what it observes (the supervisor's
  restart events, counters, the output backlog); ``setup`` says how its run
  differs from the default one;
* :class:`~bench.chaos.server.HttpFault` -- load and fault against a real
  ``trio-orch serve`` process.

The ``remote_*`` faults run with a registrar on loopback TCP
(``RunSetup(listen=True)``) and act on headless workers that join over it
(:mod:`bench.chaos.remote`).  The ``ray_*`` faults (``RunSetup(ray=True)``)
run only with ``--worker-backend ray``, on a two-node Ray cluster the command
starts (:mod:`bench.chaos.ray`); the others only without it.

Adding a fault is adding an entry to :data:`FAULTS` here (with its inject
coroutine, for a pipeline fault) and a test.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import trio

from bench.chaos.ray import placement, ray_actor_killed, ray_node_lost, ray_worker_killed
from bench.chaos.remote import RemoteWorkers
from bench.chaos.run import ChaosOptions, ChaosResult, ChaosRun, Inject, RunSetup, run_fault
from bench.chaos.server import HttpFault
from stages.auth import Keypair
from stages.config import PipelineConfig
from trio_orch.cluster.launcher import inbox_address
from trio_orch.testing.rogue import read_report
from trio_orch.types import StageOutput

__all__ = ["FAULTS", "Fault", "GatedStage", "PipelineFault"]


class Fault(Protocol):
    """One row of the chaos matrix."""

    @property
    def name(self) -> str: ...

    @property
    def description(self) -> str: ...

    async def run(self, opts: ChaosOptions) -> ChaosResult:
        """Start what the fault needs, inject it under load, measure, stop; never raises."""
        ...


@dataclass(frozen=True)
class PipelineFault:
    """A fault injected by ``inject(run)`` into a pipeline under load (see the module docstring)."""

    name: str
    description: str
    inject: Inject
    setup: RunSetup = field(default_factory=RunSetup)

    async def run(self, opts: ChaosOptions) -> ChaosResult:
        return await run_fault(self.name, self.description, self.inject, opts, self.setup)


async def holds_queued(run: ChaosRun, stage: int, replica: int) -> None:
    """Wait until that replica holds more requests than its batch (some wait inside it), or the load ended."""
    pool = run.pipe.stages[stage]
    while pool.in_flight()[replica] <= FAILOVER_BATCH and not run.load_done.is_set():
        await trio.sleep(0.005)
    run.notes["held_when_hit"] = pool.in_flight()[replica]


async def kill9(run: ChaosRun) -> None:
    await run.submitted_at_least(0.3)
    await holds_queued(run, 1, 0)
    run.mark_fault()
    os.kill(run.worker_pid(1, 0), signal.SIGKILL)
    await run.mark_restart(1, 0)


async def sigstop(run: ChaosRun) -> None:
    await run.submitted_at_least(0.3)
    await holds_queued(run, 2, 1)
    run.mark_fault()
    os.kill(run.worker_pid(2, 1), signal.SIGSTOP)  # the supervisor kills it after the heartbeat timeout
    await run.mark_restart(2, 1)


def _queue_at(stage: int) -> Callable[[PipelineConfig], None]:
    """Small batches at ``stage``: most of a replica's requests wait inside it, having produced nothing.

    A replica then dies holding queued requests, which failover resends; with
    the default batch every request it held was in its batch, with output.
    Each step also takes a while (``FAILOVER_STEP_MS``), so that stage is the
    pipeline's bottleneck on any machine: its replicas hold more than a batch
    for as long as the load lasts, not only when the machine happens to be slow.
    """
    def hook(cfg: PipelineConfig) -> None:
        cfg.stages[stage].max_batch = FAILOVER_BATCH
        cfg.stages[stage].worker_args += ["--step-delay-ms", str(FAILOVER_STEP_MS)]

    return hook


#: the batch of the stage whose replica the failover rows kill
FAILOVER_BATCH = 4
#: how long each step of that stage takes (ms): 2 replicas pass at most 2 * 4 / 20 ms = 400 requests/s
FAILOVER_STEP_MS = 20


def _garbage_config(cfg: PipelineConfig) -> None:
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
    peak = 0
    with trio.move_on_after(2.0):
        while True:
            peak = max(peak, run.outputs.backlog)  # the orchestrator's output, not read yet
            await trio.sleep(0.01)
    gate.set()
    run.consumer_gate = None
    run.mark_fault()  # from here: how long until the backlog is gone
    while run.outputs.backlog > 0:
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


def _gate_stage0(stages: list[Any]) -> list[Any]:
    return [GatedStage(stages[0]), *stages[1:]]


async def channel_full(run: ChaosRun) -> None:
    gate = run.stages[0]  # the run's setup gated stage 0
    assert isinstance(gate, GatedStage)
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


def _ray_queue_at(stage: int) -> Callable[[PipelineConfig], None]:
    """The Ray placement (:func:`bench.chaos.ray.placement`) and small batches at ``stage``."""
    queue = _queue_at(stage)

    def hook(cfg: PipelineConfig) -> None:
        placement(cfg)
        queue(cfg)

    return hook


def _slow_restart_of_thinker_0(stage: int, replica: int, attempt: int) -> list[str]:
    return ["--startup-delay", "1"] if (stage, replica) == (0, 0) else []


async def _stop_rogue(rogue: trio.Process) -> bytes:
    """SIGTERM a rogue process (:mod:`trio_orch.testing.rogue`, ``rogue_inbox``); the rest of its report."""
    rogue.send_signal(signal.SIGTERM)
    assert rogue.stdout is not None
    out = b""
    async with rogue.stdout:
        while chunk := await rogue.stdout.receive_some(65536):
            out += chunk
    await rogue.wait()
    return out


async def rogue_worker(run: ChaosRun) -> None:
    """kill -9 thinker replica 0; a rogue process takes its control socket first, with what it stole."""
    auth = run.pipe.authenticator
    assert auth is not None
    victim = run.pipe.worker(0, 0)
    address, slot = victim.client.address, victim.client.zap_domain(victim.client.address)
    earlier = auth.launches.current(slot)
    assert earlier is not None and run.pipe.security is not None
    await run.submitted_at_least(0.3)
    with tempfile.TemporaryDirectory(prefix="trio-orch-rogue-") as d:
        stolen = os.path.join(d, "stolen")
        with open(stolen, "w") as f:  # the killed worker's ticket and the pipeline secret
            f.write(f"{earlier.ticket.decode()}\n{run.pipe.security.secret.decode()}\n")
        run.mark_fault()
        os.kill(victim.pid or 0, signal.SIGKILL)
        rogue = await trio.lowlevel.open_process(
            [sys.executable, "-m", "trio_orch.testing.rogue", "--connect", address, "--passwords", stolen],
            stdout=subprocess.PIPE)
        out = b""
        try:
            while auth.launches.current(slot) in (None, earlier):
                await trio.sleep(0.005)
            current = auth.launches.current(slot)
            assert current is not None
            with open(stolen, "a") as f:  # and the replacement's own ticket, as soon as there is one
                f.write(current.ticket.decode() + "\n")
            await run.mark_restart(0, 0)
            with trio.move_on_after(30):
                while auth.refused["launch:stranger"] == 0:
                    await trio.sleep(0.01)
        finally:
            out += await _stop_rogue(rogue)
    done = read_report(out.decode())[-1]
    run.notes.update(rogue_refused=done.get("refused", 0), rogue_connected=done.get("connected", 0),
                     rogue_submits=done.get("submits", 0), refused_stranger=auth.refused["launch:stranger"],
                     refused_stale=auth.refused["launch:stale_ticket"])
    if done.get("connected") or done.get("submits") or run.pipe.worker(0, 0).pid != current.pid:
        raise RuntimeError(f"the rogue took the slot: {done}")


def _slow_restart_of_code2wav_0(stage: int, replica: int, attempt: int) -> list[str]:
    return ["--startup-delay", "1"] if (stage, replica) == (2, 0) else []


async def rogue_inbox(run: ChaosRun) -> None:
    """async-chunk: kill -9 code2wav replica 0; a rogue binds its inbox's path the moment it is gone."""
    victim = run.worker_pid(2, 0)
    inbox = inbox_address(run.pipe.tmpdir, 2, 0)
    await run.submitted_at_least(0.3)
    rogue = await trio.lowlevel.open_process(
        [sys.executable, "-m", "trio_orch.testing.rogue_inbox", "--bind", inbox, "--after-death",
         str(victim)], stdout=subprocess.PIPE)
    assert rogue.stdout is not None
    out = b""
    try:
        with trio.fail_after(60):
            while b'"started"' not in out:
                out += await rogue.stdout.receive_some(65536)
        run.mark_fault()
        os.kill(victim, signal.SIGKILL)
        await run.mark_restart(2, 0)
    finally:
        out += await _stop_rogue(rogue)
    done = read_report(out.decode())[-1]
    run.notes.update(rogue_accepted=done.get("accepted", 0), rogue_credentials=done.get("credentials", 0),
                     rogue_chunks=done.get("chunks", 0))
    if done.get("credentials") or done.get("chunks") or done.get("handshake_succeeded"):
        raise RuntimeError(f"the rogue inbox was handed something: {done}")


def _remote(run: ChaosRun) -> RemoteWorkers:
    assert run.remote is not None, "a remote fault needs RunSetup(listen=True)"
    return run.remote


async def remote_lost(run: ChaosRun) -> None:
    remote = _remote(run)
    [(first_id, member)] = remote.live_members(1).items()  # joined before the load
    pool = run.pipe.stages[1]
    idx = member.replica
    await run.submitted_at_least(0.2)
    # Placement prefers the lowest index among the least loaded, so the joined replica (the last slot)
    # may get no request at all: the others are cordoned until it holds some, then it is stopped.
    others = [i for i in pool.live_replicas() if i != idx and i not in pool.cordoned]
    for i in others:
        pool.cordon(i)
    try:
        while pool.in_flight()[idx] == 0:  # the load still sends 80% of its requests: they come here
            await trio.sleep(0.001)
    finally:
        for i in others:
            pool.uncordon(i)
    run.notes.update(placed_on_it=pool.placements[idx], held_when_lost=pool.in_flight()[idx])
    serving = remote.serving_pid(remote.procs[0])
    run.mark_fault()
    os.kill(serving, signal.SIGSTOP)  # silent, connection open: only the missed heartbeats tell
    await remote.wait_for(lambda: member.gone is not None)
    run.mark_detect()  # its requests ended with replica_died, its slot evicted
    os.kill(serving, signal.SIGCONT)  # back, but the head dropped it: it registers again, a new identity
    await remote.wait_for(lambda: any(mid != first_id for mid in remote.live_members(1)))
    run.mark_recover()


async def remote_stale(run: ChaosRun) -> None:
    remote = _remote(run)
    [(spent, member)] = remote.live_members(1).items()
    await run.submitted_at_least(0.3)
    run.mark_fault()
    remote.procs[0].kill()
    await remote.wait_for(lambda: member.gone is not None)
    run.mark_detect()
    stale = await remote.start(1, member_id=spent)  # the spent identity again ...
    await remote.start_joined(1, key=1)  # ... while a fresh worker joins
    run.mark_recover()
    with trio.fail_after(30):
        run.notes["stale_exit"] = await stale.wait()


async def remote_unknown_key(run: ChaosRun) -> None:
    remote = _remote(run)
    refused = remote.registrar.auth.refused
    before = refused["curve:register"]
    await run.submitted_at_least(0.3)
    run.mark_fault()
    # it has the head's public key, but its own key pair is not on the allow-list
    intruder = await remote.start(1, keypair=Keypair.generate())
    await remote.wait_for(lambda: refused["curve:register"] > before)
    run.mark_detect()
    with trio.fail_after(30):
        run.notes["intruder_exit"] = await intruder.wait()


#: name -> fault, in the matrix's order
FAULTS: dict[str, Fault] = {f.name: f for f in (
    PipelineFault("kill9", f"kill -9 a talker replica under load (batches of {FAILOVER_BATCH}: requests "
                  "queue in it)", kill9, RunSetup(config_hook=_queue_at(1), failover=True)),
    PipelineFault("sigstop", f"SIGSTOP a code2wav replica (hung: no heartbeats; batches of {FAILOVER_BATCH})",
                  sigstop, RunSetup(config_hook=_queue_at(2), failover=True)),
    PipelineFault("garbage", "workers send undecodable frames and outputs for unknown request ids", garbage,
                  RunSetup(config_hook=_garbage_config)),
    PipelineFault("slow_consumer", "the consumer reads slowly for 2 s, then not at all for 2 s (recover: "
                  "from resuming to an empty output backlog)", slow_consumer),
    PipelineFault("abort_storm", "half the requests aborted at random points (0-200 ms after accept)",
                  abort_storm),
    PipelineFault("shutdown", "orchestrator shutdown (no drain) with half the load sent",
                  shutdown_under_load),
    PipelineFault("startup_failure", "kill a thinker replica; its first two replacements fail at startup",
                  startup_failure, RunSetup(sup_kwargs={"extra_args": _fail_twice})),
    PipelineFault("channel_full", "stage 0 submits stall 3 s: the request channel (16) stays full",
                  channel_full, RunSetup(orch_kwargs={"request_queue_size": 16}, wrap_stages=_gate_stage0)),
    PipelineFault("connector_peer_killed", "async-chunk: kill -9 the code2wav replica receiving chunks",
                  connector_peer_killed, RunSetup(async_chunk=True)),
    PipelineFault("leave_rejoin", "a talker replica leaves gracefully (drained) and rejoins later",
                  leave_rejoin),
    PipelineFault("rogue_worker", "kill -9 a thinker replica; a rogue process with the dead worker's ticket, "
                  "the pipeline secret and the replacement's ticket takes its socket first (refused: the "
                  "replacement serves)", rogue_worker,
                  RunSetup(sup_kwargs={"extra_args": _slow_restart_of_thinker_0})),
    PipelineFault("rogue_inbox", "async-chunk: kill -9 a code2wav replica; a rogue process binds its inbox's "
                  "path first (the talkers hand it nothing; the replacement gets the chunks)",
                  rogue_inbox, RunSetup(async_chunk=True,
                                        sup_kwargs={"extra_args": _slow_restart_of_code2wav_0})),
    PipelineFault("remote_lost", "a talker joined over TCP stops answering mid-stream (SIGSTOP); resumed, it "
                  "joins again under a new identity", remote_lost,
                  RunSetup(listen=True, joined_before_load=(1,), config_hook=_queue_at(1), failover=True)),
    PipelineFault("remote_stale", "kill -9 a talker joined over TCP; it re-registers under its spent "
                  "identity (refused) while a fresh worker joins", remote_stale,
                  RunSetup(listen=True, joined_before_load=(1,))),
    PipelineFault("remote_unknown_key", "a worker whose key is not on the head's allow-list tries to join "
                  "under load", remote_unknown_key, RunSetup(listen=True)),
    PipelineFault("ray_worker_killed", "--worker-backend ray: kill -9 a talker's worker under load (its "
                  "actor lives on); a new actor replaces it", ray_worker_killed,
                  RunSetup(ray=True, config_hook=_ray_queue_at(1), failover=True)),
    PipelineFault("ray_actor_killed", "--worker-backend ray: kill -9 a talker's Ray actor under load (its "
                  "worker exits with it); a new actor replaces it", ray_actor_killed,
                  RunSetup(ray=True, config_hook=_ray_queue_at(1), failover=True)),
    PipelineFault("ray_node_lost", "--worker-backend ray: the second node (one of the two talkers) crashes "
                  "under load; its talker is replaced on the node left", ray_node_lost,
                  RunSetup(ray=True, config_hook=_ray_queue_at(1), failover=True)),
    HttpFault("http_disconnect", "HTTP clients disconnect mid-stream (every other stream, after its first "
              "chunks)", "disconnect"),
    HttpFault("sigint_server", "SIGINT to the trio-orch serve process with half the HTTP load sent",
              "sigint"),
    HttpFault("slow_body", "as many uploads as the server reads at once send a byte a second, from before "
              "the HTTP load (each must lose its read slot with a 408; the load completes)", "slow_body"),
    HttpFault("smuggle", "POSTs with Content-Length and Transfer-Encoding hide a GET in their body, beside "
              "the HTTP load (each a 400 and the connection closed; the hidden GET never served)", "smuggle"),
)}
