"""``python -m bench.perf.serving``: a real ``trio-orch serve`` under overload, idle floods and kill -9.

Loopback only, bounded in count and time.  Starts the server as a child
process and measures it from client processes of its own (raw HTTP/1.1 over
asyncio sockets: a client library would spend more CPU than the server on a
2-core box):

* ``unloaded``: requests one at a time -- the reference latency;
* ``burst``: N requests at once -- how many were admitted and shed (429),
  and the latency of the admitted ones against the unloaded p99;
* ``idle``: thousands of idle connections, then one normal request;
* ``kill``: kill -9 a worker of a stage with one replica while polling
  ``/health`` every 20 ms -- how long it said 503, and whether it ever said
  200 while the replacement was not ready.

Prints one JSON object (``--json PATH`` writes it too).  Nothing is
asserted: the numbers go to docs/operating.md.

:func:`compare_fronts` (``trio-orch bench --serving``) is the serving
benchmark of the two fronts: ``serve --loop trio`` and ``serve --loop
asyncio`` started in turn (interleaved rounds) over the same pipeline, N
concurrent streaming clients in client processes for a bounded time, and
per front: time to first content chunk, inter-chunk gap p50/p99,
requests/s, and server CPU per request (the serving process; its workers
apart).
"""

from __future__ import annotations

import argparse
import asyncio
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

__all__ = ["main"]

BODY = {"messages": [{"role": "user", "content": "Say something about the weather."}],
        "modalities": ["text", "audio"], "max_tokens": 16}


async def _post(host: str, port: int, path: str, body: bytes | None,
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


def _client(url: str, n: int, body: bytes, out: Any) -> None:
    """A client process: ``n`` concurrent requests; puts [(status, seconds), ...] on ``out``."""
    host, port = _split(url)

    async def run() -> list[tuple[int, float]]:
        return await asyncio.gather(*(_post(host, port, "/v1/chat/completions", body) for _ in range(n)))

    out.put(asyncio.run(run()))


def _idle(url: str, n: int, ready: Any, done: Any) -> None:
    """Hold ``n`` idle connections until told to stop."""
    host, port = _split(url)

    async def run() -> None:
        conns = []
        for _ in range(n):
            try:
                conns.append(await asyncio.open_connection(host, port))
            except OSError:
                break
        ready.put(len(conns))
        await asyncio.get_running_loop().run_in_executor(None, done.get)
        for _, w in conns:
            w.close()

    asyncio.run(run())


def _split(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    return host, int(port)


def _pct(xs: list[float], p: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(p * len(xs)))] * 1000, 1)


def engine_durations(url: str) -> list[tuple[float, float]]:
    """The engine's own ``request_duration_seconds{kind="finished"}`` buckets: (le, cumulative count)."""
    from prometheus_client.parser import text_string_to_metric_families

    host, port = _split(url)

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


