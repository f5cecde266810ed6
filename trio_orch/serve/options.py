"""What the serve command hands a front, and what a front hands back: the same for both fronts.

:class:`ServeOptions` is everything ``trio-orch serve``'s flags decide -- the
pipeline and the engine's options, the HTTP limits, the listening socket,
the timeouts, how the app is made -- so a front
(:mod:`trio_orch.serve.asyncio_front`, :mod:`trio_orch.serve.trio_front`:
each a ``serve(options) -> ServeOutcome``) reads no flag itself, and the
command (:mod:`trio_orch.serve.command`) turns the :class:`ServeOutcome` into
its messages and exit code in one place for both.
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from trio_orch.engine import EngineClient, PipelineFactory, ThreadEngine, TrioEngine
from trio_orch.http.limits import HTTPLimits
from trio_orch.http.metrics import ExtraCounters, FrontMetrics

__all__ = ["AppFactory", "ServeOptions", "ServeOutcome", "unfinished"]

#: ``make_app(engine, front, server_counters)``: the ASGI app over a started engine, counting into
#: ``front``, showing the server's own counters (``server_counters()``) in ``/metrics``
AppFactory = Callable[[EngineClient, FrontMetrics, Callable[[], ExtraCounters]], Any]


@dataclass(frozen=True)
class ServeOptions:
    """One ``serve`` run, decided by the command line (see the module docstring).

    ``engine``: the :class:`~trio_orch.engine.TrioEngine` options (admission
    bounds, timeouts).  ``limits``: the HTTP limits, ``max_connections``
    resolved (never None here).  ``sock``: listening already, so connections
    queue while the pipeline starts.  ``announce(host, port, front)`` says
    where it serves once it does.  ``log_level``: the HTTP server's (uvicorn's
    names); ``stats_interval``: seconds between two throughput lines (None:
    none); ``ssl``: uvicorn's ``ssl_*`` settings (the asyncio front; None: plain
    HTTP).
    """

    pipeline: PipelineFactory
    make_app: AppFactory
    sock: socket.socket
    limits: HTTPLimits
    startup_timeout: float
    shutdown_timeout: float
    announce: Callable[[str, int, str], None]
    engine: Mapping[str, Any] = field(default_factory=dict)
    log_level: str = "info"
    stats_interval: float | None = None
    ssl: Mapping[str, Any] | None = None


@dataclass
class ServeOutcome:
    """How a front's ``serve`` ended."""

    stopped_by: list[str] = field(default_factory=list)  #: the signals received, in order
    #: requests the stop ended without their answer (their terminal was ``shutdown``): a drain cut short
    unfinished: int = 0
    died: str | None = None  #: the engine stopped on its own while serving: why
    startup_error: BaseException | None = None  #: the pipeline did not start
    served: bool = False  #: the HTTP server was started


def unfinished(engine: TrioEngine | ThreadEngine) -> int:
    """Requests ``engine`` ended without their answer because it stopped (their terminal: ``shutdown``),
    read by a front once its engine stopped (:attr:`ServeOutcome.unfinished`)."""
    return engine.demux.errors_by_kind.get("shutdown", 0)
