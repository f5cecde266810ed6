"""``--worker-backend ray``: every configured replica as a Ray actor that joins over TCP.

Each actor (:class:`ReplicaActor`, in its replica's placement-group bundle:
the stage's ``resources`` from the config, e.g. ``num_gpus``, ``num_cpus``
defaulting to 1, and its ``label_selector``; see
:mod:`trio_orch.cluster.ray_placement`) runs one ``python -m stages.headless``
process that registers with the head like any remote worker, under a member
id the backend chose (how it knows which member is which actor's).  The head
makes an ephemeral key pair for itself and one for its Ray workers (the
workers' public key is allowed; the key pair travels to
each actor as a constructor argument and from the actor to its worker over a
pipe the worker inherits, ``--keys-fd``: never written to disk, never in an
environment or on a command line, where any process of the same user could
read it in ``/proc``); the pipeline config travels to the actor the same way
and to the worker in its environment (it holds no secret).  The worker gets
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
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import trio

from stages.auth import Keypair, scrubbed_environ
from stages.config import PipelineConfig, to_dict

if TYPE_CHECKING:  # an actor imports this module on its node: only what ReplicaActor needs
    from trio_orch.cluster.ray_placement import Bundle
    from trio_orch.cluster.ray_replicas import RayReplicas
    from trio_orch.cluster.registrar import Registrar
    from trio_orch.cluster.supervisor import Supervisor

__all__ = ["CONFIG_ENV", "RayKeys", "ReplicaActor", "ephemeral_keys", "keys_text", "open_ray_replicas"]

log = logging.getLogger("trio_orch.cluster.ray_backend")

#: the pipeline config (JSON of the TOML layout) handed to a worker started by an actor
CONFIG_ENV = "TRIO_ORCH_WORKER_CONFIG"


@dataclass(frozen=True)
class RayKeys:
    """The head's ephemeral key pair and the one its Ray workers share."""

    head: Keypair
    worker: Keypair


def ephemeral_keys() -> RayKeys:
    return RayKeys(Keypair.generate(), Keypair.generate())


def keys_text(keys: RayKeys) -> str:
    """What a Ray worker reads from ``--keys-fd``: its key pair and the head's public key (JSON, Z85)."""
    return json.dumps({"public": keys.worker.public.decode(), "secret": keys.worker.secret.decode(),
                       "head": keys.head.public.decode()})


class ReplicaActor:
    """A Ray actor that runs one worker process (wrapped with ``ray.remote`` when used).

    ``keys``: :func:`keys_text`, handed on to the worker over an inherited pipe (``--keys-fd``);
    ``env``: more (non-secret) variables for the worker's environment.
    """

    def __init__(self, argv: list[str], keys: str, env: dict[str, str]) -> None:
        read_end, write_end = os.pipe()
        try:
            with os.fdopen(write_end, "w") as w:  # a few hundred bytes: fits the pipe, never blocks
                w.write(keys)
            self.proc = subprocess.Popen([*argv, "--keys-fd", str(read_end)], pass_fds=(read_end,),
                                         env={**scrubbed_environ(), **env}, stdin=subprocess.DEVNULL)
        finally:
            os.close(read_end)

    def pid(self) -> int:
        return self.proc.pid

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
async def open_ray_replicas(cfg: PipelineConfig, head: str, keys: RayKeys, address: str | None,
                            *, registrar: Registrar, supervisor: Supervisor | None = None,
                            stop_grace: float = 5.0) -> AsyncIterator[RayReplicas]:
    """Place ``cfg``'s replicas as Ray actors that join ``head`` (see :mod:`trio_orch.cluster.ray_replicas`).

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
    secret = keys_text(keys)
    env = {CONFIG_ENV: json.dumps(to_dict(cfg))}

    def launch(bundle: Bundle, scheduling: Any, member_id: str) -> Any:
        argv = [sys.executable, "-m", "stages.headless", "--stage", str(bundle.stage_id), "--head", head,
                "--device", cfg.device, "--member-id", member_id]
        return actor_cls.options(scheduling_strategy=scheduling, **bundle.actor_options()).remote(
            argv, secret, env)

    try:
        reps = RayReplicas(ray, cfg, registrar, launch, supervisor, stop_grace=stop_grace)
        async with open_ray_slots(reps):
            yield reps
    finally:
        if started_ray:
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(ray.shutdown)
