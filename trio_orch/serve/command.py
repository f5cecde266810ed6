"""``trio-orch serve``: the flags, turned into the options of one of two fronts serving the HTTP app.

``--loop asyncio`` (:mod:`trio_orch.serve.asyncio_front`): uvicorn on an
asyncio loop in the main thread; the orchestrator and its pipeline run in the
:class:`~trio_orch.engine.ThreadEngine`'s Trio thread.  ``--loop trio``
(:mod:`trio_orch.serve.trio_front`): the project's lean HTTP server and the
:class:`~trio_orch.engine.TrioEngine` in one Trio run, no thread between
them.  This module only reads and checks the command line and makes a
:class:`~trio_orch.serve.options.ServeOptions` of it (the pipeline, the
engine's options, the HTTP limits -- ``max_connections`` resolved once, for
either server --, the listening socket, the app); each front's ``serve``
does the rest, and the :class:`~trio_orch.serve.options.ServeOutcome` it
returns becomes the exit code here, the same way for both.

Drain (both fronts): the first SIGTERM or SIGINT stops accepting work (``/health`` and new
requests answer 503 ``draining``; the listening socket stays open so a load
balancer sees it), lets in-flight requests finish for up to
``--shutdown-timeout`` seconds, gives the rest their ``shutdown`` terminal,
stops the workers, then the HTTP server.  A second signal ends the drain at
once; a third exits without waiting.  Exit codes, as uvicorn's and ``vllm
serve``'s (the same for both fronts): 0 stopped after a clean drain (every
request in flight answered; also a stop before anything was served), 1 the
drain was cut short (a second signal, or requests still in flight at
``--shutdown-timeout``) or the engine failed (at startup or on its own while
serving), 2 bad command line or config.

vLLM's own flags, under their names and meanings, are
:mod:`trio_orch.serve.vllm_flags`'s; so is the refusal of those that mean
nothing here.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import signal
import socket
import sys
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any

from stages.config import PIPELINES
from stages.placement import check_devices, device_arg
from stages.registry import outputs_of, text_stage
from stages.schema import positive_seconds_arg, seconds_arg
from trio_orch.cluster.distributed import add_arguments as add_distributed_arguments
from trio_orch.engine import EngineClient
from trio_orch.engine.base import as_spec
from trio_orch.http.access import ACCESS_LOGGER
from trio_orch.http.app import create_app
from trio_orch.http.generation import REQUESTS_LOGGER, CutPrompt
from trio_orch.http.limits import HTTPLimits
from trio_orch.http.metrics import ExtraCounters, FrontMetrics
from trio_orch.openai.chat_template import ChatInput, ChatTemplate
from trio_orch.openai.media import MediaPolicy
from trio_orch.serve import credentials, vllm_flags
from trio_orch.serve.checkpoint import (
    add_model_arguments,
    add_stage_config_argument,
    checkpoint_template,
    describe,
    pipeline_config,
    resolve_model,
)
from trio_orch.serve.connection_limits import default_max_connections
from trio_orch.serve.options import ServeOptions, ServeOutcome
from trio_orch.serve.throughput import INTERVAL, STATS_LOGGER
from trio_orch.serve.vllm_flags import Refused, ServerFlags

__all__ = ["DEFAULT_LOOP", "configure", "front_app", "parse", "run"]

#: the front ``serve`` runs without ``--loop`` (chosen from ``trio-orch bench --serving``: docs/operating.md)
DEFAULT_LOOP = "asyncio"

log = logging.getLogger("trio_orch.serve")



def configure(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Serve the pipeline over HTTP in OpenAI's and vLLM's dialect (docs/openai-compat.md): "
        "POST /v1/chat/completions (stream: true for server-sent events; modalities [\"text\"] or "
        "[\"text\", \"audio\"], audio as base64 16-bit PCM at 24 kHz), POST /v1/completions, "
        "POST /v1/audio/speech, POST /v1/images/generations (an image pipeline), POST /tokenize and "
        "/detokenize, the /v1/realtime WebSocket session (OpenAI's Realtime protocol, as the openai "
        "SDK's realtime.connect speaks it), GET /v1/models, /health, /metrics (Prometheus, vLLM's "
        "vllm:* names too), /version, /ping, /openapi.json and /docs. A 'vllm serve' launch line "
        "works with the command's name changed: vLLM's flags below keep their meaning, one that means "
        "nothing here is an error saying why, $VLLM_API_KEY is read. --loop trio: the HTTP server "
        "(Starlette on the project's lean Trio server) runs in the orchestrator's own Trio run; "
        "--loop asyncio (default): "
        "uvicorn on asyncio in the main thread, the orchestrator in a Trio thread. "
        "Default pipeline: the stage-worker processes thinker -> talker -> code2wav (random-weight toys); "
        "'serve MODEL_DIR' serves a local Hugging Face checkpoint instead, as 'vllm serve' does "
        "(docs/models.md). SIGTERM or Ctrl-C "
        "drains (see --shutdown-timeout); exit codes: 0 stopped after a clean drain, 1 the drain was cut "
        "short or the engine failed, 2 usage or config error.")
    parser.allow_abbrev = False  # --model is never a prefix of --model-name, nor any flag of another
    add_model_arguments(parser, positional=True)
    parser.set_defaults(loop_given=False)
    parser.add_argument("--loop", choices=["trio", "asyncio"], default=DEFAULT_LOOP, action=_Given,
                        help="trio: the project's lean HTTP/1.1 + WebSocket server (h11, wsproto; each "
                             "streamed chunk written straight to the socket) runs inside the "
                             "orchestrator's own Trio run, no thread between them; asyncio: uvicorn on "
                             "asyncio in the main thread, the orchestrator in a Trio thread behind the "
                             f"thread bridge (default {DEFAULT_LOOP}; see docs/operating.md: Two fronts)")
    parser.add_argument("--api-server-count", "-asc", type=int, default=1, metavar="N",
                        help="HTTP front processes (API servers), as vLLM's flag: with N > 1 this process "
                             "runs the orchestrator and its workers and serves no HTTP; N processes it "
                             "launches serve the app on the same port, each talking to it over ZeroMQ, so "
                             "HTTP, JSON and SSE work spreads over N cores (each serves the app with "
                             "--loop; --loop trio is the default then; default 1: one process does "
                             "everything; docs/operating.md)")
    parser.add_argument("--http-server", action=Refused, says="was removed", help=argparse.SUPPRESS,
                        why="--loop trio serves with the project's lean HTTP server, the only one "
                            "it has now (docs/operating.md)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="TCP port (default 8000; 0 picks a free one)")
    parser.add_argument("--config", default=None, metavar="FILE",
                        help="pipeline config TOML (default: the built-in 3-stage worker pipeline)")
    add_stage_config_argument(parser)
    parser.add_argument("--pipeline", choices=list(PIPELINES), default=None,
                        help="a built-in pipeline: speech (default), speech-pd, text2image (serves POST "
                             "/v1/images/generations), omni-in (chat with images and audio in, text out); "
                             "one pipeline per server process")
    parser.add_argument("--in-process", action="store_true",
                        help="serve a toy in-process pipeline instead (no worker processes, no torch)")
    parser.add_argument("--device", type=device_arg, default=None, metavar="cpu|cuda|cuda:N",
                        help="torch device of every worker, over the config's own placement (default: "
                             "the config's; cpu). A worker on cuda:N sees only that GPU (docs/models.md)")
    parser.add_argument("--replicas", type=int, default=None, help="worker processes per stage")
    parser.add_argument("--async-chunk", action="store_true", default=None,
                        help="stream chunks stage to stage (first audio comes earlier)")
    parser.add_argument("--served-model-name", "--model-name", dest="served_model_name", nargs="+",
                        default=None, metavar="NAME",
                        help="the model name(s) clients may ask for, as vLLM's flag: /v1/models lists them, "
                             "a request naming another model gets 404 model_not_found, answers carry the "
                             "first (default: the checkpoint's MODEL_DIR as given, as vLLM's; without one "
                             "trio-orch; --model-name is the same flag)")
    api_key, admin_token = credentials.SECRETS
    credentials.add_arguments(parser, api_key, "require 'Authorization: Bearer KEY' on every route but "
                              "/health, /metrics, /version, /ping, /openapi.json and /docs (and CORS "
                              "preflights), else 401 (/admin keeps its own token)", "open")
    credentials.add_arguments(parser, admin_token, "serve the control plane under /admin/... (stats, pause, "
                              "sleep, weight reload, profiling; 'trio-orch ctl' is its client), each call "
                              "needing 'Authorization: Bearer TOKEN'", "no /admin")
    parser.add_argument("--request-timeout", type=seconds_arg, default=300.0,
                        help="seconds a request may take in the orchestrator before it ends with a "
                             "timeout error and is aborted on every stage (default 300; 0: no limit)")
    parser.add_argument("--startup-timeout", type=positive_seconds_arg, default=120.0,
                        help="seconds to wait for the pipeline to become ready (default 120)")
    parser.add_argument("--shutdown-timeout", type=seconds_arg, default=30.0,
                        help="on SIGTERM/SIGINT, seconds in-flight requests may still take before they "
                             "get their shutdown error (default 30)")
    parser.add_argument("--max-restarts", type=int, default=5,
                        help="restarts of one worker replica within --restart-window before it is "
                             "given up (default 5; see docs/fault-tolerance.md)")
    parser.add_argument("--restart-window", type=positive_seconds_arg, default=60.0,
                        help="seconds of the restart-intensity window (default 60)")
    parser.add_argument("--max-retries", type=int, default=None, metavar="N",
                        help="times a request is resent when the replica holding it dies before "
                             "answering it (default: the config's [pipeline] max_retries, 1; 0: off)")
    add_distributed_arguments(parser)
    vllm_flags.add_arguments(parser)
    a = parser.add_argument_group("admission control (see docs/operating.md)")
    a.add_argument("--max-inflight", type=int, default=None, metavar="N",
                   help="admitted requests per live replica that may still have to pass a stage, for "
                        "every stage (default: each stage's max_inflight, else its max_batch, 32; "
                        "0: no bound)")
    a.add_argument("--request-queue-size", type=int, default=32,
                   help="admitted requests that may wait for room to start (default 32; 0: none -- a "
                        "request that cannot start at once is shed)")
    a.add_argument("--priority-aging", type=positive_seconds_arg, default=None, metavar="SECONDS",
                   help="seconds of waiting in the start queue that count as one priority level: a "
                        "request of priority p is passed only by more urgent ones (priority q) queued "
                        "less than (p - q + 1) x this after it, so none starves (default 1)")
    a.add_argument("--admission-timeout", type=seconds_arg, default=0.0,
                   help="seconds a request may wait for a place in that queue before it is shed with "
                        "429 (default 0: shed at once; a short wait smooths bursts, admitted requests "
                        "pay for it in latency)")
    h = parser.add_argument_group(
        "HTTP limits", "the same flag means the same on both fronts; the connection limits are each "
        "server's own settings (docs/operating.md). --max-accept-wait is gone with the acceptor process "
        "that applied it: giving it is an error")
    d = HTTPLimits()
    h.add_argument("--max-body-bytes", type=int, default=d.max_body_bytes,
                   help=f"largest request body, else 413 (default {d.max_body_bytes})")
    h.add_argument("--max-prompt-chars", type=int, default=d.max_prompt_chars,
                   help=f"longest prompt built from the messages, else 400 (default {d.max_prompt_chars})")
    h.add_argument("--max-body-reads", type=int, default=d.max_body_reads,
                   help="request bodies read at once; the others wait, unread, within --body-timeout "
                        f"(bounds the memory of an upload flood; default {d.max_body_reads})")
    h.add_argument("--body-timeout", type=positive_seconds_arg, default=d.body_timeout,
                   help=f"seconds to receive a request body, else 408 (default {d.body_timeout:g})")
    h.add_argument("--min-body-rate", type=int, default=d.min_body_rate, metavar="BYTES_PER_S",
                   help="bytes a second a request body must keep up, measured over "
                        f"{d.body_rate_window:g}s windows after the first, else 408 and its read slot "
                        f"freed (a slow sender cannot hold one; 0: no minimum; default {d.min_body_rate})")
    h.add_argument("--header-timeout", type=positive_seconds_arg, default=d.header_timeout,
                   help="seconds a connection may take to send a complete request head, from connecting "
                        "or from its previous answer, before it is closed (default "
                        f"{d.header_timeout:g})")
    h.add_argument("--keep-alive-timeout", type=positive_seconds_arg, default=d.keep_alive_timeout,
                   help=f"seconds an idle keep-alive connection is kept (default {d.keep_alive_timeout:g})")
    h.add_argument("--max-head-bytes", type=int, default=d.max_head_bytes,
                   help=f"largest request head (request line and headers), else 431 (default "
                        f"{d.max_head_bytes})")
    h.add_argument("--backlog", type=int, default=d.backlog,
                   help=f"connections the kernel queues before they are accepted (default {d.backlog})")
    h.add_argument("--max-connections", type=int, default=None,
                   help="open connections; past it a new request gets 503 (--loop asyncio: uvicorn's "
                        "limit_concurrency, which counts requests in progress too; --loop trio: the "
                        "lean server's own count; default: the file-descriptor limit minus 1024)")
    h.add_argument("--max-accept-wait", action=Refused, says="was removed", help=argparse.SUPPRESS,
                   why="it went with the acceptor process that applied it; the shedder still "
                       "answers 429 before a request body is read (docs/operating.md)")
    c = parser.add_argument_group("chat input (docs/openai-compat.md: Chat templates, images and audio)")
    c.add_argument("--chat-template", default=None, metavar="FILE",
                   help="Jinja chat template that makes the messages one prompt, as vLLM's flag: a file, "
                        "or the template itself (for chat and /tokenize; default: a checkpoint's own, "
                        "else the built-in 'role: content' lines ending 'assistant:')")
    c.add_argument("--allowed-local-media-path", default=None, metavar="DIR",
                   help="let image_url parts name file:// images inside DIR (default: none)")
    c.add_argument("--allowed-media-domains", nargs="+", default=None, metavar="HOST",
                   help="let image_url parts name http(s) URLs on these hosts (exact host names or IPs, "
                        "as vLLM's flag), fetched by the server; a redirect to another host is refused "
                        "(default: none -- unlike vLLM, which then fetches from any host -- remote "
                        "URLs are refused: send data: URLs)")


class _Given(argparse.Action):
    """Store the value and remember it was given (``loop_given``): a default may follow other flags."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        setattr(namespace, self.dest, values)
        namespace.loop_given = True


