"""The HTTP app (Starlette, ASGI) over the Trio engine: what ``trio-orch serve`` serves, on either front.

:func:`create_app` is the one place the app is assembled: every route and
the limits around them.  Routes: ``POST /v1/chat/completions``
(non-streaming, or SSE with ``"stream": true``; ``modalities`` ``["text"]``
or ``["text", "audio"]``), ``POST /v1/images/generations``
(:mod:`trio_orch.http.openai_images`; 400 naming ``model`` on a pipeline
that makes no images), the ``/v1/realtime`` WebSocket session
(:mod:`trio_orch.http.realtime_server`), ``GET /v1/models`` (and
``/v1/models/{name}``), ``GET /health``, ``GET /metrics`` (Prometheus text),
vLLM's ``GET /version`` and ``/ping`` and, with an admin token, the
``/admin/...`` control routes (:mod:`trio_orch.http.admin`).  Both fronts
(:mod:`trio_orch.serve.uvicorn_front`, :mod:`trio_orch.serve.trio_front`)
and the tests serve what it returns, so they cannot drift apart.

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
``/metrics``, ``/version`` and ``/ping`` needs ``Authorization: Bearer KEY``
(:class:`ApiKeyAuth`, asked before anything else, WebSocket handshakes
included); ``/admin/...`` keeps its own token.  A request naming a model that
is not served here is a 404 ``model_not_found`` (:class:`~trio_orch.http.schemas.ServedModels`).
"""

from __future__ import annotations

import hmac
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from functools import partial
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from stages.registry import text_stage
from trio_orch import __version__
from trio_orch.engine import AsyncRequestHandle, Engine, EngineClosed
from trio_orch.http.admin import PREFIX as ADMIN_PREFIX
from trio_orch.http.admin import AdminAuth, admin_routes
from trio_orch.http.chat_template import ChatInput
from trio_orch.http.generation import OpenAIRoute
from trio_orch.http.limits import (
    Guard,
    HTTPLimits,
    LimitsMiddleware,
    Receive,
    Refusal,
    Scope,
    Send,
    Shedder,
    json_response,
)
from trio_orch.http.metrics import CONTENT_TYPE, ExtraCounters, FrontMetrics, render
from trio_orch.http.openai_chat import (
    ChatRequest,
    ChatStream,
    map_chat_sampling,
    parse_chat_request,
)
from trio_orch.http.openai_images import IMAGES, image_route
from trio_orch.http.openai_routes import GENERATION, openai_routes
from trio_orch.http.realtime_server import realtime_route
from trio_orch.http.schemas import BadRequest, ServedModels, error_body, parse_json_body
from trio_orch.http.streaming import SSEResponse, sse
from trio_orch.http.tokenizer import check_context, context_length, prompt_token_count
from trio_orch.types import OrchError

__all__ = ["API_KEY_ENV", "CHAT", "GENERATION_PATHS", "ApiKeyAuth", "ChatCompletions", "WebSocketGuard",
           "create_app"]

log = logging.getLogger("trio_orch.serve.command")

CHAT = "/v1/chat/completions"
#: the POST routes that start work in the engine: the Shedder refuses them before their body is read
GENERATION_PATHS = frozenset({CHAT, IMAGES}) | GENERATION
#: the environment variable ``serve`` reads the API key from when ``--api-key`` is not given
API_KEY_ENV = "TRIO_ORCH_API_KEY"


class ApiKeyAuth:
    """``serve --api-key``: every route but :data:`OPEN` (and ``/admin/...``, behind its own token)
    needs ``Authorization: Bearer KEY``, as vLLM's ``--api-key``.

    A :data:`~trio_orch.http.limits.Guard`: asked before the content type, the
    body or the route, so a caller without the key learns nothing else.
    Unlike vLLM, which guards ``/v1`` only, a new route is guarded unless listed.
    """

    OPEN = frozenset({"/health", "/metrics", "/version", "/ping"})
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

    def __init__(self, app: Callable[..., Any], guards: Sequence[Guard], front: FrontMetrics) -> None:
        self.app = app
        self.guards = guards
        self.front = front

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "websocket":
            for guard in self.guards:
                refusal = guard(scope)
                if refusal is not None:
                    await receive()  # websocket.connect
                    self.front.count(str(scope.get("path", "")), refusal.status)
                    log.warning("refused a WebSocket session at %s (%d): %s", scope.get("path"),
                                refusal.status, refusal.message)
                    headers, data = json_response(refusal.status, refusal.body(), refusal.headers)
                    await send({"type": "websocket.http.response.start", "status": refusal.status,
                                "headers": headers})
                    await send({"type": "websocket.http.response.body", "body": data, "more_body": False})
                    return
        await self.app(scope, receive, send)


