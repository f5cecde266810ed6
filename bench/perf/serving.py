"""The serving benchmark of the two fronts, and the raw HTTP/1.1 client both serving runs use.

:func:`compare_fronts` (``trio-orch bench --serving``): ``serve --loop trio``
and ``serve --loop asyncio`` started in turn (interleaved rounds) over the
same pipeline, N concurrent streaming clients in client processes for a
bounded time, and per front: time to first content chunk, inter-chunk gap
p50/p99, requests/s, and server CPU per request (the serving process; its
workers apart).  :mod:`bench.perf.operating` is the other serving run (a
real ``serve`` under a burst, an idle flood and kill -9).

The clients speak raw HTTP/1.1 over asyncio sockets, loopback only, bounded
in count and time: a client library would spend more CPU than the server on
a 2-core box.
"""

from __future__ import annotations

import asyncio
import functools
import json
import multiprocessing
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from stages.lockdown import serving_pid

__all__ = [
    "BODY",
    "bucket_p99_ms",
    "compare_fronts",
    "echo_body",
    "echo_pipeline_file",
    "engine_durations",
    "http_get",
    "measure_front",
    "open_stream",
    "pct",
    "post",
    "proc_cpu",
    "split_url",
    "start_server",
    "stop_server",
    "stream_requests",
    "worker_counts",
]

BODY = {"messages": [{"role": "user", "content": "Say something about the weather."}],
        "modalities": ["text", "audio"], "max_tokens": 16}


async def post(host: str, port: int, path: str, body: bytes | None,
                timeout: float = 120.0) -> tuple[int, float]:
    """One request on a fresh connection: (status, seconds to the end of the answer); status 0 if cut."""
    t = time.perf_counter()
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
        method = "POST" if body is not None else "GET"
        head = f"{method} {path} HTTP/1.1\r\nhost: {host}\r\nconnection: close\r\n"
        if body is not None:
            head += f"content-type: application/json\r\ncontent-length: {len(body)}\r\n"
        writer.write(head.encode() + b"\r\n" + (body or b""))
        data = await asyncio.wait_for(reader.read(), timeout)
        writer.close()
    except (OSError, TimeoutError):
        return 0, time.perf_counter() - t
    m = re.match(rb"HTTP/1\.1 (\d+)", data)
    return (int(m.group(1)) if m else 0), time.perf_counter() - t


async def open_stream(host: str, port: int, path: str, body: bytes, timeout: float
                      ) -> tuple[int, asyncio.StreamReader, asyncio.StreamWriter]:
    """POST ``body`` (JSON) to ``path`` on a fresh connection (closed by the server at the end); its
    status (0 if unreadable), the reader positioned after the status line, and the writer."""
    reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
    writer.write(f"POST {path} HTTP/1.1\r\nhost: {host}\r\nconnection: close\r\n"
                 f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n".encode() + body)
    parts = (await asyncio.wait_for(reader.readline(), timeout)).split()
    return (int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else 0), reader, writer


def split_url(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    return host, int(port)


def pct(xs: list[float], p: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(p * len(xs)))] * 1000, 1)


def http_get(url: str, path: str, token: str | None = None) -> str:
    """The body of one GET on a fresh connection (``token``: sent as a bearer token)."""
    host, port = split_url(url)
    auth = f"authorization: Bearer {token}\r\n" if token else ""

    async def get() -> bytes:
        reader, writer = await asyncio.open_connection(host, port)
        writer.write(f"GET {path} HTTP/1.1\r\nhost: {host}\r\n{auth}connection: close\r\n\r\n".encode())
        data = await reader.read()
        writer.close()
        return data

    return asyncio.run(get()).split(b"\r\n\r\n", 1)[1].decode()


def worker_counts(url: str, token: str) -> tuple[int, float]:
    """Model steps the server's workers have run and the CPU seconds they have used, all stages together.

    Read through ``GET /admin/stats`` (each worker's ``steps`` and ``pid``):
    a worker step sends one message to the orchestrator, so steps per request
    say how many requests shared a step -- what the front's submit pattern
    decides on workers that step as fast as they can.
    """
    answer = json.loads(http_get(url, "/admin/stats", token))
    steps, cpu = 0, 0.0
    for res in answer["results"]:
        value = res.get("value") or {}
        steps += int(value.get("steps", 0))
        pid = value.get("pid")
        if pid is not None and Path(f"/proc/{pid}/stat").exists():
            cpu += proc_cpu(int(pid))
    return steps, cpu


