"""The control methods a stage worker answers over RPC, in one table.

The orchestrator's ``collective_rpc(method, args, kwargs)`` arrives at each
replica as one ``Rpc`` message; :meth:`WorkerControl.call` runs the method
from :data:`METHODS` (or one the model added, below) between two steps of the
worker's loop -- so it never runs concurrently with a step -- and answers
with its value or an error naming what went wrong.

Built-in methods:

- ``health``, ``stats``: read-only snapshots of the worker;
- ``methods``: the names this worker answers;
- ``pause`` / ``resume``: stop and start stepping (requests stay where they
  are; submits and aborts are still taken);
- ``sleep(level=1)`` / ``wake_up()``: free the model's weights and caches and
  put them back (:mod:`stages.weights`); asleep, the worker does not step;
- ``reload_weights(path, check_only=False)``: load a ``torch.save``'d state
  dict, checked against the model's shapes first (a file that does not fit is
  refused and the old weights stay); refused while a request is running here;
- ``start_profile(dir)`` / ``stop_profile()``: a ``torch.profiler`` trace of
  the steps in between, written to ``dir`` as a Chrome trace.

A plug-in model adds its own methods by decorating them with
:func:`rpc_method` (docs/plugins.md); a name that clashes with a built-in
is refused when the worker starts.
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Callable
from functools import partial
from typing import Any, Protocol

from stages.base import StageModel

__all__ = ["METHODS", "UNKNOWN_METHOD", "WorkerControl", "rpc_method"]

RPC_NAME = "__rpc_name__"
#: how the error of a call to a method the worker does not answer starts (the admin route answers 404)
UNKNOWN_METHOD = "unknown rpc method"


def rpc_method(name: str | None = None) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Make a model method callable over RPC as ``name`` (default: its own name).

    ``collective_rpc("name", args, kwargs)`` then calls it on every replica of
    the stage, between two steps; what it returns (msgpack-able) is the value,
    what it raises is the error.
    """
    def mark(fn: Callable[..., Any]) -> Callable[..., Any]:
        setattr(fn, RPC_NAME, name or fn.__name__)
        return fn
    return mark


class WorkerLike(Protocol):
    """What the control methods read from the worker (``stages.worker.Worker``)."""

    model: StageModel
    active: dict[str, Any]

    def health_info(self) -> dict[str, Any]: ...

    def stats_info(self) -> dict[str, Any]: ...