class ChatCompletions(OpenAIRoute):
    """``POST /v1/chat/completions`` over ``engine`` (see :func:`create_app` for the arguments)."""

    def __init__(self, engine: Engine, *, models: ServedModels, outputs: Sequence[str] | None,
                 limits: HTTPLimits, front: FrontMetrics, token_limit: int | None,
                 chat: ChatInput | None = None) -> None:
        super().__init__(engine, CHAT, front, limits)
        self.chat = chat
        self.models = models
        self.outputs = outputs
        self.token_limit = token_limit

    def route(self) -> Route:
        return Route(CHAT, self.handle, methods=["POST"])

    def final_stage_for(self, req: ChatRequest) -> int | None:
        finals = self.engine.final_stage_ids
        answers = sorted({self.outputs[k] for k in finals}) if self.outputs is not None else []
        if answers and not set(answers) & {"text", "audio", "data"}:  # e.g. text2image: neither hint fits
            route = " (POST /v1/images/generations)" if "image" in answers else ""
            raise BadRequest(f"this pipeline answers with {' and '.join(answers)}{route}, not chat: it has "
                             "no text or audio output for any modalities", "model")
        if req.audio:
            if self.outputs is not None and not any(self.outputs[k] in ("audio", "data") for k in finals):
                raise BadRequest("this pipeline has no audio output: ask for modalities [\"text\"]",
                                 "modalities")
            return None
        text = text_stage(finals, self.outputs)
        if text is None:
            raise BadRequest("this pipeline has no text-only output: "
                             "ask for modalities [\"text\", \"audio\"]", "modalities")
        return text  # text only: the request stops after the stage that gives text

    async def handle(self, request: Request) -> Response:
        engine, limits = self.engine, self.limits
        try:
            body = parse_json_body(await request.body(), limits.max_json_depth)
            req = parse_chat_request(body, self.models, limits.max_prompt_chars, self.chat, defer_remote=True)
            await req.fetch_media()  # remote images (--allowed-media-domains), without blocking the loop
            req.prompt_tokens = prompt_token_count(engine, self.outputs, req.prompt)
            check_context(engine, self.outputs, req.prompt_tokens, req.max_tokens, "messages")
            final = self.final_stage_for(req)
            map_chat_sampling(req, engine.stage_params, final_stage_ids=engine.final_stage_ids,
                              outputs=self.outputs, final_stage_id=final)
        except BadRequest as exc:
            return self.bad(exc)
        handle = await self.admit(req.payload(), final_stage_id=final, sampling=req.sampling,
                                  want_timings=not req.stream, priority=req.priority)
        if isinstance(handle, JSONResponse):
            return handle
        if req.stream:
            self.front.count(CHAT, 200)
            return SSEResponse(self.events(req, handle), on_disconnect=self.disconnected)
        result = await self.wait(partial(self.answer, req, handle), request)  # 499 if the client left first
        return result if isinstance(result, Response) else self.ok(JSONResponse(result))

    async def answer(self, req: ChatRequest, handle: AsyncRequestHandle) -> dict[str, Any] | OrchError:
        """The non-streamed completion, or the request's error terminal."""
        cs = ChatStream(req, self.outputs, self.token_limit)
        try:
            err = await self.collect(handle, cs.add)
        finally:  # cancelled too (the client left): what was generated counts
            self.count_tokens(cs)
        if err is not None:
            return err
        self.observe_rtf(cs, handle)
        out = cs.completion(cs.timings(handle.t_open, time.perf_counter(), handle.timings))
        self.front.count_finished(cs.finish_reason())
        return out

    def count_tokens(self, cs: ChatStream) -> None:
        self.front.count_tokens(cs.usage()["prompt_tokens"], cs.tokens_by_stage)

    def observe_rtf(self, cs: ChatStream, handle: AsyncRequestHandle) -> None:
        rtf = cs.real_time_factor(handle.t_open)
        if rtf is not None:
            self.front.rtf.observe(rtf)

    async def events(self, req: ChatRequest, handle: AsyncRequestHandle) -> AsyncIterator[bytes]:
        cs = ChatStream(req, self.outputs, self.token_limit)
        yield sse(cs.first_chunk())
        gen = handle.batches()
        try:
            async for msgs in gen:  # one HTTP chunk per dispatcher batch
                out = []
                for m in msgs:
                    if isinstance(m, OrchError):
                        out.append(sse(error_body(f"request failed: {m.kind}: {m.message}",
                                                  "server_error", code=m.kind)))
                        break
                    chunk = cs.add(m)
                    if chunk is not None:
                        out.append(sse(chunk))
                    if m.finished:
                        self.observe_rtf(cs, handle)
                        self.front.count_finished(cs.finish_reason())
                        out.append(sse(cs.last_chunk()))
                        if req.include_usage:
                            out.append(sse(cs.usage_chunk()))
                if out:
                    yield b"".join(out)
        except (EngineClosed, ValueError) as exc:
            yield sse(error_body(str(exc), "server_error", code="engine_closed"))
        finally:
            self.count_tokens(cs)
            await gen.aclose()
        yield b"data: [DONE]\n\n"


