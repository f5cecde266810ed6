"""A one-for-one supervisor for stage workers, in the manner of an OTP supervisor.

Each replica slot ``(stage, replica)`` of a :class:`~trio_orch.cluster.launcher.Pipeline`
is watched by one task.  When its worker dies -- it exited (kill -9, crash),
sent the ``Dying`` sentinel, or missed heartbeats for the pipeline's
``heartbeat_timeout`` (a hung or SIGSTOPped process; the launcher kills it) --
the slot is restarted under a :class:`RestartPolicy`:

* at most ``max_restarts`` restart attempts within ``window`` seconds per
  slot; past that the supervisor gives the slot up (logged as an error,
  counted), exactly like OTP's restart intensity;
* before attempt *n* it waits ``min(backoff_max, backoff_initial * backoff_factor**(n-1))``,
  *n* counting the attempts in the window, so a crash loop slows down;
* a replacement that fails its ``Ready`` handshake counts as an attempt.

While a slot restarts its pool serves from the other replicas; with none
live, ``submit`` raises ``StageUnavailable`` (the request gets a fast
``stage_unavailable`` terminal) and the pool's ``receive`` waits instead of
declaring the stage dead.  Once the replacement is ready it takes the same
slot (same index, same ipc addresses, so async-chunk peers reconnect) and new
requests are placed on it.  Only when every slot of a stage was given up does
the stage become dead for good.

Replicas that another owner starts -- the Ray backend's actors
(:mod:`trio_orch.cluster.ray_replicas`) -- are *adopted* (:meth:`Supervisor.adopt`):
their owner reports a death (:meth:`Supervisor.record_death`) and restarts
them through :meth:`Supervisor.restart` with a starter of its own, under the
same policy, backoff, counters and give-up rule as a local worker's slot.

Restarts, their causes and give-ups are logged (``trio_orch.cluster.supervisor``) and
counted: :meth:`Supervisor.counters` / :meth:`Supervisor.prometheus_counters`
(in the :data:`trio_orch.http.metrics.ExtraCounters` shape, for ``/metrics``).

Usage, nested inside the pipeline and around the orchestrator::

    async with open_pipeline(cfg) as pipe, open_supervisor(pipe) as sup:
        async with open_orchestrator(pipe.stages, **pipe.orchestrator_kwargs()) as orch:
            ...
"""

from __future__ import annotations

import logging
import os
from collections import Counter, deque
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import trio
from trio_util import AsyncValue

from stages.config import PipelineConfig
from trio_orch.cluster.credentials import prometheus_counters as auth_counters
from trio_orch.cluster.launcher import (
    Pipeline,
    WorkerHandle,
    WorkerStartupError,
    open_pipeline,
    run_worker,
    worker_argv,
)
from trio_orch.cluster.transport import ZmqStageClient

__all__ = ["CAUSES", "RestartEvent", "RestartPolicy", "Slot", "Supervisor", "classify_death",
           "open_supervisor", "supervised_pipeline"]

log = logging.getLogger("trio_orch.cluster.supervisor")

#: every cause :func:`classify_death` gives a death that is restarted (``left`` is a leave, not a failure)
CAUSES = ("exited", "dying", "heartbeat_timeout", "other")

#: extra worker flags for a restart attempt: (stage, replica, attempt number) -> argv tail
ExtraArgs = Callable[[int, int, int], list[str]]
#: starts a slot's replacement: (slot, attempt number) -> its pid once ready; raises WorkerStartupError
StartReplacement = Callable[["Slot", int], Awaitable[int | None]]


@dataclass(frozen=True)
class RestartPolicy:
    """Restart intensity and backoff of one replica slot (see the module docstring)."""

    max_restarts: int = 5
    window: float = 60.0
    backoff_initial: float = 0.1
    backoff_factor: float = 2.0
    backoff_max: float = 5.0

    def __post_init__(self) -> None:
        if self.max_restarts < 0 or self.window <= 0 or self.backoff_initial < 0 or self.backoff_factor < 1:
            raise ValueError(f"invalid restart policy {self!r}: need max_restarts >= 0, window > 0, "
                             "backoff_initial >= 0, backoff_factor >= 1")

    def backoff(self, attempt: int) -> float:
        """Seconds to wait before the ``attempt``-th attempt in the window (1-based)."""
        return min(self.backoff_max, self.backoff_initial * self.backoff_factor ** max(0, attempt - 1))


