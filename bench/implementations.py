"""The one registry of implementations: name -> description -> driver factory, and what each supports.

``trio-orch compare``, ``trio-orch bench`` and ``trio-orch chaos`` all pick
their implementations here, by what they need (:data:`CAPABILITIES`):

* ``scripted`` -- scripted in-process stages driven from the thread (emit,
  fail, hold submits...), optionally misbehaving, with access to the loop
  and the routing core (the routing tests);
* ``compare`` -- runs the comparison's scenarios (``trio-orch compare``):
  scripted stages as far as the implementation can express them; a scenario
  that needs a feature it lacks (:attr:`Implementation.lacks`) is an ``n/a``
  cell with the reason;
* ``fed`` -- in-process stages fed batches from the thread, with submission
  timestamps (the benchmark's in-process workloads);
* ``in_loop`` -- in-process stages fed and consumed by tasks inside the
  implementation's own event loop (no thread hand-off: the benchmark's
  ``loop_*`` workloads);
* ``workers`` -- real ``stages.worker`` processes over ZeroMQ, one replica
  per stage (the benchmark's echo-worker workloads);
* ``pipeline`` -- the whole process layer: replica pools, the async-chunk
  connector, the supervisor (the end-to-end torch workloads, the chaos
  matrix).

The Trio side is listed here (the orchestrator, the production ``ThreadEngine``
bridge, the benchmark's floor).  The asyncio references register
themselves: every :class:`~bench.refs.orchestrator.AsyncioOrchestrator`
subclass in a module of ``bench/refs/`` whose ``variant`` is set is one
(named ``variant``, described by its ``description``), in module order.
The order of :data:`IMPLEMENTATIONS` is the order of every table's columns.

The real vLLM-Omni (``vllm-omni``, ``vllm-omni-poll``: its own
``Orchestrator`` and ``StagePool`` over this benchmark's fed stages, see
:mod:`bench.drivers.vllm_omni`) is listed only where the package is
installed (``bench/setup_vllm_omni.sh``); elsewhere :data:`SKIPPED` says why.
It supports ``fed`` and ``compare``, not ``scripted``: it has no routing core
of the project's, so the routing tests leave it out.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import bench.refs
from bench.drivers.asyncio import AsyncioDriver
from bench.drivers.base import Driver
from bench.drivers.engine import EngineDriver
from bench.drivers.floor import FloorDriver
from bench.drivers.trio import TrioDriver
from bench.drivers.vllm_omni import VllmOmniDriver, available, missing_reason
from bench.drivers.zmq_floor import ZmqFloorDriver
from bench.refs.orchestrator import AsyncioOrchestrator

__all__ = ["CAPABILITIES", "IMPLEMENTATIONS", "SKIPPED", "Implementation", "lookup", "make_driver", "names"]

#: what an implementation can be asked to do (see the module docstring)
CAPABILITIES = ("scripted", "compare", "fed", "in_loop", "workers", "pipeline")


@dataclass(frozen=True, slots=True)
class Implementation:
    """One orchestrator implementation and how to drive it."""

    name: str
    description: str
    factory: Callable[..., Driver]  #: ``factory(*args, name=..., **options)`` -> a driver, not started
    supports: frozenset[str]
    #: features a comparison scenario may need (``Scenario.needs``) that it has no counterpart for -> why
    lacks: Mapping[str, str] = field(default_factory=dict)

    def driver(self, *args: Any, **options: Any) -> Driver:
        """A (not yet started) driver; ValueError if the options ask for what it does not support.

        A ``compare`` implementation takes misbehaving stages without ``scripted``: its
        driver raises :class:`~bench.drivers.base.Unsupported` for a fault it cannot express.
        """
        missing = _needs(options) - self.supports
        if "compare" in self.supports:
            missing.discard("scripted")
        if missing:
            raise ValueError(f"implementation {self.name!r} does not support {', '.join(sorted(missing))} "
                             f"(it supports {', '.join(sorted(self.supports))})")
        return self.factory(*args, name=self.name, **options)


def _needs(options: dict[str, Any]) -> set[str]:
    """The capabilities a driver built with these options uses."""
    workers = options.get("workers")
    if workers is not None:
        pools = workers.async_chunk or any(st.replicas != 1 for st in workers.stages)
        return {"pipeline"} if pools else {"workers"}
    if options.get("misbehaviour"):
        return {"scripted"}
    if options.get("in_loop_consumer"):
        return {"in_loop"}
    return set()


def _references() -> list[Implementation]:
    """The asyncio references: concrete AsyncioOrchestrator subclasses of bench/refs/, in module order."""
    supports = frozenset({"scripted", "compare", "fed", "in_loop", "workers"})
    found: list[Implementation] = []
    for info in sorted(pkgutil.iter_modules(bench.refs.__path__), key=lambda m: m.name):
        module = importlib.import_module(f"{bench.refs.__name__}.{info.name}")
        for obj in vars(module).values():
            if (isinstance(obj, type) and issubclass(obj, AsyncioOrchestrator)
                    and obj.__module__ == module.__name__ and obj.variant):
                found.append(Implementation(obj.variant, obj.description,
                                            partial(AsyncioDriver, orchestrator_cls=obj), supports))
    return found


def _vllm_omni() -> list[Implementation]:
    """The installed vLLM-Omni's orchestrator, event-driven and polling (its two orchestration loops)."""
    supports = frozenset({"fed", "compare", "in_loop"})
    lacks = VllmOmniDriver.LACKS
    return [
        Implementation("vllm-omni", "the installed vLLM-Omni: its Orchestrator and StagePool in a thread "
                       "with its own loop, janus queues, event-driven loop (reader task per replica)",
                       partial(VllmOmniDriver, event_driven=True), supports, lacks),
        Implementation("vllm-omni-poll", "the installed vLLM-Omni as above with its default orchestration "
                       "loop (polls every replica, 1 ms sleep when idle)",
                       partial(VllmOmniDriver, event_driven=False), supports, lacks),
    ]


