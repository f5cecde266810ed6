"""Worker lifecycle under a Trio nursery: start, handshake, watch, stop.

:func:`open_pipeline` starts every replica of every stage as a
``python -m stages.worker`` process (``trio.lowlevel.open_process``), each
behind a :class:`~trio_orch.cluster.transport.ZmqStageClient` whose socket lives in a
private temporary directory, and yields a :class:`Pipeline` whose ``stages``
(one :class:`~trio_orch.cluster.pool.ReplicaPool` per stage) plug into
:class:`~trio_orch.shell.orchestrator.Orchestrator`::

    async with open_pipeline(default_config()) as pipe:
        async with open_orchestrator(pipe.stages, **pipe.orchestrator_kwargs()) as orch:
            ...

Each worker runs where its placement says (:mod:`stages.placement`): one on
``cuda:N`` is started with ``CUDA_VISIBLE_DEVICES`` naming the head's N-th GPU
and told ``--device cuda:0``; a device this host lacks is refused before any
worker starts.  A replica is usable only after its ``Ready`` handshake; a worker that does
not get there within ``startup_timeout`` (or exits first) raises
:class:`WorkerStartupError` naming the stage with its stderr tail.  A worker
that exits, says it is dying or misses heartbeats is a dead replica (its pool
evicts it; a hung one is also killed).  Whenever the ``async with`` exits --
normally, by exception, by cancellation or Ctrl-C -- every worker gets
SIGTERM, then SIGKILL after ``stop_grace``, is reaped, and the temporary
directory (ipc socket files, stderr logs) is removed.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any

import trio
import zmq

from stages import registry
from stages.auth import Authenticator, Security, scrubbed_environ
from stages.config import PipelineConfig, StageConfig
from stages.placement import check_devices
from trio_orch.cluster.credentials import LaunchCredentials
from trio_orch.cluster.pool import ReplicaPool
from trio_orch.cluster.transport import ReplicaDied, RpcError, ZmqStageClient
from trio_orch.types import StageUnavailable

__all__ = ["Pipeline", "WorkerHandle", "WorkerStartupError", "forward_fn", "forward_fn_for", "inbox_address",
           "open_pipeline",
           "prewarm_fn", "run_worker", "worker_argv", "worker_env"]

log = logging.getLogger("trio_orch.cluster.launcher")


class WorkerStartupError(RuntimeError):
    """A worker did not complete its ready handshake (message names stage and stderr tail)."""


@dataclass
class WorkerHandle:
    """One worker process and its client."""

    stage_id: int
    replica: int
    kind: str
    client: ZmqStageClient
    stderr_path: str
    process: trio.Process | None = None
    stopping: bool = False  # set when the pipeline stops it on purpose (no warning then)
    #: the process that serves: the launched one's child once it went on in a fresh address space
    #: (``stages.lockdown.lock_down(fresh=True)``), the launched one until then
    serving_pid: int | None = None

    @property
    def pid(self) -> int | None:
        """The pid that serves (what to signal to hang, stop or kill the replica); see ``serving_pid``."""
        if self.serving_pid is not None:
            return self.serving_pid
        return self.process.pid if self.process is not None else None

    def kill(self) -> None:
        """SIGKILL the process that serves (its stand-in, the launched one, reaps it and dies alike)."""
        pid = self.pid
        if pid is not None and self.process is not None and self.process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    async def kill_and_reap(self, grace: float = 2.0) -> None:
        """:meth:`kill`, then wait for the launched process; SIGKILL it too if it is still there after
        ``grace`` seconds (a stand-in that was stopped)."""
        if self.process is None:
            return
        self.kill()
        with trio.move_on_after(grace):
            await self.process.wait()
        if self.process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.process.kill()
            await self.process.wait()

    def stderr_tail(self, lines: int = 20) -> str:
        try:
            with open(self.stderr_path, "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - 8192))
                text = f.read().decode(errors="replace")
        except OSError:
            return "(no stderr captured)"
        tail = text.strip().splitlines()[-lines:]
        return "\n".join(tail) if tail else "(stderr was empty)"


def forward_fn_for(kinds: list[str], roles: list[str] | None = None) -> Callable[..., Any]:
    """The normal-mode ``forward_fn`` of a pipeline of these kinds (and roles; see :mod:`stages.registry`)."""
    return registry.forward_fn(kinds, roles)


def forward_fn(k: int, prompt: Any, outputs: list[Any]) -> Any:
    """``forward_fn`` of the default thinker -> talker -> code2wav pipeline."""
    return _DEFAULT_FORWARD(k, prompt, outputs)


def prewarm_fn(k: int, prompt: Any) -> Any:
    """Async-chunk placeholder input for stage k >= 1 of a pipeline whose kinds keep the default."""
    return registry.placeholder_input(k, prompt)


_DEFAULT_FORWARD = registry.forward_fn(["thinker", "talker", "code2wav"])


class Pipeline:
    """A running pipeline: ``stages`` (one pool per stage) and the orchestrator glue.

    ``open_orchestrator(pipe.stages, **pipe.orchestrator_kwargs())`` routes through it.  An
    orchestrator closes its stage clients when it stops, so use one orchestrator per pipeline.
    ``workers`` (one :class:`WorkerHandle` per replica: pid, client, stderr tail), ``pids``,
    ``tmpdir`` (the private ipc directory) and :meth:`stats` are there for tests, fault
    injection and monitoring.
    """

    def __init__(self, config: PipelineConfig, stages: list[ReplicaPool], workers: list[WorkerHandle],
                 tmpdir: str, security: Security | None = None, authenticator: Authenticator | None = None,
                 inbox_host: str | None = None) -> None:
        self.config = config
        #: the pipeline secret and key pair (each local worker is handed them with its launch ticket,
        #: trio_orch/cluster/credentials.py) and the ZAP handler that checks every peer of this
        #: process's sockets (refusals: ``authenticator.refused``)
        self.security = security
        self.authenticator = authenticator
        #: where local inboxes also listen on TCP (distributed mode), else None
        self.inbox_host = inbox_host
        self.ctx: zmq.Context | None = None  #: the ZMQ context of every socket of this pipeline
        self.stages = stages
        self.workers = workers
        self.tmpdir = tmpdir
        self.forward_fn = registry.forward_fn(config.kinds(), config.roles())
        self.prewarm_fn = registry.prewarm_fn(config.kinds(), config.roles())
        #: each stage's name and sampling parameters (what requests are checked and mapped against)
        options = [st.model for st in config.stages]
        self.stage_params = registry.stage_params(config.kinds(), options)
        self.check_sampling = registry.check_sampling(config.kinds(), options)

    @property
    def final_stage_ids(self) -> list[int]:
        return list(self.config.final_stage_ids)

    @property
    def pids(self) -> list[int]:
        return [w.pid for w in self.workers if w.pid is not None]

    def orchestrator_kwargs(self) -> dict[str, Any]:
        """``final_stage_ids``, ``async_chunk``, ``forward_fn``, ``prewarm_fn``, ``check_sampling``,
        ``max_retries``.

        Also ``max_inflight`` when the config sets a stage's bound.
        """
        kw: dict[str, Any] = {"final_stage_ids": self.final_stage_ids, "async_chunk": self.config.async_chunk,
                              "forward_fn": self.forward_fn, "prewarm_fn": self.prewarm_fn,
                              "check_sampling": self.check_sampling, "max_retries": self.config.max_retries}
        bounds = self.config.admission_bounds(serving=False)
        if any(b is not None for b in bounds):
            kw["max_inflight"] = bounds
        return kw

    async def stats(self, timeout: float = 2.0) -> list[dict[str, Any]]:
        """Every worker's ``stats`` RPC, in parallel; a dead or silent one gets ``{"error": ...}``."""
        results: list[dict[str, Any]] = [{} for _ in self.workers]

        async def one(i: int, h: WorkerHandle) -> None:
            base = {"stage_id": h.stage_id, "replica": h.replica, "kind": h.kind}
            try:
                results[i] = {**base, **await h.client.rpc("stats", timeout=timeout)}
            except (TimeoutError, RpcError, ReplicaDied, StageUnavailable) as exc:
                results[i] = {**base, "error": f"{type(exc).__name__}: {exc}"}

        async with trio.open_nursery() as nursery:
            for i, h in enumerate(self.workers):
                nursery.start_soon(one, i, h)
        return results

    def worker(self, stage_id: int, replica: int = 0) -> WorkerHandle:
        for w in self.workers:
            if (w.stage_id, w.replica) == (stage_id, replica):
                return w
        raise KeyError((stage_id, replica))