def engine_durations(url: str) -> list[tuple[float, float]]:
    """The engine's own ``request_duration_seconds{kind="finished"}`` buckets: (le, cumulative count)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = http_get(url, "/metrics")
    for fam in text_string_to_metric_families(text):
        if fam.name == "trio_orch_request_duration_seconds":
            return [(float(smp.labels["le"]), smp.value) for smp in fam.samples
                    if smp.name.endswith("_bucket") and smp.labels.get("kind") == "finished"]
    return []


def bucket_p99_ms(before: list[tuple[float, float]], after: list[tuple[float, float]]) -> float | None:
    """The upper bound of the bucket holding the 99th percentile of what finished in between."""
    prior = dict(before)
    counts = [(le, n - prior.get(le, 0.0)) for le, n in after]
    total = counts[-1][1] if counts else 0
    if not total:
        return None
    return next(le * 1000 for le, n in counts if n >= 0.99 * total)


def start_server(args: list[str], cpus: set[int] | None = None, env: dict[str, str] | None = None, *,
                 admin_token: str | None = None, code: Path | None = None
                 ) -> tuple[subprocess.Popen[str], str]:
    """``trio-orch serve`` as a child process (on ``cpus`` only, workers included, when given; ``env``:
    variables added to this process's environment).

    ``admin_token``: the control plane is served behind it (given through the
    environment, so it is not in the process list).  ``code``: a tree whose
    project code the server (and its workers) run instead of this one's (an
    A/B run, ``bench.perf.ab --serving``).
    """
    pin = None if cpus is None else functools.partial(os.sched_setaffinity, 0, cpus)
    extra = dict(env or {})
    if admin_token is not None:
        extra["TRIO_ORCH_ADMIN_TOKEN"] = admin_token
    if code is not None:
        extra["PYTHONPATH"] = str(code)
    proc = subprocess.Popen([sys.executable, "-m", "trio_orch.cli", "serve", "--port", "0", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, preexec_fn=pin,
                            env={**os.environ, **extra} if extra else None, cwd=code)
    assert proc.stdout is not None
    for line in proc.stdout:
        m = re.search(r"serving on (http://\S+)", line)
        if m:
            # keep reading its output so it never blocks on a full pipe
            threading.Thread(target=proc.stdout.read, daemon=True).start()
            return proc, m.group(1)
    raise RuntimeError("trio-orch serve exited before serving")


def stop_server(proc: subprocess.Popen[str]) -> None:
    """Stop a :func:`start_server` child as a service manager would: SIGTERM (it drains), SIGKILL at 60 s."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


# ---------------------------------------------------------------------------- the two fronts
ECHO_TOML = """[pipeline]
final_stage_ids = [0, 2]
{stages}
"""


def echo_pipeline_file(outputs: int, directory: str) -> str:
    """A TOML config of three echo stages (``outputs`` outputs each), written to ``directory``."""
    stage = f'[[stages]]\nkind = "echo"\nmodel = {{outputs = {outputs}}}\n'
    path = os.path.join(directory, "echo.toml")
    Path(path).write_text(ECHO_TOML.format(stages="\n".join([stage] * 3)))
    return path


async def _stream_one(host: str, port: int, body: bytes, ttfc: list[float], gaps: list[float],
                      timeout: float = 60.0) -> bool:
    """One streamed request on a fresh connection; record TTFC and the gaps between content reads."""
    t0 = time.perf_counter()
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
        writer.write((f"POST /v1/chat/completions HTTP/1.1\r\nhost: {host}\r\n"
                      f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n").encode()
                     + body)
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout)
        if not head.startswith(b"HTTP/1.1 200"):
            writer.close()
            return False
        events = 0
        last = None
        while True:
            data = await asyncio.wait_for(reader.read(65536), timeout)
            if not data:
                break
            now = time.perf_counter()
            done = b"data: [DONE]" in data  # the end of the stream (the connection is kept alive: close it)
            n = data.count(b"data: ") - done  # content events in this read ([DONE] is not one)
            if n and events + n > 1:  # the first event is the role chunk, sent before any output
                if last is None:
                    ttfc.append(now - t0)
                else:
                    gaps.append(now - last)
                last = now
            events += n
            if done:  # counted first: a whole answer can arrive in one read
                break
        writer.close()
        return last is not None
    except (OSError, TimeoutError, asyncio.IncompleteReadError):
        return False


def _front_client(url: str, conns: int, seconds: float, body: bytes, out: Any) -> None:
    """A client process: ``conns`` connections, each streaming requests back to back for ``seconds``."""
    host, port = split_url(url)

    async def run() -> tuple[list[float], list[float], int, int]:
        ttfc: list[float] = []
        gaps: list[float] = []
        done = [0, 0]
        end = time.perf_counter() + seconds

        async def conn() -> None:
            while time.perf_counter() < end:
                ok = await _stream_one(host, port, body, ttfc, gaps)
                done[0 if ok else 1] += 1

        await asyncio.gather(*(conn() for _ in range(conns)))
        return ttfc, gaps, done[0], done[1]

    out.put(asyncio.run(run()))


