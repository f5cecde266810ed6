"""``python -m bench.perf.priority``: mixed priorities under overload, FIFO and priority in one run.

Loopback only.  Starts ``trio-orch serve`` (``--loop``: either front) on a
one-stage echo pipeline (one replica batching ``--batch`` requests, so the
serve's admission bound is the batch and the rest waits in the
orchestrator's start queue) and measures streamed chat requests' time to
first token (TTFT: until the first SSE chunk with text).  Three phases
against the same server:

1. *unloaded*: the ``--high`` high-priority clients alone;
2. *FIFO*: ``--low`` low-priority clients keep it overloaded, every request
   sent with priority 0 (arrival order);
3. *priority*: the same load, the high class sending ``priority: -5`` and the
   low class ``priority: 5``.

Each client sends one request after another.  For each phase and class it
reports requests, errors, TTFT p50/p99 and end-to-end p50/p99: the high
class's p99 against its unloaded p99, and what the low class pays.

Prints one JSON object (``--json PATH`` writes it too); ``--markdown PATH``
renders it between the file's ``<!-- priority:begin -->`` /
``<!-- priority:end -->`` markers.  Nothing is asserted: the numbers come from
the run (note how loaded the machine was).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.perf.report import publish
from bench.perf.serving import open_stream, pct, split_url, start_server, stop_server

__all__ = ["PHASES", "main", "markdown", "phase", "stream_chat"]

BEGIN, END = "<!-- priority:begin -->", "<!-- priority:end -->"
PROMPT = "one two three four five six seven eight"

CONFIG = """[pipeline]
final_stage_ids = [0]

