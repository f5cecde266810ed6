"""Who may call what: the API key, the admin token, and the refusals of WebSocket handshakes.

:class:`ApiKeyAuth` (``serve --api-key``) and :class:`AdminAuth` (``serve
--admin-token``) are :data:`~trio_orch.http.limits.Guard` s: asked before the
content type, the body or the route, so a caller without the key learns
nothing else.  :class:`LimitsMiddleware` applies them to HTTP requests,
:class:`WebSocketGuard` to WebSocket handshakes.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Callable, Sequence
from typing import Any

from trio_orch.http.limits import UNMATCHED, Guard, Receive, Refusal, RouteLabel, Scope, Send, json_response
from trio_orch.http.logs import log_refusal
from trio_orch.http.metrics import FrontMetrics

__all__ = ["ADMIN_PREFIX", "AdminAuth", "ApiKeyAuth", "WebSocketGuard"]

log = logging.getLogger("trio_orch.http")

#: every admin route's path starts with it; :class:`AdminAuth` guards the whole prefix
ADMIN_PREFIX = "/admin/"


class ApiKeyAuth:
    """``serve --api-key``: every route but :data:`OPEN` (and ``/admin/...``, behind its own token)
    needs ``Authorization: Bearer KEY``, as vLLM's ``--api-key``.

    A :data:`~trio_orch.http.limits.Guard`: asked before the content type, the
    body or the route, so a caller without the key learns nothing else.
    Unlike vLLM, which guards ``/v1`` only, a new route is guarded unless listed.
    """

    OPEN = frozenset({"/health", "/metrics", "/version", "/ping", "/openapi.json", "/docs"})
    MESSAGE = "a valid API key is required: send 'Authorization: Bearer KEY'"

    def __init__(self, key: str) -> None:
        self.expected = f"Bearer {key}".encode()

    def __call__(self, scope: Scope) -> Refusal | None:
        path = str(scope.get("path", ""))
        if path in self.OPEN or path.startswith(ADMIN_PREFIX) or scope.get("method") == "OPTIONS":
            return None
        given = next((v for k, v in scope.get("headers") or [] if k.lower() == b"authorization"), b"")
        if hmac.compare_digest(given, self.expected):
            return None
        return Refusal(401, self.MESSAGE, "invalid_api_key", "invalid_request_error",
                       {"www-authenticate": "Bearer"})


class WebSocketGuard:
    """The guards for WebSocket handshakes (:class:`LimitsMiddleware` applies them to HTTP requests):
    a refusal is the handshake's HTTP answer, with its OpenAI-shaped body."""

    def __init__(self, app: Callable[..., Any], guards: Sequence[Guard], front: FrontMetrics,
                 route_of: RouteLabel = lambda scope: UNMATCHED) -> None:
        self.app = app
        self.guards = guards
        self.front = front
        self.route_of = route_of

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "websocket":
            for guard in self.guards:
                refusal = guard(scope)
                if refusal is not None:
                    await receive()  # websocket.connect
                    route = self.route_of(scope)
                    self.front.count(route, refusal.status)
                    log_refusal(route, refusal.status, refusal.message)
                    headers, data = json_response(refusal.status, refusal.body(), refusal.headers)
                    await send({"type": "websocket.http.response.start", "status": refusal.status,
                                "headers": headers})
                    await send({"type": "websocket.http.response.body", "body": data, "more_body": False})
                    return
        await self.app(scope, receive, send)


class AdminAuth:
    """The bearer-token check of every ``/admin/...`` path, known route or not.

    :class:`~trio_orch.http.limits.LimitsMiddleware` asks it first, so a
    caller without the token gets 401 before any other check (content type,
    body size, method, route) can tell it anything.
    """

    MESSAGE = "a valid admin bearer token is required (Authorization: Bearer TOKEN)"

    def __init__(self, token: str) -> None:
        self.expected = f"Bearer {token}".encode()

    def allows(self, headers: Sequence[tuple[bytes, bytes]]) -> bool:
        given = next((v for k, v in headers if k.lower() == b"authorization"), b"")
        return hmac.compare_digest(given, self.expected)

    def __call__(self, scope: Scope) -> Refusal | None:
        """The 401 for an ``/admin/...`` request without the token; None for any other request."""
        if not str(scope.get("path", "")).startswith(ADMIN_PREFIX) or self.allows(scope.get("headers") or []):
            return None
        return Refusal(401, self.MESSAGE, "invalid_api_key", "authentication_error",
                       {"www-authenticate": "Bearer"})
