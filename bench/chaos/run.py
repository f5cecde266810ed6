"""One chaos run: a pipeline under load, one fault, and the numbers that judge it.

:func:`run_fault` starts a fresh pipeline (>= 2 replicas per stage) under a
:class:`~trio_orch.cluster.supervisor.Supervisor`, an orchestrator and a consumer,
drives ``requests`` requests through it with at most ``concurrency`` in
flight, lets the fault's ``inject`` coroutine do its damage at the chosen
moment, then checks that the orchestrator still serves (fresh probe requests
must all finish), shuts everything down and counts what was left behind.
Every number in a :class:`ChaosResult` is measured in that run.

The run drives the Trio orchestrator in this thread, not through a
thread-side driver: the faults act on the process layer (replica pools, the
supervisor, the async-chunk connector), which only the Trio side has, and
they observe it from inside its loop.  The implementation comes from the
registry all the same (:data:`IMPLEMENTATION`: one that supports
``pipeline``).
"""

from __future__ import annotations

import math
import random
import sys
import time
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from typing import Any

import trio

from bench.chaos.remote import LISTEN_HOST, RemoteWorkers, open_remote_workers
from bench.implementations import names
from stages.config import PipelineConfig, default_config, echo_config
from trio_orch.cluster.launcher import Pipeline, open_pipeline
from trio_orch.cluster.supervisor import RestartPolicy, Supervisor, open_supervisor
from trio_orch.shell.orchestrator import Orchestrator
from trio_orch.testing import LeakProbe, TerminalLedger
from trio_orch.types import Message, ObservedStageClient, OrchError

__all__ = ["IMPLEMENTATION", "ChaosOptions", "ChaosResult", "ChaosRun", "Inject", "OutputStream", "RunSetup",
           "build_config", "run_fault"]

#: the implementation under chaos: the first that supports the whole process layer (trio-orch)
IMPLEMENTATION = names("pipeline")[0]

POLICY = RestartPolicy(max_restarts=5, window=60.0, backoff_initial=0.05, backoff_factor=2.0, backoff_max=2.0)


@dataclass
class ChaosOptions:
    requests: int = 1000
    concurrency: int = 64
    echo: bool = False  # echo workers instead of the torch pipeline
    max_new_tokens: int = 4
    request_timeout: float = 30.0  # the server default: a safety net, shows up as "timeout"
    probe_requests: int = 20
    progress: bool = True
    seed: int = 0
    device: str = "cpu"  # torch device of the workers: cpu or cuda
    #: the Ray cluster the ``ray`` faults run on (``--worker-backend ray``: :mod:`bench.chaos.ray`)
    ray: Any = None


@dataclass
class ChaosResult:
    fault: str
    description: str
    workers: str
    implementation: str = IMPLEMENTATION
    requests: int = 0
    accepted: int = 0
    completed: int = 0
    failed: dict[str, int] = field(default_factory=dict)
    refused: int = 0
    without_terminal: int = 0
    duplicates: int = 0
    after_terminal: int = 0
    leaked_processes: int = 0
    leaked_fds: int = 0
    leaked_ipc_files: int = 0
    still_serving: str = "no"
    detect_s: float | None = None
    recover_s: float | None = None
    restarts: int = 0
    #: requests that ended ``replica_died`` having produced nothing where the replica died (normal
    #: mode; async-chunk: nothing shown to the user) -- failover should have resent every one of them
    silent_deaths: int = 0
    notes: dict[str, Any] = field(default_factory=dict)
    #: error kind -> the message of the first terminal of that kind (what a FAIL row is read by)
    error_examples: dict[str, str] = field(default_factory=dict)
    wall_s: float = 0.0
    error: str | None = None

    @property
    def ok(self) -> bool:
        return (self.error is None and self.without_terminal == 0 and self.duplicates == 0
                and self.after_terminal == 0 and self.leaked_processes == 0 and self.leaked_fds == 0
                and self.leaked_ipc_files == 0 and self.silent_deaths == 0
                and self.still_serving in ("yes", "n/a (stopped)"))