def _worker_argv(cfg: PipelineConfig, k: int, r: int, st: StageConfig, addr: str, tmpdir: str,
                 inbox_host: str | None = None) -> list[str]:
    argv = [sys.executable, "-m", "stages.worker", "--connect", addr, "--stage-id", str(k),
            "--replica", str(r), "--kind", st.kind, "--model-json", json.dumps(st.model),
            "--device", cfg.placement(k, r).device, "--seed", str(cfg.model_seed(k)),
            "--threads", str(st.threads),
            "--max-batch", str(st.max_batch), "--heartbeat-interval", str(cfg.heartbeat_interval),
            "--cleanup-dir", tmpdir]
    if st.role:
        argv += ["--role", st.role]
    root = registry.source_root(st.kind)  # a plug-in: import it from where this process found it
    if root is not None:
        argv += ["--python-path", root]
    if k > 0 and cfg.hands_off(k - 1):  # data from stage k-1's workers: an inbox
        argv += ["--inbox", _inbox(tmpdir, k, r)]
        if inbox_host is not None:  # and one on TCP for upstream replicas on other hosts
            argv += ["--inbox-tcp", f"tcp://{inbox_host}:0"]
    if cfg.hands_off(k):  # data to stage k+1's workers: one address per replica
        for r2 in range(cfg.stages[k + 1].replicas):
            argv += ["--downstream", _inbox(tmpdir, k + 1, r2)]
    if cfg.async_chunk and k not in cfg.final_stage_ids:
        argv.append("--control-only")
    return argv + list(st.worker_args) + list(st.replica_args.get(r, []))