def _check_args(args: argparse.Namespace) -> tuple[HTTPLimits, ServerFlags]:
    """The HTTP limits from the command line (``max_connections`` resolved) and vLLM's server flags;
    ValueError for a bad value."""
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be 0..65535 (0: a free one), got {args.port}")
    if args.request_queue_size < 0:
        raise ValueError("--request-queue-size must be >= 0")
    if args.max_inflight is not None and args.max_inflight < 0:
        raise ValueError("--max-inflight must be >= 0 (0: no bound)")
    if args.max_retries is not None and args.max_retries < 0:
        raise ValueError("--max-retries must be >= 0 (0: no failover)")
    if args.replicas is not None and args.replicas < 1:
        raise ValueError("--replicas must be >= 1")
    if args.api_server_count < 1:
        raise ValueError("--api-server-count must be >= 1")
    if args.api_server_count > 1 and not args.loop_given:
        args.loop = "trio"  # API-server processes are Trio fronts unless --loop asyncio says otherwise
    if args.served_model_name is not None and not all(args.served_model_name):
        raise ValueError("--served-model-name: a name may not be empty")
    resolve_model(args)
    flags = vllm_flags.check(args)
    if args.seed is not None and args.in_process:
        raise ValueError("--seed seeds a worker pipeline: the in-process toy pipeline has none")
    credentials.resolve(args)  # the API key and admin token: flag, file, systemd credential, environment
    # one limit on connections for either server: the flag's, else what the fd limit leaves room for
    max_connections = args.max_connections or default_max_connections()
    return HTTPLimits(max_body_bytes=args.max_body_bytes, max_body_reads=args.max_body_reads,
                      max_prompt_chars=args.max_prompt_chars,
                      body_timeout=args.body_timeout, min_body_rate=args.min_body_rate,
                      header_timeout=args.header_timeout,
                      keep_alive_timeout=args.keep_alive_timeout, max_connections=max_connections,
                      backlog=args.backlog, max_head_bytes=args.max_head_bytes), flags