def start_server(args: list[str]) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen([sys.executable, "-m", "trio_orch.cli", "serve", "--port", "0", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    for line in proc.stdout:
        m = re.search(r"serving on (http://\S+)", line)
        if m:
            # keep reading its output so it never blocks on a full pipe
            threading.Thread(target=proc.stdout.read, daemon=True).start()
            return proc, m.group(1)
    raise RuntimeError("trio-orch serve exited before serving")


def unloaded(url: str, n: int) -> dict[str, Any]:
    host, port = _split(url)
    body = json.dumps(BODY).encode()

    async def run() -> list[tuple[int, float]]:
        return [await _post(host, port, "/v1/chat/completions", body) for _ in range(n)]

    res = asyncio.run(run())
    lat = [t for code, t in res if code == 200]
    return {"requests": n, "ok": len(lat), "p50_ms": _pct(lat, 0.5), "p99_ms": _pct(lat, 0.99)}


def burst(url: str, n: int, procs: int) -> dict[str, Any]:
    body = json.dumps(BODY).encode()
    q: Any = multiprocessing.Queue()
    workers = [multiprocessing.Process(target=_client, args=(url, n // procs, body, q)) for _ in range(procs)]
    t = time.perf_counter()
    for w in workers:
        w.start()
    res = [r for _ in workers for r in q.get()]
    wall = time.perf_counter() - t
    for w in workers:
        w.join()
    ok = [s for code, s in res if code == 200]
    shed = [s for code, s in res if code == 429]
    return {"requests": len(res), "admitted": len(ok), "shed_429": len(shed),
            "other": sorted({code for code, _ in res} - {200, 429}), "admitted_p50_ms": _pct(ok, 0.5),
            "admitted_p99_ms": _pct(ok, 0.99), "shed_p99_ms": _pct(shed, 0.99), "wall_s": round(wall, 2)}


def idle(url: str, n: int, procs: int) -> dict[str, Any]:
    ready: Any = multiprocessing.Queue()
    done: Any = multiprocessing.Queue()
    holders = [multiprocessing.Process(target=_idle, args=(url, n // procs, ready, done))
               for _ in range(procs)]
    for h in holders:
        h.start()
    opened = sum(ready.get() for _ in holders)
    host, port = _split(url)
    code, took = asyncio.run(_post(host, port, "/v1/chat/completions", json.dumps(BODY).encode()))
    for _ in holders:
        done.put(None)
    for h in holders:
        h.join()
    return {"idle_connections_opened": opened, "normal_request_status": code,
            "normal_request_ms": round(took * 1000, 1)}


def kill_one(url: str, proc: subprocess.Popen[str], stage_kind: str) -> dict[str, Any]:
    """kill -9 the worker of ``stage_kind``; poll /health every 20 ms until it is 200 again."""
    from trio_orch.testing import child_pids

    host, port = _split(url)
    victim = next(p for p in child_pids(proc.pid)
                  if f"--kind\x00{stage_kind}\x00" in Path(f"/proc/{p}/cmdline").read_text())
    os.kill(victim, signal.SIGKILL)
    t0 = time.perf_counter()
    samples: list[tuple[float, int]] = []
    while time.perf_counter() - t0 < 60:
        code, _ = asyncio.run(_post(host, port, "/health", None))
        samples.append((time.perf_counter() - t0, code))
        if code == 200 and any(c == 503 for _, c in samples):
            break
        time.sleep(0.02)
    first_503 = next((t for t, c in samples if c == 503), None)
    back = samples[-1][0] if samples[-1][1] == 200 else None
    between = [c for t, c in samples if first_503 is not None and first_503 <= t < (back or 1e9)]
    return {"polls": len(samples),
            "first_503_after_ms": None if first_503 is None else round(first_503 * 1000),
            "503_for_s": None if back is None or first_503 is None else round(back - first_503, 2),
            "200_during_outage": sum(c == 200 for c in between)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.perf.serving", description=__doc__.split("\n\n")[0])
    p.add_argument("--serve-args", default="", help="extra trio-orch serve flags, e.g. '--in-process'")
    p.add_argument("--unloaded", type=int, default=30, help="requests one at a time (default 30)")
    p.add_argument("--burst", type=int, default=1024, help="requests at once (default 1024)")
    p.add_argument("--idle", type=int, default=20000, help="idle connections (default 20000)")
    p.add_argument("--kill", default="talker", help="stage kind to kill -9 (default talker; '' skips)")
    p.add_argument("--procs", type=int, default=4, help="client processes (default 4)")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the results here")
    args = p.parse_args(argv)
    proc, url = start_server(args.serve_args.split())
    out: dict[str, Any] = {"serve_args": args.serve_args, "cpus": os.cpu_count()}
    try:
        d0 = engine_durations(url)
        out["unloaded"] = unloaded(url, args.unloaded)
        d1 = engine_durations(url)
        out["unloaded"]["engine_p99_ms_bucket"] = bucket_p99_ms(d0, d1)
        out["burst"] = burst(url, args.burst, args.procs)
        out["burst"]["engine_p99_ms_bucket"] = bucket_p99_ms(d1, engine_durations(url))
        if out["burst"]["admitted_p99_ms"] and out["unloaded"]["p99_ms"]:
            ratio = out["burst"]["admitted_p99_ms"] / out["unloaded"]["p99_ms"]
            out["burst"]["p99_vs_unloaded"] = round(ratio, 2)
        if args.idle:
            out["idle"] = idle(url, args.idle, max(2, args.procs // 2))
        if args.kill:
            out["kill"] = kill_one(url, proc, args.kill)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            out["exit_code"] = proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            out["exit_code"] = None
    text = json.dumps(out, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())


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
    host, port = _split(url)

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


def measure_front(url: str, pid: int, concurrency: int, seconds: float, procs: int,
                  body: bytes) -> dict[str, Any]:
    """N concurrent streaming clients for ``seconds``: TTFC, inter-chunk gaps, req/s, server CPU."""
    q: Any = multiprocessing.Queue()
    per = [concurrency // procs + (1 if i < concurrency % procs else 0) for i in range(procs)]
    clients = [multiprocessing.Process(target=_front_client, args=(url, n, seconds, body, q))
               for n in per if n]
    cpu0, t0 = _proc_cpu(pid), time.perf_counter()
    for c in clients:
        c.start()
    res = [q.get() for _ in clients]
    wall = time.perf_counter() - t0
    cpu = _proc_cpu(pid) - cpu0
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
                    asyncio.run(_post(*_split(url), "/v1/chat/completions", body))  # warm-up
                    runs[loop].append(measure_front(url, proc.pid, concurrency, seconds, procs, body))
                finally:
                    proc.send_signal(signal.SIGTERM)
                    try:
                        proc.wait(60)
                    except subprocess.TimeoutExpired:
                        proc.kill()
                        proc.wait()
                if progress is not None:
                    progress.step(f"serving {name} --loop {loop} (round {r + 1}/{rounds})")
        out[name] = runs
    return out
