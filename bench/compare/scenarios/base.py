"""What every comparison scenario shares: the record, the watchdog, and the measurements.

A scenario is an experiment: it drives one implementation through the
thread-side driver (:class:`bench.drivers.base.Driver`), measures what happened (shutdown time, terminals per
request, messages sent vs. delivered, tasks alive, errors surfaced...) and
returns those numbers.  Its verdict is computed from the numbers by the
scenario's stated rule, never typed in, so changing an implementation changes
the table.  Anything that could hang is waited on with a watchdog (:data:`CUT`
seconds) and reported as a hang with the time it was cut.
"""

from __future__ import annotations

import logging
import threading
import time
import traceback
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from bench.drivers.base import Driver, EndOfStream, Unsupported
from bench.implementations import lookup, make_driver

__all__ = [
    "CUT",
    "GRACE",
    "KINDS",
    "NA",
    "LogCapture",
    "Outcome",
    "Scenario",
    "run_scenario",
    "shut_fmt",
    "start",
    "stop_and_drain",
    "surfaced",
    "terminal_stats",
    "until_terminal",
]

#: watchdog: seconds we wait for anything that may hang before calling it a hang
CUT = 2.0
#: shutdown_grace given to every implementation that bounds its cleanup
GRACE = 0.5


@dataclass
class Outcome:
    """One cell of the comparison: a scenario run against one implementation."""

    scenario: int
    impl: str
    metrics: dict[str, Any] = field(default_factory=dict)
    verdict: str = ""
    reason: str = ""
    headline: str = ""
    wall_s: float = 0.0
    driver_error: str | None = None  # the scenario driver itself failed (not a measurement)

    def as_dict(self) -> dict[str, Any]:
        return {
            "scenario": self.scenario, "impl": self.impl, "verdict": self.verdict,
            "reason": self.reason, "headline": self.headline, "wall_s": round(self.wall_s, 3),
            "driver_error": self.driver_error,
            "metrics": {k: _jsonable(v) for k, v in self.metrics.items()},
        }


def _jsonable(v: Any) -> Any:
    if isinstance(v, float):
        return round(v, 4)
    if isinstance(v, (int, str, bool)) or v is None:
        return v
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple, set)):
        return [_jsonable(x) for x in v]
    return repr(v)


#: where a difference in a row comes from: "model", the concurrency model itself (cancellation semantics,
#: shields, threads...), or "design", a choice either model can make (an abort path, a bounded cleanup...)
KINDS = ("model", "design")


@dataclass
class Scenario:
    """An experiment: ``measure(impl) -> metrics``; ``judge(metrics) -> (verdict, reason)``.

    ``kind`` says where a difference in its row comes from -- ``"model"`` or
    ``"design"`` (:data:`KINDS`) -- and ``because`` is the one-sentence rule
    behind it, so a reader can tell a property of Trio or asyncio from a choice
    either could make.
    """

    number: int
    key: str
    title: str
    question: str
    rule: str
    measure: Callable[[str], dict[str, Any]]
    judge: Callable[[dict[str, Any]], tuple[str, str]]
    headline: Callable[[dict[str, Any]], str]
    #: features beyond scripted stages it drives (``async_chunk``, ``deadline``, ``in_loop``, ``resumable``,
    #: ``companions``, ``rpc``, ``membership``): an implementation that lacks one gets an ``n/a`` cell
    needs: frozenset[str] = frozenset()
    kind: str = field(kw_only=True)
    because: str = field(kw_only=True)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"scenario {self.number}: kind must be one of {KINDS}, got {self.kind!r}")
        if not self.because:
            raise ValueError(f"scenario {self.number}: say the rule behind its kind (because=...)")


#: the verdict of a scenario an implementation cannot express (not an error: nothing was measured)
NA = "n/a"


def run_scenario(sc: Scenario, impl: str) -> Outcome:
    """Run one scenario against one implementation; never raises.

    ``n/a`` when the implementation lacks a feature the scenario needs, or its
    driver raised :class:`~bench.drivers.base.Unsupported` (a call or a fault it
    has no counterpart for): the reason says which.
    """
    out = Outcome(sc.number, impl)
    t0 = time.perf_counter()
    try:
        lacks = lookup(impl).lacks
        missing = sorted(f for f in sc.needs if f in lacks)
        if missing:
            out.verdict, out.headline = NA, f"no {', '.join(missing)}"
            out.reason = "; ".join(lacks[f] for f in missing)
            return out
        out.metrics = sc.measure(impl)
        out.verdict, out.reason = sc.judge(out.metrics)
        out.headline = sc.headline(out.metrics)
    except Unsupported as exc:
        out.metrics = {}
        out.verdict, out.reason, out.headline = NA, f"not expressible: {exc}", "not expressible"
    except Exception as exc:
        out.driver_error = "".join(traceback.format_exception(exc))[-2000:]
        out.verdict, out.reason, out.headline = "error", f"driver failed: {exc!r}", "driver error"
    out.wall_s = time.perf_counter() - t0
    return out