def classify_death(reason: str | None, *, exit_code: int | None = None, leaving: bool = False) -> str:
    """The cause label of a replica death from its client's ``dead_reason``.

    ``leaving``: the supervisor asked the replica to leave.  Its ``Dying`` sentinel and its exit (code 0)
    race to the head, so a clean exit seen first is a leave as well, not a death to restart.
    """
    r = reason or ""
    if leaving and exit_code == 0:
        return "left"
    if "missed heartbeats" in r:
        return "heartbeat_timeout"
    if "is dying" in r:
        return "dying" if "leaving" not in r else "left"
    if "exited with code" in r:
        return "exited"
    return "other"


@dataclass
class RestartEvent:
    """One death of one slot and what the supervisor did about it (trio clock times)."""

    stage_id: int
    replica: int
    cause: str
    reason: str
    old_pid: int | None
    t_dead: float
    t_ready: float | None = None
    new_pid: int | None = None
    attempts: int = 0
    outcome: str = "restarting"  # restarting | restarted | gave_up | left | closed


@dataclass
class Slot:
    """One supervised replica slot: its restart attempts in the window, and whether it was given up.

    ``replica`` is its index in the stage's pool (a Ray replica's changes when a replacement joins
    another free slot: its owner updates it).
    """

    stage_id: int
    replica: int
    attempts: deque[float] = field(default_factory=deque)  # times of attempts in the window
    leaving: bool = False
    left: trio.Event = field(default_factory=trio.Event)
    rejoin: trio.Event = field(default_factory=trio.Event)
    given_up: bool = False
    generation: int = 0


