"""``trio-orch ctl``: the command-line client of a server's ``/admin/...`` control plane.

``trio-orch serve --admin-token TOKEN`` turns the routes on; ``ctl`` calls
them with that token (``--token``, ``--token-file``, or ``$TRIO_ORCH_ADMIN_TOKEN``) and prints
one line per replica on stdout: its answer, or its error.  What went wrong
goes to stderr.  Exit codes: 0 every replica answered; 1 a replica failed,
the server refused the call (401: wrong token) or could not be reached; 2 a
bad command line only.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from stages.schema import positive_seconds_arg
from trio_orch.serve.credentials import TOKEN_ENV, read_secret_file

__all__ = ["configure", "request", "run"]


def configure(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Drive a running 'trio-orch serve --admin-token TOKEN' from the command line: read every "
        "replica's stats, pause and resume, sleep and wake the stage workers, load new weights at a "
        "quiesce boundary, profile. Prints one line per replica.")
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="the server (default %(default)s)")
    parser.add_argument("--token", default=None,
                        help=f"the server's admin token (default: --token-file, else ${TOKEN_ENV}; on the "
                             "command line every user can read it in ps)")
    parser.add_argument("--token-file", default=None, metavar="FILE",
                        help="read the admin token from FILE (the token alone)")
    parser.add_argument("--timeout", type=positive_seconds_arg, default=None, metavar="S",
                        help="seconds each replica has to answer (default: the server's)")
    parser.add_argument("--json", action="store_true", help="print the server's JSON answer as it is")
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)

    def action(name: str, help_text: str, stages: bool = True) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_text, description=help_text)
        if stages:
            p.add_argument("--stage", type=int, action="append", dest="stage_ids", metavar="K",
                           help="only stage K (repeatable; default: every stage)")
        return p

    action("stats", "every replica's stats (requests, steps, memory, paused, asleep)")
    action("pause", "start no new request; --mode says what happens to those in flight",
           stages=False).add_argument("--mode", choices=["wait", "abort", "keep"], default="wait",
                                      help="wait: let them finish (default); abort: end them; keep: freeze")
    action("resume", "start requests again", stages=False)
    p = action("sleep", "pause (requests in flight finish), then free the workers' weights and caches")
    p.add_argument("--level", type=int, choices=[1, 2], default=1,
                   help="1: keep a copy off the device (default); 2: discard, rebuild on wake")
    action("wake", "restore the workers' weights and caches, then resume")
    p = action("reload-weights", "load a torch.save'd state dict into every replica at a quiesce boundary "
                                 "(pause, check, load, resume)")
    p.add_argument("file", help="the weights file, a path on the server's machine (made absolute here)")
    p = action("profile", "start or stop a torch.profiler trace in every replica")
    p.add_argument("what", choices=["start", "stop"])
    p.add_argument("dir", nargs="?", default=None, help="start: where the trace files go (server's machine)")
    p = action("rpc", "call any worker method (the built-ins or a plug-in model's own)")
    p.add_argument("method")
    p.add_argument("--args", default="[]", help="positional arguments as a JSON list")
    p.add_argument("--kwargs", default="{}", help="keyword arguments as a JSON object")
    action("abort", "abort a request and wait until its stages confirm", stages=False).add_argument(
        "request_id")


def request(url: str, route: str, body: dict[str, Any] | None, token: str | None,
            http_timeout: float = 3600.0) -> tuple[int, dict[str, Any]]:
    """One admin call: ``(HTTP status, JSON answer)``; raises OSError when the server is unreachable
    (a refused connection, a timeout, a reset)."""
    data = json.dumps(body or {}).encode()
    req = urllib.request.Request(f"{url.rstrip('/')}/admin/{route}", data=data, method="POST",
                                 headers={"Content-Type": "application/json",
                                          **({"Authorization": f"Bearer {token}"} if token else {})})
    try:
        with urllib.request.urlopen(req, timeout=http_timeout) as resp:
            return resp.status, json.loads(resp.read() or b"{}")
    except urllib.error.HTTPError as exc:
        raw = exc.read()
        try:
            answer = json.loads(raw) if raw else {}
        except ValueError:
            answer = {"error": {"message": raw.decode(errors="replace")[:200]}}
        return exc.code, answer if isinstance(answer, dict) else {"error": {"message": str(answer)}}


def _call(args: argparse.Namespace) -> tuple[str, dict[str, Any]]:
    """The route and body for the chosen action; ValueError for a bad argument (the URL included)."""
    url = urllib.parse.urlsplit(args.url)
    try:
        port = url.port  # ValueError when out of range
    except ValueError:
        port = 0
    if url.scheme not in ("http", "https") or not url.hostname or port == 0:
        raise ValueError(f"--url must be an http:// or https:// URL with a valid port, got {args.url!r}")
    body: dict[str, Any] = {}
    if getattr(args, "stage_ids", None):
        body["stage_ids"] = args.stage_ids
    if args.timeout is not None:
        body["timeout"] = args.timeout
    a = args.action
    if a == "pause":
        return "pause", {"mode": args.mode}
    if a == "resume":
        return "resume", {}
    if a == "sleep":
        return "sleep", {**body, "level": args.level}
    if a == "wake":
        return "wake_up", body
    if a == "reload-weights":
        return "reload_weights", {**body, "path": os.path.abspath(args.file)}
    if a == "profile":
        if args.what == "stop":
            return "stop_profile", body
        if not args.dir:
            raise ValueError("profile start needs a directory")
        return "start_profile", {**body, "dir": os.path.abspath(args.dir)}
    if a == "rpc":
        call_args, call_kwargs = json.loads(args.args), json.loads(args.kwargs)
        if not isinstance(call_args, list) or not isinstance(call_kwargs, dict):
            raise ValueError("--args must be a JSON list and --kwargs a JSON object")
        return "rpc", {**body, "method": args.method, "args": call_args, "kwargs": call_kwargs}
    if a == "abort":
        return "abort", {"request_id": args.request_id, **({"timeout": args.timeout} if args.timeout else {})}
    return a, body  # stats


def run(args: argparse.Namespace) -> int:
    try:
        route, body = _call(args)
        if args.token is not None and args.token_file is not None:
            raise ValueError("give --token or --token-file, not both")
        token = (args.token if args.token is not None else read_secret_file(args.token_file, "admin token")
                 if args.token_file is not None else os.environ.get(TOKEN_ENV) or None)
    except ValueError as exc:  # a bad --args/--kwargs or token file: the command line
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        status, answer = request(args.url, route, body, token)
    except OSError as exc:
        print(f"error: cannot reach {args.url}: {exc}", file=sys.stderr)
        return 1
    if status == 200 or answer.get("results"):  # a recipe that failed still lists every replica's answer
        print(json.dumps(answer, indent=2) if args.json else _lines(answer))
    if status != 200:
        print(f"error: HTTP {status}: {_message(answer)}" + _hint(status, route), file=sys.stderr)
        return 1
    return 1 if any(r.get("error") for r in answer.get("results", [])) else 0


def _message(answer: dict[str, Any]) -> str:
    err = answer.get("error")
    if isinstance(err, dict):
        err = err.get("message")
    return str(err or "the server refused the call")


def _hint(status: int, route: str) -> str:
    if status == 401:
        return " (is this the token the server was started with?)"
    if status == 404 and route != "rpc":
        return " (is the server started with --admin-token?)"
    return ""


def _lines(answer: dict[str, Any]) -> str:
    out = []
    for r in answer.get("results", []):
        who = f"stage {r['stage_id']} replica {r['replica']}"
        if r.get("error"):
            out.append(f"{who}: ERROR {r['error']}")
        else:
            out.append(f"{who}: {json.dumps(r.get('value'), sort_keys=True)}")
    out.append(f"paused: {answer.get('paused') or 'no'}")
    return "\n".join(out)
