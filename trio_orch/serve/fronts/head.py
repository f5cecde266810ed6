"""``serve --api-server-count N`` (N > 1): a head runs the engine and N API-server processes, no HTTP.

The head is one Trio run whatever ``--loop`` says; ``--loop`` picks the
server each front runs (:mod:`.process`).

One Trio run, one root nursery: the engine (:class:`~trio_orch.engine.TrioEngine`:
pipeline, workers, orchestrator), the :class:`~.host.EngineHost` with one
guarded socket per front, and a supervisor task per front slot
(:func:`_supervise`).  Each front (:mod:`.process`) is launched as a worker
is: its own session, the hand-over socket and the listening socket as its
only inherited descriptors, locked down before it asks for its credentials,
which go to its pid alone (:class:`~trio_orch.cluster.credentials.LaunchCredentials`).
Only the fronts accept on the port: the head keeps the listening socket to
hand it to a front it restarts, and never accepts on it; workers never
inherit it.  The head reports ready (announces) once every front said hello.

A front that exits on its own is restarted, under the intensity limits a
worker has (``--max-restarts`` in ``--restart-window``); its open requests
were left in the head when its slot was dropped, each ending ``aborted``
there, once.  Past the limit the head stops (exit 1), as it does when the
engine dies.

Drain, in order: the first SIGTERM/SIGINT goes to every front (each stops
accepting, lets its streams finish within ``--shutdown-timeout``, exits);
once they are gone the engine drains what is left within the time that
remains, and stops its workers.  A second signal ends the drain at once; a
third cancels everything.  On the way out every front still running is
stopped and reaped, and the head's socket directory removed; a head killed
with ``kill -9`` leaves fronts whose stand-in sees it gone and stops them.
"""

from __future__ import annotations

import contextlib
import json
import logging
import shutil
import signal
import subprocess
import sys
import tempfile
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

import trio
import zmq

from stages.auth import Authenticator, Security, scrubbed_environ
from trio_orch.cluster.credentials import LaunchCredentials
from trio_orch.cluster.supervisor import RestartPolicy
from trio_orch.engine import EngineStartupError, TrioEngine
from trio_orch.serve.fronts.host import EngineHost, FrontSlot
from trio_orch.serve.options import ServeOptions, ServeOutcome, unfinished
from trio_orch.serve.signals import signal_name

__all__ = ["FRONT", "FrontsConfig", "serve"]

log = logging.getLogger("trio_orch.serve.fronts")

#: how the head names its fronts when it announces where they serve (by their ``--loop``)
FRONT = {"trio": "Trio fronts", "asyncio": "asyncio fronts"}


@dataclass(frozen=True)
class FrontsConfig:
    """What the fronts are launched with: how many, the serve command line, the secrets they are handed."""

    count: int
    argv: Sequence[str]  #: the serve command's own arguments (the fronts build the same app from them)
    api_key: str | None
    admin_token: str | None
    policy: RestartPolicy
    log_level: int = logging.WARNING
    loop: str = "trio"  #: the fronts' ``--loop`` (they read it from ``argv``; the head names them by it)


def serve(options: ServeOptions, fronts: FrontsConfig) -> ServeOutcome:
    """The whole run of a head with ``fronts.count`` API-server processes (module docstring).  Main thread."""
    out = ServeOutcome()
    trio.run(_serve, options, fronts, out)
    return out


