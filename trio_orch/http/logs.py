"""What the HTTP front writes to its log: a client's text escaped, floods kept to one line per interval.

A line about a request may carry what its client chose -- a path, a header,
a field or model name -- and a client that can put a line break there (a
``%0a`` in a path decodes to one) writes a line of its own into the log, or
moves a terminal's cursor with an escape sequence.  :class:`ClientText`
writes every character that is not printable in a record's message and
arguments as its escape (``\\n``, ``\\x1b``, ``\\u2028``): installed on every
logger of :data:`CLIENT_LOGGERS` -- the app's, both servers' -- by
:func:`guard_logs` (tests/http/test_hostile_clients.py checks that every
logger the front's modules use is listed).

:class:`RateLimitFilter` lets one line per interval through for each kind of
flood, then says how many it held back: accept errors while out of file
descriptors, and the refusals a client can repeat at will and at no cost --
401 (no credentials needed) and 404 (any path, any model name) -- which the
front logs through :func:`log_refusal`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["CLIENT_LOGGERS", "FLOODED_REFUSALS", "REFUSED", "ClientText", "RateLimitFilter", "escaped",
           "flooded_refusal", "guard_logs", "log_refusal"]

log = logging.getLogger("trio_orch.http")

#: the loggers whose lines may carry a client's text: the app's (its access log and request log too), the
#: lean server's, uvicorn's
CLIENT_LOGGERS = ("trio_orch.http", "trio_orch.access", "trio_orch.requests", "trio_orch.openai",
                  "trio_orch.openai.realtime", "trio_orch.serve.trio_http", "uvicorn.error", "uvicorn.access")

#: the one format of a refused request's line (:func:`log_refusal`)
REFUSED = "refused a request to %s (%d): %s"
#: refusals a client repeats at will: their lines are rate-limited (one per interval, with a count)
FLOODED_REFUSALS = frozenset({401, 404})


def escaped(text: str) -> str:
    """``text`` with each character that is not printable written as its escape (a line break as ``\\n``)."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)


def _escaped_arg(arg: Any) -> Any:
    if isinstance(arg, str):
        return escaped(arg)
    if arg is None or isinstance(arg, (int, float)):
        return arg
    text = str(arg)  # an exception, a path: its text is what the line shows
    return arg if text.isprintable() else escaped(text)


class ClientText(logging.Filter):
    """Escape what is not printable in a record's message and arguments (the arguments keep their shape:
    uvicorn's access formatter reads them by position)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, str):
            record.msg = escaped(record.msg)
        args = record.args
        if isinstance(args, tuple):
            record.args = tuple(_escaped_arg(a) for a in args)
        elif isinstance(args, Mapping):
            record.args = {k: _escaped_arg(v) for k, v in args.items()}
        return True


class RateLimitFilter(logging.Filter):
    """Let through at most one record per ``interval`` seconds of each flood.

    A record's flood is ``key(record)`` (None: not a flood), by default the
    first of ``floods`` its message contains.  The next one that passes says
    how many were suppressed.  Other records pass untouched.
    """

    def __init__(self, floods: tuple[str, ...] = (), interval: float = 10.0,
                 key: Callable[[logging.LogRecord], str | None] | None = None) -> None:
        super().__init__()
        self.floods = floods
        self.interval = interval
        self.key = key or self._substring
        self._last: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}

    def _substring(self, record: logging.LogRecord) -> str | None:
        text = record.getMessage()
        return next((f for f in self.floods if f in text), None)

    def filter(self, record: logging.LogRecord) -> bool:
        key = self.key(record)
        if key is None:
            return True
        now = time.monotonic()
        if now - self._last.get(key, -self.interval) < self.interval:
            self._suppressed[key] = self._suppressed.get(key, 0) + 1
            return False
        self._last[key] = now
        n = self._suppressed.pop(key, 0)
        if n:
            record.msg = (f"{record.getMessage()} ({n} more like this in the last {self.interval:g}s were "
                          "not logged)")
            record.args = ()
        return True


def log_refusal(route: str, status: int, message: str, level: int = logging.WARNING) -> None:
    """The line of a refused request: ``route`` is its route label (a template, never the raw path)."""
    log.log(level, REFUSED, route, status, message)


def flooded_refusal(record: logging.LogRecord) -> str | None:
    """The flood a refusal's line belongs to (its status), for the refusals in :data:`FLOODED_REFUSALS`."""
    if record.msg is REFUSED and isinstance(record.args, tuple) and record.args[1] in FLOODED_REFUSALS:
        return f"refusals {record.args[1]}"
    return None


def guard_logs() -> None:
    """Install :class:`ClientText` on every logger of :data:`CLIENT_LOGGERS`, and the refusal floods'
    limit on the app's (idempotent: each filter once)."""
    for name in CLIENT_LOGGERS:
        logger = logging.getLogger(name)
        if name == log.name and not any(isinstance(f, RateLimitFilter) and f.key is flooded_refusal
                                        for f in logger.filters):
            logger.addFilter(RateLimitFilter(key=flooded_refusal))  # before the escape: it reads the args
        if not any(isinstance(f, ClientText) for f in logger.filters):
            logger.addFilter(ClientText())

