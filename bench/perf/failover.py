"""``python -m bench.perf.failover``: kill -9 one of two replicas of a real server under load.

Loopback only.  Starts ``trio-orch serve`` on a one-stage echo pipeline with
two replicas, each batching ``--batch`` requests at a time (so most of what a
replica holds waits inside it, having produced nothing), keeps
``--concurrency`` clients sending requests for ``--seconds``, and kills one
replica with SIGKILL a third of the way in (once it holds a quarter of the
clients' requests); the supervisor restarts it.  It
does this twice: with failover (``--max-retries 1``) and without
(``--max-retries 0``).  For each it reports what the clients saw -- answers
by status, latency p50/p99 overall and for the requests that were in flight
or started within ``--window`` seconds of the kill -- and the server's own
``trio_orch_requests_retried_total``.

Prints one JSON object (``--json PATH`` writes it too); ``--markdown PATH``
renders it between the file's ``<!-- failover:begin -->`` / ``<!-- failover:end -->``
markers.  Nothing is asserted: the numbers come from the run (note how
loaded the machine was).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.perf.report import publish
from bench.perf.serving import pct, post, split_url, start_server, stop_server

__all__ = ["get", "held_by", "kill_replica", "load_with_kill", "main", "markdown", "retried_total", "run_one"]

BEGIN, END = "<!-- failover:begin -->", "<!-- failover:end -->"
BODY = {"messages": [{"role": "user", "content": "one two three four five six seven eight"}],
        "modalities": ["text"]}

CONFIG = """[pipeline]
final_stage_ids = [0]

[[stages]]
kind = "echo"
replicas = 2
max_batch = {batch}
model = {{outputs = {outputs}}}
worker_args = ["--step-delay-ms", "{step_ms}"]
"""


def kill_replica(proc: subprocess.Popen[str], replica: int = 0) -> int:
    """SIGKILL the echo worker of replica ``replica`` of the server ``proc``; its pid."""
    from stages.lockdown import serving_pid
    from trio_orch.testing import child_pids

    mark = f"--replica\x00{replica}\x00--kind\x00echo\x00"
    workers = child_pids(serving_pid(proc.pid))
    victim = next(p for p in workers if mark in Path(f"/proc/{p}/cmdline").read_text())
    os.kill(victim, signal.SIGKILL)
    return victim


async def held_by(host: str, port: int, replica: int) -> float:
    """``trio_orch_replica_inflight`` of stage 0's ``replica``: the requests bound to it now."""
    _, text = await get(host, port, "/metrics")
    want = f'trio_orch_replica_inflight{{replica="{replica}",stage="0"}} '
    return next((float(line[len(want):]) for line in text.splitlines() if line.startswith(want)), 0.0)


async def get(host: str, port: int, path: str) -> tuple[int, str]:
    """GET ``path`` on a fresh connection: (status, body)."""
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(f"GET {path} HTTP/1.1\r\nhost: {host}\r\nconnection: close\r\n\r\n".encode())
    data = (await reader.read()).decode(errors="replace")
    writer.close()
    head, _, body = data.partition("\r\n\r\n")
    return int(head.split(" ", 2)[1]), body


async def load_with_kill(url: str, proc: subprocess.Popen[str], concurrency: int, seconds: float
                         ) -> tuple[list[tuple[float, float, int]], float]:
    """Clients for ``seconds``, a replica killed after a third: ([(start, seconds, status)], t_kill)."""
    host, port = split_url(url)
    body = json.dumps(BODY).encode()
    t0 = time.perf_counter()
    done: list[tuple[float, float, int]] = []
    stop = asyncio.Event()

    async def client() -> None:
        while not stop.is_set():
            start = time.perf_counter() - t0
            code, took = await post(host, port, "/v1/chat/completions", body, timeout=60.0)
            done.append((start, took, code))

    tasks = [asyncio.create_task(client()) for _ in range(concurrency)]
    await asyncio.sleep(seconds / 3)
    while await held_by(host, port, 0) < concurrency / 4:  # it holds queued requests, not only a batch
        await asyncio.sleep(0.01)
    kill_replica(proc, 0)
    t_kill = time.perf_counter() - t0
    await asyncio.sleep(seconds * 2 / 3)  # the load goes on as long after the kill (however busy the machine)
    stop.set()
    await asyncio.gather(*tasks)
    return done, t_kill


def retried_total(url: str) -> float:
    """The server's ``trio_orch_requests_retried_total``, summed over stages."""
    _, text = asyncio.run(get(*split_url(url), "/metrics"))
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("trio_orch_requests_retried_total"))