def _chat_input(args: argparse.Namespace) -> ChatInput:
    """The chat template and media policy from the command line; ValueError naming a bad file or folder."""
    template = ChatTemplate.from_arg(args.chat_template) if args.chat_template else _model_template(args)
    root = Path(args.allowed_local_media_path) if args.allowed_local_media_path else None
    try:
        media = MediaPolicy(allowed_local_media_path=root,
                            allowed_media_domains=frozenset(args.allowed_media_domains or ()))
    except ValueError as exc:
        flag = "--allowed-media-domains" if "media domain" in str(exc) else "--allowed-local-media-path"
        raise ValueError(f"{flag}: {exc}") from None
    return ChatInput(template, media)


def _model_template(args: argparse.Namespace) -> ChatTemplate:
    """The checkpoint's chat template (the built-in one without a checkpoint, or for one that has none)."""
    found = checkpoint_template(args.model_dir) if args.model_dir else None
    if args.model_dir and found is None:
        log.warning("%s has no chat template: chat uses the built-in 'role: content' one (give "
                    "--chat-template)", args.model_dir)
    return found or ChatTemplate()


def _with_options(factory: Any, **options: Any) -> Any:
    """``factory`` whose pipeline spec carries ``options`` for its orchestrator too."""
    @asynccontextmanager
    async def with_options() -> AsyncIterator[Any]:
        async with factory() as raw:
            spec = as_spec(raw)
            spec.options.update(options)
            yield spec

    return with_options


