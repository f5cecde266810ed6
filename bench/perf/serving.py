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
    "echo_pipeline_file",
    "engine_durations",
    "measure_front",
    "pct",
    "post",
    "split_url",
    "start_server",
    "stop_server",
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


def split_url(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    return host, int(port)


def pct(xs: list[float], p: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(p * len(xs)))] * 1000, 1)


def engine_durations(url: str) -> list[tuple[float, float]]:
    """The engine's own ``request_duration_seconds{kind="finished"}`` buckets: (le, cumulative count)."""
    from prometheus_client.parser import text_string_to_metric_families

    host, port = split_url(url)

    async def get() -> bytes:
        reader, writer = await asyncio.open_connection(host, port)
        writer.write(f"GET /metrics HTTP/1.1\r\nhost: {host}\r\nconnection: close\r\n\r\n".encode())
        data = await reader.read()
        writer.close()
        return data

    text = asyncio.run(get()).split(b"\r\n\r\n", 1)[1].decode()
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


def start_server(args: list[str], cpus: set[int] | None = None) -> tuple[subprocess.Popen[str], str]:
    """``trio-orch serve`` as a child process (on ``cpus`` only, workers included, when given)."""
    pin = None if cpus is None else functools.partial(os.sched_setaffinity, 0, cpus)
    proc = subprocess.Popen([sys.executable, "-m", "trio_orch.cli", "serve", "--port", "0", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, preexec_fn=pin)
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


def _proc_cpu(pid: int) -> float:
    """utime + stime of one process, in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def front_cpu(pid: int) -> float:
    """CPU seconds of the serving process, the workers apart: what serving HTTP costs.

    ``trio-orch serve`` goes on in a fresh child of the process started (``stages.lockdown``): that
    child's, not its idle stand-in's.
    """
    return _proc_cpu(serving_pid(pid))


def measure_front(url: str, pid: int, concurrency: int, seconds: float, procs: int,
                  body: bytes) -> dict[str, Any]:
    """N concurrent streaming clients for ``seconds``: TTFC, inter-chunk gaps, req/s, server CPU."""
    q: Any = multiprocessing.Queue()
    per = [concurrency // procs + (1 if i < concurrency % procs else 0) for i in range(procs)]
    clients = [multiprocessing.Process(target=_front_client, args=(url, n, seconds, body, q))
               for n in per if n]
    cpu0, t0 = front_cpu(pid), time.perf_counter()
    for c in clients:
        c.start()
    res = [q.get() for _ in clients]
    wall = time.perf_counter() - t0
    cpu = front_cpu(pid) - cpu0
    for c in clients:
        c.join()
    ttfc = [x for r in res for x in r[0]]
    gaps = [x for r in res for x in r[1]]
    ok = sum(r[2] for r in res)
    return {"ttfc": ttfc, "gaps": gaps, "ok": ok, "failed": sum(r[3] for r in res), "wall_s": wall,
            "server_cpu_s": cpu}


def compare_fronts(pipelines: dict[str, list[str]], concurrency: int = 64, seconds: float = 5.0,
                   rounds: int = 3, procs: int = 2, progress: Any = None) -> dict[str, Any]:
    """Both fronts over each pipeline (``name -> serve flags``), interleaved rounds; raw per-front results.

    A pipeline whose flags name an echo config gets no ``max_tokens`` (echo stages take none).
    """
    import random

    out: dict[str, Any] = {}
    for name, flags in pipelines.items():
        echo = any(f.endswith("echo.toml") for f in flags)
        req = {k: v for k, v in BODY.items() if not (echo and k == "max_tokens")}
        body = json.dumps({**req, "stream": True}).encode()
        runs: dict[str, list[dict[str, Any]]] = {"trio": [], "asyncio": []}
        for r in range(rounds):
            order = ["trio", "asyncio"]
            random.Random(r).shuffle(order)
            for loop in order:
                proc, url = start_server([*flags, "--loop", loop, "--max-inflight", "0",
                                          "--request-queue-size", str(4 * concurrency)])
                try:
                    asyncio.run(post(*split_url(url), "/v1/chat/completions", body))  # warm-up
                    runs[loop].append(measure_front(url, proc.pid, concurrency, seconds, procs, body))
                finally:
                    stop_server(proc)
                if progress is not None:
                    progress.step(f"serving {name} --loop {loop} (round {r + 1}/{rounds})")
        out[name] = runs
    return out
