"""``/admin/...``: the control plane over HTTP, behind a bearer token.

Only served when ``trio-orch serve --admin-token TOKEN`` (or the environment
variable ``TRIO_ORCH_ADMIN_TOKEN``) gives a token; every call must then carry
``Authorization: Bearer TOKEN``.  The token is checked before anything else
(:class:`~trio_orch.http.auth.AdminAuth`, applied by
:class:`~trio_orch.http.limits.LimitsMiddleware` before the content type or
the body): a missing or wrong one gets 401, does nothing and learns nothing.
Each route is one engine control call (the ``*_async`` calls of
:class:`~trio_orch.engine.api.EngineClient`); its body is a typed schema read
by the one validator (:mod:`trio_orch.openai.validation`: an unknown key, a
wrong type or a value out of range is 400 ``bad_argument`` naming the key).
The answer is JSON: ``{"paused": mode or null, "results": [{"stage_id",
"replica", "value", "error"}, ...]}``; a refusal adds ``"error"`` in the
OpenAI shape the other routes use (``{"message", "type", "param",
"code"}``): 400 a bad argument, 404 an RPC method no replica knows, 502 a
replica that failed a recipe (with every replica's answer), 503 a stopped
engine, 504 requests that did not drain in time.  ``trio-orch ctl`` is the
command-line client.

The routes (``POST``; ``stats`` also ``GET``), their JSON body (``*``: required;
``stage_ids`` and ``timeout`` are taken by every route that asks replicas) and the engine call:

- ``/admin/stats``: ``collective_rpc("stats")``;
- ``/admin/rpc``: ``method*``, ``args``, ``kwargs``: ``collective_rpc``;
- ``/admin/pause``: ``mode`` (wait, abort, keep): ``pause``; ``/admin/resume``: ``resume`` (no replica
  argument);
- ``/admin/sleep``: ``level`` (1, 2), ``drain_timeout``: ``sleep``; ``/admin/wake_up``: ``wake_up``;
- ``/admin/reload_weights``: ``path*``, ``drain_timeout``: ``update_weights``;
- ``/admin/start_profile``: ``dir*``; ``/admin/stop_profile``: ``start_profile``, ``stop_profile``;
- ``/admin/abort``: ``request_id*``, ``timeout``: ``abort_confirmed``.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Sequence
from typing import Annotated, Any, Literal

from msgspec import Meta, Struct
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from stages.control import UNKNOWN_METHOD
from stages.schema import NonNegativeInt, PositiveSeconds
from trio_orch.engine.api import ControlError, EngineClient, EngineClosed
from trio_orch.http.auth import ADMIN_PREFIX, AdminAuth
from trio_orch.openai.validation import BadRequest, decode, error_body, parse_json_body
from trio_orch.types import RpcResult

__all__ = ["ROUTES", "admin_routes"]

Text = Annotated[str, Meta(min_length=1)]
#: a path on the workers' hosts: no NUL byte (no OS takes one)
PathText = Annotated[str, Meta(min_length=1, pattern="^[^\x00]*$", description="a path without NUL bytes")]


class _Replicas(Struct, forbid_unknown_fields=True, kw_only=True):
    """What every route that asks replicas takes."""

    stage_ids: list[NonNegativeInt] | None = None
    timeout: PositiveSeconds | None = None


class _Rpc(_Replicas, kw_only=True):
    method: Text
    args: list[Any] = []
    kwargs: dict[str, Any] = {}


class _Pause(Struct, forbid_unknown_fields=True):
    mode: Literal["wait", "abort", "keep"] = "wait"


class _Resume(Struct, forbid_unknown_fields=True):
    pass


class _Sleep(_Replicas, kw_only=True):
    level: Literal[1, 2] = 1
    drain_timeout: PositiveSeconds | None = None


class _Reload(_Replicas, kw_only=True):
    path: PathText
    drain_timeout: PositiveSeconds | None = None


class _StartProfile(_Replicas, kw_only=True):
    dir: PathText


class _Abort(Struct, forbid_unknown_fields=True, kw_only=True):
    request_id: Text
    timeout: PositiveSeconds | None = None


class UnknownMethod(Exception):
    """No replica asked knows the RPC method (404)."""


def _jsonable(obj: Any) -> Any:
    """Worker answers may hold arrays or other non-JSON values: lists, or their repr."""
    def default(o: Any) -> Any:
        tolist = getattr(o, "tolist", None)
        return tolist() if callable(tolist) else repr(o)
    return json.loads(json.dumps(obj, default=default))


async def _stats(e: EngineClient, b: _Replicas) -> Any:
    return await e.collective_rpc_async("stats", stage_ids=b.stage_ids, timeout=b.timeout)


async def _rpc(e: EngineClient, b: _Rpc) -> Any:
    results = await e.collective_rpc_async(b.method, b.args, b.kwargs, stage_ids=b.stage_ids,
                                           timeout=b.timeout)
    asked = [r for r in results if r.replica >= 0]
    if asked and all(r.error is not None and r.error.startswith(UNKNOWN_METHOD) for r in asked):
        raise UnknownMethod(asked[0].error)
    return results


async def _pause(e: EngineClient, b: _Pause) -> Any:
    await e.pause_async(b.mode)


async def _resume(e: EngineClient, b: _Resume) -> Any:
    await e.resume_async()


async def _sleep(e: EngineClient, b: _Sleep) -> Any:
    return await e.sleep_async(b.level, stage_ids=b.stage_ids, timeout=b.timeout,
                               drain_timeout=b.drain_timeout)


async def _wake(e: EngineClient, b: _Replicas) -> Any:
    return await e.wake_up_async(stage_ids=b.stage_ids, timeout=b.timeout)


async def _reload(e: EngineClient, b: _Reload) -> Any:
    return await e.update_weights_async(b.path, stage_ids=b.stage_ids, timeout=b.timeout,
                                        drain_timeout=b.drain_timeout)


async def _start_profile(e: EngineClient, b: _StartProfile) -> Any:
    return await e.start_profile_async(b.dir, stage_ids=b.stage_ids, timeout=b.timeout)


async def _stop_profile(e: EngineClient, b: _Replicas) -> Any:
    return await e.stop_profile_async(stage_ids=b.stage_ids, timeout=b.timeout)


async def _abort(e: EngineClient, b: _Abort) -> Any:
    return await e.abort_confirmed_async(b.request_id, b.timeout)


Handler = Callable[[EngineClient, Any], Awaitable[Any]]

#: route name -> (HTTP methods, body schema, handler)
ROUTES: dict[str, tuple[tuple[str, ...], type[Struct], Handler]] = {
    "stats": (("GET", "POST"), _Replicas, _stats),
    "rpc": (("POST",), _Rpc, _rpc),
    "pause": (("POST",), _Pause, _pause),
    "resume": (("POST",), _Resume, _resume),
    "sleep": (("POST",), _Sleep, _sleep),
    "wake_up": (("POST",), _Replicas, _wake),
    "reload_weights": (("POST",), _Reload, _reload),
    "start_profile": (("POST",), _StartProfile, _start_profile),
    "stop_profile": (("POST",), _Replicas, _stop_profile),
    "abort": (("POST",), _Abort, _abort),
}


def _results(results: Sequence[RpcResult] | None) -> list[dict[str, Any]]:
    return [{"stage_id": r.stage_id, "replica": r.replica, "value": r.value, "error": r.error}
            for r in results or ()]


def _body(raw: bytes, schema: type[Struct], name: str) -> Any:
    """The request's arguments checked against the route's schema (an empty body: none given)."""
    return decode(parse_json_body(raw or b"{}"), schema, what=f"an /admin/{name} request")


def admin_routes(engine: EngineClient, auth: AdminAuth | None) -> list[Route]:
    """The ``/admin/...`` routes, or none when ``auth`` is None (the control plane stays off).

    The middleware refuses a request without the token first; each endpoint
    checks it again, so the routes are never open, however they are mounted.
    """
    if auth is None:
        return []

    def endpoint(name: str, schema: type[Struct], handler: Handler
                 ) -> Callable[[Request], Awaitable[Response]]:
        async def call(request: Request) -> Response:
            refusal = auth(request.scope)
            if refusal is not None:
                return JSONResponse(refusal.body(), status_code=refusal.status, headers=refusal.headers)
            try:
                results = await handler(engine, _body(await request.body(), schema, name))
            except BadRequest as exc:
                return _answer(engine, None, 400, f"bad argument: {exc}", code="bad_argument",
                               param=exc.param)
            except ControlError as exc:
                return _answer(engine, exc.results, 502, str(exc), "server_error", "control_failed")
            except TimeoutError as exc:
                return _answer(engine, None, 504, str(exc), "server_error", "timeout")
            except EngineClosed as exc:
                return _answer(engine, None, 503, str(exc), "server_error", "engine_closed")
            except UnknownMethod as exc:
                return _answer(engine, None, 404, str(exc), code="unknown_method")
            except (ValueError, TypeError) as exc:  # a bad argument, a bad stage id
                return _answer(engine, None, 400, str(exc), code="bad_argument")
            return _answer(engine, results, 200)
        return call

    return [Route(f"{ADMIN_PREFIX}{name}", endpoint(name, schema, handler), methods=list(methods))
            for name, (methods, schema, handler) in ROUTES.items()]


def _answer(engine: EngineClient, results: Sequence[RpcResult] | None, status: int, error: str | None = None,
            kind: str = "invalid_request_error", code: str | None = None, param: str | None = None
            ) -> Response:
    body: dict[str, Any] = {"paused": engine.paused, "results": _results(results)}
    if error is not None:
        body.update(error_body(error, kind, param, code))
    return JSONResponse(_jsonable(body), status_code=status)
