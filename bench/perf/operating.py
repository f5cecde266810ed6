"""``python -m bench.perf.operating``: a real ``trio-orch serve`` under overload, idle floods and kill -9.

Loopback only, bounded in count and time.  Starts the server as a child
process and measures it from client processes of its own
(:mod:`bench.perf.http_clients`; ``--server-cpus``/``--client-cpus`` pin
the two apart).  A request's latency runs from the moment the client wrote it to
the last byte of the answer: the wait in the server's accept queue counts,
the client's own delay between connecting and writing does not.

* ``unloaded``: requests one at a time -- the reference latency;
* ``burst``: N requests at once -- how many were admitted and shed (429),
  and the latency of the admitted ones against the unloaded p99;
* ``probe`` (``--probe N``): one request alone, then one with a burst
  released the moment it was written -- its latency and its workers'
  compute time (the answer's ``timings``): where an admitted request's
  extra time goes;
* ``idle``: thousands of idle connections, then one normal request;
* ``kill``: kill -9 a worker of a stage with one replica while polling
  ``/health`` every 20 ms -- how long it said 503, and whether it ever said
  200 while the replacement was not ready.

Prints one JSON object (``--json PATH`` writes it too).  Nothing is
asserted.  ``--report A.json B.json ... --markdown docs/operating.md``
renders runs (one table row each: the defaults, a tighter bound...) between
the file's ``<!-- serving:begin -->`` / ``<!-- serving:end -->`` markers:
every number in that table comes from a run's JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

from bench.perf.http_clients import (
    at_once,
    burst_client,
    idle_client,
    one_request,
    raw_request,
    waiting_client,
)
from bench.perf.report import update_between_markers
from bench.perf.serving import BODY, bucket_p99_ms, engine_durations, pct, post, split_url, start_server

__all__ = ["burst", "cpu_list", "idle", "kill_one", "main", "markdown_table", "measure", "probe",
           "run_label", "unloaded", "write_markdown"]

BEGIN, END = "<!-- serving:begin -->", "<!-- serving:end -->"


def unloaded(url: str, n: int) -> list[float]:
    """``n`` requests one after the other, with the burst's client: the seconds of those answered 200."""
    host, port = split_url(url)
    request = raw_request(host, json.dumps(BODY).encode())
    return [t for _ in range(n) for code, t in at_once(host, port, 1, request) if code == 200]