#: implementations known but not runnable in this interpreter: name -> why
SKIPPED: dict[str, str] = {} if available() else {i.name: missing_reason() for i in _vllm_omni()}

IMPLEMENTATIONS: dict[str, Implementation] = {i.name: i for i in (
    Implementation("floor", "the floors of the in-process paths, every hop the path needs and nothing else: "
                   "thread workloads, two plain-thread wake-ups (no loop); loop_* workloads, one task "
                   "wake-up; no routing", FloorDriver, frozenset({"fed", "in_loop"})),
    Implementation("zmq-floor", "the ZMQ floor: the same worker process and framing, a plain thread owning "
                   "the socket, the two thread hops every bridge takes; no loop, no routing",
                   ZmqFloorDriver, frozenset({"workers"})),
    Implementation("trio", "trio_orch.Orchestrator: one nursery, memory channels, Trio token bridge",
                   TrioDriver, frozenset(CAPABILITIES)),
    Implementation("trio-engine", "trio-orch through the production ThreadEngine bridge: one RequestHandle "
                   "per request", EngineDriver, frozenset({"fed"})),
    *_references(),
    *(_vllm_omni() if available() else []),
)}


def names(supporting: str) -> list[str]:
    """The implementations that support ``supporting`` (one of :data:`CAPABILITIES`), in table order."""
    if supporting not in CAPABILITIES:
        raise ValueError(f"unknown capability {supporting!r}: choose from {', '.join(CAPABILITIES)}")
    return [n for n, i in IMPLEMENTATIONS.items() if supporting in i.supports]


def lookup(name: str) -> Implementation:
    """Implementation ``name``; ValueError naming why where it is skipped here, or the choices."""
    impl = IMPLEMENTATIONS.get(name)
    if impl is None and name in SKIPPED:
        raise ValueError(f"implementation {name!r} is not available here: {SKIPPED[name]}")
    if impl is None:
        raise ValueError(f"unknown implementation {name!r}: choose from {', '.join(IMPLEMENTATIONS)}")
    return impl


def make_driver(name: str, *args: Any, **options: Any) -> Driver:
    """A (not yet started) driver for implementation ``name``; see :class:`~bench.drivers.base.Driver`."""
    return lookup(name).driver(*args, **options)
