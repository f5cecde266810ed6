"""The line a busy server logs every 10 seconds, as ``vllm serve``'s stats logger does.

``Avg prompt throughput: 12.0 tokens/s, Avg generation throughput: 48.3 tokens/s, Running: 3 reqs,
Waiting: 1 reqs`` on the ``trio_orch.stats`` logger: the tokens the routes counted over the interval
(:class:`~trio_orch.http.metrics.FrontMetrics`), the requests running and waiting at its end (the
engine's snapshot; what ``vllm:num_requests_running`` and ``vllm:num_requests_waiting`` show).  An
idle server says nothing, after one last line that shows the drop to 0.  ``serve
--disable-log-stats`` turns it off.  :class:`ThroughputLog` makes the line from two readings; each
front drives it on its own clock: :func:`run_trio` in the Trio front's run, :func:`run_thread` in a
thread beside uvicorn.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

import trio

from trio_orch.http.metrics import FrontMetrics

if TYPE_CHECKING:
    from trio_orch.engine import ThreadEngine, TrioEngine
    from trio_orch.engine.api import EngineStatistics

__all__ = ["INTERVAL", "STATS_LOGGER", "ThroughputLog", "run_thread", "run_trio"]

#: seconds between two lines (vLLM's)
INTERVAL = 10.0
#: the logger of the lines
STATS_LOGGER = "trio_orch.stats"
log = logging.getLogger(STATS_LOGGER)


class ThroughputLog:
    """The throughput line of each interval, from the front's token counts and an engine snapshot."""

    def __init__(self, front: FrontMetrics, now: float) -> None:
        self.front = front
        self.t_last = now
        self.prompt, self.generated = self._tokens()
        self.was_busy = False

    def _tokens(self) -> tuple[int, int]:
        return self.front.prompt_tokens, sum(self.front.generation_tokens.values())

    def line(self, stats: EngineStatistics, now: float) -> str | None:
        """The line of the interval that ends ``now``; None when it and the one before were idle."""
        prompt, generated = self._tokens()
        seconds = max(now - self.t_last, 1e-9)
        prompt_rate = (prompt - self.prompt) / seconds
        generation_rate = (generated - self.generated) / seconds
        running = stats.active_requests - stats.queued_requests
        waiting = stats.queued_requests + stats.admission_waiting
        busy = bool(running or waiting or prompt_rate or generation_rate)
        say = busy or self.was_busy
        self.t_last, self.prompt, self.generated, self.was_busy = now, prompt, generated, busy
        if not say:
            return None
        return (f"Avg prompt throughput: {prompt_rate:.1f} tokens/s, Avg generation throughput: "
                f"{generation_rate:.1f} tokens/s, Running: {running} reqs, Waiting: {waiting} reqs")


async def run_trio(engine: TrioEngine, front: FrontMetrics, interval: float = INTERVAL) -> None:
    """Log the line every ``interval`` seconds of the run's clock, until cancelled."""
    meter = ThroughputLog(front, trio.current_time())
    while True:
        await trio.sleep(interval)
        line = meter.line(await engine.stats_async(), trio.current_time())
        if line is not None:
            log.info("%s", line)


def run_thread(engine: ThreadEngine, front: FrontMetrics, stop: threading.Event,
               interval: float = INTERVAL) -> None:
    """Log the line every ``interval`` seconds until ``stop`` is set (a thread's body)."""
    meter = ThroughputLog(front, time.monotonic())
    while not stop.wait(interval):
        line = meter.line(engine.stats(), time.monotonic())  # a stopped engine's snapshot reads idle
        if line is not None:
            log.info("%s", line)