def burst(url: str, n: int, procs: int, cpus: set[int] | None = None) -> list[tuple[int, float]]:
    """``n`` requests at once from ``procs`` client processes (on ``cpus``): [(status, seconds), ...]."""
    body = json.dumps(BODY).encode()
    q: Any = multiprocessing.Queue()
    workers = [multiprocessing.Process(target=burst_client, args=(url, n // procs, body, q, cpus))
               for _ in range(procs)]
    for w in workers:
        w.start()
    got = [x for _ in workers for x in q.get()]
    for w in workers:
        w.join()
    return got


def measure(url: str, *, unloaded_n: int, burst_n: int, procs: int, rounds: int, repeat: int,
            pause: float = 1.0, client_cpus: set[int] | None = None) -> dict[str, Any]:
    """``repeat`` times: ``unloaded_n`` requests one at a time, then ``rounds`` bursts ``pause`` s apart.

    Latencies are pooled over everything (the p99 of the admitted requests
    against the p99 of the unloaded ones); the ratio of each repeat is kept
    too, to show the spread between runs.
    """
    lat: list[float] = []
    res: list[tuple[int, float]] = []
    per_round: list[int] = []
    ratios: list[float | None] = []
    d_unloaded: list[tuple[float, float]] = []
    d_burst: list[tuple[float, float]] = []
    for _ in range(repeat):
        a = engine_durations(url)
        mine = unloaded(url, unloaded_n)
        b = engine_durations(url)
        d_unloaded = _add(d_unloaded, a, b)
        got: list[tuple[int, float]] = []
        for r in range(rounds):
            if r:
                time.sleep(pause)  # the engine drains and stops shedding
            one = burst(url, burst_n, procs, client_cpus)
            per_round.append(sum(code == 200 for code, _ in one))
            got += one
        d_burst = _add(d_burst, b, engine_durations(url))
        ok = [t for code, t in got if code == 200]
        u99, a99 = pct(mine, 0.99), pct(ok, 0.99)
        ratios.append(round(a99 / u99, 2) if u99 and a99 else None)
        lat += mine
        res += got
        time.sleep(pause)
    ok = [t for code, t in res if code == 200]
    shed = [t for code, t in res if code == 429]
    out = {"unloaded": {"requests": unloaded_n * repeat, "ok": len(lat), "p50_ms": pct(lat, 0.5),
                        "p99_ms": pct(lat, 0.99), "engine_p99_ms_bucket": bucket_p99_ms([], d_unloaded)},
           "burst": {"repeat": repeat, "rounds": rounds * repeat, "requests": len(res), "admitted": len(ok),
                     "admitted_per_round": per_round, "shed_429": len(shed),
                     "other": sorted({code for code, _ in res} - {200, 429}),
                     "admitted_ms": [round(x * 1000, 1) for x in ok] if len(ok) <= 64 else None,
                     "admitted_p50_ms": pct(ok, 0.5), "admitted_p99_ms": pct(ok, 0.99),
                     "shed_p99_ms": pct(shed, 0.99), "engine_p99_ms_bucket": bucket_p99_ms([], d_burst),
                     "p99_vs_unloaded_per_repeat": ratios}}
    u99, a99 = out["unloaded"]["p99_ms"], out["burst"]["admitted_p99_ms"]
    if u99 and a99:
        out["burst"]["p99_vs_unloaded"] = round(a99 / u99, 2)
    return out


def _add(total: list[tuple[float, float]], before: list[tuple[float, float]],
         after: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Cumulative histogram buckets: ``total`` plus what was counted between ``before`` and ``after``."""
    prior = dict(before)
    mine = dict(total)
    return [(le, mine.get(le, 0.0) + n - prior.get(le, 0.0)) for le, n in after]


def probe(url: str, rounds: int, burst_n: int, procs: int, cpus: set[int] | None = None,
          pause: float = 0.5) -> dict[str, Any]:
    """Where an admitted request's time goes under a burst.

    ``rounds`` times: one request alone, then one request with a burst of
    ``burst_n`` released the moment it was written (so it is admitted and
    the burst is shed around it).  For each: the latency at the client, and
    the workers' compute time from the answer's own ``timings``.
    """
    host, port = split_url(url)
    body = json.dumps(BODY).encode()
    request = raw_request(host, body)
    gos = [multiprocessing.Event() for _ in range(procs)]
    q: Any = multiprocessing.Queue()
    clients = [multiprocessing.Process(target=waiting_client, args=(url, burst_n // procs, body, g, q, cpus),
                                       daemon=True) for g in gos]
    for c in clients:
        c.start()

    def release() -> None:
        for g in gos:
            g.set()

    seen: dict[str, list[tuple[float, float]]] = {"alone": [], "burst": []}
    try:
        for _ in range(rounds):
            for kind, after in (("alone", None), ("burst", release)):
                time.sleep(pause)
                code, took, answer = one_request(host, port, request, after)
                if after is not None:
                    for _ in clients:
                        q.get()
                if code == 200 and answer and "timings" in answer:
                    compute = sum(st["compute_ms"] for st in answer["timings"]["stages"]) / 1000
                    seen[kind].append((took, compute))
    finally:
        for c in clients:
            c.terminate()
            c.join()
    return {"rounds": rounds, **{kind: {"ok": len(xs), "client_p50_ms": pct([x for x, _ in xs], 0.5),
                                        "client_max_ms": pct([x for x, _ in xs], 1.0),
                                        "compute_p50_ms": pct([c for _, c in xs], 0.5),
                                        "compute_max_ms": pct([c for _, c in xs], 1.0)}
                                 for kind, xs in seen.items()}}


def idle(url: str, n: int, procs: int) -> dict[str, Any]:
    ready: Any = multiprocessing.Queue()
    done: Any = multiprocessing.Queue()
    holders = [multiprocessing.Process(target=idle_client, args=(url, n // procs, ready, done))
               for _ in range(procs)]
    for h in holders:
        h.start()
    opened = sum(ready.get() for _ in holders)
    host, port = split_url(url)
    code, took = asyncio.run(post(host, port, "/v1/chat/completions", json.dumps(BODY).encode()))
    for _ in holders:
        done.put(None)
    for h in holders:
        h.join()
    return {"idle_connections_opened": opened, "normal_request_status": code,
            "normal_request_ms": round(took * 1000, 1)}


def kill_one(url: str, proc: subprocess.Popen[str], stage_kind: str) -> dict[str, Any]:
    """kill -9 the worker of ``stage_kind``; poll /health every 20 ms until it is 200 again."""
    from stages.lockdown import serving_pid
    from trio_orch.testing import child_pids

    host, port = split_url(url)
    victim = next(p for p in child_pids(serving_pid(proc.pid))
                  if f"--kind\x00{stage_kind}\x00" in Path(f"/proc/{p}/cmdline").read_text())
    os.kill(victim, signal.SIGKILL)
    t0 = time.perf_counter()
    samples: list[tuple[float, int]] = []
    while time.perf_counter() - t0 < 60:
        code, _ = asyncio.run(post(host, port, "/health", None))
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


def cpu_list(text: str) -> set[int]:
    """``"0,2-3"`` -> {0, 2, 3}: the CPUs a process may run on."""
    cpus: set[int] = set()
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        try:
            cpus.update(range(int(lo), int(hi or lo) + 1))
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a CPU list: {text!r} (e.g. '0' or '0,2-3')") from None
    return cpus


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.perf.operating", description=__doc__.split("\n\n")[0])
    p.add_argument("--serve-args", default="", help="extra trio-orch serve flags, e.g. '--in-process'")
    p.add_argument("--unloaded", type=int, default=30, help="requests one at a time (default 30)")
    p.add_argument("--burst", type=int, default=1024, help="requests at once (default 1024)")
    p.add_argument("--rounds", type=int, default=5,
                   help="bursts, a second apart; admitted latencies are pooled over them (default 5)")
    p.add_argument("--repeat", type=int, default=1,
                   help="unloaded requests then bursts, this many times, pooled; the ratio of each "
                        "repeat is reported too (default 1)")
    p.add_argument("--idle", type=int, default=20000, help="idle connections (default 20000)")
    p.add_argument("--kill", default="talker", help="stage kind to kill -9 (default talker; '' skips)")
    p.add_argument("--procs", type=int, default=4, help="client processes (default 4)")
    p.add_argument("--probe", type=int, default=0, metavar="N",
                   help="N rounds of: one request alone, one with a burst released as it is written; "
                        "reports its latency and its workers' compute time (default 0: skip)")
    p.add_argument("--server-cpus", type=cpu_list, default=None, metavar="LIST",
                   help="pin the server and its workers to these CPUs, e.g. '0' (Linux)")
    p.add_argument("--client-cpus", type=cpu_list, default=None, metavar="LIST",
                   help="pin the load generator (this process and its clients) to these CPUs, e.g. '1'")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the results here")
    p.add_argument("--report", nargs="+", metavar="JSON", help="no run: render these runs' JSON (one table "
                   "row each) into --markdown")
    p.add_argument("--markdown", default=None, metavar="PATH",
                   help=f"with --report: the file whose {BEGIN} ... {END} block gets the table")
    args = p.parse_args(argv)
    if args.report:
        runs = [json.loads(Path(f).read_text()) for f in args.report]
        table = markdown_table(runs)
        if args.markdown:
            write_markdown(Path(args.markdown), table)
            print(f"wrote {args.markdown}")
        else:
            print(table)
        return 0
    proc, url = start_server(args.serve_args.split(), args.server_cpus)
    if args.client_cpus:
        os.sched_setaffinity(0, args.client_cpus)
    out: dict[str, Any] = {"serve_args": args.serve_args, "cpus": os.cpu_count(),
                           "server_cpus": sorted(args.server_cpus or ()),
                           "client_cpus": sorted(args.client_cpus or ())}
    try:
        out.update(measure(url, unloaded_n=args.unloaded, burst_n=args.burst, procs=args.procs,
                           rounds=args.rounds, repeat=args.repeat, client_cpus=args.client_cpus))
        if args.probe:
            out["probe"] = probe(url, args.probe, args.burst, args.procs, args.client_cpus)
        if args.idle:
            out["idle"] = idle(url, args.idle, max(2, args.procs // 2))
        if args.kill:
            if args.idle:
                time.sleep(2.0)  # the server settles after closing the idle connections
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


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x:.0f}"


def run_label(run: dict[str, Any]) -> str:
    """A run's settings, and where its processes ran when they were pinned."""
    label = f"`{run['serve_args']}`" if run["serve_args"] else "defaults"
    server, clients = run.get("server_cpus"), run.get("client_cpus")
    if server or clients:
        def cpus(xs: list[int] | None) -> str:
            return ",".join(map(str, xs)) if xs else "any"
        label += f" (server on CPU {cpus(server)}, load generator on CPU {cpus(clients)})"
    return label


def markdown_table(runs: list[dict[str, Any]]) -> str:
    """The runs as the table of docs/operating.md (a row per run), then the idle and kill results."""
    out = ["| settings | unloaded p50 / p99 (ms) | unloaded p99, engine (ms) | bursts x requests -> admitted "
           "/ 429 / other | admitted p50 / p99 (ms) | admitted p99, engine (ms) | 429 p99 (ms) |",
           "|---|---|---|---|---|---|---|"]
    for run in runs:
        u, b = run["unloaded"], run["burst"]
        label = run_label(run)
        ratio = f" ({b['p99_vs_unloaded']:.2f}x" if b.get("p99_vs_unloaded") else ""
        each = [r for r in b.get("p99_vs_unloaded_per_repeat") or [] if r is not None]
        if ratio and len(each) > 1:
            ratio += f"; {len(each)} repeats: {min(each):.2f}-{max(each):.2f}x"
        ratio += ")" if ratio else ""
        out.append(f"| {label} | {_ms(u['p50_ms'])} / {_ms(u['p99_ms'])} "
                   f"| ≤ {_ms(u['engine_p99_ms_bucket'])} "
                   f"| {b.get('rounds', 1)} x {b['requests'] // b.get('rounds', 1)} -> {b['admitted']} / "
                   f"{b['shed_429']} / {len(b['other'])} "
                   f"| {_ms(b['admitted_p50_ms'])} / {_ms(b['admitted_p99_ms'])}{ratio} "
                   f"| ≤ {_ms(b['engine_p99_ms_bucket'])} | {_ms(b['shed_p99_ms'])} |")
    out.append("")
    for run in runs:
        label = run_label(run)
        if "probe" in run:
            pr = run["probe"]
            a, b = pr["alone"], pr["burst"]
            out.append(f"- {label}: where an admitted request's time goes ({pr['rounds']} rounds): alone, "
                       f"{_ms(a['client_p50_ms'])} ms at the client (median; max {_ms(a['client_max_ms'])}), "
                       f"{_ms(a['compute_p50_ms'])} ms of it computing in the workers; with a burst "
                       f"released as it was written, {_ms(b['client_p50_ms'])} ms (max "
                       f"{_ms(b['client_max_ms'])}), {_ms(b['compute_p50_ms'])} ms computing.")
        if "idle" in run:
            i = run["idle"]
            out.append(f"- {label}: {i['idle_connections_opened']} idle connections, then a normal request: "
                       f"HTTP {i['normal_request_status']} in {i['normal_request_ms']:.0f} ms.")
        if "kill" in run:
            k = run["kill"]
            out.append(f"- {label}: kill -9 the only talker, `/health` polled every 20 ms "
                       f"({k['polls']} polls): first 503 after {k['first_503_after_ms']} ms, "
                       f"503 `degraded` for {k['503_for_s']} s "
                       f"until the replacement was ready, {k['200_during_outage']} answers of 200 during the "
                       "outage.")
        out.append(f"- {label}: `serve` exited {run['exit_code']} after the SIGTERM that ended the run; "
                   f"{run['cpus']} CPUs.")
    out.append("")
    out.append("(engine columns: the bucket of `trio_orch_request_duration_seconds` holding the 99th "
               "percentile, so an upper bound; client columns: measured by the client processes, from "
               "writing the request to the last byte of the answer.)")
    return "\n".join(out) + "\n"


def write_markdown(path: Path, table: str) -> None:
    """Replace what is between the markers of ``path`` with ``table``."""
    update_between_markers(path, table, BEGIN, END)


if __name__ == "__main__":
    raise SystemExit(main())