def proc_cpu(pid: int) -> float:
    """utime + stime of one process, in seconds (readable for a non-dumpable process too)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def front_cpu(pid: int) -> float:
    """CPU seconds of the serving process, the workers apart: what serving HTTP costs.

    ``trio-orch serve`` goes on in a fresh child of the process started (``stages.lockdown``): that
    child's, not its idle stand-in's.
    """
    return proc_cpu(serving_pid(pid))


def measure_front(url: str, pid: int, concurrency: int, seconds: float, procs: int,
                  body: bytes, admin_token: str | None = None) -> dict[str, Any]:
    """N concurrent streaming clients for ``seconds``: TTFC, inter-chunk gaps, req/s, server CPU.

    With ``admin_token`` (the server's), also the workers' steps and CPU seconds in that time.
    """
    q: Any = multiprocessing.Queue()
    per = [concurrency // procs + (1 if i < concurrency % procs else 0) for i in range(procs)]
    clients = [multiprocessing.Process(target=_front_client, args=(url, n, seconds, body, q))
               for n in per if n]
    steps0, wcpu0 = worker_counts(url, admin_token) if admin_token else (0, 0.0)
    cpu0, t0 = front_cpu(pid), time.perf_counter()
    for c in clients:
        c.start()
    res = [q.get() for _ in clients]
    wall = time.perf_counter() - t0
    cpu = front_cpu(pid) - cpu0
    steps1, wcpu1 = worker_counts(url, admin_token) if admin_token else (0, 0.0)
    for c in clients:
        c.join()
    ttfc = [x for r in res for x in r[0]]
    gaps = [x for r in res for x in r[1]]
    ok = sum(r[2] for r in res)
    out = {"ttfc": ttfc, "gaps": gaps, "ok": ok, "failed": sum(r[3] for r in res), "wall_s": wall,
           "server_cpu_s": cpu}
    if admin_token:
        out.update(worker_steps=steps1 - steps0, worker_cpu_s=wcpu1 - wcpu0)
    return out


async def stream_requests(url: str, body: bytes, requests: int, concurrency: int) -> int:
    """``requests`` streamed requests, ``concurrency`` at a time, each on a fresh connection; how many
    succeeded (a count-driven load, for profiled runs: the same work on both sides of a comparison)."""
    host, port = split_url(url)
    left, ok = [requests], [0]
    ttfc: list[float] = []
    gaps: list[float] = []

    async def client() -> None:
        while left[0] > 0:
            left[0] -= 1
            ok[0] += await _stream_one(host, port, body, ttfc, gaps)

    await asyncio.gather(*(client() for _ in range(concurrency)))
    return ok[0]


def echo_body(flags: list[str]) -> bytes:
    """The streamed chat request of the serving runs (an echo pipeline takes no ``max_tokens``)."""
    echo = any(f.endswith("echo.toml") for f in flags)
    req = {k: v for k, v in BODY.items() if not (echo and k == "max_tokens")}
    return json.dumps({**req, "stream": True}).encode()


def compare_fronts(pipelines: dict[str, list[str]], concurrency: int = 64, seconds: float = 5.0,
                   rounds: int = 3, procs: int = 2, progress: Any = None) -> dict[str, Any]:
    """Both fronts over each pipeline (``name -> serve flags``), interleaved rounds; raw per-front results.

    A pipeline whose flags name an echo config gets no ``max_tokens`` (echo stages take none).
    """
    import random
    import secrets

    token = secrets.token_urlsafe(16)  # /admin/stats: the workers' steps and pids
    out: dict[str, Any] = {}
    for name, flags in pipelines.items():
        body = echo_body(flags)
        runs: dict[str, list[dict[str, Any]]] = {"trio": [], "asyncio": []}
        for r in range(rounds):
            order = ["trio", "asyncio"]
            random.Random(r).shuffle(order)
            for loop in order:
                proc, url = start_server([*flags, "--loop", loop, "--max-inflight", "0",
                                          "--request-queue-size", str(4 * concurrency)], admin_token=token)
                try:
                    asyncio.run(post(*split_url(url), "/v1/chat/completions", body))  # warm-up
                    runs[loop].append(measure_front(url, proc.pid, concurrency, seconds, procs, body,
                                                    admin_token=token))
                finally:
                    stop_server(proc)
                if progress is not None:
                    progress.step(f"serving {name} --loop {loop} (round {r + 1}/{rounds})")
        out[name] = runs
    return out
