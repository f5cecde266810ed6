"""``vllm serve``'s flags: those that mean something here, under their vLLM names, and those that do not.

A launch line written for ``vllm serve`` runs as ``trio-orch serve`` with the
command's name changed.  :func:`add_arguments` gives ``serve`` every vLLM flag
that has a meaning here, with vLLM's meaning and default (the scheduler's
``--max-num-seqs``; uvicorn's log level and access log; the request log;
the stats line; CORS; ``--root-path``; TLS where the front speaks it), and
turns each one that means nothing here (:data:`REFUSED`: tensor parallelism,
the KV-cache pool, quantization, LoRA, ...) into a one-line usage error that
names the flag and says why (exit 2), where argparse would print the usage
and "unrecognized arguments".  A flag or a size that asks for what is done
anyway (:data:`ALREADY`: ``--enforce-eager``, ``--no-enable-prefix-caching``
...; :data:`ONLY_ONE`: ``--tensor-parallel-size 1``) is accepted.  :func:`check` reads the
values that need it (the JSON lists of the CORS flags) into
:class:`ServerFlags`.
"""

from __future__ import annotations

import argparse
import json
import logging
from dataclasses import dataclass
from typing import Any

from trio_orch.http.access import VLLM_CORS, Cors

__all__ = ["ALREADY", "LOG_LEVELS", "ONLY_ONE", "REFUSED", "Refused", "ServerFlags", "add_arguments", "check"]

#: ``--uvicorn-log-level``'s choices (vLLM's), and the logging level each one is
LOG_LEVELS = {"critical": logging.CRITICAL, "error": logging.ERROR, "warning": logging.WARNING,
              "info": logging.INFO, "debug": logging.DEBUG, "trace": 5}

_ONE_PROCESS = "each replica is one worker process on one device: scale a stage with --replicas or its " \
               "replicas in the pipeline config (docs/pipelines.md)"
_NO_KV_POOL = "workers allocate what their model needs: there is no paged KV-cache pool to size here"

#: sizes vLLM splits a model over: 1 is what is done here, anything else is refused
ONLY_ONE = {
    "--tensor-parallel-size": ("-tp", _ONE_PROCESS),
    "--pipeline-parallel-size": ("-pp", _ONE_PROCESS),
    "--data-parallel-size": ("-dp", _ONE_PROCESS),
}

#: vLLM flags that ask for what is done here anyway: accepted, and nothing changes -> why
ALREADY: dict[str, str] = {
    "--enforce-eager": "no CUDA graphs are captured here",
    "--no-enable-prefix-caching": "there is no prefix cache here",
    "--no-enable-chunked-prefill": "a prompt is prefilled in one step here",
    "--disable-custom-all-reduce": "nothing is reduced across devices here",
    "--disable-frontend-multiprocessing": "the HTTP front and the engine share this process here",
}

#: vLLM flags that mean nothing here -> why (a usage error naming the flag, exit 2)
REFUSED: dict[str, str] = {
    "--gpu-memory-utilization": _NO_KV_POOL,
    "--num-gpu-blocks-override": _NO_KV_POOL,
    "--block-size": _NO_KV_POOL,
    "--kv-cache-dtype": _NO_KV_POOL,
    "--swap-space": _NO_KV_POOL,
    "--cpu-offload-gb": _NO_KV_POOL,
    "--enable-prefix-caching": "there is no prefix cache here",
    "--max-num-batched-tokens": "workers batch requests (a stage's max_batch in the pipeline config), "
                                "not a token budget",
    "--enable-chunked-prefill": "a prompt is prefilled in one step here",
    "--quantization": "checkpoints are loaded as they are (--dtype picks the weights' dtype)",
    "--load-format": "checkpoints are read as safetensors directories (docs/models.md)",
    "--download-dir": "nothing is downloaded: MODEL_DIR is a local checkpoint directory",
    "--revision": "nothing is downloaded: MODEL_DIR is a local checkpoint directory",
    "--tokenizer": "the checkpoint's own tokenizer is used",
    "--trust-remote-code": "a checkpoint's own code is never run: only the architectures in docs/models.md",
    "--enable-lora": "LoRA adapters are not served",
    "--lora-modules": "LoRA adapters are not served",
    "--speculative-config": "there is no speculative decoding here",
    "--enable-auto-tool-choice": "tool calls are not served (a request with tools is a 400)",
    "--tool-call-parser": "tool calls are not served (a request with tools is a 400)",
    "--reasoning-parser": "reasoning output is not parsed here",
    "--distributed-executor-backend": "workers are this server's own processes, or Ray actors "
                                      "(--worker-backend ray)",
    "--kv-transfer-config": "the prefill/decode split is a pipeline config (--pipeline speech-pd)",
    "--uds": "serve listens on --host and --port only",
    "--middleware": "the app's middleware is fixed",
    "--chat-template-content-format": "a template gets each message's content as the client sent it "
                                      "(a string or a list of parts: docs/openai-compat.md)",
    "--limit-mm-per-prompt": "media per request are bounded by --max-body-bytes",
    "--enable-sleep-mode": "sleep is always there, behind --admin-token (/admin/sleep)",
}


