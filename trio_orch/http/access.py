"""What an operator sets around the routes: the access-log line, the request id, the path prefix, CORS.

:class:`AccessLog` writes one line per request on the ``trio_orch.access``
logger once its answer is complete (a stream: when it ends) -- the client,
method, path, status, duration and request id -- and gives the answer an
``X-Request-Id`` header (the client's own, if it sent a usable one): the
same line on either front, where uvicorn's own access log (which knows
neither the duration nor an id) is off.  A WebSocket session's line comes
when it closes (101 once accepted).  ``serve --disable-uvicorn-access-log``
leaves the middleware out; ``--uvicorn-log-level`` above ``info`` silences
the logger.

:class:`RootPath` is ``serve --root-path``: a proxy may forward
``/PREFIX/v1/...`` or ``/v1/...``; either reaches the route, and the
prefix is the ASGI ``root_path`` the app links with.

:class:`Cors` is vLLM's CORS flags (``--allowed-origins`` and friends), with
vLLM's defaults: any origin, method and header, no credentials; the app
applies them with Starlette's ``CORSMiddleware`` (vLLM's, through FastAPI),
which answers a browser's ``OPTIONS`` preflight itself.
"""

from __future__ import annotations

import logging
import re
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from trio_orch.http.limits import Receive, Scope, Send

__all__ = ["ACCESS_LOGGER", "VLLM_CORS", "AccessLog", "Cors", "RootPath"]

#: the logger of the access-log lines
ACCESS_LOGGER = "trio_orch.access"
log = logging.getLogger(ACCESS_LOGGER)

#: a client's X-Request-Id is echoed and logged when it looks like an id (else one is made)
_USABLE_ID = re.compile(rb"[A-Za-z0-9._:\-]{1,128}")


class AccessLog:
    """One access-log line per request, and its ``X-Request-Id`` (see the module docstring)."""

    def __init__(self, app: Callable[..., Any]) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        given = next((v for k, v in scope.get("headers") or [] if k == b"x-request-id"), b"")
        rid = given.decode() if _USABLE_ID.fullmatch(given) else secrets.token_hex(8)
        t0 = time.perf_counter()
        status = 0
        complete = False

        async def sending(message: dict[str, Any]) -> None:
            nonlocal status, complete
            t = message["type"]
            if t in ("http.response.start", "websocket.http.response.start"):
                status = message["status"]
                message["headers"] = [*message.get("headers", ()), (b"x-request-id", rid.encode())]
            elif t == "websocket.accept":
                status = 101
            elif t == "websocket.close" and not status:
                status = 403  # closed before it was accepted: the handshake's refusal
            elif t == "http.response.body" and not message.get("more_body", False):
                complete = True
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            if log.isEnabledFor(logging.INFO):
                self.line(scope, status or 500, time.perf_counter() - t0, rid,
                          complete or kind == "websocket" or not status)

    @staticmethod
    def line(scope: Scope, status: int, seconds: float, rid: str, complete: bool) -> None:
        client = scope.get("client")
        who = f"{client[0]}:{client[1]}" if client else "-"
        method = scope.get("method", "WS") if scope["type"] == "http" else "WS"
        path = scope.get("root_path", "") + scope.get("path", "")
        query = scope.get("query_string", b"")
        target = f"{path}?{query.decode('latin-1')}" if query else path
        log.info('%s - "%s %s HTTP/%s" %d %.1fms request_id=%s%s', who, method, target,
                 scope.get("http_version", "1.1"), status, seconds * 1000, rid,
                 "" if complete else " (the client left before the end)")


class RootPath:
    """``serve --root-path PREFIX``: requests with or without the prefix reach the same route."""

    def __init__(self, app: Callable[..., Any], root_path: str) -> None:
        self.app = app
        self.root_path = root_path

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket"):
            root, path = self.root_path, scope["path"]
            if path == root or path.startswith(root + "/"):
                path = path[len(root):] or "/"
            scope = {**scope, "root_path": root, "path": path}
        await self.app(scope, receive, send)


@dataclass(frozen=True)
class Cors:
    """vLLM's CORS flags (vLLM's defaults: every origin, method and header; no credentials)."""

    origins: tuple[str, ...] = ("*",)
    methods: tuple[str, ...] = ("*",)
    headers: tuple[str, ...] = ("*",)
    credentials: bool = False


#: vLLM's defaults
VLLM_CORS = Cors()