def worker_argv(cfg: PipelineConfig, k: int, r: int, st: StageConfig, addr: str, tmpdir: str,
                inbox_host: str | None = None) -> list[str]:
    """The ``python -m stages.worker`` command line of replica ``r`` of stage ``k`` (public for
    supervisors and fault harnesses that start replicas themselves)."""
    return _worker_argv(cfg, k, r, st, addr, tmpdir, inbox_host)


def worker_env(cfg: PipelineConfig, k: int, r: int) -> dict[str, str]:
    """The environment replica ``r`` of stage ``k`` is started with: this process's, without its
    secrets (:func:`stages.auth.scrubbed_environ`), with the one GPU its placement gives it
    (``CUDA_VISIBLE_DEVICES``: :mod:`stages.placement`)."""
    return {**scrubbed_environ(), **cfg.placement(k, r).env}


def _inbox(tmpdir: str, k: int, r: int) -> str:
    return f"ipc://{tmpdir}/in-s{k}r{r}"


def inbox_address(tmpdir: str, k: int, r: int) -> str:
    """The ipc async-chunk inbox of local replica ``r`` of stage ``k``."""
    return _inbox(tmpdir, k, r)


async def _run_worker(h: WorkerHandle, argv: list[str], cfg: PipelineConfig, *,
                      task_status: trio.TaskStatus[WorkerHandle] = trio.TASK_STATUS_IGNORED) -> None:
    """Start one worker, wait for Ready, watch it; always stop and reap it on the way out.

    A secured client's worker gets its credentials -- a one-time ticket for this slot, the
    pipeline secret and key pair -- over the hand-over of :class:`LaunchCredentials` (``--auth-fd``),
    once it has locked itself down: never in its environment, on its command line, or in anything
    another process of the same user could open.  Only its pid may then take the slot, and its
    ``Ready`` counts only from that pid.
    """
    label = f"stage {h.stage_id} ({h.kind}) replica {h.replica}"
    client = h.client
    creds: LaunchCredentials | None = None
    if client.security is not None and client.authenticator is not None:
        security = client.security
        creds = LaunchCredentials(client.authenticator, client.zap_domain(client.address), client.name,
                                  lambda ticket: security.to_text(ticket).encode())
        argv = [*argv, *creds.argv()]
    try:
        with open(h.stderr_path, "wb") as errf:
            # A session of its own: a signal to serve's whole process group (`timeout`, `kill -- -PGID`,
            # Ctrl-C in a terminal) must not stop the workers before serve drained them. Serve stops
            # them itself; if serve is SIGKILLed, they see their parent gone. (systemd's default
            # KillMode=control-group signals every process of the unit whatever its session: the
            # unit in docs/operating.md uses KillMode=mixed.)
            h.process = await trio.lowlevel.open_process(argv, stdin=subprocess.DEVNULL, stdout=errf,
                                                         stderr=errf,
                                                         pass_fds=creds.pass_fds if creds else (),
                                                         env=worker_env(cfg, h.stage_id, h.replica),
                                                         start_new_session=True)
    except BaseException:
        if creds is not None:
            creds.close()
        raise
    if creds is not None:
        creds.started(h.process.pid)
    proc = h.process
    try:
        async with trio.open_nursery() as nursery:
            async def watch_exit() -> None:
                code = await proc.wait()
                h.client.mark_dead(f"worker process {proc.pid} exited with code {code}; "
                                   f"stderr tail:\n{h.stderr_tail(8)}")

            nursery.start_soon(watch_exit)
            if creds is not None:
                async def hand_over(creds: LaunchCredentials) -> None:
                    serving = await creds.deliver()
                    if serving is not None:  # its Ready counts from this pid alone
                        h.serving_pid = client.expected_pid = serving

                nursery.start_soon(hand_over, creds)
            try:
                with trio.fail_after(cfg.startup_timeout):
                    await h.client.wait_ready()
            except (trio.TooSlowError, ReplicaDied) as exc:
                why = (f"not ready after {cfg.startup_timeout:g}s" if isinstance(exc, trio.TooSlowError)
                       else f"exited before it was ready (code {proc.returncode})")
                raise WorkerStartupError(f"{label} failed to start: {why}\n--- worker stderr (tail) ---\n"
                                         f"{h.stderr_tail()}") from None
            log.info("%s ready (pid %d)", label, proc.pid)
            task_status.started(h)
            await h.client.dead_event.wait()  # exit, Dying sentinel or missed heartbeats
            log.log(logging.INFO if h.stopping else logging.WARNING, "%s is dead: %s", label,
                    h.client.dead_reason)
            nursery.cancel_scope.cancel()
    finally:
        with trio.CancelScope(shield=True):
            dying = (h.client.dead_reason or "").startswith("worker is dying")
            await _stop(proc, cfg.stop_grace, label, exiting=dying, kill=h.kill_and_reap)
        if creds is not None:
            creds.close()  # its ticket opens nothing any more


