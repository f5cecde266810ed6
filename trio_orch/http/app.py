"""The HTTP app (Starlette, ASGI) over the engine: what ``trio-orch serve`` serves, on either front.

:func:`create_app` is the one place the app is assembled -- it only
assembles: every route (one module per route family in
:mod:`trio_orch.http.routes`: chat, completions, speech, images, tokenize,
realtime, admin, status) and the guards and limits around them.  Both fronts
(:mod:`trio_orch.serve.asyncio_front`, :mod:`trio_orch.serve.trio_front`)
and the tests serve what it returns, so they cannot drift apart.  The engine
is either kind (:class:`~trio_orch.engine.api.EngineClient`: the thread
adapter on asyncio, the engine itself on Trio).

A request is admitted before any byte of the answer goes out, so a refusal
is a status code: 429 with ``Retry-After`` when the engine sheds it
(:class:`~trio_orch.engine.base.Overloaded`; the :class:`~trio_orch.http.limits.Shedder`
refuses a POST to any generation route before its body is read), 503 when a
stage of its path has no live replica or the server is draining.  A client
that goes away -- mid-stream or while waiting for a non-streamed answer --
aborts its request in the orchestrator.  ``/health`` says ``ok``,
``degraded`` (a stage has no live replica; per-stage live/total replicas),
``draining`` or ``down``.

With an API key (``serve --api-key``) every route but ``/health``,
``/metrics``, ``/version``, ``/ping``, ``/openapi.json`` and ``/docs`` needs ``Authorization: Bearer KEY``
(:class:`~trio_orch.http.auth.ApiKeyAuth`, asked before anything else,
WebSocket handshakes included); ``/admin/...`` keeps its own token.  A
request naming a model that is not served here is a 404 ``model_not_found``
(:class:`~trio_orch.openai.protocol.ServedModels`).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Match, Route, WebSocketRoute

from stages.registry import text_stage
from trio_orch.engine.api import EngineClient
from trio_orch.http.access import VLLM_CORS, AccessLog, Cors, RootPath
from trio_orch.http.auth import AdminAuth, ApiKeyAuth, WebSocketGuard
from trio_orch.http.limits import UNMATCHED, Guard, HTTPLimits, LimitsMiddleware, Scope, Shedder
from trio_orch.http.logs import guard_logs
from trio_orch.http.metrics import ExtraCounters, FrontMetrics
from trio_orch.http.routes.admin import admin_routes
from trio_orch.http.routes.chat import CHAT, chat_route
from trio_orch.http.routes.completions import COMPLETIONS, completions_route
from trio_orch.http.routes.images import IMAGES, image_route
from trio_orch.http.routes.openapi import openapi_routes
from trio_orch.http.routes.realtime import realtime_route
from trio_orch.http.routes.speech import SPEECH, speech_route
from trio_orch.http.routes.status import status_routes
from trio_orch.http.routes.tokenize import tokenizer_routes
from trio_orch.openai.chat_template import ChatInput
from trio_orch.openai.protocol import ServedModels
from trio_orch.openai.tokenizer import context_length
from trio_orch.openai.validation import error_body

__all__ = ["GENERATION_PATHS", "RouteLabels", "create_app"]

#: the POST routes that start work in the engine: the Shedder refuses them before their body is read
GENERATION_PATHS = frozenset({CHAT, IMAGES, COMPLETIONS, SPEECH})


class RouteLabels:
    """A request's ``route`` label for metrics and log lines: the path template of the route it
    matches (``/v1/models/{name:path}``), else :data:`~trio_orch.http.limits.UNMATCHED`.

    Never the raw path: a client could then add a series to ``/metrics`` (and a line to the log) with
    every request it makes to a path of its own choosing.
    """

    def __init__(self, routes: Sequence[BaseRoute]) -> None:
        self.routes = [r for r in routes if isinstance(r, Route | WebSocketRoute)]
        self.exact = {r.path for r in self.routes if "{" not in r.path}

    def __call__(self, scope: Scope) -> str:
        path = scope.get("path", "")
        if path in self.exact:
            return str(path)
        return next((r.path for r in self.routes if r.matches(scope)[0] is not Match.NONE), UNMATCHED)


def _http_errors(front: FrontMetrics, route_of: RouteLabels
                 ) -> Callable[[Request, Exception], Awaitable[Response]]:
    """Starlette's own refusals (404 no such route, 405 no such method), OpenAI-shaped and counted."""
    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        front.count(route_of(request.scope), exc.status_code)
        return JSONResponse(error_body(exc.detail, "invalid_request_error"), status_code=exc.status_code)

    return http_error