class _Pipeline:
    """What serve runs: the factory, its description and what the front needs to know of it."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.chat_input = _chat_input(args)
        self.supervisor: Any = None
        self.registrar: Any = None
        if args.in_process:
            if args.stage_config:
                raise ValueError("--stage-config places worker stages: --in-process has none")
            from trio_orch.testing.toy_pipeline import toy_pipeline

            self.factory: Any = toy_pipeline()
            if args.max_retries is not None:  # honoured as for workers (toy stages never die, though)
                self.factory = _with_options(self.factory, max_retries=args.max_retries)
            self.what = "in-process toy pipeline (thinker -> talker -> vocoder, no workers)"
            self.outputs: list[str] | None = None
            self.names: list[str] | None = ["toy thinker", "toy talker", "toy vocoder"]
            bound = 32 if args.max_inflight is None else args.max_inflight or None
            self.max_inflight: list[int | None] = [bound] * 3
            self._aging(args)
            return
        from trio_orch.cluster.distributed import head_options, open_head_pipeline
        from trio_orch.cluster.supervisor import RestartPolicy

        cfg = pipeline_config(args)  # the checkpoint's, --config's or built-in; --stage-config over it
        if args.seed is not None:
            cfg = cfg.with_overrides(seed=args.seed)  # vLLM's --seed
        policy = RestartPolicy(max_restarts=args.max_restarts, window=args.restart_window)
        opts, local_cfg = head_options(args, cfg)
        check_devices(local_cfg.devices())  # every local replica's device exists here: exit 2 if not
        what = describe(cfg) if args.model_dir else (
            f"worker pipeline {' -> '.join(s.label for s in cfg.stages)} on {cfg.where()}")
        self.what = f"{what} (supervised)"
        self.outputs = outputs_of(s.kind for s in cfg.stages)
        self.names = [s.label for s in cfg.stages]
        self.max_inflight = (cfg.admission_bounds(serving=True) if args.max_inflight is None
                             else [args.max_inflight or None] * len(cfg.stages))

        @asynccontextmanager
        async def factory() -> AsyncIterator[Any]:
            # dead or hung local workers are restarted; with --listen, replicas may join over TCP;
            # --loop trio, and a head of API-server processes, take SIGTERM in their own run (a drain)
            own_run = args.loop == "trio" or args.api_server_count > 1
            async with open_head_pipeline(local_cfg, opts, full_config=cfg, policy=policy,
                                          handle_sigterm=not own_run) as pipe:
                self.supervisor = pipe.supervisor
                self.registrar = pipe.registrar
                yield pipe

        self.factory = factory
        self._aging(args)

    def _aging(self, args: argparse.Namespace) -> None:
        if args.priority_aging is not None:
            self.factory = _with_options(self.factory, priority_aging=args.priority_aging)

    def extra_metrics(self) -> dict[str, Any]:
        out = self.supervisor.prometheus_counters() if self.supervisor is not None else {}
        if self.registrar is not None:
            from trio_orch.cluster.registrar import prometheus_counters

            out.update(prometheus_counters(self.registrar))
        return out

    def token_limit(self, engine: EngineClient) -> int | None:
        """The text stage's own cap on generated tokens, from its workers' ready handshake."""
        k = text_stage(engine.final_stage_ids, self.outputs)
        if k is None:
            return None
        limit = engine.stage_info(k).get("max_new_tokens")
        return limit if isinstance(limit, int) else None


def run(args: argparse.Namespace) -> int:
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _interrupt)  # until serving: a SIGTERM is a Ctrl-C (nothing to drain)
    try:
        return _run(args)
    except KeyboardInterrupt:  # before anything was served: nothing was accepted, nothing lost
        print("interrupted before serving: stopped", file=sys.stderr, flush=True)
        return 0


def _run(args: argparse.Namespace) -> int:
    """``run`` once SIGTERM is a Ctrl-C: check, listen, start the front, map its outcome to the exit code."""
    try:
        limits, flags = _check_args(args)
        pipeline = _Pipeline(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    sock = socket.socket(socket.AF_INET6 if ":" in args.host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((args.host, args.port))
        sock.listen(limits.backlog)  # connections queue from now on, before the server starts accepting
    except OSError as exc:
        sock.close()
        print(f"error: cannot listen on {args.host}:{args.port}: {exc}", file=sys.stderr)
        return 2
    _configure_logging(flags)
    options = ServeOptions(
        pipeline=pipeline.factory, make_app=partial(_app, args, pipeline, limits, flags), sock=sock,
        limits=limits, startup_timeout=args.startup_timeout, shutdown_timeout=args.shutdown_timeout,
        announce=partial(_announce, pipeline, args.api_key is not None, flags),
        engine=_engine_options(args, pipeline), log_level=args.uvicorn_log_level,
        stats_interval=INTERVAL if flags.log_stats else None, ssl=flags.ssl)
    print(f"starting {pipeline.what} ...", flush=True)
    try:
        if args.api_server_count > 1:
            out = _serve_with_fronts(args, options)
        else:  # each front imports its own server only when it runs
            out = importlib.import_module(f"trio_orch.serve.{args.loop}_front").serve(options)
    finally:
        sock.close()
    return _exit_code(out)


def _serve_with_fronts(args: argparse.Namespace, options: ServeOptions) -> ServeOutcome:
    """The head of ``--api-server-count N``: the engine here, N launched processes serving the app."""
    from trio_orch.cluster.supervisor import RestartPolicy
    from trio_orch.serve.fronts import head

    argv = sys.argv[sys.argv.index("serve") + 1:] if "serve" in sys.argv else []
    fronts = head.FrontsConfig(args.api_server_count, argv, args.api_key, args.admin_token,
                               RestartPolicy(max_restarts=args.max_restarts, window=args.restart_window),
                               log_level=logging.getLogger().getEffectiveLevel(), loop=args.loop)
    return head.serve(options, fronts)


def parse(argv: list[str]) -> argparse.Namespace:
    """``serve``'s arguments parsed as the command does (an API-server process builds its app from them)."""
    parser = argparse.ArgumentParser(prog="trio-orch serve")
    configure(parser)
    return parser.parse_args(argv)


