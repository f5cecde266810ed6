"""The Ray replicas of a pipeline: placed in their placement groups, watched, and restarted when lost.

:class:`RayReplicas` owns one :class:`RaySlot` per configured replica: the
bundle it holds in its placement group (:mod:`trio_orch.cluster.ray_placement`),
its current actor, and the member identity that actor's worker registers
under (``--member-id``), by which the registrar's members are told apart.

Starting: :meth:`RayReplicas.place` checks the plan against the cluster's
nodes (a pipeline it can never hold is a :class:`PlacementError` at once,
naming the missing resource), creates the placement groups and waits up to
the config's ``startup_timeout`` for them (then a :class:`PlacementError`
naming what the cluster has free); :meth:`RayReplicas.launch_all` starts one
actor per bundle.  The workers join through the registrar once the
orchestrator routes (a join goes through its core).

Supervised (a :class:`~trio_orch.cluster.supervisor.Supervisor`; ``serve``):
each slot is *adopted* by the supervisor and watched by one task.  When its
member is lost -- the worker killed, the actor killed (its worker exits with
it), the node gone (the worker dies with it, or its heartbeats stop), missed
heartbeats -- the death is counted, the requests it held fail over or end as
the routing core decides (exactly as for a local worker), and the slot is
restarted under the supervisor's policy (same intensity limit and backoff):
the old actor is stopped and killed, a new one is started in the *same
bundle* and must join within ``startup_timeout``.  Ray re-places a bundle
whose node was lost on a node left that fits it; where none fits (a stage
pinned to the lost node) the attempt fails naming what is missing, which
``/health`` shows beside the slot (``restart``), and the next attempt waits
for the node to come back.  A worker that exits or an actor that dies before
joining fails its attempt at once.

Unsupervised (``generate``): the actors are started and stopped, a lost one
stays lost.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import trio

from stages.config import PipelineConfig
from trio_orch.cluster.launcher import WorkerStartupError
from trio_orch.cluster.ray_placement import (
    Bundle,
    Group,
    PlacementError,
    cluster_nodes,
    plan,
    unfit,
    unplaced,
)
from trio_orch.cluster.registrar import Member, Registrar
from trio_orch.cluster.supervisor import Slot, Supervisor

__all__ = ["Launch", "RayReplicas", "RaySlot", "open_ray_slots"]

log = logging.getLogger("trio_orch.cluster.ray_replicas")

#: starts one replica's actor: (its bundle, Ray's scheduling strategy for that bundle, the member id
#: its worker registers under) -> the actor handle
Launch = Callable[[Bundle, Any, str], Any]

#: seconds between two looks at a joining replica (the registrar's members, its actor)
POLL = 0.2
#: seconds between two looks at the cluster's nodes while a replacement waits (for ``/health``)
LOOK = 2.0


@dataclass
class RaySlot:
    """One configured replica: its bundle, the actor running it now and its worker's member id."""

    bundle: Bundle
    group: int  #: index of its placement group
    index: int  #: its bundle's index in that group
    actor: Any = None
    member_id: str = ""
    constructed: bool = False  #: the current actor answered once (its worker was started)
    probe: Any = None  #: an outstanding ``returncode`` call on the current actor
    sup: Slot | None = None  #: the supervisor's slot (restart budget), when supervised