class Supervisor:
    """Watches and restarts the workers of ``pipeline`` (run it with :func:`open_supervisor`).

    ``extra_args(stage, replica, attempt)`` appends worker flags to a restart
    attempt (fault injection: a replacement that fails at startup).
    ``max_message_bytes`` is applied to every replica client: a larger message
    from a worker is refused and the requests it carried outputs for fail.
    ``events`` lists every :class:`RestartEvent`; ``ready_count`` counts
    successful restarts (tests wait on it with :meth:`wait_restarts`).
    """

    def __init__(self, pipeline: Pipeline, policy: RestartPolicy | None = None, *,
                 extra_args: ExtraArgs | None = None, max_message_bytes: int | None = 256 << 20) -> None:
        self.pipeline = pipeline
        self.max_message_bytes = max_message_bytes
        for w in pipeline.workers:
            w.client.max_message_bytes = max_message_bytes
        self._retired: Counter[tuple[int, str]] = Counter()  # bad-input counts of replaced clients
        self.policy = policy or RestartPolicy()
        self.extra_args = extra_args
        self.events: list[RestartEvent] = []
        self._counts: Counter[tuple[str, int, str]] = Counter()
        self._slots = {(w.stage_id, w.replica): Slot(w.stage_id, w.replica) for w in pipeline.workers}
        self._adopted: list[Slot] = []  # replicas someone else starts (Ray actors), restarted by its rules
        self._version = AsyncValue(0)  # bumped on every supervisor event; waiters re-check
        self._closing = False
        self._nursery: trio.Nursery | None = None

    # ------------------------------------------------------------------ observability
    def counters(self) -> dict[str, int]:
        """Flat counters: ``deaths``, ``restarts``, ``restart_failures``, ``gave_up``, per cause too."""
        out: Counter[str] = Counter()
        for (name, _stage, cause), n in self._counts.items():
            out[name] += n
            out[f"{name}.{cause}"] += n
        return dict(out)

    def prometheus_counters(self) -> dict[str, tuple[str, dict[tuple[tuple[str, str], ...], int]]]:
        """Counters in the :data:`trio_orch.http.metrics.ExtraCounters` shape (for ``/metrics``)."""
        helps = {
            "deaths": "worker replica deaths seen by the supervisor, by stage and cause",
            "restarts": "worker replicas restarted and ready again, by stage and cause of the death",
            "restart_failures": "restart attempts whose replacement failed its ready handshake",
            "gave_up": "replica slots given up after exceeding the restart intensity",
        }
        fams: dict[str, tuple[str, dict[tuple[tuple[str, str], ...], int]]] = {
            f"trio_orch_supervisor_{name}": (text, {}) for name, text in helps.items()}
        counts = dict(self._counts)  # one C-level copy: safe to call from another thread
        for name in helps:  # every (stage, cause) from the start at 0: rate() reads 0, not "no data"
            for stage in range(len(self.pipeline.config.stages)):
                for cause in CAUSES:
                    counts.setdefault((name, stage, cause), 0)
        for (name, stage, cause), n in sorted(counts.items()):
            if f"trio_orch_supervisor_{name}" in fams:
                fams[f"trio_orch_supervisor_{name}"][1][(("stage", str(stage)), ("cause", cause))] = n
        fams["trio_orch_bad_worker_messages"] = (
            "messages from workers refused or dropped: garbage, oversized, output for an unknown "
            "request id, second finish of a request",
            {(("stage", str(k)), ("kind", kind)): n for (k, kind), n in sorted(self.bad_input().items())})
        if self.pipeline.authenticator is not None:  # who tried to take a slot's place, and was refused
            fams.update(auth_counters(self.pipeline.authenticator))
        return fams

    def bad_input(self) -> dict[tuple[int, str], int]:
        """Bad messages from workers by (stage, kind): garbage, oversized, unknown, duplicate_finish."""
        out: Counter[tuple[int, str]] = Counter(dict(self._retired))
        for w in list(self.pipeline.workers):
            out[(w.stage_id, "garbage")] += w.client.garbage_frames
            out[(w.stage_id, "oversized")] += w.client.oversized_messages
        for pool in self.pipeline.stages:
            for kind in ("unknown", "duplicate_finish"):
                out[(pool.stage_id, kind)] += pool.stray_outputs[kind]
        return dict(out)

    @property
    def restarts(self) -> int:
        return sum(n for (name, _, _), n in self._counts.items() if name == "restarts")

    async def wait_restarts(self, n: int) -> None:
        """Wait until at least ``n`` restarts completed (tests, chaos runs)."""
        await self.wait_for(lambda: self.restarts >= n)

    async def wait_for(self, predicate: Callable[[], bool]) -> None:
        """Wait until ``predicate()`` holds; re-checked after every supervisor event."""
        await self._version.wait_value(lambda _: predicate())

    def _notify(self) -> None:
        self._version.value += 1

    def _count(self, name: str, stage: int, cause: str) -> None:
        self._counts[(name, stage, cause)] += 1

    # ------------------------------------------------------------------ running
    async def run(self, *, task_status: trio.TaskStatus[Supervisor] = trio.TASK_STATUS_IGNORED) -> None:
        """Watch every slot until cancelled; replacement workers live in this nursery."""
        for pool in self.pipeline.stages:
            pool.supervised = True
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                for slot in self._slots.values():
                    nursery.start_soon(self._watch, slot, name=f"supervisor[{slot.stage_id}.{slot.replica}]")
                task_status.started(self)
                await trio.sleep_forever()  # live for the block, with no local slot too (Ray's are adopted)
        finally:
            self._closing = True
            self._nursery = None
            for pool in self.pipeline.stages:  # nobody restarts replicas any more
                pool.stop_supervision()

    async def leave(self, stage_id: int, replica: int, *, drain_timeout: float = 10.0) -> None:
        """Take a replica out gracefully: no new requests, let its own finish, stop it."""
        slot = self._slots[(stage_id, replica)]
        pool = self.pipeline.stages[stage_id]
        slot.leaving = True
        slot.left = trio.Event()
        slot.rejoin = trio.Event()
        pool.cordon(replica)
        with trio.move_on_after(drain_timeout):
            while pool.in_flight()[replica] > 0:
                await trio.sleep(0.02)
        log.info("stage %d replica %d leaves the pool", stage_id, replica)
        self.pipeline.worker(stage_id, replica).client.request_shutdown("leaving the pool")
        await slot.left.wait()

    async def rejoin(self, stage_id: int, replica: int) -> None:
        """Start a replica that left again; returns once it is ready and placed on."""
        slot = self._slots[(stage_id, replica)]
        if not slot.leaving:
            raise RuntimeError(f"stage {stage_id} replica {replica} did not leave")
        start_count = self._counts[("rejoined", stage_id, "left")]
        slot.rejoin.set()
        await self.wait_for(lambda: self._counts[("rejoined", stage_id, "left")] > start_count)

    async def _watch(self, slot: Slot) -> None:
        k, r = slot.stage_id, slot.replica
        pool = self.pipeline.stages[k]
        while True:
            h = self.pipeline.worker(k, r)
            await h.client.dead_event.wait()
            if self._closing or pool.closed:
                return
            reason = h.client.dead_reason or "unknown"
            exit_code = h.process.returncode if h.process is not None else None
            cause = classify_death(reason, exit_code=exit_code, leaving=slot.leaving)
            ev = RestartEvent(k, r, cause, reason, h.pid, trio.current_time())
            self.events.append(ev)
            self._count("deaths", k, cause)
            if slot.leaving:
                ev.outcome = "left"
                slot.left.set()
                self._notify()
                await slot.rejoin.wait()
                if await self._restart(slot, ev, counted=False, rejoin=True):
                    slot.leaving = False
                    pool.uncordon(r)
                    self._count("rejoined", k, "left")
                    self._notify()
                    continue
                return
            log.warning("stage %d replica %d died (%s): %s", k, r, cause, reason.splitlines()[0])
            self._notify()
            if not await self._restart(slot, ev, counted=True):
                return

    # ------------------------------------------------------------------ replicas started elsewhere
    def adopt(self, stage_id: int, replica: int) -> Slot:
        """A slot whose replicas another owner starts (a Ray actor): it restarts them through
        :meth:`restart`, under this supervisor's policy, counters and give-up rule."""
        slot = Slot(stage_id, replica)
        self._adopted.append(slot)
        return slot

    def record_death(self, slot: Slot, reason: str, old_pid: int | None) -> RestartEvent:
        """Count and log the death of an adopted slot's replica; the event :meth:`restart` completes."""
        cause = classify_death(reason)
        cause = "exited" if cause == "left" else cause  # a leave nobody asked for is a loss here
        ev = RestartEvent(slot.stage_id, slot.replica, cause, reason, old_pid, trio.current_time())
        self.events.append(ev)
        self._count("deaths", slot.stage_id, cause)
        log.warning("stage %d replica %d died (%s): %s", slot.stage_id, slot.replica, cause,
                    reason.splitlines()[0] if reason else "unknown")
        self._notify()
        return ev

    async def restart(self, slot: Slot, ev: RestartEvent, start: StartReplacement) -> bool:
        """Restart an adopted slot with ``start(attempt) -> new pid`` (raises WorkerStartupError when
        the replacement does not come up), under the policy; True once one is ready."""
        return await self._restart(slot, ev, counted=True, start=start)

    async def _restart(self, slot: Slot, ev: RestartEvent, *, counted: bool, rejoin: bool = False,
                       start: StartReplacement | None = None) -> bool:
        """Attempt restarts under the policy; True once a replacement is ready.

        ``rejoin``: a replica that left starts again on request; that is no restart.
        ``start``: how a replacement starts (default: a local worker process in the slot).
        """
        k, r = slot.stage_id, slot.replica
        pool = self.pipeline.stages[k]
        policy = self.policy
        last_failure: str | None = None  # why the last replacement failed to start
        while True:
            if self._closing or pool.closed:
                ev.outcome = "closed"
                return False
            now = trio.current_time()
            while slot.attempts and slot.attempts[0] < now - policy.window:
                slot.attempts.popleft()
            if counted and len(slot.attempts) >= policy.max_restarts:
                self._give_up(slot, ev, last_failure)
                return False
            delay = policy.backoff(len(slot.attempts) + 1) if counted else 0.0
            if counted:
                slot.attempts.append(now)
            ev.attempts += 1
            await trio.sleep(delay)
            try:
                new_pid = await (start or self._start_local)(slot, ev.attempts)
            except (WorkerStartupError, BaseExceptionGroup) as raised:
                exc = _startup_error(raised)
                if exc is None:
                    raise
                self._count("restart_failures", k, ev.cause)
                last_failure = _first_and_last_line(str(exc)) or type(exc).__name__
                log.error("restart of stage %d replica %d failed (attempt %d): %s", k, r, ev.attempts,
                          last_failure)
                self._notify()
                counted = True  # a crash loop at startup always counts towards the intensity
                continue
            ev.t_ready = trio.current_time()
            ev.new_pid = new_pid
            ev.outcome = "restarted"
            if not rejoin:
                self._count("restarts", k, ev.cause)
            log.warning("stage %d replica %d restarted as pid %s after %.2fs (%s)", k, r, new_pid,
                        ev.t_ready - ev.t_dead, ev.cause)
            self._notify()
            return True

    def _give_up(self, slot: Slot, ev: RestartEvent, last_failure: str | None = None) -> None:
        """No more restarts for ``slot``: counted, logged, and told to its pool with why (``/health``)."""
        k, r = slot.stage_id, slot.replica
        slot.given_up = True
        ev.outcome = "gave_up"
        self._count("gave_up", k, ev.cause)
        death = ev.reason.splitlines()[0] if ev.reason else "unknown"
        why = (f"{self.policy.max_restarts} restarts within {self.policy.window:g}s; "
               f"last death ({ev.cause}): {death}")
        if last_failure is not None:
            why += f"; last restart failed: {last_failure}"
        self.pipeline.stages[k].give_up(r, why)
        log.error("stage %d replica %d: giving the slot up: %s", k, r, why)
        if all(s.given_up for s in [*self._slots.values(), *self._adopted] if s.stage_id == k):
            log.error("stage %d: every replica slot was given up; the stage is dead", k)
            self.pipeline.stages[k].stop_supervision()
        self._notify()

    async def _start_local(self, slot: Slot, attempt: int) -> int | None:
        return (await self._start_replacement(slot, attempt)).pid

    async def _start_replacement(self, slot: Slot, attempt: int) -> WorkerHandle:
        """Bind a fresh client on the slot's address, start the worker, wait for Ready, swap it in."""
        pipe = self.pipeline
        assert self._nursery is not None
        k, r = slot.stage_id, slot.replica
        old = pipe.worker(k, r)
        cfg = pipe.config
        st = cfg.stages[k]
        pool = pipe.stages[k]
        if old.process is not None:
            # A hung process may never answer SIGTERM: kill it.  Either way it must be gone before
            # the address is bound again, or its socket could reconnect and take some of our sends.
            hung = classify_death(old.client.dead_reason) == "heartbeat_timeout"
            if old.process.returncode is None and hung:
                await old.kill_and_reap()
            await old.process.wait()
        await old.client.aclose()  # closes the socket and removes its ipc file
        slot.generation += 1
        client = ZmqStageClient(old.client.sock.context, old.client.address, stage_id=k, replica=r,
                                sink=pool.sink, heartbeat_timeout=old.client.heartbeat_timeout,
                                heartbeat_interval=old.client.heartbeat_interval,
                                name=old.client.name, max_message_bytes=self.max_message_bytes,
                                security=old.client.security, authenticator=old.client.authenticator)
        h = WorkerHandle(k, r, st.kind, client,
                         os.path.join(pipe.tmpdir, f"s{k}r{r}.g{slot.generation}.stderr"))
        argv = worker_argv(cfg, k, r, st, client.address, pipe.tmpdir, pipe.inbox_host)
        if self.extra_args is not None:
            argv += self.extra_args(k, r, attempt)
        await self._nursery.start(client.run)
        try:
            await self._nursery.start(run_worker, h, argv, cfg)
        except BaseException:
            with trio.CancelScope(shield=True):
                await client.aclose()
            raise
        self._retired[(k, "garbage")] += old.client.garbage_frames
        self._retired[(k, "oversized")] += old.client.oversized_messages
        pipe.workers[pipe.workers.index(old)] = h  # the launcher stops it with the others
        if pool.closed:  # shut down while we started it
            return h
        pool.replace_replica(r, client, f"replaced by a restart: {old.client.dead_reason}")
        return h