def build_config(opts: ChaosOptions, *, async_chunk: bool = False) -> PipelineConfig:
    """The default thinker -> talker -> code2wav pipeline (or echo), 2 replicas per stage, short outputs."""
    timing = {"heartbeat_interval": 0.2, "heartbeat_timeout": 1.0, "stop_grace": 1.0, "startup_timeout": 60.0}
    if opts.echo:
        cfg = echo_config(3, replicas=2, outputs=3, final_stage_ids=[0, 2], **timing)
    else:
        cfg = default_config(**timing).with_overrides(replicas=2, device=opts.device)
        cfg.stages[0].model.update(max_new_tokens=opts.max_new_tokens, min_new_tokens=1)
    cfg.async_chunk = async_chunk
    return cfg.validate()


class OutputStream:
    """The orchestrator's output sink, read by the run's consumer; its backlog can be measured."""

    def __init__(self) -> None:
        self._send, self._recv = trio.open_memory_channel[Message](math.inf)

    def put(self, msgs: list[Message]) -> None:
        """The orchestrator's ``output_sink``: one batch per routing step."""
        send = self._send.send_nowait
        for m in msgs:
            send(m)

    def close(self) -> None:
        """End of stream: the orchestrator stopped."""
        self._send.close()

    @property
    def backlog(self) -> int:
        """Messages delivered by the orchestrator and not consumed yet."""
        return self._recv.statistics().current_buffer_used

    def __aiter__(self) -> trio.MemoryReceiveChannel[Message]:
        return self._recv


class ChaosRun:
    """What a fault's ``inject`` coroutine sees and marks.

    ``stages`` are the stage clients the orchestrator routes through (the
    pipeline's pools, or what :attr:`RunSetup.wrap_stages` made of them);
    ``outputs`` is the stream the consumer reads; ``remote`` the registrar and
    the workers that join over TCP (:attr:`RunSetup.listen`), else None.
    """

    def __init__(self, name: str, opts: ChaosOptions, pipe: Pipeline, sup: Supervisor, orch: Orchestrator,
                 ledger: TerminalLedger, stages: list[Any], outputs: OutputStream,
                 remote: RemoteWorkers | None = None) -> None:
        self.name, self.opts, self.pipe, self.sup, self.remote = name, opts, pipe, sup, remote
        self.orch, self.ledger, self.stages, self.outputs = orch, ledger, stages, outputs
        self.rng = random.Random(opts.seed)
        self.submitted = 0
        self.refused = 0
        self.t_fault: float | None = None
        self.t_detect: float | None = None
        self.t_recover: float | None = None
        self.notes: dict[str, Any] = {}
        self.stopped_on_purpose = False
        self.consumer_gate: trio.Event | None = None  # set: the consumer is paused until it is set
        self.consumer_delay = 0.0
        self.on_accepted: Callable[[str], None] | None = None
        self._progress = trio.Event()
        self.load_done = trio.Event()  # every load request was sent (or refused)
        self.silent_deaths = 0  # see ChaosResult.silent_deaths
        self.error_examples: dict[str, str] = {}  # see ChaosResult.error_examples

    def died_silent(self, msg: Message) -> bool:
        """``msg`` is a ``replica_died`` terminal of a request that had produced nothing there.

        Normal mode: the stage's timing of the request (the replica it was on)
        saw no output; async-chunk: nothing of it reached the user (its
        partial output is empty).  Read as the terminal arrives, while the
        pool still remembers the request.
        """
        if type(msg) is not OrchError or msg.kind != "replica_died" or msg.stage_id is None:
            return False
        if self.orch.router.async_chunk:
            return not any(msg.partial.values()) if msg.partial else True
        stage = self.pipe.stages[msg.stage_id]
        tm = stage.timing_of(msg.request_id) if isinstance(stage, ObservedStageClient) else None
        return tm is not None and tm.t_first is None

    # -------------------------------------------------------------- marks
    def mark_fault(self) -> None:
        self.t_fault = time.monotonic()

    def mark_detect(self, t: float | None = None) -> None:
        if self.t_detect is None:
            self.t_detect = t if t is not None else time.monotonic()

    def mark_recover(self, t: float | None = None) -> None:
        if self.t_recover is None:
            self.t_recover = t if t is not None else time.monotonic()

    def trio_to_mono(self, t: float) -> float:
        """Convert a trio-clock time (supervisor events) to ``time.monotonic``."""
        return time.monotonic() - (trio.current_time() - t)

    async def submitted_at_least(self, fraction: float) -> None:
        """Wait until ``fraction`` of the requests were submitted."""
        goal = math.ceil(self.opts.requests * fraction)
        while self.submitted < goal and not self.stopped_on_purpose:
            await self._progress.wait()

    def worker_pid(self, stage: int, replica: int) -> int:
        pid = self.pipe.worker(stage, replica).pid
        assert pid is not None
        return pid

    async def mark_restart(self, stage: int, replica: int) -> None:
        """Mark detection/recovery from the supervisor's event for that slot."""
        await self.sup.wait_for(lambda: any(e.stage_id == stage and e.replica == replica and e.t_ready
                                            for e in self.sup.events))
        ev = next(e for e in self.sup.events if e.stage_id == stage and e.replica == replica and e.t_ready)
        self.mark_detect(self.trio_to_mono(ev.t_dead))
        self.mark_recover(self.trio_to_mono(ev.t_ready))

    def bump(self) -> None:
        """Wake whoever waits in :meth:`submitted_at_least` (the load sent one more request)."""
        self._progress.set()
        self._progress = trio.Event()


