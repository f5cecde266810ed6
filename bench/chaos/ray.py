"""Chaos over ``--worker-backend ray``: the pipeline's replicas as Ray actors on a two-node cluster.

``trio-orch chaos --worker-backend ray`` starts a two-node Ray cluster on this
machine (:class:`~trio_orch.testing.ray_cluster.LocalRayCluster`: a head node
and a second one, each a ``ray start`` with its own loopback address, temp dir
and ports), makes this process its driver, and runs the faults whose setup
says ``ray`` (:data:`bench.chaos.faults.FAULTS`), each on a fresh pipeline
opened as ``serve`` opens it (:func:`open_ray_pipeline`): every replica a Ray
actor in its placement-group bundle, supervised (a lost one restarted as a new
actor under the same policy as a local worker).  Placement (:func:`placement`):
the thinkers and vocoders are pinned to the head by its custom resource; each
stage has a placement group of its own, ``SPREAD``, so the two talkers run one
on each node -- losing the second node loses one talker, whose requests fail
over to the other, and its replacement fits on the head.  The cluster is stopped when the matrix ends
(every process of it, checked).

A run's leak check adds the trio-orch workers and actors left on the nodes
(:func:`leftover_workers`) to the processes it counts.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any

import trio

from stages.config import PipelineConfig
from trio_orch.testing.ray_cluster import LocalRayCluster

__all__ = ["HEAD", "TWO", "all_joined", "leftover_workers", "local_cluster", "open_ray_pipeline", "placement",
           "ray_actor_killed", "ray_node_lost", "ray_worker_killed"]

#: the head node: room for the pinned stages (2 thinkers, 2 vocoders) and both talkers after a loss
HEAD = {"num_cpus": 6, "resources": {"head": 10.0}, "labels": {"node": "head"}}
#: the second node, where one talker runs until it is lost
TWO = {"num_cpus": 4, "resources": {"node2": 10.0}, "labels": {"node": "two"}}


@contextmanager
def local_cluster() -> Iterator[LocalRayCluster]:
    """A two-node cluster on this machine, this process its driver (``ray.init``), all stopped after."""
    import ray

    cluster = LocalRayCluster()
    try:
        cluster.start_head(**HEAD)  # type: ignore[arg-type]
        cluster.add_node("two", **TWO)  # type: ignore[arg-type]
        os.environ.update({k: v for k, v in cluster.driver_env.items() if k.startswith("RAY_")})
        ray.init(address=cluster.address, log_to_driver=False)
        _warm_up(ray)
        try:
            yield cluster
        finally:
            ray.shutdown()
    finally:
        cluster.stop()
        left = cluster.leftovers()
        if left:
            raise RuntimeError(f"processes of the chaos Ray cluster left running: {left}")


class _Probe:
    def node(self) -> str:
        import ray

        return str(ray.get_runtime_context().get_node_id())


def _warm_up(ray: Any) -> None:
    """One actor on each node, called and killed: the connections a Ray driver opens once, and keeps,
    are open before the first fault (whose leak check would count them)."""
    probe = ray.remote(_Probe)
    actors = [probe.options(num_cpus=0, resources={res: 0.01}).remote() for res in ("head", "node2")]
    ray.get([a.node.remote() for a in actors], timeout=120)
    for a in actors:
        ray.kill(a)


def placement(cfg: PipelineConfig) -> None:
    """Pin the thinkers and vocoders to the head; a placement group per stage, SPREAD: the two talkers
    go one to each node (and a lost one's bundle is placed again on the node left)."""
    cfg.placement_strategy = "SPREAD"
    cfg.placement_scope = "stage"
    for k in (0, 2):
        cfg.stages[k].resources = {"head": 1.0}


@asynccontextmanager
async def open_ray_pipeline(cfg: PipelineConfig, cluster: LocalRayCluster, policy: Any) -> AsyncIterator[Any]:
    """The pipeline as ``serve --worker-backend ray`` opens it (supervised), on ``cluster``."""
    from trio_orch.cluster.distributed import HeadOptions, open_head_pipeline

    local = cfg.with_overrides(replicas=0)
    opts = HeadOptions(listen="tcp://127.0.0.1:0", backend="ray", ray_address=cluster.address)
    async with open_head_pipeline(local, opts, full_config=cfg, policy=policy, handle_sigterm=False) as pipe:
        yield pipe


async def all_joined(pipe: Any, timeout: float) -> None:
    """Wait until every configured replica's worker joined (a join goes through the orchestrator: it
    runs by now); trio.TooSlowError after ``timeout``."""
    want = sum(st.replicas for st in pipe.ray.cfg.stages)
    with trio.fail_after(timeout):
        while sum(pipe.registrar.stage_members()) < want:
            await trio.sleep(0.05)


async def leftover_workers(cluster: LocalRayCluster, wait: float = 30.0) -> list[str]:
    """trio-orch workers and replica actors still on the nodes once they had ``wait`` s to go."""
    def left() -> list[str]:
        return [f"{p} on {n.name}: {what}" for n in cluster.nodes.values()
                for what in ("stages.headless", "ray::ReplicaActor") for p in n.find(what)]

    with trio.move_on_after(wait):
        while left():
            await trio.sleep(0.1)
    return left()


# ------------------------------------------------------------------ the faults
def _talker(run: Any, node: str) -> tuple[int, Any]:
    """A talker's worker pid on ``node`` and its member (its slot in the pool)."""
    cluster: LocalRayCluster = run.opts.ray
    pids = cluster.nodes[node].workers("--stage 1 ")
    members = {m.client.ready.pid: m for m in run.pipe.registrar.members.values()
               if m.gone is None and m.stage_id == 1 and m.client.ready is not None}
    pid = next(p for p in pids if p in members)
    return pid, members[pid]


async def ray_worker_killed(run: Any) -> None:
    await run.submitted_at_least(0.3)
    pid, member = _talker(run, "two")
    run.mark_fault()
    os.kill(pid, signal.SIGKILL)  # the actor lives on: the head sees its member lost
    await run.mark_restart(1, member.replica)


async def ray_actor_killed(run: Any) -> None:
    await run.submitted_at_least(0.3)
    pid, member = _talker(run, "two")
    run.mark_fault()
    os.kill(run.opts.ray.nodes["two"].actor_of(pid), signal.SIGKILL)  # its worker exits with it
    await run.mark_restart(1, member.replica)


async def ray_node_lost(run: Any) -> None:
    cluster: LocalRayCluster = run.opts.ray
    await run.submitted_at_least(0.3)
    lost = [m for m in run.pipe.registrar.members.values() if m.gone is None and m.client.ready is not None
            and m.client.ready.pid in cluster.nodes["two"].workers()]
    run.notes["replicas_on_lost_node"] = len(lost)
    run.mark_fault()
    await trio.to_thread.run_sync(lambda: cluster.stop_node("two", crash=True))  # every process of it
    slots = {(m.stage_id, m.replica) for m in lost}

    def deaths() -> list[float]:
        return [e.t_dead for e in run.sup.events if (e.stage_id, e.replica) in slots]

    def replaced() -> list[float]:
        return [e.t_ready for e in run.sup.events if (e.stage_id, e.replica) in slots and e.t_ready]

    await run.sup.wait_for(lambda: len(deaths()) >= len(slots))
    run.mark_detect(run.trio_to_mono(max(deaths())))  # every replica it held reported lost

    await run.sup.wait_for(lambda: len(replaced()) >= len(slots))
    run.mark_recover(run.trio_to_mono(max(replaced())))  # the last of them ready on the node left
    run.notes["replaced_on_head"] = len(cluster.nodes["head"].workers("--stage 1 "))
    t = time.monotonic()
    await trio.to_thread.run_sync(lambda: cluster.add_node("two", **TWO))  # type: ignore[arg-type]
    run.notes["node_back_s"] = round(time.monotonic() - t, 1)