def create_app(engine: EngineClient, *, model_name: str | Sequence[str] = "trio-orch",
               extra_metrics: Callable[[], ExtraCounters] | None = None,
               outputs: Sequence[str] | None = None, limits: HTTPLimits | None = None,
               front: FrontMetrics | None = None, token_limit: int | None = None,
               stage_names: Sequence[str] | None = None, admin_token: str | None = None,
               api_key: str | None = None, chat_input: ChatInput | None = None, access_log: bool = True,
               cors: Cors | None = VLLM_CORS, root_path: str = "", docs: bool = True) -> Starlette:
    """The whole ASGI app over a started engine (either kind: the thread bridge or the in-loop one).

    ``extra_metrics()`` returns more counters for ``/metrics`` (the supervisor's
    restarts, the front's connection closes).  ``outputs``: each stage's output
    modality (``stages.registry.outputs_of``); None judges outputs by their
    shape and takes stage 0 for text.  ``limits``: the HTTP limits (defaults of
    :class:`HTTPLimits`); ``front``: the counters shared with the server (set
    ``front.draining`` to drain); ``token_limit``: the text stage's own cap on
    generated tokens (for ``finish_reason``); ``stage_names`` label the stages
    in ``/health``; ``admin_token`` turns on the ``/admin/...`` control routes
    behind that bearer token.  ``model_name``: the served name, or names (the
    first is the one answers carry); ``api_key`` guards every route but the
    open ones (:class:`ApiKeyAuth`); ``chat_input``: the chat template and
    media limits (default: the default template), taking the media the
    pipeline's stages encode.  Around every route: one access-log line per
    request (``access_log``), CORS as vLLM's flags say (``cors``; None: no
    CORS headers), ``root_path`` as the path prefix a proxy may add
    (:mod:`trio_orch.http.access`); ``/openapi.json`` and ``/docs`` describe
    the routes (unless ``docs`` is false: ``serve --disable-fastapi-docs``).
    """
    limits = limits or HTTPLimits()
    front = front if front is not None else FrontMetrics()
    models = ServedModels(model_name, max_model_len=context_length(engine, outputs))  # created: now
    front.serve_model(models.name, models.max_model_len)  # the vLLM families' label and token buckets
    auth = AdminAuth(admin_token) if admin_token else None
    guards: tuple[Guard, ...] = tuple(g for g in (ApiKeyAuth(api_key) if api_key else None, auth)
                                      if g is not None)
    text = text_stage(engine.final_stage_ids, outputs)
    if text is not None:
        front.expect_stage(text)  # its generated tokens are shown from the start, at 0
    chat = (chat_input or ChatInput()).for_kinds(engine.stage_kinds)
    served = {"models": models, "outputs": outputs, "limits": limits, "front": front}
    routes: list[BaseRoute] = [
        chat_route(engine, **served, token_limit=token_limit, chat=chat),
        image_route(engine, **served),
        completions_route(engine, **served, token_limit=token_limit),
        speech_route(engine, **served),
        *tokenizer_routes(engine, **served, chat=chat),
        realtime_route(engine, outputs, models=models, front=front),
        *status_routes(engine, front, models=models, outputs=outputs, stage_names=stage_names,
                       extra_metrics=extra_metrics),
        *admin_routes(engine, auth),
    ]
    if docs:
        routes += openapi_routes(routes, api_key=api_key is not None, root_path=root_path)
    shedder = Shedder(lambda: engine.shedding, GENERATION_PATHS, front, engine.retry_after,
                      capacity=lambda: engine.capacity)
    around: list[Middleware] = []  # outermost first
    if access_log:
        around.append(Middleware(AccessLog))
    if root_path:
        around.append(Middleware(RootPath, root_path=root_path))
    if cors is not None:
        around.append(Middleware(CORSMiddleware, allow_origins=cors.origins, allow_methods=cors.methods,
                                 allow_headers=cors.headers, allow_credentials=cors.credentials))
    route_of = RouteLabels(routes)
    guard_logs()  # a client's text escaped in every line the front writes; floods of refusals limited
    return Starlette(routes=routes, exception_handlers={HTTPException: _http_errors(front, route_of)},
                     middleware=[*around,
                                 Middleware(WebSocketGuard, guards=guards, front=front, route_of=route_of),
                                 Middleware(LimitsMiddleware, limits=limits, front=front, shedder=shedder,
                                            guards=guards, route_of=route_of)])