#: Start one worker under the caller's nursery: ``await nursery.start(run_worker, handle, argv, cfg)``
#: returns once it is ready (raises WorkerStartupError otherwise); the task then watches the process
#: (exit -> ``handle.client.mark_dead``) and always stops and reaps it when it ends.
run_worker = _run_worker


async def _stop(proc: trio.Process, grace: float, label: str, *, exiting: bool = False,
                kill: Callable[[], Awaitable[None]] | None = None) -> None:
    """SIGTERM, wait ``grace`` seconds, SIGKILL (``await kill()`` if given); always reap.

    ``exiting``: the worker already said it is dying; give it ``grace`` first.
    """
    if exiting and proc.returncode is None:
        with trio.move_on_after(grace):
            await proc.wait()
    if proc.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
        with trio.move_on_after(grace):
            await proc.wait()
    if proc.returncode is None:
        log.warning("%s did not exit %.1fs after SIGTERM: SIGKILL", label, grace)
        if kill is not None:
            await kill()
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()


@asynccontextmanager
async def _unwrap_single() -> AsyncIterator[None]:
    """Re-raise a nursery's lone exception as itself (``except WorkerStartupError`` works)."""
    try:
        yield
    except BaseExceptionGroup as group:
        leaves = _leaves(group)
        if len(leaves) == 1:
            raise leaves[0] from None
        startup = [e for e in leaves if isinstance(e, WorkerStartupError)]
        if startup and all(isinstance(e, WorkerStartupError | trio.Cancelled) for e in leaves):
            raise startup[0] from None
        raise


def _leaves(group: BaseExceptionGroup) -> list[BaseException]:
    out: list[BaseException] = []
    for e in group.exceptions:
        out.extend(_leaves(e) if isinstance(e, BaseExceptionGroup) else [e])
    return out


#: pipelines not closed yet (ipc dir -> workers): the atexit safety net's work list
_LIVE: dict[str, list[WorkerHandle]] = {}


def _register_for_exit(tmpdir: str, workers: list[WorkerHandle]) -> None:
    if not _LIVE:
        atexit.unregister(_cleanup_at_exit)
        atexit.register(_cleanup_at_exit)
    _LIVE[tmpdir] = workers


def _cleanup_at_exit() -> None:
    """The interpreter exits with a pipeline still open (e.g. run in a daemon thread that never
    unwound): kill its workers and remove its ipc directory rather than leave them behind."""
    for tmpdir, workers in list(_LIVE.items()):
        for h in list(workers):
            if h.process is not None and h.process.returncode is None:
                h.kill()
                with contextlib.suppress(OSError):
                    os.kill(h.process.pid, signal.SIGKILL)
        shutil.rmtree(tmpdir, ignore_errors=True)
    _LIVE.clear()