class LogCapture(logging.Handler):
    """Collects WARNING+ records from every thread while a scenario runs (and keeps them off stderr)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[str] = []
        self._lock2 = threading.Lock()
        self._saved: list[logging.Handler] = []
        self._saved_level = logging.WARNING

    def emit(self, record: logging.LogRecord) -> None:
        text = f"{record.name}: {record.getMessage()}"
        if record.exc_info and record.exc_info[1] is not None:
            text += " | " + "".join(traceback.format_exception(record.exc_info[1]))
        with self._lock2:
            self.records.append(text)

    def __enter__(self) -> LogCapture:
        root = logging.getLogger()
        self._saved, self._saved_level = root.handlers[:], root.level
        root.handlers = [self]
        root.setLevel(logging.WARNING)
        return self

    def __exit__(self, *exc: object) -> None:
        root = logging.getLogger()
        root.handlers = self._saved
        root.setLevel(self._saved_level)


def _exc_text(exc: BaseException | None) -> str:
    if exc is None:
        return ""
    return "".join(traceback.format_exception(exc))


def surfaced(markers: Iterable[str], logs: list[str], run_error: BaseException | None,
             messages: list[Any]) -> int:
    """How many of the injected error ``markers`` reached a place a user can see.

    Visible places: what ``run()`` raised, a WARNING+ log record, a terminal
    message's text.  An error that reached none of them was swallowed.
    """
    hay = "\n".join([*logs, _exc_text(run_error),
                     *(getattr(m, "message", "") for m in messages)])
    return sum(1 for m in markers if m in hay)


def terminal_stats(messages: list[Any], accepted: Iterable[str]) -> dict[str, int]:
    """Terminals per accepted request: missing, duplicated, and messages after a terminal."""
    terminals: Counter[str] = Counter()
    after = 0
    for m in messages:
        if terminals[m.request_id]:
            after += 1
        if m.finished:
            terminals[m.request_id] += 1
    acc = set(accepted)
    return {
        "requests": len(acc),
        "without_terminal": sum(1 for r in acc if terminals[r] == 0),
        "duplicate_terminals": sum(max(0, terminals[r] - 1) for r in acc),
        "after_terminal": after,
    }


def stop_and_drain(h: Driver, timeout: float | None = None) -> dict[str, Any]:
    """Shut down under the watchdog, collect what is left; the shutdown metrics."""
    rep = h.shutdown(timeout, wait=CUT)
    if rep.hung:
        h.abandon()
    _, ended = h.drain(0.3 if rep.hung else 1.0)
    return {
        "shutdown_s": rep.seconds,
        "hung": rep.hung,
        "cut_s": CUT if rep.hung else None,
        "run_error": repr(rep.run_error) if rep.run_error is not None else None,
        "tasks_alive_after_run": rep.tasks_alive_after_run,
        "stream_ended": ended,
    }


def start(impl: str, *args: Any, **kwargs: Any) -> Driver:
    """A started driver for ``impl`` with the comparison's shutdown grace."""
    kwargs.setdefault("shutdown_grace", GRACE)
    return make_driver(impl, *args, **kwargs).start()


def shut_fmt(m: dict[str, Any]) -> str:
    """``cut at 2.0 s`` or ``0.012 s``."""
    if m.get("hung"):
        return f"cut at {m['cut_s']:.1f} s"
    return f"{m['shutdown_s']:.3f} s"


def until_terminal(h: Driver, rid: str, seconds: float = CUT) -> None:
    """Consume messages until ``rid``'s terminal, the end of the stream, or ``seconds``."""
    deadline = time.monotonic() + seconds
    while not any(x.request_id == rid and x.finished for x in h.received):
        left = deadline - time.monotonic()
        if left <= 0:
            return
        try:
            h.next_output(timeout=left)
        except (TimeoutError, EndOfStream):
            return