def _first_and_last_line(text: str) -> str:
    """A failure's headline and its last line (a worker's stderr tail ends with what went wrong)."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.startswith("---")]
    if len(lines) <= 1:
        return lines[0] if lines else ""
    return f"{lines[0]} ({lines[-1]})"


def _startup_error(exc: BaseException) -> WorkerStartupError | None:
    """The WorkerStartupError in ``exc`` (trio may wrap it in a group), or None if it holds more."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc if isinstance(exc, WorkerStartupError) else None


@asynccontextmanager
async def supervised_pipeline(config: PipelineConfig, policy: RestartPolicy | None = None, *,
                              inbox_host: str | None = None, handle_sigterm: bool = True,
                              **kwargs: Any) -> AsyncIterator[Pipeline]:
    """``open_pipeline`` + ``open_supervisor``: yields the Pipeline, with ``.supervisor`` set.

    ``handle_sigterm=False``: the caller's Trio run handles SIGTERM itself (``serve --loop trio``).
    """
    async with (open_pipeline(config, inbox_host=inbox_host, handle_sigterm=handle_sigterm) as pipe,
                open_supervisor(pipe, policy, **kwargs) as sup):
        pipe.supervisor = sup  # type: ignore[attr-defined]
        yield pipe


@asynccontextmanager
async def open_supervisor(pipeline: Pipeline, policy: RestartPolicy | None = None,
                          **kwargs: Any) -> AsyncIterator[Supervisor]:
    """Run a :class:`Supervisor` over ``pipeline`` for the duration of the block."""
    sup = Supervisor(pipeline, policy, **kwargs)
    async with trio.open_nursery() as nursery:
        await nursery.start(sup.run)
        try:
            yield sup
        finally:
            sup._closing = True
            nursery.cancel_scope.cancel()
