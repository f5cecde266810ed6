"""The routes that say how the server is: ``/v1/models``, ``/health``, ``/metrics``, ``/version``, ``/ping``.

``GET /v1/models`` (and ``/v1/models/{name}``) list the served model names;
``/health`` says ``ok``, ``degraded`` (a stage has no live replica, or
every replica of one is suspect; per-stage live/total replicas),
``draining`` or ``down``; ``/metrics`` is the Prometheus text of one engine
snapshot and the front's own counters (:mod:`trio_orch.http.metrics`);
``/version`` and ``/ping`` are vLLM's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from trio_orch import __version__
from trio_orch.engine.api import EngineClient
from trio_orch.http.metrics import CONTENT_TYPE, ExtraCounters, FrontMetrics, render
from trio_orch.openai.protocol import ServedModels
from trio_orch.openai.validation import error_body

__all__ = ["status_routes"]


def status_routes(engine: EngineClient, front: FrontMetrics, *, models: ServedModels,
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