def _status_routes(engine: Engine, front: FrontMetrics, *, models: ServedModels,
                   outputs: Sequence[str] | None, stage_names: Sequence[str] | None,
                   extra_metrics: Callable[[], ExtraCounters] | None) -> list[BaseRoute]:
    """``/v1/models``, ``/v1/models/{name}``, ``/health``, ``/metrics``, ``/version`` and ``/ping``."""

    async def listing(request: Request) -> Response:
        return JSONResponse(models.listing())

    async def model(request: Request) -> Response:
        name = request.path_params["name"]
        if name in models.names:
            return JSONResponse(models.card(name))
        return JSONResponse(error_body(f"The model `{name}` does not exist", "invalid_request_error",
                                       "model", "model_not_found"), status_code=404)

    async def version(request: Request) -> Response:
        return JSONResponse({"version": __version__})

    async def ping(request: Request) -> Response:
        return Response(status_code=200)

    async def health(request: Request) -> Response:
        stats = await engine.stats_async()
        stages = [{"stage": k, "live": live, "total": total, "available": live > 0, **stats.stage_health(k)}
                  for k, (live, total) in enumerate(stats.replicas)]
        if stage_names is not None:
            for st, name in zip(stages, stage_names, strict=False):
                st["name"] = name
        body: dict[str, Any] = {"stages": stages, "stages_available": list(stats.stage_available),
                                "active_requests": stats.active_requests,
                                "queued_requests": stats.queued_requests + stats.admission_waiting}
        down = [k for k, a in enumerate(stats.stage_available) if not a]
        suspect = [k for k in stats.suspect_stages if k not in down]  # no replica is making progress
        if front.draining or stats.draining:
            status = "draining"
        elif not stats.running:
            return JSONResponse({"status": "down", "reason": engine.closed_reason}, status_code=503)
        elif down or suspect:
            status = "degraded"
            body["unavailable_stages"] = down
            if suspect:
                body["suspect_stages"] = suspect
        else:
            status = "ok"
        return JSONResponse({"status": status, **body}, status_code=200 if status == "ok" else 503)

    async def metrics(request: Request) -> Response:
        stats = await engine.stats_async()
        extra = extra_metrics() if extra_metrics is not None else None
        return Response(render(stats, front, extra, outputs), media_type=CONTENT_TYPE)

    return [Route("/v1/models", listing, methods=["GET"]),
            Route("/v1/models/{name:path}", model, methods=["GET"]),
            Route("/health", health, methods=["GET"]), Route("/metrics", metrics, methods=["GET"]),
            Route("/version", version, methods=["GET"]), Route("/ping", ping, methods=["GET"])]


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    return JSONResponse(error_body(exc.detail, "invalid_request_error"), status_code=exc.status_code)


def create_app(engine: Engine, *, model_name: str | Sequence[str] = "trio-orch",
               extra_metrics: Callable[[], ExtraCounters] | None = None,
               outputs: Sequence[str] | None = None, limits: HTTPLimits | None = None,
               front: FrontMetrics | None = None, token_limit: int | None = None,
               stage_names: Sequence[str] | None = None, admin_token: str | None = None,
               api_key: str | None = None, chat_input: ChatInput | None = None) -> Starlette:
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
    pipeline's stages encode.
    """
    limits = limits or HTTPLimits()
    front = front if front is not None else FrontMetrics()
    models = ServedModels(model_name, max_model_len=context_length(engine, outputs))  # created: now
    auth = AdminAuth(admin_token) if admin_token else None
    guards: tuple[Guard, ...] = tuple(g for g in (ApiKeyAuth(api_key) if api_key else None, auth)
                                      if g is not None)
    text = text_stage(engine.final_stage_ids, outputs)
    if text is not None:
        front.expect_stage(text)  # its generated tokens are shown from the start, at 0
    kinds = [p.name for p in engine.stage_params] if engine.stage_params is not None else None
    chat_input = (chat_input or ChatInput()).for_kinds(kinds)
    chat = ChatCompletions(engine, models=models, outputs=outputs, limits=limits, front=front,
                           token_limit=token_limit, chat=chat_input)
    routes: list[BaseRoute] = [
        chat.route(),
        image_route(engine, models=models, outputs=outputs, front=front, limits=limits),
        *openai_routes(engine, models, outputs=outputs, limits=limits, front=front, token_limit=token_limit,
                       chat=chat_input),
        realtime_route(engine, outputs, models=models, front=front),
        *_status_routes(engine, front, models=models, outputs=outputs, stage_names=stage_names,
                        extra_metrics=extra_metrics),
        *admin_routes(engine, auth),
    ]
    shedder = Shedder(lambda: engine.shedding, GENERATION_PATHS, front, engine.retry_after,
                      capacity=lambda: engine.capacity)
    return Starlette(routes=routes, exception_handlers={HTTPException: _http_error},
                     middleware=[Middleware(WebSocketGuard, guards=guards, front=front),
                                 Middleware(LimitsMiddleware, limits=limits, front=front, shedder=shedder,
                                            guards=guards)])
