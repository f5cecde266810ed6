"""The head's command-line side of distribution: ``--listen``, ``--keys``, ``--worker-backend``.

``serve`` and ``generate`` call :func:`add_arguments` and open their
pipeline with :func:`open_head_pipeline`: the local workers of the config
(supervised or not), plus, with ``--listen tcp://HOST:PORT``, a registrar
that lets replicas join over TCP (:mod:`trio_orch.cluster.registrar`), plus, with
``--worker-backend ray``, every configured replica placed as a Ray actor
that joins the same way (:mod:`trio_orch.cluster.ray_backend`).  A one-shot job
(``generate``) cannot run while a stage has no replica: it waits for joins
first (:func:`wait_for_replicas`).  See docs/distributed.md.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, replace
from typing import Any

import trio

from stages.config import PipelineConfig

__all__ = ["HeadOptions", "ReplicasMissing", "add_arguments", "head_options", "open_head_pipeline",
           "wait_for_replicas"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("replicas on other hosts (see docs/distributed.md)")
    g.add_argument(
        "--listen",
        default=None,
        metavar="tcp://HOST:PORT",
        help="accept stage replicas that join over TCP here (trio-orch worker --head ...); "
        "HOST is the address workers reach this host at",
    )
    g.add_argument(
        "--keys",
        default=None,
        metavar="DIR",
        help="key directory made by 'trio-orch keys' (needed with --listen): the head's key "
        "pair and the allow-list of worker keys",
    )
    g.add_argument(
        "--worker-backend",
        choices=["local", "ray"],
        default="local",
        help="local: worker processes on this host (default); ray: every configured replica "
        "runs as a Ray actor that joins over TCP, in placement groups made from the config "
        "(a stage's resources and label_selector, [pipeline] placement_strategy and "
        "placement_scope); a lost one is restarted as a new actor (docs/distributed.md)",
    )
    g.add_argument(
        "--ray-address",
        default=None,
        metavar="ADDR",
        help="the Ray cluster to use (default: RAY_ADDRESS or a running local one)",
    )


@dataclass(frozen=True)
class HeadOptions:
    listen: str | None = None
    keys: str | None = None
    backend: str = "local"
    ray_address: str | None = None


def head_options(args: argparse.Namespace, cfg: PipelineConfig) -> tuple[HeadOptions, PipelineConfig]:
    """Check the distribution flags against the config; the options and the config of the LOCAL workers.

    Raises ValueError with a message for the user.
    """
    from trio_orch.cluster.registrar import parse_listen

    opts = HeadOptions(
        getattr(args, "listen", None),
        getattr(args, "keys", None),
        getattr(args, "worker_backend", "local") or "local",
        getattr(args, "ray_address", None),
    )
    if opts.backend == "ray" and opts.listen is None:
        opts = replace(opts, listen="tcp://127.0.0.1:0")
    if opts.listen is not None:
        parse_listen(opts.listen)
        if opts.keys is None and opts.backend != "ray":
            raise ValueError("--listen needs --keys DIR (make them with: trio-orch keys DIR)")
        if opts.keys is not None:
            from trio_orch.cluster.registrar import HeadKeys

            HeadKeys.load(opts.keys)  # a missing or broken key directory is a usage error
    if opts.backend == "ray":
        local = cfg.with_overrides(replicas=0)
        return opts, local
    empty = [k for k, s in enumerate(cfg.stages) if s.replicas == 0]
    if empty and opts.listen is None:
        raise ValueError(f"stage(s) {empty} have no local replica: give --listen so that replicas can join")
    return opts, cfg


@asynccontextmanager
async def open_head_pipeline(
    cfg: PipelineConfig,
    opts: HeadOptions,
    *,
    full_config: PipelineConfig | None = None,
    policy: Any = None,
    supervised: bool = True,
    handle_sigterm: bool = True,
) -> AsyncIterator[Any]:
    """The pipeline, its registrar (``pipe.registrar``, or None), supervisor (``pipe.supervisor``) and
    Ray replicas (``pipe.ray``: :class:`~trio_orch.cluster.ray_replicas.RayReplicas`, or None).

    With ``--worker-backend ray`` and a supervisor, lost Ray replicas are restarted as new actors
    under the supervisor's policy; a cluster that cannot hold the pipeline raises
    :class:`~trio_orch.cluster.ray_placement.PlacementError` here.
    """
    from stages.auth import Keypair
    from trio_orch.cluster.launcher import open_pipeline
    from trio_orch.cluster.registrar import HeadKeys, open_registrar, parse_listen
    from trio_orch.cluster.supervisor import open_supervisor

    host = parse_listen(opts.listen)[0] if opts.listen else None
    async with AsyncExitStack() as stack:
        pipe = await stack.enter_async_context(
            open_pipeline(cfg, handle_sigterm=handle_sigterm, inbox_host=host)
        )
        pipe.supervisor = (
            await stack.enter_async_context(open_supervisor(pipe, policy)) if supervised else None
        )
        pipe.registrar = None
        pipe.ray = None
        if opts.listen is not None:
            # with Ray and no key directory: an ephemeral head key pair; each actor gets a one-time key
            keys = HeadKeys.load(opts.keys) if opts.keys is not None else HeadKeys(Keypair.generate(),
                                                                                    frozenset())
            pipe.registrar = await stack.enter_async_context(open_registrar(pipe, opts.listen, keys))
            if opts.backend == "ray":
                from trio_orch.cluster.ray_backend import open_ray_replicas

                pipe.ray = await stack.enter_async_context(
                    open_ray_replicas(full_config or cfg, pipe.registrar, opts.ray_address,
                                      supervisor=pipe.supervisor)
                )
        yield pipe


class ReplicasMissing(Exception):
    """Some stage still had no replica when the wait for joins ran out (the message names them)."""


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


async def wait_for_replicas(pipe: Any, timeout: float, *, say: Callable[[str], None] = _say,
                            poll: float = 0.1) -> None:
    """Return once every stage of ``pipe`` has a replica that takes requests; say what it waits for.

    A stage with no local replica has to wait for one to join (``--listen``):
    a request sent before would fail at once.  Needs an orchestrator routing
    through ``pipe`` (joins go through it).  Raises :class:`ReplicasMissing`,
    naming the stages still without a replica, after ``timeout`` seconds.
    """
    labels = [f"{k} ({st.label})" for k, st in enumerate(pipe.config.stages)]

    def missing() -> list[int]:
        return [k for k, pool in enumerate(pipe.stages) if pool.replica_counts()[0] == 0]

    waiting = missing()
    if not waiting:
        return
    head = pipe.registrar.address if getattr(pipe, "registrar", None) is not None else "the head"
    say(f"waiting up to {timeout:g} s for replicas to join at {head}: stage(s) "
        f"{', '.join(labels[k] for k in waiting)} have none yet (start one with: trio-orch worker "
        f"--stage {waiting[0]} --head {head} --keys DIR --config FILE)")
    with trio.move_on_after(timeout):
        while waiting:
            await trio.sleep(poll)
            now = missing()
            for k in sorted(set(waiting) - set(now)):
                say(f"stage {labels[k]}: a replica joined"
                    + (f"; still waiting for stage(s) {', '.join(labels[j] for j in now)}" if now else ""))
            waiting = now
    if waiting:
        raise ReplicasMissing(f"no replica joined stage(s) {', '.join(labels[k] for k in waiting)} within "
                              f"{timeout:g} s (--join-timeout); is a worker running with "
                              f"--head {head} and a key on the allow-list?")