def run_one(max_retries: int, args: argparse.Namespace, config: str) -> dict[str, Any]:
    """One server, one kill: what its clients saw."""
    proc, url = start_server(["--config", config, "--max-retries", str(max_retries),
                              "--request-timeout", "60", "--max-inflight", "0"])
    try:
        time.sleep(1.0)  # both replicas settled (serve prints its address once they are ready)
        done, t_kill = asyncio.run(load_with_kill(url, proc, args.concurrency, args.seconds))
        retried = retried_total(url)
    finally:
        stop_server(proc)
    near = [(s, took, c) for s, took, c in done if s <= t_kill + args.window and s + took >= t_kill]
    by_status: dict[str, int] = {}
    for _, _, c in done:
        by_status[str(c)] = by_status.get(str(c), 0) + 1
    return {"max_retries": max_retries, "requests": len(done), "by_status": by_status,
            "errors": sum(c != 200 for _, _, c in done), "kill_at_s": round(t_kill, 2),
            "p50_ms": pct([t for _, t, c in done if c == 200], 0.50),
            "p99_ms": pct([t for _, t, c in done if c == 200], 0.99),
            "near_kill": {"requests": len(near), "errors": sum(c != 200 for _, _, c in near),
                          "p50_ms": pct([t for _, t, c in near if c == 200], 0.50),
                          "p99_ms": pct([t for _, t, c in near if c == 200], 0.99)},
            "retried": retried}


def markdown(out: dict[str, Any]) -> str:
    """The run as a table (one row per setting) and a line saying how it was run."""
    s = out["settings"]
    lines = ["| failover | requests | errors seen by clients | answers by status | p50 / p99 ok (ms) "
             f"| within {s['window']:g} s of the kill: requests, errors, p50 / p99 ok (ms) | retried |",
             "|---|---|---|---|---|---|---|"]
    for r in out["runs"]:
        n = r["near_kill"]
        status = ", ".join(f"{k}: {v}" for k, v in sorted(r["by_status"].items()))
        lines.append(f"| `--max-retries {r['max_retries']}` | {r['requests']} | {r['errors']} | {status} "
                     f"| {r['p50_ms']} / {r['p99_ms']} | {n['requests']}, {n['errors']}, "
                     f"{n['p50_ms']} / {n['p99_ms']} | {r['retried']:.0f} |")
    lines.append("")
    lines.append(f"(`{out['command']}`, {out['date']}: one echo stage, 2 replicas batching {s['batch']} "
                 f"requests, {s['outputs']} outputs {s['step_ms']} ms apart each; {s['concurrency']} "
                 f"clients for {s['seconds']:g} s; one replica killed with SIGKILL at about a third; "
                 f"{out['cpus']} CPUs, load average {out['loadavg']} at the start: {out['machine']}.)")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.perf.failover", description=__doc__.split("\n\n")[0])
    p.add_argument("--concurrency", type=int, default=32, help="clients sending at once (default 32)")
    p.add_argument("--seconds", type=float, default=12.0, help="load duration per setting (default 12)")
    p.add_argument("--batch", type=int, default=4, help="requests a replica batches (default 4)")
    p.add_argument("--outputs", type=int, default=40, help="outputs per request (default 40)")
    p.add_argument("--step-ms", type=int, default=20, help="ms between a replica's steps (default 20)")
    p.add_argument("--window", type=float, default=3.0, help="seconds after the kill counted as near it")
    p.add_argument("--machine", default="", help="a note on the machine (e.g. 'loaded: a CI run beside')")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the results here")
    p.add_argument("--markdown", default=None, metavar="PATH",
                   help=f"write the table between {BEGIN} and {END} of this file")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as d:
        config = os.path.join(d, "echo2.toml")
        Path(config).write_text(CONFIG.format(batch=args.batch, outputs=args.outputs, step_ms=args.step_ms))
        out: dict[str, Any] = {
            "command": " ".join(["python -m bench.perf.failover", *(sys.argv[1:] if argv is None else argv)]),
            "date": time.strftime("%Y-%m-%d", time.gmtime()), "cpus": os.cpu_count(),
            "loadavg": round(os.getloadavg()[0], 1), "machine": args.machine or "not described",
            "settings": {k: getattr(args, k) for k in ("concurrency", "seconds", "batch", "outputs",
                                                        "step_ms", "window")},
            "runs": [run_one(n, args, config) for n in (1, 0)]}
    publish(out, args.json, args.markdown, markdown, BEGIN, END)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
