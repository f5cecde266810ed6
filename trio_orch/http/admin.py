"""``/admin/...``: the control plane over HTTP, behind a bearer token.

Only served when ``trio-orch serve --admin-token TOKEN`` (or the environment
variable ``TRIO_ORCH_ADMIN_TOKEN``) gives a token; every call must then carry
``Authorization: Bearer TOKEN`` -- a missing or wrong one gets 401 and does
nothing.  Each route is one engine control call (:mod:`trio_orch.engine.control`);
the answer is JSON: ``{"paused": mode or null, "results": [{"stage_id",
"replica", "value", "error"}, ...]}``.  A bad argument is 400, a replica that
failed a recipe 502 (with every replica's answer), requests that did not
drain in time 504, a stopped engine 503.  ``trio-orch ctl`` is the
command-line client.

The routes (``POST``; ``stats`` also ``GET``), their JSON body (``*``: required;
``stage_ids`` and ``timeout`` are taken by every one) and the engine call:

- ``/admin/stats``: ``collective_rpc("stats")``;
- ``/admin/rpc``: ``method*``, ``args``, ``kwargs``: ``collective_rpc``;
- ``/admin/pause``: ``mode`` (wait, abort, keep): ``pause``; ``/admin/resume``: ``resume``;
- ``/admin/sleep``: ``level`` (1, 2), ``drain_timeout``: ``sleep``; ``/admin/wake_up``: ``wake_up``;
- ``/admin/reload_weights``: ``path*``, ``drain_timeout``: ``update_weights``;
- ``/admin/start_profile``: ``dir*``; ``/admin/stop_profile``: ``start_profile``, ``stop_profile``;
- ``/admin/abort``: ``request_id*``: ``abort_confirmed``.
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from trio_orch.engine import ControlError, Engine, EngineClosed
from trio_orch.types import RpcResult

__all__ = ["TOKEN_ENV", "admin_routes"]

#: the environment variable ``serve`` and ``ctl`` read the token from when no option gives it
TOKEN_ENV = "TRIO_ORCH_ADMIN_TOKEN"

Handler = Callable[[Engine, dict[str, Any]], Awaitable[Any]]


def _jsonable(obj: Any) -> Any:
    """Worker answers may hold arrays or other non-JSON values: lists, or their repr."""
    def default(o: Any) -> Any:
        tolist = getattr(o, "tolist", None)
        return tolist() if callable(tolist) else repr(o)
    return json.loads(json.dumps(obj, default=default))


def _need(body: dict[str, Any], key: str) -> Any:
    if key not in body:
        raise ValueError(f"the body needs {key!r}")
    return body[key]


def _opt(body: dict[str, Any], *keys: str) -> dict[str, Any]:
    return {k: body[k] for k in keys if k in body}


async def _stats(e: Engine, b: dict[str, Any]) -> Any:
    return await e.collective_rpc_async("stats", **_opt(b, "stage_ids", "timeout"))


async def _rpc(e: Engine, b: dict[str, Any]) -> Any:
    opts = _opt(b, "args", "kwargs", "stage_ids", "timeout")
    return await e.collective_rpc_async(_need(b, "method"), **opts)


async def _pause(e: Engine, b: dict[str, Any]) -> Any:
    await e.pause_async(b.get("mode", "wait"))


async def _resume(e: Engine, b: dict[str, Any]) -> Any:
    await e.resume_async()


async def _sleep(e: Engine, b: dict[str, Any]) -> Any:
    return await e.sleep_async(b.get("level", 1), **_opt(b, "stage_ids", "timeout", "drain_timeout"))


async def _wake(e: Engine, b: dict[str, Any]) -> Any:
    return await e.wake_up_async(**_opt(b, "stage_ids", "timeout"))


async def _reload(e: Engine, b: dict[str, Any]) -> Any:
    return await e.update_weights_async(_need(b, "path"), **_opt(b, "stage_ids", "timeout", "drain_timeout"))


async def _start_profile(e: Engine, b: dict[str, Any]) -> Any:
    return await e.start_profile_async(_need(b, "dir"), **_opt(b, "stage_ids", "timeout"))


async def _stop_profile(e: Engine, b: dict[str, Any]) -> Any:
    return await e.stop_profile_async(**_opt(b, "stage_ids", "timeout"))


async def _abort(e: Engine, b: dict[str, Any]) -> Any:
    return await e.abort_confirmed_async(_need(b, "request_id"), b.get("timeout"))


#: route name -> (HTTP methods, handler)
ROUTES: dict[str, tuple[tuple[str, ...], Handler]] = {
    "stats": (("GET", "POST"), _stats),
    "rpc": (("POST",), _rpc),
    "pause": (("POST",), _pause),
    "resume": (("POST",), _resume),
    "sleep": (("POST",), _sleep),
    "wake_up": (("POST",), _wake),
    "reload_weights": (("POST",), _reload),
    "start_profile": (("POST",), _start_profile),
    "stop_profile": (("POST",), _stop_profile),
    "abort": (("POST",), _abort),
}


def _results(results: Sequence[RpcResult] | None) -> list[dict[str, Any]]:
    return [{"stage_id": r.stage_id, "replica": r.replica, "value": r.value, "error": r.error}
            for r in results or ()]


def admin_routes(engine: Engine, token: str | None) -> list[Route]:
    """The ``/admin/...`` routes, or none when ``token`` is None (the control plane stays off)."""
    if not token:
        return []
    expected = f"Bearer {token}".encode()

    def endpoint(handler: Handler) -> Callable[[Request], Awaitable[Response]]:
        async def call(request: Request) -> Response:
            given = request.headers.get("authorization", "").encode()
            if not hmac.compare_digest(given, expected):
                return JSONResponse({"error": "a valid admin bearer token is required"}, status_code=401,
                                    headers={"WWW-Authenticate": "Bearer"})
            try:
                body = await request.json() if await request.body() else {}
                if not isinstance(body, dict):
                    raise ValueError("the body must be a JSON object")
                results = await handler(engine, body)
            except ControlError as exc:
                return _answer(engine, exc.results, 502, str(exc))
            except TimeoutError as exc:
                return _answer(engine, None, 504, str(exc))
            except EngineClosed as exc:
                return _answer(engine, None, 503, str(exc))
            except (ValueError, TypeError) as exc:  # bad JSON, a bad argument, a bad stage id
                return _answer(engine, None, 400, f"{type(exc).__name__}: {exc}")
            return _answer(engine, results, 200)
        return call

    return [Route(f"/admin/{name}", endpoint(handler), methods=list(methods))
            for name, (methods, handler) in ROUTES.items()]


def _answer(engine: Engine, results: Sequence[RpcResult] | None, status: int, error: str | None = None
            ) -> Response:
    body: dict[str, Any] = {"paused": engine.paused, "results": _results(results)}
    if error is not None:
        body["error"] = error
    return JSONResponse(_jsonable(body), status_code=status)
