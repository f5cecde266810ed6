"""``python -m bench.perf.http_layer``: the HTTP server alone, per streamed chunk, with no orchestrator.

The serving fronts differ by about 5 ms of server CPU per streamed request
(docs/performance.md).  This run asks how much of that is the HTTP server
itself: one ASGI app that streams ``--chunks`` server-sent events per
request (a checkpoint before each, as a request task woken per output
would), served in turn by

* ``hypercorn``: hypercorn's Trio worker, as ``serve --loop trio`` ran it
  before the lean server (the comparison: hypercorn is the ``bench`` extra's,
  not the product's);
* ``uvicorn``: uvicorn with its h11 protocol, as ``serve --loop asyncio``;
* ``h11-trio``: a minimal keep-alive HTTP/1.1 loop on Trio over h11 (no
  timeouts, no limits, no WebSocket): what a lean Trio server would cost,
  the same parser as the other two;
* ``lean-trio``: the same loop with the chunks framed by hand and written
  with :func:`write_nowait` (no checkpoint when the socket takes the bytes,
  as asyncio's ``transport.write``): what the per-chunk ``send_all`` costs;
* ``trio-http``: the product's lean server (:mod:`trio_orch.serve.trio_http`,
  what ``serve --loop trio`` runs by default), with its limits, disconnect
  watch and drain.

``--app starlette`` puts Starlette's router and ``StreamingResponse`` in
front (what the product's routes run on).  Each server is a child process
given a listening socket by its file descriptor; the clients are those of
the serving benchmark (:func:`bench.perf.serving.measure_front`), loopback
only, bounded in time.  Reports requests/s and the server's CPU per request
and per chunk, rounds interleaved.  Nothing is asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import random
import shlex
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio

from bench.perf.report import publish
from bench.perf.serving import measure_front, post

__all__ = ["SERVERS", "markdown", "package_of", "run", "serve"]

SERVERS = ("hypercorn", "uvicorn", "h11-trio", "lean-trio", "trio-http")
BEGIN, END = "<!-- http-layer:begin -->", "<!-- http-layer:end -->"
CHUNK = (b'data: {"id":"chatcmpl-0","object":"chat.completion.chunk",'
         b'"choices":[{"index":0,"delta":{"content":"hello"}}]}\n\n')
DONE = b"data: [DONE]\n\n"

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


def raw_app(chunks: int) -> Callable[[Scope, Receive, Send], Awaitable[None]]:
    """A bare ASGI app: read the body, stream ``chunks`` events and ``[DONE]``."""
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        while (await receive()).get("more_body"):
            pass
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        for _ in range(chunks):
            await anyio.sleep(0)
            await send({"type": "http.response.body", "body": CHUNK, "more_body": True})
        await send({"type": "http.response.body", "body": DONE, "more_body": False})
    return app


def starlette_app(chunks: int) -> Any:
    """The same stream behind Starlette's router and ``StreamingResponse``."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import StreamingResponse
    from starlette.routing import Route

    async def events() -> Any:
        for _ in range(chunks):
            await anyio.sleep(0)
            yield CHUNK
        yield DONE

    async def chat(request: Request) -> StreamingResponse:
        await request.body()
        return StreamingResponse(events(), media_type="text/event-stream")

    return Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"])])


def _receive_once(body: bytes) -> Receive:
    """An ASGI ``receive`` that gives the whole body once, then waits for ever (no disconnects here)."""
    import trio

    delivered = False

    async def receive() -> dict[str, Any]:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        await trio.sleep_forever()
        raise AssertionError("unreachable")
    return receive


async def write_nowait(fd: int, data: bytes) -> None:
    """Write ``data`` to a non-blocking socket, waiting only while the kernel's buffer is full.

    No checkpoint when the socket takes the bytes at once (as asyncio's
    ``transport.write``): the caller's own waits are its schedule points.
    """
    import trio

    view = memoryview(data)
    while view:
        try:
            view = view[os.write(fd, view):]
        except BlockingIOError:
            await trio.lowlevel.wait_writable(fd)


