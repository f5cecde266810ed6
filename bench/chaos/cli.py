"""``trio-orch chaos``: the fault matrix, one fault at a time, over real worker processes.

Each fault gets a fresh pipeline (the default thinker -> talker -> code2wav
torch pipeline with 2 replicas per stage and short generations, or echo
workers with ``--echo``) under the supervisor, ``--requests`` requests with
at most ``--concurrency`` in flight, the fault injected mid-load, a check
that fresh requests still finish, a shutdown, and a leak check.  Every cell
of the table comes from that run:

* completed / failed by kind: terminals of the accepted requests (plus the
  ``--probe`` requests sent after the fault);
* no terminal / duplicates / after terminal: requests without exactly one
  terminal, second terminals, messages after a terminal (all must be 0);
* leaks: worker processes still alive, fds opened and not closed, files left
  in the pipeline's ipc directory, after shutdown (all must be 0);
* serving: the probe requests after the fault all finished;
* detect / recover: seconds from the fault to its detection (e.g. the
  supervisor seeing the death) and to recovery (the replacement ready).

Output: a terminal table, ``--json PATH``, ``--markdown PATH``; the exit
status is 1 if any row breaks a guarantee.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import trio

from bench.chaos.faults import FAULTS
from bench.chaos.run import IMPLEMENTATION, ChaosOptions, ChaosResult
from stages.schema import positive_seconds_arg

__all__ = ["configure", "main_async", "render_markdown", "render_table", "renderables", "run"]

QUICK_REQUESTS = 200


def configure(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.description = __doc__
    parser.epilog = ("faults:\n" + "\n".join(f"  {name:22s} {f.description}" for name, f in FAULTS.items())
                     + f"\nimplementation: {IMPLEMENTATION} (the one that supports the whole process layer: "
                       "replica pools, supervisor, async-chunk connector)")
    parser.add_argument("--quick", action="store_true",
                        help=f"{QUICK_REQUESTS} requests per fault instead of 1000 (2-3 minutes in all)")
    parser.add_argument("--requests", type=int, default=None, metavar="N",
                        help="requests per fault (default 1000; --quick: 200)")
    parser.add_argument("--concurrency", type=int, default=64, metavar="C", help="most requests in flight")
    parser.add_argument("--only", action="append", default=[], metavar="NAME",
                        help="run only this fault (repeatable)")
    parser.add_argument("--echo", action="store_true",
                        help="echo workers instead of the torch models (model compute is irrelevant to "
                             "most faults; the table says which workers ran)")
    parser.add_argument("--max-new-tokens", type=int, default=4, help="thinker tokens per request")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="torch device of the workers (default cpu)")
    parser.add_argument("--request-timeout", type=positive_seconds_arg, default=30.0,
                        help="per-request deadline (the server default); a hang shows up as 'timeout'")
    parser.add_argument("--probe", type=int, default=20,
                        help="requests sent after the fault to check it still serves")
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON")
    parser.add_argument("--markdown", metavar="PATH", help="write the table as markdown")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random choices (abort storm)")
    parser.add_argument("--no-progress", action="store_true", help="no progress lines on stderr")
    parser.add_argument("--worker-backend", choices=["local", "ray"], default="local",
                        help="local: the faults on worker processes of this host (default); ray: the "
                             "ray_* faults, the replicas as Ray actors on a two-node Ray cluster started "
                             "on this machine for the run (needs the ray extra)")


def _fmt_s(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.2f}"


def _notes(r: ChaosResult) -> str:
    notes = ", ".join(f"{k}={v}" for k, v in r.notes.items())
    if r.restarts:
        notes = f"restarts={r.restarts}" + (f", {notes}" if notes else "")
    if r.refused:
        notes = f"refused={r.refused}" + (f", {notes}" if notes else "")
    if r.error:
        notes = f"ERROR {r.error}" + (f", {notes}" if notes else "")
    return notes or "-"


def _row(r: ChaosResult) -> list[str]:
    failed = ", ".join(f"{k} {n}" for k, n in r.failed.items()) or "-"
    leaks = f"{r.leaked_processes}/{r.leaked_fds}/{r.leaked_ipc_files}"
    return [r.fault, str(r.accepted), str(r.completed), failed, str(r.without_terminal),
            str(r.duplicates + r.after_terminal), leaks, r.still_serving, _fmt_s(r.detect_s),
            _fmt_s(r.recover_s), "ok" if r.ok else "FAIL", _notes(r)]


HEADERS = ["fault", "accepted", "completed", "failed by kind", "no terminal", "dup/after",
           "leaked proc/fd/ipc", "serving after", "detect s", "recover s", "verdict", "notes"]

#: the terminal table's columns: (header, the cell from a markdown row), narrow enough for 100 columns
_TERMINAL = [("fault", lambda c: c[0]), ("completed\n/accepted", lambda c: f"{c[2]}/{c[1]}"),
             ("failed by kind", lambda c: c[3]), ("no terminal\n/dup/after", lambda c: f"{c[4]}/{c[5]}"),
             ("leaked\nproc/fd/ipc", lambda c: c[6]), ("serving\nafter", lambda c: c[7]),
             ("detect\n/recover s", lambda c: f"{c[8]}/{c[9]}"), ("verdict", lambda c: c[10])]

LEGEND = [
    "completed/accepted: requests that finished / that the orchestrator accepted",
    "failed by kind: terminals that were errors, by kind",
    "no terminal/dup/after: requests without a terminal / second terminals and messages after one "
    "(must be 0/0)",
    "leaked proc/fd/ipc: worker processes alive, descriptors left open, ipc files left after shutdown "
    "(must be 0/0/0)",
    "serving after: the probe requests sent after the fault all finished",
    "detect/recover s: seconds from the fault to its detection and to the replacement being ready",
    "verdict: ok where the row keeps every guarantee, FAIL where it breaks one",
]


def renderables(results: list[ChaosResult]) -> list[Any]:
    """The rich table (fits 100 columns: each row's notes are listed under it), notes and legend."""
    from bench.tables import table, text

    rows = [_row(r) for r in results]
    parts: list[Any] = [table([h for h, _ in _TERMINAL], [[cell(c) for _, cell in _TERMINAL] for c in rows],
                              title="Chaos matrix", names={0}, numbers={1, 3, 4, 6})]
    notes = [f"  {c[0]}: {c[11]}" for c in rows if c[11] != "-"]
    if notes:
        parts.append(text("Notes\n" + "\n".join(notes)))
    parts.append(text("Legend\n" + "\n".join(f"  {line}" for line in LEGEND)))
    return parts


def render_table(results: list[ChaosResult], columns: int | None = None) -> str:
    """The table, the notes and the legend as plain text, ``columns`` wide (default: the terminal's)."""
    from bench.tables import render

    return render(renderables(results), columns)


def render_markdown(results: list[ChaosResult], meta: dict[str, Any]) -> str:
    out = [f"Chaos matrix: `{meta['command']}` ({meta.get('implementation', IMPLEMENTATION)} over "
           f"{meta['workers']} workers, {meta['requests']} requests per "
           f"fault + {meta['probe']} probe requests, 2 replicas per stage, {meta['date']}).", ""]
    out.append("| " + " | ".join(HEADERS[:-1]) + " | notes |")
    out.append("|" + "---|" * len(HEADERS))
    for r in results:
        out.append("| " + " | ".join(c.replace("|", "/") for c in _row(r)) + " |")
    out.append("")
    out.extend(f"- **{r.fault}**: {r.description}" for r in results)
    return "\n".join(out) + "\n"


def _on_ray(fault: Any) -> bool:
    setup = getattr(fault, "setup", None)
    return bool(setup is not None and setup.ray)


async def main_async(args: argparse.Namespace, ray_cluster: Any = None) -> list[ChaosResult]:
    ray = getattr(args, "worker_backend", "local") == "ray"
    faults = {name: f for name, f in FAULTS.items() if _on_ray(f) == ray}
    names = args.only or list(faults)
    unknown = [n for n in names if n not in faults]
    if unknown:
        other = [n for n in unknown if n in FAULTS]
        if other:
            raise SystemExit(f"fault(s) {other} run {'without' if ray else 'with'} --worker-backend ray")
        raise SystemExit(f"unknown fault(s) {unknown}; known: {', '.join(faults)}")
    n_req = args.requests or (QUICK_REQUESTS if args.quick else 1000)
    opts = ChaosOptions(requests=n_req, concurrency=args.concurrency, echo=args.echo,
                        max_new_tokens=args.max_new_tokens, request_timeout=args.request_timeout,
                        probe_requests=args.probe, progress=not args.no_progress, seed=args.seed,
                        device=args.device, ray=ray_cluster)
    from bench.tables import console, text

    err = console(stderr=True)
    results = []
    for i, name in enumerate(names, 1):
        f = faults[name]
        err.print(text(f"[{i}/{len(names)}] {name}: {f.description}"))
        res = await f.run(opts)
        err.print(text(f"  -> {'ok' if res.ok else 'FAIL'}: {res.completed} completed, failed "
                       f"{res.failed or '-'}, {res.without_terminal} without terminal, {res.wall_s:.1f}s"))
        if not res.ok:
            for kind, example in res.error_examples.items():
                err.print(text(f"     first {kind}: {example}"))
        results.append(res)
    return results


def run(args: argparse.Namespace) -> int:
    t0 = time.monotonic()
    orch_log = logging.getLogger("trio_orch")
    saved_level = orch_log.level
    if not (getattr(args, "verbose", 0) or getattr(args, "sub_verbose", 0)):
        # The faults make the orchestrator log warnings by the hundred (that is their job); keep the
        # progress readable.  -v shows them.
        orch_log.setLevel(logging.CRITICAL)
    try:
        if getattr(args, "worker_backend", "local") == "ray":
            from bench.chaos.ray import local_cluster

            print("starting a two-node Ray cluster on this machine ...", file=sys.stderr, flush=True)
            with local_cluster() as cluster:
                results = trio.run(main_async, args, cluster)
        else:
            results = trio.run(main_async, args)
    finally:
        orch_log.setLevel(saved_level)
    from bench.tables import console

    out = console()
    for part in renderables(results):
        out.print(part)
    meta = {"command": "trio-orch chaos " + " ".join(sys.argv[2:]) if sys.argv[1:2] == ["chaos"]
            else "trio-orch chaos", "implementation": IMPLEMENTATION,
            "workers": results[0].workers if results else "-",
            "requests": results[0].requests if results else 0, "probe": args.probe,
            "date": time.strftime("%Y-%m-%d", time.gmtime()), "wall_s": round(time.monotonic() - t0, 1)}
    if args.json:
        Path(args.json).write_text(json.dumps({"meta": meta, "results": [asdict(r) | {"ok": r.ok}
                                                                          for r in results]}, indent=2))
        print(f"wrote {args.json}", file=sys.stderr)
    if args.markdown:
        Path(args.markdown).write_text(render_markdown(results, meta))
        print(f"wrote {args.markdown}", file=sys.stderr)
    bad = [r.fault for r in results if not r.ok]
    print(f"{len(results) - len(bad)}/{len(results)} faults kept every guarantee"
          + (f"; FAILED: {', '.join(bad)}" if bad else "") + f" ({time.monotonic() - t0:.0f}s)")
    return 1 if bad else 0
