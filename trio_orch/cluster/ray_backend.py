"""``--worker-backend ray``: every configured replica as a Ray actor that joins over TCP.

Each actor (:class:`ReplicaActor`, in its replica's placement-group bundle:
the stage's ``resources`` from the config, e.g. ``num_gpus``, ``num_cpus``
defaulting to 1, a GPU for a replica placed on CUDA, and its
``label_selector``; see :mod:`trio_orch.cluster.ray_placement`) runs one
``python -m stages.headless`` process (:func:`worker_launch`: on its
replica's device -- ``cuda:0``, the GPU Ray gave the actor, or ``cpu``
seeing no GPU) that registers with the head like any remote worker, under a member
id the backend chose (how it knows which member is which actor's).  Each
actor -- a replacement too -- gets a key pair of its own that opens the head's
registration once (:meth:`~trio_orch.cluster.registrar.Registrar.one_time_key`:
spent by its worker's ``Register``, so a copy read later opens nothing).  It
travels to the actor as a constructor argument (Ray's trust boundary: any
driver of the cluster can read actor arguments) and from the actor to its
worker over the hand-over of :mod:`stages.credentials` (``--keys-fd``: a
socket, answered only once the worker locked itself down, and only to it):
never written to disk, never in an environment, on a command line or in a
pipe, where any process of the same user could read it in ``/proc``.  Once
joined, the worker's control link takes only the session key it made
itself.  The pipeline config travels to the actor the same way and to the
worker in its environment (it holds no secret).  The worker gets
the actor's environment without the variables named like a secret and
without Ray's own settings (:func:`stages.auth.scrubbed_environ`).  Leaving
the block stops every actor's worker (SIGTERM, then SIGKILL), kills the
actors and removes the placement groups.  An actor that dies (killed, its
node lost) takes its worker with it: the worker exits when its parent goes,
and the head sees a lost replica; under a supervisor it is restarted as a new
actor in the same bundle (:mod:`trio_orch.cluster.ray_replicas`).

Ray is an optional dependency: ``pip install -e '.[ray]'``.  The cluster is
an existing one (``ray start --head`` locally; ``--ray-address`` or
``RAY_ADDRESS`` otherwise).
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

import trio

from stages.auth import Keypair, scrubbed_environ
from stages.config import PipelineConfig, to_dict
from stages.credentials import Handover, HandoverError

if TYPE_CHECKING:  # an actor imports this module on its node: only what ReplicaActor needs
    from trio_orch.cluster.ray_placement import Bundle
    from trio_orch.cluster.ray_replicas import RayReplicas
    from trio_orch.cluster.registrar import Registrar
    from trio_orch.cluster.supervisor import Supervisor

__all__ = ["CONFIG_ENV", "ReplicaActor", "keys_text", "open_ray_replicas", "worker_launch"]

log = logging.getLogger("trio_orch.cluster.ray_backend")

#: the pipeline config (JSON of the TOML layout) handed to a worker started by an actor
CONFIG_ENV = "TRIO_ORCH_WORKER_CONFIG"


def keys_text(worker: Keypair, head: bytes) -> str:
    """What a Ray worker asks for over ``--keys-fd``: its key pair and the head's public key (JSON, Z85)."""
    return json.dumps({"public": worker.public.decode(), "secret": worker.secret.decode(),
                       "head": head.decode()})


def worker_launch(bundle: Bundle, head: str, member_id: str,
                  config_json: str) -> tuple[list[str], dict[str, str]]:
    """The command line and the (non-secret) variables of the worker a replica's actor starts: its
    stage, the head it joins, the member id it registers under, the device its bundle gives it
    (:meth:`~trio_orch.cluster.ray_placement.Bundle.worker_device`), the pipeline config."""
    device, env = bundle.worker_device()
    argv = [sys.executable, "-m", "stages.headless", "--stage", str(bundle.stage_id), "--head", head,
            "--device", device, "--member-id", member_id]
    return argv, {CONFIG_ENV: config_json, **env}


class ReplicaActor:
    """A Ray actor that runs one worker process (wrapped with ``ray.remote`` when used).

    ``keys``: :func:`keys_text`, handed to the worker once it asks for them over the socket it
    inherits (``--keys-fd``); ``env``: more (non-secret) variables for the worker's environment.
    """

    def __init__(self, argv: list[str], keys: str, env: dict[str, str],
                 handover_timeout: float = 120.0) -> None:
        handover = Handover()
        try:
            self.proc = subprocess.Popen([*argv, "--keys-fd", str(handover.child_fd)],
                                         stdin=subprocess.DEVNULL, pass_fds=(handover.child_fd,),
                                         env={**scrubbed_environ(), **env})
            handover.child_started(keys.encode())
            try:  # the process that serves: the worker's fresh child (stages/lockdown.py)
                self.serving_pid = handover.serve(self.proc.pid, keys.encode(), handover_timeout,
                                                  on_stranger=lambda pid: log.warning(
                                                      "refused the worker's keys to pid %d: not the worker "
                                                      "(pid %d)", pid, self.proc.pid))
            except HandoverError as exc:  # it exited first: its exit code tells
                log.warning("the worker did not get its keys: %s", exc)
                self.serving_pid = self.proc.pid
        finally:
            handover.close()

    def pid(self) -> int:
        """The worker process that serves (what its ``Ready`` names)."""
        return self.serving_pid

    def returncode(self) -> int | None:
        return self.proc.poll()

    def stop(self, grace: float = 10.0) -> int | None:
        """SIGTERM (a graceful leave), SIGKILL after ``grace`` seconds; the exit code."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def _import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise RuntimeError("--worker-backend ray needs Ray: pip install -e '.[ray]'") from None
    return ray


@asynccontextmanager
async def open_ray_replicas(cfg: PipelineConfig, registrar: Registrar, address: str | None,
                            *, supervisor: Supervisor | None = None,
                            stop_grace: float = 5.0) -> AsyncIterator[RayReplicas]:
    """Place ``cfg``'s replicas as Ray actors that join ``registrar``, each with a one-time key
    (see :mod:`trio_orch.cluster.ray_replicas`).

    Raises :class:`~trio_orch.cluster.ray_placement.PlacementError` when the
    cluster cannot hold them.  With a ``supervisor`` a lost replica is restarted.
    """
    from trio_orch.cluster.ray_replicas import RayReplicas, open_ray_slots

    ray = _import_ray()
    started_ray = False
    if not ray.is_initialized():
        addr = address or os.environ.get("RAY_ADDRESS") or "auto"
        await trio.to_thread.run_sync(lambda: ray.init(address=addr, log_to_driver=False,
                                                       include_dashboard=False))
        started_ray = True
    actor_cls = ray.remote(ReplicaActor)
    head, head_key = registrar.address, registrar.keys.keypair.public
    config_json = json.dumps(to_dict(cfg))

    def launch(bundle: Bundle, scheduling: Any, member_id: str) -> Any:
        argv, env = worker_launch(bundle, head, member_id, config_json)
        keys = keys_text(registrar.one_time_key(), head_key)
        return actor_cls.options(scheduling_strategy=scheduling, **bundle.actor_options()).remote(
            argv, keys, env)

    try:
        reps = RayReplicas(ray, cfg, registrar, launch, supervisor, stop_grace=stop_grace)
        async with open_ray_slots(reps):
            yield reps
    finally:
        if started_ray:
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(ray.shutdown)