async def _serve(options: ServeOptions, fronts: FrontsConfig, out: ServeOutcome) -> None:
    engine = TrioEngine(options.pipeline, **options.engine)
    directory = tempfile.mkdtemp(prefix="trio-orch-fronts-")
    ctx = zmq.Context()
    security = Security.new_pipeline()
    authenticator = Authenticator(ctx, security.secret).start()
    host: EngineHost | None = None
    run = _Fronts(options, fronts, out)
    try:
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async with trio.open_nursery() as root:
                run.give_up = partial(engine.request_stop, 0.0)  # the engine stops; its end stops the rest

                async def run_engine(task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
                    try:
                        await engine.run(task_status=task_status)
                    finally:
                        out.unfinished = unfinished(engine)
                        if not out.stopped_by and out.served and out.died is None:
                            out.died = engine.closed_reason or "its orchestrator stopped"
                        root.cancel_scope.cancel()

                async def drain() -> None:
                    deadline = trio.current_time() + options.shutdown_timeout
                    run.stopping = True
                    for proc in run.procs.values():
                        _signal(proc, signal.SIGTERM)  # each front stops accepting, its streams finish
                    with trio.move_on_at(deadline + 1.0):
                        await run.gone.wait()
                    engine.request_stop(max(0.0, deadline - trio.current_time()))

                async def watch_signals() -> None:
                    async for signum in signals:
                        name = signal_name(signum)
                        out.stopped_by.append(name)
                        if not out.served or len(out.stopped_by) >= 3:
                            root.cancel_scope.cancel()
                        elif len(out.stopped_by) == 1:
                            print(f"{name}: draining (the API-server processes first; up to "
                                  f"{options.shutdown_timeout:g}s; again to stop at once) ...", flush=True)
                            root.start_soon(drain)
                        else:
                            run.stopping = True
                            for proc in run.procs.values():
                                _signal(proc, signal.SIGKILL)
                            engine.end_drain()

                root.start_soon(watch_signals)
                try:
                    with trio.fail_after(options.startup_timeout):
                        await root.start(run_engine)
                    host = EngineHost(engine, ctx, directory, fronts.count, security=security,
                                      authenticator=authenticator)
                    root.start_soon(host.watch_state)
                    with trio.fail_after(options.startup_timeout):
                        await root.start(run.run, host)
                except (EngineStartupError, trio.TooSlowError) as exc:
                    out.startup_error = (exc if isinstance(exc, EngineStartupError) else EngineStartupError(
                        f"the server did not become ready within {options.startup_timeout}s"))
                    root.cancel_scope.cancel()
                    return
                out.served = True
                host_addr, port = options.sock.getsockname()[:2]
                what = f"{FRONT[fronts.loop]}: {fronts.count} API-server processes"
                options.announce(host_addr, port, what)
        if run.failed is not None and not out.served:
            out.startup_error = EngineStartupError(run.failed)
    finally:
        with trio.CancelScope(shield=True):
            async with trio.open_nursery() as stoppers:
                for proc in run.procs.values():
                    stoppers.start_soon(_stop, proc, 5.0)
        if host is not None:
            host.close()
        authenticator.stop()
        ctx.destroy(linger=0)
        shutil.rmtree(directory, ignore_errors=True)


class _Fronts:
    """The supervisors of the front slots: who runs, whether the server stops, when all are gone."""

    def __init__(self, options: ServeOptions, fronts: FrontsConfig, out: ServeOutcome) -> None:
        self.options = options
        self.fronts = fronts
        self.out = out
        self.procs: dict[int, trio.Process] = {}
        self.stopping = False
        self.gone = trio.Event()
        self.give_up: Callable[[], object] = lambda: None  #: stops the server (a front was given up)
        self.failed: str | None = None  #: why a front was given up

    async def run(self, host: EngineHost, *,
                  task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Start every front (returns from ``start`` once each said hello), supervise them until they end."""
        try:
            async with trio.open_nursery() as nursery:
                for slot in host.slots:
                    await nursery.start(self.supervise, slot)
                task_status.started()
        finally:
            self.gone.set()

    async def supervise(self, slot: FrontSlot, *,
                        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Launch ``slot``'s front, and again each time it exits on its own, within the restart intensity."""
        label = f"API-server process {slot.index}"
        policy = self.fronts.policy
        restarts: deque[float] = deque()
        listen_fd = self.options.sock.fileno()
        payload = {"index": slot.index, "address": slot.address, "argv": list(self.fronts.argv),
                   "api_key": self.fronts.api_key, "admin_token": self.fronts.admin_token,
                   "shutdown_timeout": self.options.shutdown_timeout, "log_level": self.fronts.log_level}
        while True:
            creds = LaunchCredentials(slot.host.authenticator, slot.zap_domain, label,
                                      partial(_payload, payload))
            try:
                proc = await trio.lowlevel.open_process(
                    front_argv(creds, listen_fd), stdin=subprocess.DEVNULL, env=scrubbed_environ(),
                    pass_fds=(*creds.pass_fds, listen_fd), start_new_session=True)
            except BaseException:
                creds.close()
                raise
            creds.started(proc.pid)
            self.procs[slot.index] = proc
            try:
                async with trio.open_nursery() as nursery:
                    await nursery.start(slot.run)
                    serving = await creds.deliver()
                    if serving is not None:
                        with trio.move_on_after(self.options.startup_timeout):
                            await slot.hello.wait()
                    if slot.hello.is_set():
                        log.info("%s ready (pid %s)", label, serving)
                        task_status.started()
                        task_status = trio.TASK_STATUS_IGNORED
                    code = await proc.wait()
                    slot.drop()
            finally:
                creds.close()
            slot.reset()
            if self.stopping:
                return
            now = trio.current_time()
            restarts.append(now)
            while restarts and restarts[0] < now - policy.window:
                restarts.popleft()
            if len(restarts) > policy.max_restarts:
                self.failed = (f"{label} exited (code {code}) {len(restarts)} times within "
                               f"{policy.window:g}s: given up")
                log.error("%s; the server stops", self.failed)
                if self.out.served:
                    self.out.died = self.failed
                self.give_up()
                return
            log.warning("%s exited on its own (code %s): its requests were aborted; restarting it", label,
                        code)
            await trio.sleep(policy.backoff(len(restarts)))
            if self.stopping:  # the server began to stop meanwhile: launch nothing more
                return


def _signal(proc: trio.Process, signum: int) -> None:
    if proc.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signum)


async def _stop(proc: trio.Process, grace: float) -> None:
    """SIGTERM, ``grace`` seconds, SIGKILL; always reaped."""
    _signal(proc, signal.SIGTERM)
    with trio.move_on_after(grace):
        await proc.wait()
    _signal(proc, signal.SIGKILL)
    await proc.wait()


def front_argv(creds: LaunchCredentials, listen_fd: int) -> list[str]:
    """A front's command line: its module, the fds of the hand-over and listening sockets (nothing secret)."""
    return [sys.executable, "-m", "trio_orch.serve.fronts.process", *creds.argv(), "--listen-fd",
            str(listen_fd)]


def _payload(payload: dict[str, object], ticket: bytes) -> bytes:
    """What a front is handed: ``payload`` and its launch's ``ticket`` (JSON)."""
    return json.dumps({**payload, "ticket": ticket.decode()}).encode()