Inject = Callable[[ChaosRun], Awaitable[None]]


@dataclass(frozen=True)
class RunSetup:
    """How a fault's run differs from the default one."""

    async_chunk: bool = False
    orch_kwargs: dict[str, Any] = field(default_factory=dict)  #: Orchestrator options on top
    sup_kwargs: dict[str, Any] = field(default_factory=dict)  #: open_supervisor options
    #: the stage clients the orchestrator gets, made from the pipeline's pools
    wrap_stages: Callable[[list[Any]], list[Any]] | None = None
    config_hook: Callable[[PipelineConfig], None] | None = None  #: edits the pipeline config in place
    #: a registrar on loopback TCP (keys made for the run): replicas may join (:mod:`bench.chaos.remote`)
    listen: bool = False
    #: stages that get one joined remote replica each before the load starts (needs ``listen``)
    joined_before_load: tuple[int, ...] = ()
    #: the fault kills or loses a replica that holds queued requests: its row always notes ``retried``
    failover: bool = False
    #: every replica a Ray actor on :attr:`ChaosOptions.ray` (run only with ``--worker-backend ray``)
    ray: bool = False


async def run_fault(name: str, description: str, inject: Inject, opts: ChaosOptions,
                    setup: RunSetup | None = None) -> ChaosResult:
    """Run one fault from a fresh pipeline to a clean shutdown; see the module docstring."""
    setup = setup or RunSetup()
    ray_left = 0
    res = ChaosResult(name, description, "echo" if opts.echo else "torch (thinker/talker/code2wav)")
    res.requests = opts.requests
    t_start = time.monotonic()
    probe = LeakProbe()
    ledger = TerminalLedger()
    cfg = build_config(opts, async_chunk=setup.async_chunk)
    if setup.config_hook is not None:
        setup.config_hook(cfg)
    if opts.progress:  # workers take seconds to start: say so rather than sit silent
        n = sum(st.replicas for st in cfg.stages)
        print(f"  {name}: starting {n} workers ...", file=sys.stderr, flush=True)
    try:
        async with AsyncExitStack() as stack:
            if setup.ray:
                from bench.chaos.ray import open_ray_pipeline

                if opts.ray is None:
                    raise RuntimeError(f"{name} runs on Ray: give --worker-backend ray")
                pipe = await stack.enter_async_context(open_ray_pipeline(cfg, opts.ray, POLICY))
                sup = pipe.supervisor
                res.workers = f"Ray-actor (2 nodes) {res.workers}"
            else:
                pipe = await stack.enter_async_context(
                    open_pipeline(cfg, inbox_host=LISTEN_HOST if setup.listen else None))
                sup = await stack.enter_async_context(open_supervisor(pipe, POLICY, **setup.sup_kwargs))
            remote = await stack.enter_async_context(open_remote_workers(pipe)) if setup.listen else None
            if opts.progress:
                print(f"  {name}: workers ready after {time.monotonic() - t_start:.1f} s", file=sys.stderr,
                      flush=True)
            probe.saw(pipe.pids)
            probe.saw_dir(pipe.tmpdir)
            stages = setup.wrap_stages(list(pipe.stages)) if setup.wrap_stages else list(pipe.stages)
            outputs = OutputStream()
            orch = Orchestrator(stages, request_timeout=opts.request_timeout, output_sink=outputs.put,
                                **{**pipe.orchestrator_kwargs(), **setup.orch_kwargs})
            run = ChaosRun(name, opts, pipe, sup, orch, ledger, stages, outputs, remote)

            async def run_orchestrator(task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
                                       ) -> None:
                try:
                    await orch.run(task_status=task_status)
                finally:
                    outputs.close()

            async with trio.open_nursery() as nursery:
                await nursery.start(run_orchestrator)
                if setup.ray:  # the actors' workers join through the orchestrator: it routes now
                    from bench.chaos.ray import all_joined

                    await all_joined(pipe, cfg.startup_timeout)
                    if opts.progress:
                        print(f"  {name}: every replica joined after {time.monotonic() - t_start:.1f} s",
                              file=sys.stderr, flush=True)
                for k in setup.joined_before_load:  # a join goes through the orchestrator: it runs now
                    assert remote is not None, "joined_before_load needs listen"
                    await remote.start_joined(k)
                await _drive(run, nursery, inject)
                res.still_serving = await _still_serving(run)
                await orch.shutdown()
            probe.saw(e.new_pid for e in sup.events)
            if remote is not None:
                probe.saw(remote.pids)
                res.notes.update(remote.counts())
            res.restarts = sup.restarts
            res.notes.update(run.notes)
            counts = sup.counters()
            for key in ("restart_failures", "gave_up"):
                if counts.get(key):
                    res.notes[key] = counts[key]
            bad_totals: dict[str, int] = {}
            for (_, kind), n in sup.bad_input().items():
                bad_totals[kind] = bad_totals.get(kind, 0) + n
            res.notes.update({f"bad_{k}": n for k, n in bad_totals.items() if n})
            if orch.dropped_outputs:
                res.notes["dropped_outputs"] = orch.dropped_outputs
            retried = sum(orch.statistics().core.retried_by_stage)
            if retried or setup.failover:  # failover: requests a dead replica held, resent before they
                res.notes["retried"] = retried  # produced anything
            res.silent_deaths = run.silent_deaths
            res.error_examples = dict(run.error_examples)
            if run.t_fault is not None:
                res.detect_s = None if run.t_detect is None else max(0.0, run.t_detect - run.t_fault)
                res.recover_s = None if run.t_recover is None else max(0.0, run.t_recover - run.t_fault)
            res.refused = run.refused
            if run.stopped_on_purpose:
                res.still_serving = "n/a (stopped)"
    except Exception as exc:  # a crash of the run or the orchestrator is a failed row, not a crash
        res.error = f"{type(exc).__name__}: {exc}"
    res.accepted = len(ledger.accepted)
    kinds = ledger.by_kind()
    res.completed = kinds.pop("ok", 0)
    res.failed = kinds
    res.without_terminal = ledger.without_terminal()
    res.duplicates = ledger.duplicates
    res.after_terminal = ledger.after_terminal
    if setup.ray and opts.ray is not None:  # trio-orch workers and actors left on the Ray nodes
        from bench.chaos.ray import leftover_workers

        probe.children |= {n.proc.pid for n in opts.ray.nodes.values()}  # a node started again: the cluster's
        left = await leftover_workers(opts.ray)
        ray_left = len(left)
        if left:
            res.notes["left_on_ray_nodes"] = "; ".join(left)
    leaks = probe.leaks()
    res.leaked_processes, res.leaked_fds, res.leaked_ipc_files = (
        leaks["processes"] + ray_left, leaks["fds"], leaks["ipc_files"])
    res.wall_s = time.monotonic() - t_start
    return res