class Refused(argparse.Action):
    """A flag that is not taken here: one line naming it and ``why``, exit 2 -- never silently ignored,
    never argparse's usage dump.  ``says`` words it (default: a vLLM flag that means nothing here;
    ``serve`` also refuses its own removed flags with it)."""

    def __init__(self, option_strings: list[str], dest: str, *, why: str,
                 says: str = "(a vllm serve flag) means nothing here", **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs="?", **kwargs)
        self.why, self.says = why, says

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        parser.exit(2, f"{parser.prog}: error: {option_string} {self.says}: {self.why}\n")


class _OnlyOne(Refused):
    """A parallel size: 1 (what is done here) is taken, anything else refused as :class:`Refused`."""

    def __init__(self, option_strings: list[str], dest: str, *, why: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, why=why, **kwargs)
        self.nargs = None

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        if values != "1":
            parser.exit(2, f"{parser.prog}: error: {option_string} {values}: only 1 is served here: "
                           f"{self.why}\n")


def _json_list(flag: str) -> Any:
    def parse(text: str) -> list[str]:
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            value = None
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise argparse.ArgumentTypeError(f"{flag} takes a JSON list of strings, as vLLM's: "
                                             f"'[\"https://example.com\"]', got {text!r}")
        return value

    parse.__name__ = "JSON list"
    return parse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """vLLM's flags that mean something here (a group of their own), and the refused ones (hidden)."""
    g = parser.add_argument_group(
        "vLLM's flags", "as 'vllm serve' takes them, with vLLM's meaning and default; a vLLM flag that "
        "means nothing here (--gpu-memory-utilization, --tensor-parallel-size 2, --quantization, ...) is "
        "an error that says why (docs/openai-compat.md: Flags)")
    g.add_argument("--max-num-seqs", type=int, default=None, metavar="N",
                   help="the most requests running at once, as vLLM's scheduler: the others wait, in "
                        "priority order (vllm:num_requests_waiting), and a request beyond "
                        "--request-queue-size waiting is shed with 429 (default: no bound but the "
                        "stages' --max-inflight)")
    g.add_argument("--uvicorn-log-level", choices=list(LOG_LEVELS), default="info",
                   help="the HTTP server's log level, the access log's included, on either front "
                        "(default info)")
    g.add_argument("--disable-uvicorn-access-log", action="store_true",
                   help="no access-log line per request (default: one line each -- method, path, "
                        "status, duration, request id -- on either front)")
    r = g.add_mutually_exclusive_group()
    r.add_argument("--enable-log-requests", action="store_true", dest="log_requests",
                   help="log a line when each request is received (its id, prompt and sampling) and "
                        "when it ends (default: not, as vLLM's)")
    r.add_argument("--disable-log-requests", action="store_false", dest="log_requests",
                   help="do not log each request (the default; kept for vLLM launch lines)")
    g.add_argument("--max-log-len", type=int, default=None, metavar="N",
                   help="with --enable-log-requests: the most characters of a prompt logged (default: all)")
    g.add_argument("--disable-log-stats", action="store_true",
                   help="no throughput line (default: every 10 s while requests run or tokens flow, "
                        "one line with prompt and generation tokens/s, running and waiting requests)")
    g.add_argument("--allowed-origins", type=_json_list("--allowed-origins"), default=["*"], metavar="JSON",
                   help="CORS: the origins a browser may call from, a JSON list (default '[\"*\"]')")
    g.add_argument("--allowed-methods", type=_json_list("--allowed-methods"), default=["*"], metavar="JSON",
                   help="CORS: the methods allowed (default '[\"*\"]')")
    g.add_argument("--allowed-headers", type=_json_list("--allowed-headers"), default=["*"], metavar="JSON",
                   help="CORS: the request headers allowed (default '[\"*\"]')")
    g.add_argument("--allow-credentials", action="store_true",
                   help="CORS: allow credentials (cookies, Authorization) in cross-origin requests")
    g.add_argument("--root-path", default="", metavar="PATH",
                   help="the path prefix a proxy serves this under (/openapi.json names it; a request "
                        "may come with it or without it)")
    g.add_argument("--ssl-keyfile", default=None, metavar="FILE", help="TLS: the key (--loop asyncio)")
    g.add_argument("--ssl-certfile", default=None, metavar="FILE",
                   help="TLS: the certificate (--loop asyncio)")
    g.add_argument("--ssl-ca-certs", default=None, metavar="FILE",
                   help="TLS: CA certificates to check clients' certificates with (--loop asyncio)")
    g.add_argument("--ssl-cert-reqs", type=int, default=0, metavar="N",
                   help="TLS: whether a client certificate is required (Python's ssl.CERT_*: 0 none, "
                        "1 optional, 2 required; default 0)")
    g.add_argument("--seed", type=int, default=None,
                   help="the pipeline's seed (its random weights, its default sampling; default: the "
                        "config's, 0)")
    g.add_argument("--disable-fastapi-docs", action="store_true",
                   help="no /openapi.json and /docs (default: both, open without the API key)")
    for flag, why in ALREADY.items():
        g.add_argument(flag, action="store_true", help=f"accepted for vLLM launch lines: {why}")
    for flag, (short, why) in ONLY_ONE.items():
        g.add_argument(flag, short, action=_OnlyOne, why=why, metavar="1", help="1 only: " + why)
    for flag, why in REFUSED.items():
        parser.add_argument(flag, action=Refused, why=why, help=argparse.SUPPRESS)