def front_app(args: argparse.Namespace) -> tuple[HTTPLimits, Callable[..., Any], dict[str, Any] | None]:
    """The HTTP limits, the app factory (``make_app(engine, front, server_counters)``) and uvicorn's TLS
    settings (``--loop asyncio``; None: plain HTTP) of ``args``: what an API-server process serves, the
    same app as a single-process ``serve`` (ValueError if bad)."""
    limits, flags = _check_args(args)
    pipeline = _Pipeline(args)
    return limits, partial(_app, args, pipeline, limits, flags), flags.ssl


def _exit_code(out: ServeOutcome) -> int:
    """What the command says, and its exit code, for how a front's run ended (the same for both):
    uvicorn's and vLLM's -- 0 after a clean drain, 1 for a drain cut short or an engine failure."""
    if out.startup_error is not None:
        print(f"error: {out.startup_error}", file=sys.stderr)
        return 1
    if not out.served:
        print("interrupted while starting: stopped", file=sys.stderr, flush=True)
        return 0  # nothing was accepted, nothing was lost
    if out.died is not None:
        print(f"error: the engine stopped on its own ({out.died}); the server stopped with it",
              file=sys.stderr)
        return 1
    if out.unfinished or len(out.stopped_by) > 1:
        why = "a second signal" if len(out.stopped_by) > 1 else "--shutdown-timeout"
        print(f"stopped: the drain was cut short by {why}: {out.unfinished} request(s) ended unanswered "
              "(their terminal: shutdown)", file=sys.stderr, flush=True)
        return 1
    print("stopped", flush=True)
    return 0


