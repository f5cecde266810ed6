"""``trio-orch serve``: an OpenAI-style HTTP front (asyncio, Starlette + uvicorn) over the Trio engine.

The HTTP server runs on an asyncio loop in the main thread; the orchestrator
and its pipeline run in the :class:`~trio_orch.bridge.Engine`'s Trio thread.
Routes: ``POST /v1/chat/completions`` (non-streaming, or SSE with
``"stream": true``; ``modalities`` ``["text"]`` or ``["text", "audio"]``),
``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus text), and
the ``/v1/realtime`` WebSocket session (:mod:`trio_orch.realtime_server`).
A client that goes away -- mid-stream or while waiting for a non-streamed
answer -- aborts its request in the orchestrator.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import socket
import sys
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from stages.registry import text_stage
from trio_orch.bridge import Engine, EngineClosed, EngineStartupError
from trio_orch.config import PIPELINES
from trio_orch.metrics import render_prometheus
from trio_orch.openai_chat import (
    BadRequest,
    ChatRequest,
    ChatStream,
    error_body,
    map_chat_sampling,
    orch_error_status,
    parse_chat_request,
)
from trio_orch.openai_images import add_image_routes
from trio_orch.realtime_server import realtime_route
from trio_orch.types import OrchError

__all__ = ["SSEResponse", "configure", "create_app", "run"]

log = logging.getLogger("trio_orch.server")

PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"


def _sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


async def _until_disconnect(receive: Receive) -> None:
    while True:
        if (await receive())["type"] == "http.disconnect":
            return


class SSEResponse(StreamingResponse):
    """Server-sent events that watch for the client leaving, whatever the ASGI spec version.

    The body and a disconnect watcher race; if the client goes first, the
    body task is cancelled, which cancels the ``engine.generate`` under it
    (and so aborts the request in the orchestrator).
    """

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[bytes], on_disconnect: Any = None) -> None:
        super().__init__(events, 200, {"cache-control": "no-cache", "x-accel-buffering": "no"},
                         self.media_type)
        self.events = events
        self.on_disconnect = on_disconnect

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def pump() -> None:
            await send({"type": "http.response.start", "status": self.status_code,
                        "headers": self.raw_headers})
            async for chunk in self.events:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        body = asyncio.ensure_future(pump())
        watch = asyncio.ensure_future(_until_disconnect(receive))
        client_left = False
        try:
            await asyncio.wait({body, watch}, return_when=asyncio.FIRST_COMPLETED)
            client_left = watch.done() and not body.done()
        finally:
            for t in (body, watch):
                t.cancel()
            await asyncio.gather(body, watch, return_exceptions=True)
            await self.events.aclose()  # type: ignore[attr-defined]
        exc = None if body.cancelled() else body.exception()
        if isinstance(exc, OSError):  # the client went away while we were writing
            client_left = True
        elif exc is not None:
            raise exc
        if client_left and self.on_disconnect is not None:
            self.on_disconnect()


class _Counters:
    """HTTP-side counters; touched only on the event loop."""

    def __init__(self) -> None:
        self.requests: dict[tuple[tuple[str, str], ...], int] = {}
        self.disconnects = 0

    def count(self, route: str, status: int) -> None:
        key = (("route", route), ("status", str(status)))
        self.requests[key] = self.requests.get(key, 0) + 1


def create_app(engine: Engine, *, model_name: str = "trio-orch",
               extra_metrics: Callable[[], dict[str, Any]] | None = None,
               outputs: Sequence[str] | None = None) -> Starlette:
    """The ASGI app over a started :class:`Engine`.

    ``extra_metrics()`` returns more counters for ``/metrics`` (the supervisor's restarts),
    in ``render_prometheus``'s ``extra_counters`` shape.  ``outputs``: each stage's output
    modality (``stages.registry.outputs_of``); None judges outputs by their shape and
    takes stage 0 for text.
    """
    counters = _Counters()

    def error(status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
              code: str | None = None) -> JSONResponse:
        counters.count("/v1/chat/completions", status)
        if status < 500:  # bad client input: say what was refused (counted by status on /metrics)
            log.warning("refused a chat completion request (%d): %s", status, message)
        return JSONResponse(error_body(message, kind, param, code), status_code=status)

    def final_stage_for(req: ChatRequest) -> int | None:
        finals = engine.final_stage_ids
        if req.audio:
            if outputs is not None and not any(outputs[k] in ("audio", "data") for k in finals):
                raise BadRequest("this pipeline has no audio output: ask for modalities [\"text\"]",
                                 "modalities")
            return None
        text = text_stage(finals, outputs)
        if text is None:
            raise BadRequest("this pipeline has no text-only output: "
                             "ask for modalities [\"text\", \"audio\"]", "modalities")
        return text  # text only: the request stops after the stage that gives text

    def disconnected() -> None:
        counters.disconnects += 1
        log.info("a client disconnected before its answer; its request was aborted")

    async def chat_completions(request: Request) -> Response:
        raw = await request.body()
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            return error(400, f"malformed JSON in the request body: {exc}", code="invalid_json")
        try:
            req = parse_chat_request(body, model_name)
            final = final_stage_for(req)
            map_chat_sampling(body, req, engine.stage_params, final_stage_ids=engine.final_stage_ids,
                              outputs=outputs, final_stage_id=final)
        except BadRequest as exc:
            return error(exc.status, str(exc), param=exc.param)
        if not engine.running:
            why = engine.closed_reason or "it has not started"
            return error(503, f"the engine is not running: {why}", "server_error", code="engine_closed")
        if req.stream:
            counters.count("/v1/chat/completions", 200)
            return SSEResponse(_stream(req, final), on_disconnect=disconnected)
        collector = asyncio.ensure_future(_collect(req, final))
        watch = asyncio.ensure_future(_until_disconnect(request.receive))
        try:
            await asyncio.wait({collector, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in (collector, watch):
                t.cancel()
            await asyncio.gather(collector, watch, return_exceptions=True)
        if collector.cancelled():  # the client left first: cancelling the collector aborted the request
            disconnected()
            counters.count("/v1/chat/completions", 499)
            return Response(status_code=499)
        exc = collector.exception()
        if isinstance(exc, EngineClosed):
            return error(503, str(exc), "server_error", code="engine_closed")
        if isinstance(exc, ValueError):
            return error(400, str(exc))
        if exc is not None:
            raise exc
        result = collector.result()
        if isinstance(result, OrchError):
            return error(orch_error_status(result), f"request failed: {result.kind}: {result.message}",
                         "server_error", code=result.kind)
        counters.count("/v1/chat/completions", 200)
        return JSONResponse(result)

    async def _collect(req: ChatRequest, final: int | None) -> dict[str, Any] | OrchError:
        cs = ChatStream(req, outputs)
        async for m in engine.generate(req.payload(), final_stage_id=final, sampling=req.sampling):
            if isinstance(m, OrchError):
                return m
            cs.add(m)
        return cs.completion()

    async def _stream(req: ChatRequest, final: int | None) -> AsyncIterator[bytes]:
        cs = ChatStream(req, outputs)
        yield _sse(cs.first_chunk())
        try:
            gen = engine.generate_batches(req.payload(), final_stage_id=final, sampling=req.sampling)
            try:
                async for msgs in gen:  # one HTTP chunk per dispatcher batch
                    out = []
                    for m in msgs:
                        if isinstance(m, OrchError):
                            out.append(_sse(error_body(f"request failed: {m.kind}: {m.message}",
                                                       "server_error", code=m.kind)))
                            break
                        chunk = cs.add(m)
                        if chunk is not None:
                            out.append(_sse(chunk))
                        if m.finished:
                            out.append(_sse(cs.last_chunk()))
                            if req.include_usage:
                                out.append(_sse(cs.usage_chunk()))
                    if out:
                        yield b"".join(out)
            finally:
                await gen.aclose()
        except (EngineClosed, ValueError) as exc:
            yield _sse(error_body(str(exc), "server_error", code="engine_closed"))
        yield b"data: [DONE]\n\n"

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [
            {"id": model_name, "object": "model", "created": 0, "owned_by": "trio-orch"}]})

    async def health(request: Request) -> Response:
        stats = await engine.stats_async()
        available = list(stats.stage_available)
        if not stats.running:
            return JSONResponse({"status": "down", "reason": engine.closed_reason}, status_code=503)
        status = "ok" if all(available) else "degraded"
        return JSONResponse({"status": status, "stages_available": available,
                             "active_requests": stats.active_requests},
                            status_code=200 if status == "ok" else 503)

    async def metrics(request: Request) -> Response:
        stats = await engine.stats_async()
        extra = {
            "trio_orch_http_requests": ("chat completion requests by HTTP status", counters.requests),
            "trio_orch_http_client_disconnects": ("clients that left before their answer (request aborted)",
                                                  {(): counters.disconnects}),
        }
        if extra_metrics is not None:
            extra.update(extra_metrics())
        return Response(render_prometheus(stats, engine.latency, extra), media_type=PROMETHEUS_TEXT)

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        return JSONResponse(error_body(exc.detail, "invalid_request_error"), status_code=exc.status_code)

    return Starlette(routes=[
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        realtime_route(engine, outputs),
    ], exception_handlers={HTTPException: http_error})


# ---------------------------------------------------------------------------- the command
def configure(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Serve the pipeline over HTTP in the OpenAI chat-completions shape: POST /v1/chat/completions "
        "(stream: true for server-sent events; modalities [\"text\"] or [\"text\", \"audio\"], audio as "
        "base64 16-bit PCM at 24 kHz), the /v1/realtime WebSocket session (text in while the answer "
        "streams out), GET /health, GET /metrics (Prometheus). The orchestrator runs "
        "in a Trio thread, the HTTP server (Starlette + uvicorn) on asyncio in the main thread. "
        "Default pipeline: the stage-worker processes thinker -> talker -> code2wav.")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="TCP port (default 8000; 0 picks a free one)")
    parser.add_argument("--config", default=None, metavar="FILE",
                        help="pipeline config TOML (default: the built-in 3-stage worker pipeline)")
    parser.add_argument("--pipeline", choices=list(PIPELINES), default=None,
                        help="a built-in pipeline: speech (default), speech-pd, text2image (serves POST "
                             "/v1/images/generations); one pipeline per server process")
    parser.add_argument("--in-process", action="store_true",
                        help="serve a toy in-process pipeline instead (no worker processes, no torch)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default=None,
                        help="torch device of the workers (default: cpu, or the config's)")
    parser.add_argument("--replicas", type=int, default=None, help="worker processes per stage")
    parser.add_argument("--async-chunk", action="store_true", default=None,
                        help="stream chunks stage to stage (first audio comes earlier)")
    parser.add_argument("--model-name", default="trio-orch", help="model id reported to clients")
    parser.add_argument("--request-queue-size", type=int, default=256,
                        help="bound of the orchestrator's request channel (backpressure; default 256)")
    parser.add_argument("--request-timeout", type=float, default=300.0,
                        help="seconds a request may take in the orchestrator before it ends with a "
                             "timeout error and is aborted on every stage (default 300; 0: no limit)")
    parser.add_argument("--startup-timeout", type=float, default=120.0,
                        help="seconds to wait for the pipeline to become ready (default 120)")
    parser.add_argument("--max-restarts", type=int, default=5,
                        help="restarts of one worker replica within --restart-window before it is "
                             "given up (default 5; see docs/fault-tolerance.md)")
    parser.add_argument("--restart-window", type=float, default=60.0,
                        help="seconds of the restart-intensity window (default 60)")


def _pipeline_factory(args: argparse.Namespace) -> tuple[Any, str, list[str] | None]:
    """(factory, description, each stage's output modality or None when judged by shape)."""
    if args.in_process:
        from trio_orch.toy_pipeline import toy_pipeline

        return toy_pipeline(), "in-process toy pipeline (thinker -> talker -> vocoder, no workers)", None
    from trio_orch.config import builtin_config, load_config
    from trio_orch.supervisor import RestartPolicy, supervised_pipeline

    if args.config and args.pipeline:
        raise ValueError("give --config or --pipeline, not both")
    cfg = load_config(args.config) if args.config else builtin_config(args.pipeline or "speech")
    cfg = cfg.with_overrides(async_chunk=args.async_chunk, replicas=args.replicas, device=args.device)
    kinds = " -> ".join(s.label for s in cfg.stages)
    policy = RestartPolicy(max_restarts=args.max_restarts, window=args.restart_window)

    @asynccontextmanager
    async def factory() -> AsyncIterator[Any]:
        async with supervised_pipeline(cfg, policy) as pipe:  # dead or hung workers are restarted
            _supervisors[:] = [pipe.supervisor]
            yield pipe

    return factory, f"worker pipeline {kinds} on {cfg.device} (supervised)", cfg.outputs()


_supervisors: list[Any] = []  # the running pipeline's supervisor, for /metrics


def _supervisor_metrics() -> dict[str, Any]:
    return _supervisors[0].prometheus_counters() if _supervisors else {}


def run(args: argparse.Namespace) -> int:
    import uvicorn

    try:
        factory, what, outputs = _pipeline_factory(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    sock = socket.socket(socket.AF_INET6 if ":" in args.host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((args.host, args.port))
        sock.listen(2048)  # connections queue from now on, before uvicorn starts accepting
    except OSError as exc:
        print(f"error: cannot listen on {args.host}:{args.port}: {exc}", file=sys.stderr)
        return 2
    print(f"starting {what} ...", flush=True)
    engine = Engine(factory, startup_timeout=args.startup_timeout,
                    request_queue_size=args.request_queue_size, request_timeout=args.request_timeout or None)
    try:
        engine.start()
    except EngineStartupError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sock.close()
        return 1
    host, port = sock.getsockname()[:2]
    route = "/v1/images/generations" if outputs and "image" in outputs else "/v1/chat/completions"
    print(f"serving on http://{host}:{port}  (POST {route}, WS /v1/realtime, GET /health, "
          "GET /metrics; "
          "Ctrl-C stops)", flush=True)
    app = create_app(engine, model_name=args.model_name, extra_metrics=_supervisor_metrics, outputs=outputs)
    add_image_routes(app, engine, model_name=args.model_name, outputs=outputs)
    level = logging.getLogger().getEffectiveLevel()
    config = uvicorn.Config(app, log_level="info" if level <= logging.INFO else "warning",
                            lifespan="off", timeout_graceful_shutdown=5)
    # uvicorn shuts down gracefully on SIGINT/SIGTERM, then re-raises the signal with the
    # previous handlers restored: make those raise, so the engine (and its workers) always stop.
    previous = {sig: signal.signal(sig, _stop_serving) for sig in (signal.SIGINT, signal.SIGTERM)}
    server = uvicorn.Server(config)
    stopping = threading.Event()
    died: list[str] = []
    threading.Thread(target=watch_engine, args=(engine, server, stopping, died), daemon=True,
                     name="trio-orch-engine-watch").start()
    try:
        server.run(sockets=[sock])
    except _StopServing:
        pass
    finally:
        stopping.set()
        for sig in previous:  # a second Ctrl-C must not abort the (bounded) cleanup: workers would leak
            signal.signal(sig, signal.SIG_IGN)
        print("stopping the engine ...", flush=True)
        engine.close()
        sock.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if died:
        print(f"error: the engine stopped on its own ({died[0]}); the server stopped with it",
              file=sys.stderr)
        return 1
    print("stopped", flush=True)
    return 0


def watch_engine(engine: Engine, server: Any, stopping: threading.Event, died: list[str]) -> None:
    """If the engine thread ends while we serve (a crash), stop the HTTP server too: exit 1.

    Serving only 503s would hide the failure from whoever restarts the process.
    """
    engine.join()
    if not stopping.is_set():
        died.append(engine.closed_reason or "its thread exited")
        server.should_exit = True


class _StopServing(Exception):
    pass


def _stop_serving(signum: int, frame: Any) -> None:
    raise _StopServing(signal.Signals(signum).name)