async def h11_trio_serve(app: Any, listener: Any, lean: bool = False) -> None:
    """The minimal HTTP/1.1 server: one task per connection, h11 in, chunked SSE out.

    ``lean``: frame the chunks by hand and write them with :func:`write_nowait`
    instead of h11's send path and ``send_all`` (which checkpoints every chunk).
    """
    import h11
    import trio

    async def connection(stream: trio.SocketStream) -> None:
        conn = h11.Connection(h11.SERVER)
        fd = stream.socket.fileno()

        async def next_event() -> Any:
            while (event := conn.next_event()) is h11.NEED_DATA:
                conn.receive_data(await stream.receive_some(65536))
            return event

        try:
            while isinstance(request := await next_event(), h11.Request):
                body = b""
                while isinstance(event := await next_event(), h11.Data):
                    body += event.data
                receive = _receive_once(body)

                async def send_lean(message: dict[str, Any]) -> None:
                    if message["type"] == "http.response.start":
                        await write_nowait(fd, conn.send(h11.Response(
                            status_code=message["status"],
                            headers=[*message.get("headers", []), (b"transfer-encoding", b"chunked")])))
                        return
                    body = message.get("body", b"")
                    out = b"%x\r\n%s\r\n" % (len(body), body) if body else b""
                    if not message.get("more_body"):
                        out += b"0\r\n\r\n"
                        conn.send(h11.EndOfMessage())  # h11 keeps the state; its bytes are the line above
                    await write_nowait(fd, out)

                async def send(message: dict[str, Any]) -> None:
                    if message["type"] == "http.response.start":
                        await stream.send_all(conn.send(h11.Response(
                            status_code=message["status"],
                            headers=[*message.get("headers", []), (b"transfer-encoding", b"chunked")])))
                        return
                    out = conn.send(h11.Data(data=message["body"])) if message.get("body") else b""
                    if not message.get("more_body"):
                        out += conn.send(h11.EndOfMessage())
                    await stream.send_all(out)

                scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
                         "method": request.method.decode(), "scheme": "http",
                         "path": request.target.decode(), "raw_path": request.target,
                         "query_string": b"", "root_path": "", "headers": list(request.headers),
                         "server": None, "client": None}
                await app(scope, receive, send_lean if lean else send)
                if conn.our_state is h11.MUST_CLOSE:
                    return
                conn.start_next_cycle()
        except (trio.BrokenResourceError, trio.ClosedResourceError, h11.RemoteProtocolError):
            pass
        finally:
            await stream.aclose()

    await trio.serve_listeners(connection, [listener])


def serve(server: str, app_kind: str, fd: int, chunks: int) -> None:
    """In the child: serve the app on the listening socket ``fd`` until killed."""
    app = raw_app(chunks) if app_kind == "raw" else starlette_app(chunks)
    if server == "uvicorn":
        import uvicorn
        uvicorn.run(app, fd=fd, http="h11", loop="asyncio", log_level="warning", access_log=False,
                    lifespan="off")
        return
    import trio
    if server == "hypercorn":
        from hypercorn.config import Config
        from hypercorn.trio import serve as hypercorn_serve
        config = Config()
        config.bind = [f"fd://{fd}"]
        config.accesslog = None
        config.loglevel = "WARNING"
        trio.run(hypercorn_serve, app, config)  # type: ignore[arg-type]
        return

    if server == "trio-http":
        from trio_orch.serve.trio_http import serve as lean_serve
        trio.run(lean_serve, app, socket.socket(fileno=fd))
        return

    async def main() -> None:
        sock = trio.socket.fromfd(fd, socket.AF_INET, socket.SOCK_STREAM)
        await h11_trio_serve(app, trio.SocketListener(sock), lean=server == "lean-trio")
    trio.run(main)