def _configure_logging(flags: ServerFlags) -> None:
    """vLLM's logging flags: the HTTP server's level (the access log's too), the request log and its
    length, the throughput line (at info, as vLLM's, whatever -v says)."""
    level = flags.log_level
    for name in ("uvicorn", "uvicorn.error", "trio_orch.serve.trio_http", ACCESS_LOGGER):
        logging.getLogger(name).setLevel(level)
    logging.getLogger(STATS_LOGGER).setLevel(logging.INFO)
    requests = logging.getLogger(REQUESTS_LOGGER)
    requests.setLevel(logging.INFO if flags.log_requests else logging.WARNING)
    if flags.max_log_len is not None:
        requests.addFilter(CutPrompt(flags.max_log_len))


def _app(args: argparse.Namespace, pipeline: _Pipeline, limits: HTTPLimits, flags: ServerFlags,
         engine: EngineClient, front: FrontMetrics, server_counters: Callable[[], ExtraCounters]) -> Any:
    """The one app both fronts serve (:func:`~trio_orch.http.app.create_app`), from the command line."""
    def extra_metrics() -> ExtraCounters:
        return {**pipeline.extra_metrics(), **server_counters()}

    return create_app(engine, model_name=args.served_model_name, extra_metrics=extra_metrics,
                      outputs=pipeline.outputs, limits=limits, front=front,
                      token_limit=pipeline.token_limit(engine), stage_names=pipeline.names,
                      admin_token=args.admin_token, api_key=args.api_key, chat_input=pipeline.chat_input,
                      access_log=flags.access_log, cors=flags.cors, root_path=flags.root_path,
                      docs=flags.docs)