async def _drive(run: ChaosRun, nursery: trio.Nursery, inject: Inject) -> None:
    """Send the load, run the fault beside it, wait for every terminal (or the orchestrator's end)."""
    opts, orch, ledger = run.opts, run.orch, run.ledger
    slots = trio.Semaphore(opts.concurrency)
    done_sending = trio.Event()
    all_ended = trio.Event()
    mine: set[str] = set()

    async def consume() -> None:
        async for msg in run.outputs:
            gate = run.consumer_gate
            if gate is not None:
                await gate.wait()
            if run.consumer_delay:
                await trio.sleep(run.consumer_delay)
            first = msg.finished and msg.request_id not in ledger.terminal
            if first and run.died_silent(msg):
                run.silent_deaths += 1
            if first and type(msg) is OrchError and msg.kind not in run.error_examples:
                run.error_examples[msg.kind] = f"stage {msg.stage_id}: {msg.message}"[:300]
            ledger.record(msg)
            if first and msg.request_id in mine:
                mine.discard(msg.request_id)
                slots.release()
            if done_sending.is_set() and not mine:
                all_ended.set()
        all_ended.set()

    async def send() -> None:
        try:
            for i in range(opts.requests):
                await slots.acquire()
                rid = f"{run.name}-{i}"
                mine.add(rid)
                ledger.accepted.add(rid)
                try:
                    await orch.add_request(rid, _prompt(opts, i))
                except RuntimeError:  # shutting down: not accepted
                    ledger.accepted.discard(rid)
                    mine.discard(rid)
                    slots.release()
                    run.refused += 1
                    continue
                if run.on_accepted is not None:
                    run.on_accepted(rid)
                run.submitted += 1
                run.bump()
        finally:
            done_sending.set()
            run.load_done.set()
            run.bump()
            if not mine:
                all_ended.set()

    tty = sys.stderr.isatty()

    async def progress() -> None:
        while True:
            await trio.sleep(1.0 if tty else 5.0)
            lead, end = ("\r", "") if tty else ("", "\n")
            print(f"{lead}  {run.name}: {run.submitted}/{opts.requests} sent, {len(ledger.terminal)} ended",
                  end=end, file=sys.stderr, flush=True)

    injected = trio.Event()

    async def fault() -> None:
        try:
            await inject(run)
        finally:
            injected.set()

    nursery.start_soon(consume)
    async with trio.open_nursery() as inner:
        if opts.progress:
            inner.start_soon(progress)
        inner.start_soon(fault)
        await send()
        with trio.move_on_after(opts.request_timeout + 30):
            await all_ended.wait()
        with trio.move_on_after(60):  # e.g. a restart still in progress: let it finish
            await injected.wait()
        inner.cancel_scope.cancel()
    if opts.progress and tty:
        print(f"\r  {run.name}: {run.submitted}/{opts.requests} sent, {len(ledger.terminal)} ended",
              file=sys.stderr, flush=True)


async def _still_serving(run: ChaosRun) -> str:
    """Fresh requests after the fault must all finish."""
    orch = run.orch
    if not orch.running:
        return "no"
    rids = [f"{run.name}-probe-{i}" for i in range(run.opts.probe_requests)]
    try:
        for rid in rids:
            run.ledger.accepted.add(rid)
            await orch.add_request(rid, _prompt(run.opts, 0))
    except RuntimeError:
        return "no"
    with trio.move_on_after(run.opts.request_timeout + 5):
        while any(r not in run.ledger.terminal for r in rids):
            await trio.sleep(0.02)
    return "yes" if all(run.ledger.terminal.get(r) == "ok" for r in rids) else "no"


def _prompt(opts: ChaosOptions, i: int) -> Any:
    if opts.echo:
        return f"request {i}"
    return {"text": f"chaos request {i}: say something", "max_new_tokens": opts.max_new_tokens}