async def _exit_on_sigterm(*, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    """Turn SIGTERM into ``SystemExit(143)`` so the pipeline unwinds and stops its workers.

    Python's default SIGTERM action kills the process on the spot, skipping
    every ``finally``: the workers would be orphaned and the ipc directory left.
    """
    with trio.open_signal_receiver(signal.SIGTERM) as signals:
        task_status.started()
        async for _ in signals:
            log.warning("SIGTERM: stopping the pipeline's workers")
            raise SystemExit(128 + signal.SIGTERM)


@asynccontextmanager
async def open_pipeline(config: PipelineConfig, *, handle_sigterm: bool = True,
                        inbox_host: str | None = None) -> AsyncIterator[Pipeline]:
    """Start every worker of ``config`` (in parallel), yield the :class:`Pipeline`, stop them all.

    Raises ValueError, before any worker starts, if a replica is placed on a
    CUDA device this host does not have (:mod:`stages.placement`), and
    :class:`WorkerStartupError` if a worker does not become ready.  A
    lone exception from inside the block is re-raised as itself, not wrapped
    in an exception group.  With ``handle_sigterm`` (and only in the main
    thread), SIGTERM while the pipeline is open raises ``SystemExit(143)``
    after the workers were stopped, instead of killing the process without
    cleanup.  Workers also exit, and remove the ipc directory, if this
    process dies without cleaning up (e.g. SIGKILL).

    Every socket checks its peers (:mod:`stages.auth`): each replica's control
    socket takes only the worker launched for it (a one-time ticket, its pid),
    and a fresh pipeline secret, handed to each worker with its ticket, is
    required to connect to any worker's inbox.  ``inbox_host``: async-chunk inboxes also listen
    on TCP there, for replicas on other hosts (see :mod:`trio_orch.cluster.registrar`).
    """
    config.validate()
    check_devices(config.devices())  # ValueError naming the replica and the device: nothing started yet
    tmpdir = tempfile.mkdtemp(prefix="trio-orch-")
    ctx = zmq.Context()
    security = Security.new_pipeline()
    authenticator = Authenticator(ctx, security.secret).start()  # before any socket binds
    assert security.keypair is not None
    authenticator.allow([security.keypair.public])
    pools: list[ReplicaPool] = []
    workers: list[WorkerHandle] = []
    _register_for_exit(tmpdir, workers)
    try:
        async with _unwrap_single(), trio.open_nursery() as nursery:
            if handle_sigterm and threading.current_thread() is threading.main_thread():
                await nursery.start(_exit_on_sigterm)
            plans = []
            for k, st in enumerate(config.stages):
                pool = ReplicaPool(k, name=f"stage {k} ({st.label})")
                pools.append(pool)
                for r in range(st.replicas):
                    addr = f"ipc://{tmpdir}/ctl-s{k}r{r}"
                    client = ZmqStageClient(ctx, addr, stage_id=k, replica=r, sink=pool.sink,
                                            heartbeat_timeout=config.heartbeat_timeout
                                            if config.heartbeat_interval > 0 else None,
                                            heartbeat_interval=config.heartbeat_interval or None,
                                            name=f"stage {k} ({st.label}) replica {r}",
                                            security=security, authenticator=authenticator)
                    pool.add_replica(client)
                    await nursery.start(client.run)
                    h = WorkerHandle(k, r, st.kind, client, os.path.join(tmpdir, f"s{k}r{r}.stderr"))
                    workers.append(h)
                    plans.append((h, _worker_argv(config, k, r, st, addr, tmpdir, inbox_host)))
            for k in range(len(pools) - 1):
                pools[k + 1].upstream = pools[k]  # its hand-offs are timed from this stage's finish
                if config.hands_off(k):
                    pools[k].downstream = pools[k + 1]  # async-chunk, or a KV handoff (PD)
            async with trio.open_nursery() as starters:  # start all workers at once
                for h, argv in plans:
                    starters.start_soon(nursery.start, _run_worker, h, argv, config)
            try:
                pipe = Pipeline(config, pools, workers, tmpdir, security, authenticator, inbox_host)
                pipe.ctx = ctx
                yield pipe
            finally:
                for h in workers:
                    h.stopping = True
                with trio.CancelScope(shield=True):  # stop workers while their sockets still listen
                    async with trio.open_nursery() as stoppers:
                        for h in workers:
                            if h.process is not None:
                                stoppers.start_soon(partial(_stop, h.process, config.stop_grace,
                                                            f"stage {h.stage_id} replica {h.replica}",
                                                            kill=h.kill_and_reap))
                shutil.rmtree(tmpdir, ignore_errors=True)  # at once: nothing below can leave it behind
                nursery.cancel_scope.cancel()
    finally:
        _LIVE.pop(tmpdir, None)
        authenticator.stop()  # the sockets are closed by now: nothing is checked after this
        ctx.destroy(linger=0)
        shutil.rmtree(tmpdir, ignore_errors=True)