def _wait_ready(port: int, proc: subprocess.Popen[bytes], timeout: float) -> None:
    """Until the server answers a request (its imports done before any client counts)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode} before it answered")
        if asyncio.run(post("127.0.0.1", port, "/", None, timeout=5.0))[0]:  # any status: it is up
            return
        time.sleep(0.05)
    raise SystemExit(f"the server did not answer within {timeout} s")


def _one(server: str, app_kind: str, args: argparse.Namespace) -> dict[str, Any]:
    """Start one server on a fresh loopback socket, drive it, stop it."""
    lsock = socket.socket()
    lsock.bind(("127.0.0.1", 0))
    lsock.listen(1024)
    fd = lsock.fileno()
    proc = subprocess.Popen([sys.executable, "-m", "bench.perf.http_layer", "--serve", server,
                             "--app", app_kind, "--fd", str(fd), "--chunks", str(args.chunks)],
                            pass_fds=(fd,))
    try:
        port = lsock.getsockname()[1]
        lsock.close()  # the child holds its copy
        url = f"http://127.0.0.1:{port}"
        _wait_ready(port, proc, args.warmup)
        res: dict[str, Any] = {}
        driver = threading.Thread(target=lambda: res.update(measure_front(
            url, proc.pid, args.concurrency, args.seconds, args.procs, b'{"stream":true}')))
        driver.start()
        profile = _py_spy(proc.pid, args.py_spy, delay=min(1.0, args.seconds / 4)) if args.py_spy else None
        driver.join()
    finally:
        proc.kill()
        proc.wait()
    ok = max(res["ok"], 1)
    return {"server": server, "app": app_kind, "ok": res["ok"], "failed": res["failed"],
            "req_per_s": res["ok"] / res["wall_s"], "cpu_ms_per_req": 1000 * res["server_cpu_s"] / ok,
            "cpu_us_per_chunk": 1e6 * res["server_cpu_s"] / ok / (args.chunks + 1),
            **({"profile": profile} if profile else {})}


#: the packages a profile sample is charged to (by its innermost frame's file)
PACKAGES = ("trio_orch", "hypercorn", "uvicorn", "starlette", "anyio", "h11", "trio", "asyncio", "selectors",
            "outcome")


def package_of(frame: str) -> str:
    """``"name (path:line)"`` -> the package of ``path`` (py-spy shortens site-packages paths)."""
    path = frame.rsplit("(", 1)[-1].split(":", 1)[0]
    if path.startswith("<attrs generated methods "):  # attrs' generated code: the class's package
        path = path.removeprefix("<attrs generated methods ").split(".", 1)[0] + "/"
    for name in PACKAGES:
        if path.startswith(f"{name}/") or f"/{name}/" in path or path.endswith(f"{name}.py"):
            return name
    return "http_layer (the app)" if path.endswith("http_layer.py") else "other"


def _py_spy(pid: int, seconds: float, delay: float) -> dict[str, Any]:
    """py-spy's samples of ``pid`` for ``seconds`` (after ``delay``): shares by package, top functions.

    Shares of the samples in which the server's thread was busy (py-spy's
    default leaves idle ones out), charged to the innermost frame's package;
    ``functions``: the busiest frames of the servers' own packages, counted
    once per sample that has them anywhere on its stack (inclusive).
    """
    if shutil.which("py-spy") is None and not Path(sys.executable).with_name("py-spy").exists():
        raise SystemExit("--py-spy needs py-spy (pip install py-spy)")
    exe = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    time.sleep(delay)
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "samples.txt"
        subprocess.run([exe, "record", "-p", str(pid), "-d", str(max(1, round(seconds))), "-r", "200",
                        "--nonblocking", "-f", "raw", "-o", str(out)], check=True, capture_output=True)
        lines = out.read_text().splitlines()
    inner: collections.Counter[str] = collections.Counter()
    inclusive: collections.Counter[str] = collections.Counter()
    total = 0
    for line in lines:
        stack, _, count = line.rpartition(" ")
        n = int(count)
        frames = stack.split(";")
        total += n
        inner[package_of(frames[-1])] += n
        for name in {f.split(" (", 1)[0] for f in frames if package_of(f) in ("hypercorn", "uvicorn", "h11")}:
            inclusive[name] += n
    share = {k: round(v / max(total, 1), 3) for k, v in inner.most_common()}
    top = {k: round(v / max(total, 1), 3) for k, v in inclusive.most_common(8)}
    return {"samples": total, "innermost": share, "functions": top}


def run(args: argparse.Namespace, progress: Callable[[str], None] = print) -> dict[str, Any]:
    """Every server x app, ``--rounds`` interleaved rounds (order shuffled per round)."""
    runs: list[dict[str, Any]] = []
    pairs = [(s, a) for a in args.apps for s in args.servers]
    for r in range(args.rounds):
        order = pairs[:]
        random.Random(r).shuffle(order)
        for server, app_kind in order:
            one = _one(server, app_kind, args)
            runs.append({**one, "round": r})
            progress(f"round {r + 1}/{args.rounds} {server:9} {app_kind:9} {one['req_per_s']:7.0f} req/s "
                     f"{one['cpu_ms_per_req']:6.2f} ms CPU/request ({one['failed']} failed)")
    return {"command": " ".join(["python -m bench.perf.http_layer", shlex.join(args.argv)]).rstrip(),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpus": os.cpu_count(),
            "loadavg": [round(x, 2) for x in os.getloadavg()], "machine": args.machine or "not described",
            "settings": {k: getattr(args, k)
                         for k in ("chunks", "concurrency", "seconds", "procs", "rounds")},
            "runs": runs}


def markdown(out: dict[str, Any]) -> str:
    """The table: medians over rounds per server and app, and each one's ratio to uvicorn's CPU."""
    s = out["settings"]
    lines = [f"`{out['command']}`, {out['date']}, {out['cpus']} CPUs, load average after "
             f"{' '.join(str(x) for x in out['loadavg'])} ({out['machine']}): {s['concurrency']} streaming "
             f"clients, {s['chunks']} events + `[DONE]` a request, {s['seconds']} s a run, "
             f"{s['rounds']} interleaved rounds (medians).", "",
             "| server | app | requests/s | server CPU / request | CPU / chunk | CPU vs uvicorn |",
             "|---|---|---|---|---|---|"]
    med: dict[tuple[str, str], dict[str, float]] = {}
    for r in out["runs"]:
        med.setdefault((r["server"], r["app"]), {})
    for key in med:
        rows = [r for r in out["runs"] if (r["server"], r["app"]) == key]
        med[key] = {m: statistics.median(r[m] for r in rows)
                    for m in ("req_per_s", "cpu_ms_per_req", "cpu_us_per_chunk")}
        med[key]["failed"] = sum(r["failed"] for r in rows)
    for (server, app_kind), m in sorted(med.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        base = med.get(("uvicorn", app_kind))
        ratio = f"{m['cpu_ms_per_req'] / base['cpu_ms_per_req']:.2f}x" if base else "--"
        failed = f" ({m['failed']:.0f} failed)" if m["failed"] else ""
        lines.append(f"| {server} | {app_kind} | {m['req_per_s']:.0f}{failed} | {m['cpu_ms_per_req']:.2f} ms "
                     f"| {m['cpu_us_per_chunk']:.0f} us | {ratio} |")
    return "\n".join(lines + _profile_lines(out["runs"])) + "\n"


def _profile_lines(runs: list[dict[str, Any]]) -> list[str]:
    """The py-spy shares of each profiled server and app (samples summed over rounds)."""
    merged: dict[tuple[str, str], dict[str, Any]] = {}
    for r in runs:
        if "profile" not in r:
            continue
        m = merged.setdefault((r["server"], r["app"]), {"samples": 0, "innermost": collections.Counter(),
                                                         "functions": collections.Counter()})
        n = r["profile"]["samples"]
        m["samples"] += n
        for part in ("innermost", "functions"):
            m[part].update({k: v * n for k, v in r["profile"][part].items()})
    if not merged:
        return []
    lines = ["", "Where each server's busy samples are (py-spy, 200 Hz, charged to the innermost frame's "
             "package; then the busiest frames of the server's own code and h11, inclusive):", "",
             "| server | app | samples | innermost frame: share by package | busiest server frames |",
             "|---|---|---|---|---|"]
    for (server, app_kind), m in sorted(merged.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        total = max(m["samples"], 1)
        inner = ", ".join(f"{k} {100 * v / total:.0f} %" for k, v in m["innermost"].most_common(5))
        busiest = [(k, v) for k, v in m["functions"].most_common() if v / total < 0.9][:4]  # not the loop
        funcs = ", ".join(f"`{k}` {100 * v / total:.0f} %" for k, v in busiest)
        lines.append(f"| {server} | {app_kind} | {m['samples']} | {inner} | {funcs} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.perf.http_layer", description=__doc__.split("\n\n")[0])
    p.add_argument("--servers", type=lambda s: s.split(","), default=list(SERVERS),
                   help=f"comma-separated, of {', '.join(SERVERS)} (default all)")
    p.add_argument("--apps", type=lambda s: s.split(","), default=["raw", "starlette"],
                   help="comma-separated, of raw, starlette (default both)")
    p.add_argument("--chunks", type=int, default=40, help="events a request, before [DONE] (default 40)")
    p.add_argument("--concurrency", type=int, default=64, help="streaming clients (default 64)")
    p.add_argument("--procs", type=int, default=2, help="client processes (default 2)")
    p.add_argument("--seconds", type=float, default=4.0, help="duration of each run (default 4)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    p.add_argument("--start-timeout", dest="warmup", type=float, default=30.0,
                   help="seconds a server may take to answer its first request (default 30)")
    p.add_argument("--py-spy", type=float, default=0.0, metavar="SECONDS",
                   help="also sample each server with py-spy for this long in each run (default off)")
    p.add_argument("--machine", default="", help="a note on the machine (e.g. 'quiet')")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the results here")
    p.add_argument("--markdown", default=None, metavar="PATH",
                   help=f"write the table between {BEGIN} and {END} of this file")
    p.add_argument("--serve", choices=SERVERS, help=argparse.SUPPRESS)  # the child's side
    p.add_argument("--app", choices=("raw", "starlette"), default="raw", help=argparse.SUPPRESS)
    p.add_argument("--fd", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.serve:
        serve(args.serve, args.app, args.fd, args.chunks)
        return 0
    unknown = ([s for s in args.servers if s not in SERVERS]
               + [a for a in args.apps if a not in ("raw", "starlette")])
    if unknown:
        p.error(f"unknown server or app: {', '.join(unknown)}")
    args.argv = sys.argv[1:] if argv is None else argv
    out = run(args, progress=lambda line: print(line, file=sys.stderr, flush=True))
    publish(out, args.json, args.markdown, markdown, BEGIN, END)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
