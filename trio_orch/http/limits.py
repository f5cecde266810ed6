"""HTTP limits that any ASGI server can apply: body size and time, content type, errors as JSON.

:class:`LimitsMiddleware` wraps the app (Starlette puts it inside its own
error middleware, so it sees the route's exceptions first).  Its guards
(the admin token) answer first.  While the server drains, a POST to a
generation route and a WebSocket handshake get 503 ``draining`` before any
other check.  Before a POST reaches a route it checks the ``Content-Type`` (JSON only: a browser cannot
send that cross-origin without a CORS preflight), refuses a declared body
over ``max_body_bytes`` at once (413), reads the body within
``body_timeout`` seconds (408 otherwise; a slow client cannot hold a task
forever) and stops reading as soon as it passes the limit (413); the route
then gets the buffered body.  At most ``max_body_reads`` bodies are read at
once (the others wait, unread, within their ``body_timeout``): that bounds
the memory a flood of uploads takes, apart from admission.  A read slot is
held only while the body flows (:class:`BodyRate`): after a first window, a
body that brings less than ``min_body_rate`` bytes a second over a window
of ``body_rate_window`` seconds (or less than its rest, whichever is
smaller) is refused with 408 -- otherwise 32 clients sending a byte a
second would hold every slot for ``body_timeout`` and stall every POST.  A POST to a
generation route is refused with 429 before its body is read while the
engine sheds, or once the requests already read and on their way to the
engine fill its capacity -- an upload in progress, or a request the route
refuses (a prompt over the limit), holds no room there; it is asked again
once the body is in (:class:`Shedder`: under a flood, parsing
requests that would be shed anyway would starve the admitted ones of CPU).
A client that disconnects during its upload costs one log line.  An
exception from a route becomes an OpenAI-shaped 500, counted and logged
once.  Every refusal has OpenAI's ``{"error": {...}}`` body, and reads and
drops the rest of a body it did not want first (bounded): a connection closed
with its input unread is reset, and the client would lose the answer.

Timeouts use anyio, so the middleware runs unchanged on an asyncio or a
Trio ASGI server.  Limits on connections (how many, how long an idle one
or a slow header may hold a socket, the listen backlog, the size of a
request head) belong to the server: the asyncio front maps them to uvicorn's
settings (:mod:`trio_orch.serve.asyncio_front`), the Trio front's lean
server reads them as they are (:mod:`trio_orch.serve.trio_front`).  :class:`RateLimitFilter` keeps
floods of identical log lines (accept errors when out of file descriptors)
to one line per interval.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import anyio

from stages.schema import NonNegativeInt, PositiveInt, PositiveSeconds, check_fields
from trio_orch.http.logs import log_refusal
from trio_orch.http.metrics import FrontMetrics
from trio_orch.openai.validation import error_body

__all__ = ["UNMATCHED", "BodyRate", "Guard", "HTTPLimits", "LimitsMiddleware", "Refusal", "RouteLabel",
           "Scope", "Shedder", "json_response"]

log = logging.getLogger("trio_orch.http")

Scope = dict[str, Any]
AsgiMessage = dict[str, Any]
Receive = Callable[[], Awaitable[AsgiMessage]]
Send = Callable[[AsgiMessage], Awaitable[None]]


@dataclass(frozen=True)
class Refusal:
    """An answer that refuses a request: its status and OpenAI-shaped error."""

    status: int
    message: str
    code: str
    kind: str = "invalid_request_error"
    headers: dict[str, str] | None = None

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.kind, None, self.code)


#: asked first for every HTTP request: a :class:`Refusal` answers it before any other check
Guard = Callable[[Scope], Refusal | None]
#: a request's ``route`` label (metrics, log lines): its matched route's path template, else
#: :data:`UNMATCHED` -- never the raw path, which a client could make new for every request
RouteLabel = Callable[[Scope], str]
#: the route label of a request that matches no route
UNMATCHED = "unmatched"


@dataclass(frozen=True)
class HTTPLimits:
    """Every limit of the HTTP front, with defaults for a small serving box.

    ``header_timeout``, ``keep_alive_timeout``, ``max_connections``,
    ``backlog`` and ``max_head_bytes`` are applied by the server (each front
    maps them to its server's settings); the others by :class:`LimitsMiddleware`
    and the request parser.  ``max_connections`` None: the serve command derives
    it from the process's file-descriptor limit, the same for either server.
    Each field's range is its annotation (:mod:`stages.schema`'s: a time is a
    finite number of seconds), checked when the limits are made.
    """

    max_body_bytes: PositiveInt = 4 << 20
    max_body_reads: PositiveInt = 32
    max_prompt_chars: PositiveInt = 32_000
    max_json_depth: PositiveInt = 32
    body_timeout: PositiveSeconds = 30.0
    header_timeout: PositiveSeconds = 10.0
    keep_alive_timeout: PositiveSeconds = 5.0
    max_connections: PositiveInt | None = None
    backlog: PositiveInt = 2048
    max_head_bytes: PositiveInt = 64 << 10
    min_body_rate: NonNegativeInt = 1024  #: bytes a second a body must keep up (0: no minimum)
    body_rate_window: PositiveSeconds = 2.0  #: the window it is measured over, after a first one

    def __post_init__(self) -> None:
        check_fields(self)


def json_response(status: int, body: Any, headers: dict[str, str] | None = None) -> tuple[list[Any], bytes]:
    """(raw ASGI headers, body bytes) of a JSON response."""
    data = json.dumps(body, separators=(",", ":")).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    raw += [(k.encode(), v.encode()) for k, v in (headers or {}).items()]
    return raw, data


class Shedder:
    """The one decision to refuse a POST with 429 because the engine would shed it, and its answer.

    Refused while the engine sheds (its hint), and also once the requests
    already let through and not yet answered (``pending``, which
    :class:`LimitsMiddleware` counts) reach the engine's capacity: they get
    there first, so a new one could only be shed.  Without that count the
    whole first wave of a burst -- every request read before the engine shed
    its first -- would take the full HTTP path.  The middleware asks before
    reading a body; the refusal is counted once, by route, as shed.
    """

    MESSAGE = "overloaded: request not accepted (the server is shedding load); retry later"

    def __init__(self, shedding: Callable[[], bool], paths: frozenset[str], front: FrontMetrics,
                 retry_after: float = 1.0, capacity: Callable[[], float] = lambda: math.inf) -> None:
        self.shedding = shedding
        self.capacity = capacity
        self.paths = paths
        self.front = front
        self.headers, self.body = json_response(
            429, error_body(self.MESSAGE, "rate_limit_error", None, "overloaded"),
            {"retry-after": str(max(1, math.ceil(retry_after)))})

    def full(self, pending: float = 0) -> bool:
        """Whether a request now would be shed: the engine sheds, or ``pending`` fill its capacity."""
        return self.shedding() or pending >= self.capacity()

    def refuse(self, route: str, pending: int = 0) -> bool:
        """Whether a POST to ``route`` is refused now, ``pending`` requests being on their way
        (counted when it is)."""
        if route not in self.paths or not self.full(pending):
            return False
        self.front.count_shed(route)
        return True


class BodyRate:
    """Whether a body still flows: the minimum receive rate of :class:`LimitsMiddleware`.

    The first window is free (a client's first bytes may come late); from
    then on each window of ``window`` seconds must bring ``rate * window``
    bytes, or the rest of a body of known length if that is less.  nginx's
    and hypercorn's per-read timeouts do the same for a sender that stalls;
    a rate also catches one that trickles a byte at a time.
    """

    def __init__(self, rate: int, window: float, now: float, remaining: int | None = None) -> None:
        self.rate = rate
        self.window = window
        self.remaining = remaining  #: bytes still to come, if the length was declared
        self.deadline = now + 2 * window  #: when the current window ends
        self.counted = 0  #: bytes in the current window

    @property
    def on(self) -> bool:
        return self.rate > 0

    def received(self, size: int, now: float) -> None:
        if self.remaining is not None:
            self.remaining -= size
        if now >= self.deadline - self.window:  # the first window's bytes count for nothing
            self.counted += size

    def window_ended(self) -> bool:
        """At :attr:`deadline`: whether the window brought enough (then the next one starts)."""
        needed = self.rate * self.window
        if self.remaining is not None:
            needed = min(needed, max(self.remaining, 0))
        if self.counted < needed:
            return False
        self.counted = 0
        self.deadline += self.window
        return True


class _Refused(Exception):
    def __init__(self, status: int, message: str, code: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = code


class _ClientLeft(Exception):
    pass


class LimitsMiddleware:
    """See the module docstring.  ``front`` counts refusals, 500s and disconnects by route, the label
    ``route_of(scope)`` gives (the app's route table; without one, :data:`UNMATCHED`)."""

    def __init__(self, app: Callable[..., Awaitable[None]], limits: HTTPLimits, front: FrontMetrics,
                 shedder: Shedder | None = None, guards: tuple[Guard, ...] = (),
                 route_of: RouteLabel = lambda scope: UNMATCHED) -> None:
        self.app = app
        self.limits = limits
        self.front = front
        self.shedder = shedder
        self.guards = guards
        self.route_of = route_of
        #: bodies being read at once: bounds their memory, apart from admission (the Shedder's count)
        self.reading = anyio.Semaphore(limits.max_body_reads)

    #: the answer to new work once the server drains (both fronts, every generation route)
    DRAINING = Refusal(503, "the server is shutting down: not accepting new requests", "draining",
                       "server_error", {"retry-after": "1", "connection": "close"})

    @property
    def generation_paths(self) -> frozenset[str]:
        return self.shedder.paths if self.shedder is not None else frozenset()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "websocket" and self.front.draining:
            await self._refuse_websocket(self.route_of(scope), receive, send)
            return
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        route = scope.get("path", "")  # what is decided on; counts and lines use its label (route_of)
        for guard in self.guards:  # authentication before anything that could tell the caller more
            refusal = guard(scope)
            if refusal is not None:
                await self._discard_body(scope, receive)
                await self._refuse(send, scope, refusal)
                return
        if self.front.draining and scope.get("method") == "POST" and route in self.generation_paths:
            await self._discard_body(scope, receive)  # before the shedder: not a 429, nothing parsed
            await self._refuse(send, scope, self.DRAINING)
            return
        shedder = self.shedder
        counted = scope.get("method") == "POST" and shedder is not None and route in shedder.paths
        if counted and await self._shed(route, send):  # before the body: the cheap refusal
            return
        if scope.get("method") == "POST":
            try:
                body = await self._read_body(scope, receive)
            except _Refused as exc:
                if exc.status != 408:  # a slow client is not waited for twice
                    await self._discard_body(scope, receive)
                await self._refuse(send, scope, Refusal(exc.status, str(exc), exc.code))
                return
            except _ClientLeft:
                self.front.disconnects += 1
                log.info("a client disconnected during its upload to %s", self.route_of(scope))
                return
            receive = self._replay(body, receive)
        # On its way to the engine only once its body is in: an upload (valid or not) holds no
        # admission room, and a request the route refuses (a prompt too long) holds it for the parse.
        # Asked again now: the uploads that passed the first check together cannot all be let in.
        if counted:
            if await self._shed(route, send):
                return
            self.front.pending += 1
        try:
            await self._serve(scope, receive, send)
        finally:
            if counted:
                self.front.pending -= 1

    async def _shed(self, route: str, send: Send) -> bool:
        """Answer 429 if the Shedder refuses ``route`` now; whether it did.

        Its body is left unread (the cheap refusal): the answer keeps the
        connection open, so the server reads the body on and nothing resets."""
        shedder = self.shedder
        assert shedder is not None
        if not shedder.refuse(route, self.front.pending):
            return False
        await send({"type": "http.response.start", "status": 429, "headers": shedder.headers})
        await send({"type": "http.response.body", "body": shedder.body, "more_body": False})
        return True

    async def _serve(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = False

        async def tracking_send(message: AsgiMessage) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception as exc:
            log.error("unexpected error while serving %s %s: %s: %s", scope.get("method"),
                      self.route_of(scope), type(exc).__name__, exc, exc_info=exc)
            if not started:
                await self._refuse(send, scope, Refusal(500, "internal server error: the error was logged",
                                                        "internal_error", "server_error"))

    async def _read_body(self, scope: Scope, receive: Receive) -> bytes:
        headers = dict(scope.get("headers") or [])
        ctype = headers.get(b"content-type", b"").split(b";", 1)[0].strip().lower()
        if ctype != b"application/json":
            shown = ctype.decode("latin-1")[:100] or "none"
            raise _Refused(415, f"the request body must be JSON: send 'Content-Type: application/json' "
                                f"(got {shown})", "unsupported_media_type")
        limit = self.limits.max_body_bytes
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise _Refused(413, f"the request body is {int(declared)} bytes, over the limit of {limit} bytes",
                           "request_too_large")
        try:
            with anyio.fail_after(self.limits.body_timeout):
                async with self.reading:  # past max_body_reads, an upload waits for a slot, unread
                    rate = BodyRate(self.limits.min_body_rate, self.limits.body_rate_window,
                                    anyio.current_time(), int(declared) if declared and declared.isdigit()
                                    else None)
                    self.front.body_reads += 1
                    try:
                        return await self._receive_body(receive, limit, rate)
                    finally:
                        self.front.body_reads -= 1
        except TimeoutError:
            raise _Refused(408, f"the request body did not arrive within {self.limits.body_timeout:g}s",
                           "request_timeout") from None

    #: how far past the body limit a refusal still reads (and drops) a body, so that its client reads it
    LINGER_BYTES = 1 << 20

    async def _discard_body(self, scope: Scope, receive: Receive) -> None:
        """Read and drop the rest of the body before a refusal (a 401, 413, 415, 503).

        Closing a connection with its body unread resets it, and the client
        would lose the answer with it.  Bounded: within the body timeout, at
        most the body limit plus :data:`LINGER_BYTES`; a body announced larger
        than that is not read at all (answered at once; its client may see a
        reset).  After a replayed body it returns at once (``more_body`` over).
        """
        bound = self.limits.max_body_bytes + self.LINGER_BYTES
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > bound:
            return
        with anyio.move_on_after(self.limits.body_timeout):
            size = 0
            while size <= bound:
                message = await receive()
                if message["type"] != "http.request":
                    return
                size += len(message.get("body", b""))
                if not message.get("more_body", False):
                    return

    @staticmethod
    async def _receive_body(receive: Receive, limit: int, rate: BodyRate) -> bytes:
        """The whole body (as one bytes), or 413 as soon as it passes ``limit``, 408 once it is too slow."""
        chunks: list[bytes] = []
        size = 0
        while True:
            if rate.on:
                with anyio.move_on_after(rate.deadline - anyio.current_time()) as scope:
                    message = await receive()
                if scope.cancelled_caught:
                    if not rate.window_ended():
                        raise _Refused(408, f"the request body came slower than {rate.rate} bytes/s over "
                                            f"{rate.window:g}s", "request_timeout")
                    continue
                rate.received(len(message.get("body", b"")), anyio.current_time())
            else:
                message = await receive()
            if message["type"] == "http.disconnect":
                raise _ClientLeft()
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise _Refused(413, f"the request body is over the limit of {limit} bytes",
                               "request_too_large")
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    @staticmethod
    def _replay(body: bytes, receive: Receive) -> Receive:
        """The app's receive: the buffered body first, then the real one (to see a disconnect)."""
        sent = False

        async def replay() -> AsgiMessage:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        return replay

    async def _refuse_websocket(self, route: str, receive: Receive, send: Send) -> None:
        """A WebSocket session asked for while draining: the 503 as the handshake's answer."""
        await receive()  # websocket.connect
        self.front.count(route, 503)
        headers, data = json_response(503, self.DRAINING.body(), {"retry-after": "1"})
        await send({"type": "websocket.http.response.start", "status": 503, "headers": headers})
        await send({"type": "websocket.http.response.body", "body": data, "more_body": False})

    async def _refuse(self, send: Send, scope: Scope, refusal: Refusal) -> None:
        status = refusal.status
        route = self.route_of(scope)
        self.front.count(route, status)
        if status < 500 and status != 429:  # shedding is counted, not logged line by line
            log_refusal(route, status, refusal.message)
        headers, data = json_response(status, refusal.body(),
                                      {"connection": "close"} if status in (408, 413) else refusal.headers)
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": data, "more_body": False})