def _announce(pipeline: _Pipeline, api_key: bool, flags: ServerFlags, host: str, port: int,
              front: str) -> None:
    """Where it serves, whether the API is open, and its routes."""
    images = pipeline.outputs is not None and "image" in pipeline.outputs
    work = ("POST /v1/images/generations" if images else
            "POST /v1/chat/completions, /v1/completions, /v1/audio/speech, /tokenize, /detokenize; "
            "WS /v1/realtime")
    access = ("the API needs its key: 'Authorization: Bearer KEY'" if api_key else
              "the API is OPEN: no API key (--api-key-file FILE or $VLLM_API_KEY sets one)")
    scheme = "https" if flags.ssl else "http"
    docs = ", /openapi.json, /docs" if flags.docs else ""
    print(f"serving on {scheme}://{host}:{port}{flags.root_path}  ({front}; {access})\n"
          f"  {work}\n"
          f"  GET /v1/models, /health, /metrics{docs}; Ctrl-C or SIGTERM drains and stops", flush=True)


def _engine_options(args: argparse.Namespace, pipeline: _Pipeline) -> dict[str, Any]:
    return {"request_queue_size": args.request_queue_size, "request_timeout": args.request_timeout or None,
            "admission_timeout": args.admission_timeout, "max_waiting": args.request_queue_size,
            "max_inflight": pipeline.max_inflight, "max_running": args.max_num_seqs}


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)