class WorkerControl:
    """Control state of one worker (paused, asleep, profiling) and its method table.

    ``rebuild()`` makes a fresh model as the worker did (what a level-2 sleep
    wakes up from); ``scratch_dir`` holds a CPU model's level-1 sleep copy
    (default: a private temporary directory); ``label`` names trace files.
    """

    def __init__(self, worker: WorkerLike, *, rebuild: Callable[[], StageModel],
                 scratch_dir: str | None = None, label: str = "worker") -> None:
        self.worker = worker
        self.rebuild = rebuild
        self.scratch_dir = scratch_dir
        self.label = label
        self.paused = False
        self.calls = 0
        self._sleeper: Any = None  # stages.weights.Sleeper, made on first use (imports torch)
        self._profiler: Any = None
        self._profile_dir = ""
        self._own_scratch: str | None = None
        self.methods: dict[str, Callable[..., Any]] = {n: partial(fn, self) for n, fn in METHODS.items()}
        for attr in dir(type(worker.model)):
            name = getattr(getattr(type(worker.model), attr, None), RPC_NAME, None)
            if name is None:
                continue
            if name in METHODS:
                raise ValueError(f"{type(worker.model).__name__}.{attr}: rpc method {name!r} clashes with a "
                                 "built-in worker method; choose another name")
            self.methods[name] = getattr(worker.model, attr)

    @property
    def stepping(self) -> bool:
        """May the worker run a step now (not paused, not asleep)?"""
        return not self.paused and not self.asleep

    @property
    def asleep(self) -> bool:
        return self._sleeper is not None and self._sleeper.asleep

    def call(self, method: str, args: list[Any], kwargs: dict[str, Any]) -> tuple[Any, str | None]:
        """Run one method: ``(value, None)``, or ``(None, error)`` naming the method and the failure."""
        self.calls += 1
        fn = self.methods.get(method)
        if fn is None:
            known = ", ".join(sorted(self.methods))
            return None, f"{UNKNOWN_METHOD} {method!r}; this worker answers: {known}"
        try:
            return fn(*args, **kwargs), None
        except Exception as exc:
            return None, f"{method}: {type(exc).__name__}: {exc}"

    def state(self) -> dict[str, Any]:
        """The control state, for ``health`` and ``stats``."""
        return {"paused": self.paused, "asleep": self._sleeper.level if self.asleep else 0,
                "profiling": self._profiler is not None}

    def close(self) -> None:
        """Stop a running profile (its trace is written) and delete a sleep copy."""
        if self._profiler is not None:
            try:
                self.stop_profile()
            except Exception:  # best effort on the way out
                self._profiler = None
        if self._sleeper is not None:
            self._sleeper.close()
        if self._own_scratch is not None:
            import shutil

            shutil.rmtree(self._own_scratch, ignore_errors=True)

    # ------------------------------------------------------------------ methods
    def pause(self) -> dict[str, Any]:
        self.paused = True
        return self.state()

    def resume(self) -> dict[str, Any]:
        self.paused = False
        return self.state()

    def sleep(self, level: int = 1) -> dict[str, Any]:
        busy = len(self.worker.active)
        if busy:
            raise ValueError(f"{busy} request(s) are running on this replica: pause the orchestrator "
                             "(mode 'wait') before sleep")
        freed = self._weights().sleep(level)
        return {**self.state(), "freed_bytes": freed, **_memory()}

    def wake_up(self) -> dict[str, Any]:
        restored = self._weights().wake_up()
        return {**self.state(), "restored_bytes": restored, **_memory()}

    def reload_weights(self, path: str, check_only: bool = False) -> dict[str, Any]:
        if not isinstance(path, str) or not path:
            raise ValueError(f"path must be a file name, got {path!r}")
        sleeper = self._weights()
        if sleeper.asleep:
            raise ValueError("the replica is asleep: wake_up before reload_weights")
        busy = len(self.worker.active)
        if busy and not check_only:
            raise ValueError(f"{busy} request(s) are running on this replica (they would see two sets "
                             "of weights): pause the orchestrator (mode 'wait') first")
        from stages.weights import apply_state, load_checked

        state = load_checked(path, self.worker.model)
        if check_only:
            return {"path": path, "tensors": len(state), "checked": True}
        copied = apply_state(self.worker.model, state)
        sleeper.weights_file = os.path.abspath(path)
        return {"path": path, "tensors": len(state), "bytes": copied}

    def start_profile(self, dir: str) -> dict[str, Any]:
        if self._profiler is not None:
            raise ValueError(f"a profile is already running (into {self._profile_dir}): stop_profile first")
        if not isinstance(dir, str) or not dir:
            raise ValueError(f"dir must be a directory name, got {dir!r}")
        os.makedirs(dir, exist_ok=True)
        import torch
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU]
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            activities.append(ProfilerActivity.CUDA)
        prof = profile(activities=activities)
        prof.start()
        self._profiler, self._profile_dir = prof, dir
        return {"profiling": True, "dir": dir}

    def stop_profile(self) -> dict[str, Any]:
        prof = self._profiler
        if prof is None:
            raise ValueError("no profile is running: start_profile first")
        self._profiler = None
        prof.stop()
        n = sum(1 for f in os.listdir(self._profile_dir) if f.startswith(self.label))
        path = os.path.join(os.path.abspath(self._profile_dir), f"{self.label}-{os.getpid()}-{n}.trace.json")
        prof.export_chrome_trace(path)
        return {"profiling": False, "trace": path}

    # ------------------------------------------------------------------ helpers
    def _weights(self) -> Any:
        if self._sleeper is None:
            from stages.weights import Sleeper

            if self.scratch_dir is None:
                self._own_scratch = self.scratch_dir = tempfile.mkdtemp(prefix="trio-orch-sleep-")
            self._sleeper = Sleeper(self.worker.model, self.rebuild, self.scratch_dir)
        return self._sleeper


def _memory() -> dict[str, Any]:
    """The process's resident memory (and CUDA memory in use, where there is CUDA)."""
    out: dict[str, Any] = {}
    try:
        with open("/proc/self/statm") as f:
            out["rss_bytes"] = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        pass
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda_allocated_bytes"] = int(torch.cuda.memory_allocated())
        out["cuda_reserved_bytes"] = int(torch.cuda.memory_reserved())
    return out


def _health(ctl: WorkerControl) -> dict[str, Any]:
    return {**ctl.worker.health_info(), **ctl.state()}


def _stats(ctl: WorkerControl) -> dict[str, Any]:
    return {**ctl.worker.stats_info(), **ctl.state(), "rpc_calls": ctl.calls, **_memory()}


#: the built-in methods: name -> function(control, *args, **kwargs)
METHODS: dict[str, Callable[..., Any]] = {
    "health": _health,
    "stats": _stats,
    "methods": lambda ctl: sorted(ctl.methods),
    "pause": WorkerControl.pause,
    "resume": WorkerControl.resume,
    "sleep": WorkerControl.sleep,
    "wake_up": WorkerControl.wake_up,
    "reload_weights": WorkerControl.reload_weights,
    "start_profile": WorkerControl.start_profile,
    "stop_profile": WorkerControl.stop_profile,
}