[[stages]]
kind = "echo"
replicas = 1
max_batch = {batch}
model = {{outputs = {outputs}}}
worker_args = ["--step-delay-ms", "{step_ms}"]
"""

#: phase -> (load from the low class?, priority of the high class, of the low class)
PHASES: dict[str, tuple[bool, int, int]] = {"unloaded": (False, 0, 0), "fifo": (True, 0, 0),
                                            "priority": (True, -5, 5)}


async def stream_chat(host: str, port: int, priority: int, timeout: float = 120.0
                      ) -> tuple[int, float | None, float]:
    """One streamed chat request on a fresh connection: (status, seconds to its first text chunk,
    seconds to its end)."""
    body = json.dumps({"messages": [{"role": "user", "content": PROMPT}], "modalities": ["text"],
                       "stream": True, "priority": priority}).encode()
    t = time.perf_counter()
    ttft: float | None = None
    try:
        status, reader, writer = await open_stream(host, port, "/v1/chat/completions", body, timeout)
        while True:
            line = await asyncio.wait_for(reader.readline(), timeout)
            if not line:
                break
            if ttft is None and line.startswith(b"data: {") and _has_text(line[6:]):
                ttft = time.perf_counter() - t
        writer.close()
    except (OSError, TimeoutError):
        return 0, None, time.perf_counter() - t
    return status, ttft, time.perf_counter() - t


def _has_text(data: bytes) -> bool:
    try:
        chunk = json.loads(data)
    except ValueError:
        return False
    return any((c.get("delta") or {}).get("content") for c in chunk.get("choices", ()))


async def phase(url: str, name: str, args: argparse.Namespace) -> dict[str, Any]:
    """One phase: the high class (and the low class, if loaded) for ``--seconds``; per-class numbers."""
    loaded, high_prio, low_prio = PHASES[name]
    host, port = split_url(url)
    stop = asyncio.Event()
    done: dict[str, list[tuple[int, float | None, float]]] = {"high": [], "low": []}

    async def client(cls: str, prio: int, pause: float) -> None:
        while not stop.is_set():
            done[cls].append(await stream_chat(host, port, prio))
            if pause:
                await asyncio.sleep(pause)

    tasks = [asyncio.create_task(client("high", high_prio, args.high_pause)) for _ in range(args.high)]
    if loaded:
        tasks += [asyncio.create_task(client("low", low_prio, 0.0)) for _ in range(args.low)]
    await asyncio.sleep(args.seconds)
    stop.set()
    await asyncio.gather(*tasks)
    out: dict[str, Any] = {"phase": name, "high_priority": high_prio, "low_priority": low_prio}
    for cls, rows in done.items():
        if cls == "low" and not loaded:
            continue
        ok = [(ttft, e2e) for status, ttft, e2e in rows if status == 200 and ttft is not None]
        out[cls] = {"requests": len(rows), "errors": len(rows) - len(ok),
                    "ttft_p50_ms": pct([t for t, _ in ok], 0.50),
                    "ttft_p99_ms": pct([t for t, _ in ok], 0.99),
                    "e2e_p50_ms": pct([e for _, e in ok], 0.50),
                    "e2e_p99_ms": pct([e for _, e in ok], 0.99)}
    return out


async def run_phases(url: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    results = []
    for name in PHASES:
        results.append(await phase(url, name, args))
        await asyncio.sleep(1.0)  # the queue drains between phases
    return results


def markdown(out: dict[str, Any]) -> str:
    """The run as a table (one row per phase and class) and a line saying how it was run."""
    s = out["settings"]
    base = out["phases"][0]["high"]["ttft_p99_ms"]
    lines = ["| phase | class (priority sent) | requests | errors | TTFT p50 / p99 (ms) "
             "| TTFT p99 / unloaded high p99 | end-to-end p50 / p99 (ms) |", "|---|---|---|---|---|---|---|"]
    for p in out["phases"]:
        for cls in ("high", "low"):
            r = p.get(cls)
            if r is None:
                continue
            ratio = (f"{r['ttft_p99_ms'] / base:.1f}x" if base and r["ttft_p99_ms"] is not None else "-")
            lines.append(f"| {p['phase']} | {cls} ({p[cls + '_priority']}) | {r['requests']} | {r['errors']} "
                         f"| {r['ttft_p50_ms']} / {r['ttft_p99_ms']} | {ratio} "
                         f"| {r['e2e_p50_ms']} / {r['e2e_p99_ms']} |")
    lines.append("")
    front = f"`serve --loop {s['loop']}`" if "loop" in s else "`serve`"
    lines.append(f"(`{out['command']}`, {out['date']}: {front}, one echo stage, 1 replica batching "
                 f"{s['batch']} requests, {s['outputs']} outputs {s['step_ms']} ms apart each; "
                 f"{s['high']} high-priority clients (a {s['high_pause']:g} s pause between requests) "
                 f"and, loaded, {s['low']} low-priority clients back to back, {s['seconds']:g} s per phase, "
                 f"streamed chat; "
                 f"{out['cpus']} CPUs, load average {out['loadavg']} at the start: {out['machine']}.)")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.perf.priority", description=__doc__.split("\n\n")[0])
    p.add_argument("--loop", choices=("trio", "asyncio"), default="asyncio",
                   help="the serving front (serve's --loop; default asyncio, serve's default)")
    p.add_argument("--high", type=int, default=2, help="high-priority clients (default 2)")
    p.add_argument("--high-pause", type=float, default=0.2,
                   help="seconds a high-priority client waits between requests (default 0.2)")
    p.add_argument("--low", type=int, default=16,
                   help="low-priority clients in the loaded phases (default 16)")
    p.add_argument("--seconds", type=float, default=10.0, help="duration of each phase (default 10)")
    p.add_argument("--batch", type=int, default=2, help="requests the replica batches (default 2)")
    p.add_argument("--outputs", type=int, default=10, help="outputs per request (default 10)")
    p.add_argument("--step-ms", type=int, default=20, help="ms between the replica's steps (default 20)")
    p.add_argument("--machine", default="", help="a note on the machine (e.g. 'loaded: a CI run beside')")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the results here")
    p.add_argument("--markdown", default=None, metavar="PATH",
                   help=f"write the table between {BEGIN} and {END} of this file")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as d:
        config = os.path.join(d, "echo1.toml")
        Path(config).write_text(CONFIG.format(batch=args.batch, outputs=args.outputs, step_ms=args.step_ms))
        out: dict[str, Any] = {
            "command": " ".join(["python -m bench.perf.priority",
                                 shlex.join(sys.argv[1:] if argv is None else argv)]).rstrip(),
            "date": time.strftime("%Y-%m-%d", time.gmtime()), "cpus": os.cpu_count(),
            "loadavg": round(os.getloadavg()[0], 1), "machine": args.machine or "not described",
            "settings": {k: getattr(args, k) for k in ("loop", "high", "high_pause", "low", "seconds",
                                                        "batch", "outputs", "step_ms")}}
        proc, url = start_server(["--loop", args.loop, "--config", config, "--request-timeout", "120"])
        try:
            time.sleep(1.0)  # the replica settled
            out["phases"] = asyncio.run(run_phases(url, args))
        finally:
            stop_server(proc)
    publish(out, args.json, args.markdown, markdown, BEGIN, END)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