@dataclass(frozen=True)
class ServerFlags:
    """What vLLM's server flags decide, checked: logging, CORS, the path prefix, TLS, the API's docs."""

    log_level: int = logging.INFO
    access_log: bool = True
    log_requests: bool = False
    max_log_len: int | None = None
    log_stats: bool = True
    cors: Cors = VLLM_CORS
    root_path: str = ""
    ssl: dict[str, Any] | None = None  #: uvicorn's ssl_* settings (None: plain HTTP)
    docs: bool = True  #: serve /openapi.json and /docs


def check(args: argparse.Namespace) -> ServerFlags:
    """The flags above as :class:`ServerFlags`; ValueError (a usage error) naming a bad one."""
    if args.max_num_seqs is not None and args.max_num_seqs < 1:
        raise ValueError(f"--max-num-seqs must be >= 1, got {args.max_num_seqs}")
    if args.max_log_len is not None and args.max_log_len < 0:
        raise ValueError(f"--max-log-len must be >= 0, got {args.max_log_len}")
    root = args.root_path.rstrip("/")
    if root and not root.startswith("/"):
        raise ValueError(f"--root-path must start with '/', got {args.root_path!r}")
    ssl = None
    if args.ssl_keyfile or args.ssl_certfile:
        if not (args.ssl_keyfile and args.ssl_certfile):
            raise ValueError("TLS needs both --ssl-keyfile and --ssl-certfile")
        if args.loop != "asyncio":
            raise ValueError("--ssl-keyfile/--ssl-certfile: the lean Trio server (--loop trio) does not "
                             "speak TLS: use --loop asyncio, or a TLS-terminating proxy in front")
        ssl = {"ssl_keyfile": args.ssl_keyfile, "ssl_certfile": args.ssl_certfile,
               "ssl_ca_certs": args.ssl_ca_certs, "ssl_cert_reqs": args.ssl_cert_reqs}
    elif args.ssl_ca_certs:
        raise ValueError("--ssl-ca-certs applies to TLS: give --ssl-keyfile and --ssl-certfile too")
    cors = Cors(tuple(args.allowed_origins), tuple(args.allowed_methods), tuple(args.allowed_headers),
                args.allow_credentials)
    return ServerFlags(log_level=LOG_LEVELS[args.uvicorn_log_level],
                       access_log=not args.disable_uvicorn_access_log, log_requests=args.log_requests,
                       max_log_len=args.max_log_len, log_stats=not args.disable_log_stats, cors=cors,
                       root_path=root, ssl=ssl, docs=not args.disable_fastapi_docs)
