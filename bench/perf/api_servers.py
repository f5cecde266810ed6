"""``serve --api-server-count N``: requests/s, TTFC and CPU per request for N = 1 and 2, measured in one run.

``python -m bench.perf.api_servers [--concurrency 64,256] [--seconds 5] [--pipelines echo,torch]
[--loops trio,asyncio]``

For each pipeline (three echo workers; the default thinker -> talker ->
code2wav torch workers) and each concurrency, ``serve --loop L`` is started
for each front (``L``: trio, asyncio) with ``--api-server-count 1`` and
``2`` in turn (the order shuffled per cell), warmed up, and loaded by streaming clients in client processes
for ``--seconds`` (:func:`bench.perf.serving.measure_front`: raw HTTP/1.1,
each request on a fresh connection).  Reported per run: requests/s, time to
the first content chunk (p50/p99), and CPU seconds per request of the
serving processes -- the head (the orchestrator: with N = 1 it also serves
HTTP) and the fronts together -- the workers apart.

From N = 2's head CPU per request ``h`` (the orchestrator alone) and its
fronts' ``f`` (HTTP, JSON, SSE per request), one core of orchestrator keeps
up with ``f / h`` fronts, each on a core of its own: the projected N at
which the one orchestrator process saturates on a machine with many cores.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.perf.serving import (
    echo_body,
    echo_pipeline_file,
    measure_front,
    pct,
    post,
    proc_cpu,
    split_url,
    start_server,
    stop_server,
)
from stages.lockdown import serving_pid
from trio_orch.testing import child_pids

__all__ = ["fronts_of", "main", "measure"]


def fronts_of(head: int) -> list[int]:
    """The serving pids of the API-server processes of the head ``head`` (its workers apart)."""
    out = []
    for pid in child_pids(head):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"trio_orch.serve.fronts.process" in cmd:
            out.append(serving_pid(pid))
    return out


def measure(flags: list[str], count: int, concurrency: int, seconds: float, procs: int,
            loop: str = "trio") -> dict[str, Any]:
    """One server with ``--loop loop --api-server-count count``, loaded for ``seconds``: its numbers."""
    body = echo_body(flags)
    proc, url = start_server([*flags, "--loop", loop, "--api-server-count", str(count),
                              "--max-inflight", "0", "--request-queue-size", str(4 * concurrency)])
    try:
        asyncio.run(post(*split_url(url), "/v1/chat/completions", body))  # warm-up
        head = serving_pid(proc.pid)
        fronts = fronts_of(head)
        f0 = sum(proc_cpu(p) for p in fronts)
        run = measure_front(url, proc.pid, concurrency, seconds, procs, body)
        f1 = sum(proc_cpu(p) for p in fronts)
    finally:
        stop_server(proc)
    ok = run["ok"]
    return {"loop": loop, "api_server_count": count, "concurrency": concurrency, "requests": ok,
            "failed": run["failed"],
            "requests_per_s": ok / run["wall_s"],
            "ttfc_p50_ms": pct(run["ttfc"], 0.50) or float("nan"),  # pct gives milliseconds
            "ttfc_p99_ms": pct(run["ttfc"], 0.99) or float("nan"),
            "head_cpu_ms_per_request": run["server_cpu_s"] / ok * 1e3 if ok else float("nan"),
            "fronts_cpu_ms_per_request": (f1 - f0) / ok * 1e3 if ok and count > 1 else 0.0}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.perf.api_servers", description=__doc__.split("\n\n")[0])
    p.add_argument("--concurrency", default="64,256", help="streaming clients, comma-separated (64,256)")
    p.add_argument("--seconds", type=float, default=5.0, help="seconds of load per run (5)")
    p.add_argument("--pipelines", default="echo,torch", help="echo and/or torch (echo,torch)")
    p.add_argument("--loops", default="trio,asyncio",
                   help="the fronts' --loop, comma-separated (trio,asyncio)")
    p.add_argument("--client-procs", type=int, default=2, help="client processes (2)")
    p.add_argument("--json", default=None, metavar="FILE", help="also write the results as JSON")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        pipelines = {"echo": ["--config", echo_pipeline_file(4, tmp)], "torch": []}
        rows = []
        for name in args.pipelines.split(","):
            for conc in (int(c) for c in args.concurrency.split(",")):
                cells = [(loop, n) for loop in args.loops.split(",") for n in (1, 2)]
                random.Random(conc).shuffle(cells)
                for loop, n in cells:
                    row = {"pipeline": name,
                           **measure(pipelines[name], n, conc, args.seconds, args.client_procs, loop)}
                    rows.append(row)
                    print(json.dumps(row), file=sys.stderr, flush=True)
    rows.sort(key=lambda r: (r["pipeline"], r["concurrency"], r["loop"], r["api_server_count"]))
    print("| pipeline | clients | --loop | N | requests/s | TTFC p50 ms | TTFC p99 ms | head CPU ms/req | "
          "fronts CPU ms/req | failed |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['pipeline']} | {r['concurrency']} | {r['loop']} | {r['api_server_count']} | "
              f"{r['requests_per_s']:.0f} | "
              f"{r['ttfc_p50_ms']:.1f} | {r['ttfc_p99_ms']:.1f} | {r['head_cpu_ms_per_request']:.2f} | "
              f"{r['fronts_cpu_ms_per_request']:.2f} | {r['failed']} |")
    print()
    for r in rows:
        if r["api_server_count"] == 2 and r["head_cpu_ms_per_request"] > 0:
            print(f"- {r['pipeline']}, {r['concurrency']} clients, --loop {r['loop']}: the orchestrator "
                  "process saturates at about "
                  f"N = {r['fronts_cpu_ms_per_request'] / r['head_cpu_ms_per_request']:.1f} fronts "
                  f"(fronts {r['fronts_cpu_ms_per_request']:.2f} ms / head "
                  f"{r['head_cpu_ms_per_request']:.2f} ms of CPU per request)")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