class RayReplicas:
    """Every replica of ``cfg`` as a Ray actor in its bundle (see the module docstring)."""

    def __init__(self, ray: Any, cfg: PipelineConfig, registrar: Registrar, launch: Launch,
                 supervisor: Supervisor | None = None, *, stop_grace: float = 5.0) -> None:
        self.ray = ray
        self.cfg = cfg
        self.registrar = registrar
        self.launch = launch
        self.supervisor = supervisor
        self.stop_grace = stop_grace
        self.groups: list[Group] = plan(cfg)
        self.slots = [RaySlot(b, g, i) for g, group in enumerate(self.groups)
                      for i, b in enumerate(group.bundles)]
        self.pgs: list[Any] = []
        self._closing = False

    # ------------------------------------------------------------------ start
    async def place(self) -> None:
        """Check the plan against the cluster, create the placement groups, wait until they are placed."""
        ray = self.ray
        from ray.util.placement_group import placement_group

        nodes = cluster_nodes(await trio.to_thread.run_sync(ray.nodes))
        why = unfit(self.groups, nodes)
        if why is not None:
            raise PlacementError(f"the Ray cluster cannot hold this pipeline: {why}")

        def create() -> list[Any]:
            pgs = []
            for g in self.groups:
                selectors = [dict(b.label_selector) for b in g.bundles]
                pgs.append(placement_group([dict(b.resources) for b in g.bundles], strategy=g.strategy,
                                           bundle_label_selector=selectors if any(selectors) else None))
            return pgs

        self.pgs = await trio.to_thread.run_sync(create)
        timeout = self.cfg.startup_timeout

        def wait() -> list[bool]:
            refs = [pg.ready() for pg in self.pgs]
            done, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout)
            return [r in done for r in refs]

        ready = await trio.to_thread.run_sync(wait)
        if not all(ready):
            free = await trio.to_thread.run_sync(ray.available_resources)
            raise PlacementError(unplaced(self.groups, ready, free, timeout))
        log.info("Ray placement groups ready: %s", "; ".join(f"{g.name} ({g.strategy}, {len(g.bundles)} "
                                                              "bundles)" for g in self.groups))

    async def launch_all(self) -> None:
        """Start every slot's actor; return once each has started its worker (raises if one cannot)."""
        await trio.to_thread.run_sync(lambda: [self._spawn(s) for s in self.slots])
        timeout = self.cfg.startup_timeout
        try:
            pids = await trio.to_thread.run_sync(
                lambda: self.ray.get([s.actor.pid.remote() for s in self.slots], timeout=timeout))
        except Exception as exc:  # an actor that could not start its worker, or none in time
            raise WorkerStartupError(f"the Ray actors did not all start their workers within {timeout:g} s "
                                     f"(startup_timeout): {type(exc).__name__}: {exc}") from None
        for s in self.slots:
            s.constructed = True
        log.info("Ray actors started %d workers (pids %s)", len(pids), pids)

    def _spawn(self, slot: RaySlot) -> None:
        """A new actor for ``slot`` in its bundle, its worker registering under a new member id (blocking)."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        slot.member_id = uuid.uuid4().hex
        strategy = PlacementGroupSchedulingStrategy(self.pgs[slot.group],
                                                    placement_group_bundle_index=slot.index)
        slot.actor = self.launch(slot.bundle, strategy, slot.member_id)
        slot.constructed = False
        slot.probe = None
        log.info("%s: placed as a Ray actor (bundle %d of placement group %s: %s)", slot.bundle.name,
                 slot.index, self.groups[slot.group].name, dict(slot.bundle.resources))

    # ------------------------------------------------------------------ supervision
    async def run(self, *, task_status: trio.TaskStatus[RayReplicas] = trio.TASK_STATUS_IGNORED) -> None:
        """Watch every slot (when supervised) until cancelled."""
        async with trio.open_nursery() as nursery:
            if self.supervisor is not None:
                for slot in self.slots:
                    slot.sup = self.supervisor.adopt(slot.bundle.stage_id, -1)
                    nursery.start_soon(self._watch, slot,
                                       name=f"ray[{slot.bundle.stage_id}.{slot.bundle.replica}]")
            task_status.started(self)
            await trio.sleep_forever()

    def _pool(self, slot: RaySlot) -> Any:
        return self.registrar.pipe.stages[slot.bundle.stage_id]

    async def _watch(self, slot: RaySlot) -> None:
        """Supervise one slot; a failure of the supervision itself (a Ray call that raised) is logged
        and gives the slot up, so ``/health`` says no replacement will come instead of hiding it."""
        try:
            await self._supervise(slot)
        except Exception as exc:
            log.exception("%s: supervising its Ray actor failed", slot.bundle.name)
            if slot.sup is not None and slot.sup.replica >= 0:
                self._pool(slot).give_up(slot.sup.replica, f"supervising its Ray actor failed: {exc!r}")

    async def _supervise(self, slot: RaySlot) -> None:
        sup, pool = self.supervisor, self._pool(slot)
        assert sup is not None and slot.sup is not None
        try:
            await self._wait_joined(slot)
        except WorkerStartupError as exc:
            if self._closing or pool.closed:
                return
            ev = sup.record_death(slot.sup, f"its first start failed: {exc}", None)
            if not await sup.restart(slot.sup, ev, self._replace(slot)):
                return
        while True:
            member = self.registrar.members[slot.member_id]
            slot.sup.replica = member.replica
            await member.client.dead_event.wait()
            if self._closing or pool.closed:
                return
            reason = member.client.dead_reason or "lost"
            old_pid = member.client.ready.pid if member.client.ready is not None else None
            ev = sup.record_death(slot.sup, f"{slot.bundle.name} (Ray actor): {reason}", old_pid)
            pool.note_restart(member.replica, "a new Ray actor starts in its placement-group bundle")
            if not await sup.restart(slot.sup, ev, self._replace(slot)):
                return

    def _replace(self, slot: RaySlot) -> Callable[[Slot, int], Any]:
        async def start(_sup_slot: Slot, attempt: int) -> int | None:
            await self._retire(slot)
            await trio.to_thread.run_sync(self._spawn, slot)
            return await self._wait_joined(slot)

        return start

    async def _wait_joined(self, slot: RaySlot) -> int | None:
        """The new member's worker pid once it joined; WorkerStartupError (saying why) if it does not."""
        pool = self._pool(slot)
        timeout = self.cfg.startup_timeout
        next_look = trio.current_time() + LOOK
        with trio.move_on_after(timeout):
            while True:
                m: Member | None = self.registrar.members.get(slot.member_id)
                if m is not None:
                    if m.gone is not None:
                        raise WorkerStartupError(f"{slot.bundle.name}: its worker joined and was lost at "
                                                 f"once: {m.gone.splitlines()[0]}")
                    slot.constructed = True  # its worker runs: the actor was built
                    if slot.sup is not None:
                        pool.note_restart(slot.sup.replica, None)
                        slot.sup.replica = m.replica
                    pool.note_restart(m.replica, None)
                    return m.client.ready.pid if m.client.ready is not None else None
                ended = await trio.to_thread.run_sync(self._probe, slot)
                if ended is not None:
                    raise WorkerStartupError(f"{slot.bundle.name}: {ended} before its worker joined")
                if slot.sup is not None and slot.sup.replica >= 0 and trio.current_time() >= next_look:
                    next_look = trio.current_time() + LOOK  # /health says what the replacement waits for
                    note = await trio.to_thread.run_sync(self._waiting_for, slot)
                    pool.note_restart(slot.sup.replica, note)
                await trio.sleep(POLL)
        why = await trio.to_thread.run_sync(self._diagnose, slot)
        if slot.sup is not None:
            pool.note_restart(slot.sup.replica, why)
        raise WorkerStartupError(f"{slot.bundle.name}: its Ray actor's worker did not join within "
                                 f"{timeout:g} s (startup_timeout): {why}")

    def _probe(self, slot: RaySlot) -> str | None:
        """Is the slot's actor, or its worker, gone already? (blocking; a quick look, never a wait)"""
        ray = self.ray
        if slot.probe is None:
            slot.probe = slot.actor.returncode.remote()
        done, _ = ray.wait([slot.probe], timeout=0)
        if not done:
            return None
        probe, slot.probe = slot.probe, None
        try:
            code = ray.get(probe)
        except Exception as exc:  # RayActorError & co: the actor died (killed, its node lost)
            return f"its Ray actor died ({type(exc).__name__}: {str(exc).splitlines()[0][:200]})"
        slot.constructed = True
        return None if code is None else f"its worker exited with code {code} (its stderr is in the Ray logs)"

    def _waiting_for(self, slot: RaySlot) -> str:
        """What a slot's new actor waits for, as far as the cluster's nodes tell (blocking)."""
        why = unfit([Group(slot.bundle.name, "PACK", (slot.bundle,))], cluster_nodes(self.ray.nodes()))
        if why is not None:
            return f"waiting for a node that can hold it: {why}"
        return "a new Ray actor starts in its placement-group bundle"

    def _diagnose(self, slot: RaySlot) -> str:
        """Why a slot's actor has not joined: no node fits its bundle, its group not placed, or its worker."""
        from ray.util.placement_group import placement_group_table

        waiting = self._waiting_for(slot)
        if waiting.startswith("waiting for a node"):
            return waiting
        state = placement_group_table(self.pgs[slot.group]).get("state", "?")
        if state != "CREATED":
            return f"its placement group is {state} (waiting for room on the nodes left)"
        if not slot.constructed:
            return "its actor is not running yet (its bundle's node has no room, or Ray is slow to start it)"
        return "its actor runs, its worker did not register (see the Ray worker logs of its node)"

    async def _retire(self, slot: RaySlot) -> None:
        """Stop the slot's worker (SIGTERM, then SIGKILL) and kill its actor."""
        actor, slot.actor = slot.actor, None
        if actor is None:
            return
        constructed = slot.constructed
        grace = self.stop_grace

        def kill() -> None:
            if constructed:
                try:
                    self.ray.get(actor.stop.remote(grace), timeout=grace + 10)
                except Exception as exc:  # dead already: killing it is enough
                    log.info("%s: stopping its worker: %s", slot.bundle.name, type(exc).__name__)
            self.ray.kill(actor)

        await trio.to_thread.run_sync(kill)

    # ------------------------------------------------------------------ stop
    async def stop(self) -> None:
        """Stop every worker, kill every actor, remove the placement groups."""
        self._closing = True
        ray, grace = self.ray, self.stop_grace
        actors = [s.actor for s in self.slots if s.actor is not None]
        running = [s.actor for s in self.slots if s.actor is not None and s.constructed]
        for s in self.slots:
            s.actor = None

        def stop_all() -> None:
            try:  # (an actor still waiting for a node has no worker: it is only killed)
                ray.get([a.stop.remote(grace) for a in running], timeout=grace + 10)
            except Exception as exc:  # an actor already dead: killing it below is enough
                log.warning("stopping Ray workers: %r", exc)
            for a in actors:
                ray.kill(a)
            from ray.util.placement_group import remove_placement_group

            for pg in self.pgs:
                try:
                    remove_placement_group(pg)
                except Exception as exc:
                    log.warning("removing a placement group: %r", exc)

        await trio.to_thread.run_sync(stop_all)


@asynccontextmanager
async def open_ray_slots(reps: RayReplicas) -> AsyncIterator[RayReplicas]:
    """Place, launch and (supervised) watch ``reps`` for the duration of the block; stop them all after."""
    try:
        await reps.place()
        await reps.launch_all()
        async with trio.open_nursery() as nursery:
            await nursery.start(reps.run)
            try:
                yield reps
            finally:
                reps._closing = True
                nursery.cancel_scope.cancel()
    finally:
        with trio.CancelScope(shield=True):
            await reps.stop()
