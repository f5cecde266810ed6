"""``python -m bench.perf.overhead``: what orchestration costs beside a real model's step.

One checkpoint stage -- the tiny test checkpoint (:mod:`trio_orch.testing.checkpoints`)
widened (:data:`SHAPE`) so one sequence's step takes milliseconds on a CPU --
measured two ways on the same requests, in one run:

- **served**: ``trio-orch serve MODEL_DIR`` on each front (``--loop asyncio``
  and ``--loop trio``, both started once), clients streaming
  ``/v1/completions`` over loopback;
- **alone**: the worker's model (the same ``hf-causal-lm`` stage, built as
  the worker builds it, one torch thread as the worker has) driven by the
  worker's loop reduced to the model -- admit every request, step the batch
  until each finished, release -- with no orchestrator, no socket, no HTTP
  (:mod:`bench.perf.alone`, in a process and session of its own, as a
  worker is).

A *wave* is ``c`` requests sent at once (``c`` in ``--levels``: 1, 8, 32), each
greedy with ``min_tokens = max_tokens = --tokens`` so every one generates the
same number of tokens and the batch is ``c`` for every step alone.  Per front
and level: tokens/s, time to first token (TTFT: from sending the request to
its first streamed text), inter-token latency (ITL: the gap between two
streamed text pieces -- one token, or several where a character spans
tokens; alone: between two step outputs with text), and the **overhead**:
the median served wave's wall time over the median alone wave's, minus one,
and its CPU twin: the serving process's and its worker's CPU per token over
the model's alone, minus one (wall time moves with a shared machine's load;
CPU much less).  Each served request's text must equal the alone run's for
the same prompt (greedy, and batching never changes a request's numbers):
the JSON counts the mismatches.

Where the difference goes: the worker's model steps (served: the worker's
``stats``; alone: counted), CPU seconds per token of the serving process and
of its worker (``/proc``) against the model alone, and with ``--py-spy S`` a
py-spy profile of both processes during ``S`` seconds of waves at the level
of the largest CPU overhead.  ``--waves`` waves per level, implementation
and round, the three (alone and the two fronts) interleaved wave by wave in
a shuffled order, so drift of a shared machine hits all alike.

``--quick``: levels 1 and 4, 4 tokens, one round, the tiny checkpoint as the
tests build it (a few seconds of waves; the servers' start-up dominates).
Prints the JSON (``--json PATH`` writes it); ``--markdown PATH`` renders it
between the file's ``<!-- overhead:begin -->`` / ``<!-- overhead:end -->``
markers.  Nothing is asserted: note the machine's load (``--machine``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.perf.report import publish
from bench.perf.serving import open_stream, pct, proc_cpu, split_url, start_server, stop_server

__all__ = ["BEGIN", "END", "SHAPE", "Alone", "Served", "Wave", "main", "markdown", "overhead_at", "place_of",
           "prompts", "run"]

BEGIN, END = "<!-- overhead:begin -->", "<!-- overhead:end -->"
#: the tiny test checkpoint widened: one sequence's step takes a few ms on a CPU (``--quick``: as the tests')
SHAPE: dict[str, int] = {"hidden_size": 256, "layers": 2, "heads": 4, "kv_heads": 2}
MODEL = "bench"  # the served model name
ADMIN = "overhead-bench"  # the admin token of the benchmark's servers (loopback only): worker stats
FRONTS = ("asyncio", "trio")
GOAL = 0.05  # the overhead the project aims under
RATE = 200  # py-spy's samples per second
WORDS = ("the quick brown fox jumps over the lazy dog hello world how are you today a stage worker "
         "serves a model from a local checkpoint directory tokens stream back one at a time").split()


def prompts(n: int, offset: int = 0) -> list[str]:
    """``n`` different prompts of 8 to 15 words (the same ``offset`` gives the same prompts)."""
    out = []
    for i in range(offset, offset + n):
        rng = random.Random(i)
        out.append(" ".join(rng.choice(WORDS) for _ in range(8 + i % 8)))
    return out


@dataclass
class Wave:
    """What one wave gave: per request its TTFT and text; the gaps between pieces; tokens; wall time."""

    ttft: list[float] = field(default_factory=list)
    gaps: list[float] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    tokens: int = 0
    wall: float = 0.0
    failed: int = 0


class Alone:
    """The worker's model stepping alone (:mod:`bench.perf.alone`), in a process and session of its own."""

    def __init__(self, checkpoint: str, device: str) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "bench.perf.alone", checkpoint, device],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     start_new_session=True)  # as the launcher starts a worker
        self.steps = 0
        self._ask(None)

    def _ask(self, ask: dict[str, Any] | None) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        if ask is not None:
            self.proc.stdin.write(json.dumps(ask) + "\n")
            self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"bench.perf.alone exited with code {self.proc.wait()}")
        return json.loads(line)

    def wave(self, texts: list[str], tokens: int) -> Wave:
        r = self._ask({"texts": texts, "tokens": tokens})
        self.steps = r["steps"]
        return Wave(r["ttft"], r["gaps"], r["texts"], r["tokens"], r["wall"])

    def cpu(self) -> dict[str, float]:
        return {"model": proc_cpu(self.proc.pid)}

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


async def _complete(host: str, port: int, prompt: str, tokens: int, w: Wave, i: int,
                    timeout: float = 600.0) -> None:
    """One streamed greedy completion on a fresh connection: its TTFT, gaps, text and token count."""
    body = json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": tokens, "min_tokens": tokens,
                       "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}).encode()
    t0 = time.perf_counter()
    last: float | None = None
    try:
        status, reader, writer = await open_stream(host, port, "/v1/completions", body, timeout)
        if status != 200:
            raise OSError(f"HTTP {status}")
        while line := await asyncio.wait_for(reader.readline(), timeout):
            if not line.startswith(b"data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                w.tokens += chunk["usage"]["completion_tokens"]
            text = "".join(c.get("text") or "" for c in chunk.get("choices", ()))
            if text:
                now = time.perf_counter()
                if last is None:
                    w.ttft.append(now - t0)
                else:
                    w.gaps.append(now - last)
                last = now
                w.texts[i] += text
        writer.close()
    except (OSError, TimeoutError, ValueError):
        w.failed += 1


class Served:
    """``trio-orch serve MODEL_DIR --loop LOOP``: its address, its worker, their CPU and the steps."""

    def __init__(self, checkpoint: str, loop: str, device: str) -> None:
        from stages.lockdown import serving_pid
        from trio_orch.serve.credentials import TOKEN_ENV
        from trio_orch.testing import child_pids, worker_alive

        self.loop = loop
        self.proc, self.url = start_server(
            [checkpoint, "--loop", loop, "--device", device, "--served-model-name", MODEL,
             "--request-timeout", "600", "--startup-timeout", "600"],
            env={TOKEN_ENV: ADMIN})
        # serve and each worker go on in a fresh child of the process started (stages.lockdown): those
        # children do the work, their stand-ins idle
        self.head = serving_pid(self.proc.pid)
        workers = [p for p in child_pids(self.head) if worker_alive(p)]
        assert len(workers) == 1, f"expected one worker under serve, found {workers}"
        self.worker = serving_pid(workers[0])

    def wave(self, texts: list[str], tokens: int) -> Wave:
        host, port = split_url(self.url)
        w = Wave(texts=[""] * len(texts))

        async def all_at_once() -> None:
            await asyncio.gather(*(_complete(host, port, p, tokens, w, i) for i, p in enumerate(texts)))

        t0 = time.perf_counter()
        asyncio.run(all_at_once())
        w.wall = time.perf_counter() - t0
        return w

    def cpu(self) -> dict[str, float]:
        return {"head": proc_cpu(self.head), "worker": proc_cpu(self.worker)}

    @property
    def steps(self) -> int:
        """The worker's model steps so far (its ``stats``, through ``/admin/stats``)."""
        import urllib.request

        req = urllib.request.Request(f"{self.url}/admin/stats", headers={"Authorization": f"Bearer {ADMIN}"})
        with urllib.request.urlopen(req, timeout=60) as r:
            return int(json.loads(r.read())["results"][0]["value"]["steps"])

    def close(self) -> None:
        stop_server(self.proc)


# ---------------------------------------------------------------------------- the run
@dataclass
class Tally:
    """One (implementation, level)'s waves summed over rounds."""

    ttft: list[float] = field(default_factory=list)
    gaps: list[float] = field(default_factory=list)
    tokens: int = 0
    wall: float = 0.0
    steps: int = 0
    failed: int = 0
    mismatched: int = 0
    requests: int = 0
    cpu: Counter[str] = field(default_factory=Counter)
    walls: list[float] = field(default_factory=list)  # per round: the waves' wall times summed
    wave_walls: list[float] = field(default_factory=list)  # every wave's

    def add(self, w: Wave, steps: int, cpu: dict[str, float]) -> None:
        self.ttft += w.ttft
        self.gaps += w.gaps
        self.tokens += w.tokens
        self.wall += w.wall
        self.steps += steps
        self.failed += w.failed
        self.requests += len(w.texts)
        self.cpu.update(cpu)
        self.wave_walls.append(w.wall)

    def summary(self) -> dict[str, Any]:
        per_token = {k: round(v / self.tokens * 1e3, 3) if self.tokens else None for k, v in self.cpu.items()}
        return {"requests": self.requests, "failed": self.failed, "mismatched_texts": self.mismatched,
                "tokens": self.tokens, "wall_s": round(self.wall, 4), "waves": len(self.wave_walls),
                "wave_wall_p50_ms": pct(self.wave_walls, 0.5),
                "tokens_per_s": round(self.tokens / self.wall, 2) if self.wall else None,
                "ttft_p50_ms": pct(self.ttft, 0.5), "ttft_p99_ms": pct(self.ttft, 0.99),
                "itl_p50_ms": pct(self.gaps, 0.5), "itl_p99_ms": pct(self.gaps, 0.99),
                "steps": self.steps,
                "tokens_per_step": round(self.tokens / self.steps, 2) if self.steps else None,
                "cpu_ms_per_token": per_token, "wall_s_rounds": [round(x, 4) for x in self.walls]}


def _measure(impl: Alone | Served, texts: list[str], tokens: int, tally: Tally,
             reference: dict[str, str]) -> float:
    """One wave of ``texts`` on ``impl`` into ``tally`` (texts checked against ``reference``); its wall."""
    steps0, cpu0 = impl.steps, impl.cpu()
    w = impl.wave(texts, tokens)
    cpu1 = impl.cpu()
    tally.add(w, impl.steps - steps0, {k: cpu1[k] - cpu0[k] for k in cpu0})
    for p, text in zip(texts, w.texts, strict=True):
        if reference.setdefault(p, text) != text:
            tally.mismatched += 1
    return w.wall


def _start_fronts(checkpoint: str, device: str) -> dict[str, Served]:
    """Both fronts, started at once (each loads the model in its worker)."""
    out: dict[str, Served] = {}
    errors: list[BaseException] = []

    def start(loop: str) -> None:
        try:
            out[loop] = Served(checkpoint, loop, device)
        except BaseException as exc:  # reported below, after the other one started or failed
            errors.append(exc)

    threads = [threading.Thread(target=start, args=(loop,)) for loop in FRONTS]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        for s in out.values():
            s.close()
        raise errors[0]
    return out


def run(args: argparse.Namespace, checkpoint: str, progress: Any = print) -> dict[str, Any]:
    """Every level on alone and both fronts, ``--rounds`` interleaved rounds; the results as a dict."""
    fronts = _start_fronts(checkpoint, args.device)
    alone: Alone | None = None
    try:
        alone = Alone(checkpoint, args.device)
        impls: dict[str, Alone | Served] = {"alone": alone, **fronts}
        for name, impl in impls.items():  # warm-up, not measured: first requests import and allocate
            for c in sorted({1, min(4, max(args.levels))}):
                impl.wave(prompts(c, offset=10_000), args.tokens)
            progress(f"warmed up: {name}")
        tallies = {(n, c): Tally() for n in impls for c in args.levels}
        reference: dict[str, str] = {}
        for r in range(args.rounds):
            for c in args.levels:
                texts = prompts(c)
                walls = Counter[str]()
                for w in range(args.waves):  # wave by wave, in a shuffled order: drift hits all alike
                    order = list(impls)
                    random.Random(f"{r}/{c}/{w}").shuffle(order)
                    for name in order:
                        walls[name] += _measure(impls[name], texts, args.tokens, tallies[name, c], reference)
                for name in impls:
                    tallies[name, c].walls.append(walls[name])
                progress(f"round {r + 1}/{args.rounds}: {args.waves} waves of {c} on each of "
                         f"{', '.join(impls)}")
        results = {name: {str(c): tallies[name, c].summary() for c in args.levels} for name in impls}
        overhead = {front: {str(c): overhead_at(results["alone"][str(c)], results[front][str(c)])
                            for c in args.levels} for front in FRONTS}
        out: dict[str, Any] = {"results": results, "overhead": overhead}
        if args.py_spy:
            worst = max(args.levels,
                        key=lambda c: max(overhead[f][str(c)]["cpu_overhead"] or 0.0 for f in FRONTS))
            out["profile"] = {"level": worst, "seconds": args.py_spy,
                              **{f: _profile(fronts[f], worst, args) for f in FRONTS}}
        return out
    finally:
        for s in fronts.values():
            s.close()
        if alone is not None:
            alone.close()


def overhead_at(alone: dict[str, Any], served: dict[str, Any]) -> dict[str, Any]:
    """Served against alone at one level: the wall time's overhead (the median wave's; each round's waves
    summed), and the CPU's: the serving process's and its worker's per token over the model's alone."""
    def ratio(a: Any, b: Any) -> float | None:
        return round(a / b, 3) if a is not None and b else None

    walls = zip(served["wall_s_rounds"], alone["wall_s_rounds"], strict=True)
    rounds = [round(s / a - 1, 4) for s, a in walls if a]
    cpu, model = served["cpu_ms_per_token"], alone["cpu_ms_per_token"]["model"]
    med, base = served["wave_wall_p50_ms"], alone["wave_wall_p50_ms"]
    return {"overhead": round(med / base - 1, 4) if med is not None and base else None,
            "overhead_rounds": rounds,
            "cpu_overhead": round((cpu["head"] + cpu["worker"]) / model - 1, 4) if model else None,
            "ttft_p50_ratio": ratio(served["ttft_p50_ms"], alone["ttft_p50_ms"]),
            "itl_p50_ratio": ratio(served["itl_p50_ms"], alone["itl_p50_ms"])}


# ---------------------------------------------------------------------------- the profile
#: where a frame's time goes, by a fragment of its path (first match): the model, or orchestration's parts
_PLACES = (("torch/", "model (torch)"), ("transformers/", "model (transformers)"),
           ("stages/hf/", "model (stage code)"), ("stages/text_stream", "model (stage code)"),
           ("stages/sampling", "model (stage code)"), ("tokenizers", "model (stage code)"),
           ("stages/wire", "wire (msgspec frames)"), ("msgspec", "wire (msgspec frames)"),
           ("stages/", "worker loop"), ("zmq/", "zmq"),
           ("trio_orch/serve", "HTTP server"), ("trio_orch/http", "HTTP app"),
           ("trio_orch/openai", "HTTP app"), ("trio_orch/", "orchestrator"), ("uvicorn/", "HTTP server"),
           ("h11/", "HTTP server"), ("starlette/", "HTTP app"), ("anyio/", "HTTP app"), ("trio/", "trio"),
           ("asyncio/", "asyncio"), ("selectors", "asyncio"), ("threading", "threads"), ("janus", "threads"),
           ("importlib", "imports"), ("<frozen", "imports"), ("dataclasses", "imports"), ("sympy", "imports"))


def place_of(frame: str) -> str:
    """``"name (path:line)"`` (py-spy's raw format) -> where its time goes (:data:`_PLACES`)."""
    path = frame.rsplit("(", 1)[-1]
    return next((label for part, label in _PLACES if part in path), "other")


def _py_spy(pid: int, seconds: float, out: Path) -> subprocess.Popen[bytes]:
    exe = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    return subprocess.Popen([exe, "record", "-p", str(pid), "-d", str(max(1, round(seconds))),
                             "-r", str(RATE), "--nonblocking", "-f", "raw", "-o", str(out)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def _shares(raw: str, seconds: float) -> dict[str, Any]:
    """py-spy's busy samples (idle ones are left out) of one process, charged to their innermost frame."""
    inner: Counter[str] = Counter()
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        inner[place_of(stack.split(";")[-1])] += int(count)
    total = sum(inner.values())
    return {"samples": total, "busy_cores": round(total / (RATE * seconds), 2),
            "innermost": {k: round(v / max(total, 1), 3) for k, v in inner.most_common()}}


def _profile(front: Served, level: int, args: argparse.Namespace) -> dict[str, Any]:
    """Both processes of ``front`` under py-spy while waves at ``level`` run back to back."""
    if shutil.which("py-spy") is None and not Path(sys.executable).with_name("py-spy").exists():
        raise SystemExit("--py-spy needs py-spy (pip install py-spy)")
    with tempfile.TemporaryDirectory() as d:
        outs = {"head": Path(d) / "head.txt", "worker": Path(d) / "worker.txt"}
        spies = {name: _py_spy(pid, args.py_spy, outs[name])
                 for name, pid in (("head", front.proc.pid), ("worker", front.worker))}
        while any(p.poll() is None for p in spies.values()):
            front.wave(prompts(level), args.tokens)
        for name, p in spies.items():
            if p.returncode != 0:
                err = p.stderr.read().decode(errors="replace") if p.stderr else ""
                raise SystemExit(f"py-spy of the {name} failed: {err.strip()}")
        return {name: _shares(path.read_text(), args.py_spy) for name, path in outs.items()}


# ---------------------------------------------------------------------------- the table
def _pair(a: Any, b: Any) -> str:
    return f"{a} / {b}"


def _pct(x: float | None) -> str:
    """A signed percentage, or n/a where the run could not compute it (a measure that came out empty)."""
    return "n/a" if x is None else f"{x:+.1%}"


def markdown(out: dict[str, Any]) -> str:
    """The run as tables: per front and level, served against alone; where it goes; a line on the run."""
    s, res = out["settings"], out["results"]
    lines = ["| front | concurrent requests | tokens/s served / alone | overhead: wall time (rounds) "
             "| overhead: CPU | TTFT p50 served / alone (ms) | TTFT p99 served / alone (ms) "
             "| ITL p50 served / alone (ms) | ITL p99 served / alone (ms) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for front in FRONTS:
        for c in map(str, s["levels"]):
            sv, al, ov = res[front][c], res["alone"][c], out["overhead"][front][c]
            rounds = ", ".join(f"{x:+.1%}" for x in ov["overhead_rounds"])
            lines.append(f"| {front} | {c} | {_pair(sv['tokens_per_s'], al['tokens_per_s'])} "
                         f"| **{_pct(ov['overhead'])}** ({rounds}) | **{_pct(ov['cpu_overhead'])}** "
                         f"| {_pair(sv['ttft_p50_ms'], al['ttft_p50_ms'])} "
                         f"| {_pair(sv['ttft_p99_ms'], al['ttft_p99_ms'])} "
                         f"| {_pair(sv['itl_p50_ms'], al['itl_p50_ms'])} "
                         f"| {_pair(sv['itl_p99_ms'], al['itl_p99_ms'])} |")
    lines += ["", "Where the time goes: the worker's model steps for the same tokens (tokens per step: the "
              "mean batch), and CPU per token generated -- the serving process, its worker, the model alone:",
              "", "| front | concurrent requests | steps served / alone | tokens per step served / alone "
              "| CPU / token: serve process (ms) | worker (ms) | model alone (ms) |",
              "|---|---|---|---|---|---|---|"]
    for front in FRONTS:
        for c in map(str, s["levels"]):
            sv, al = res[front][c], res["alone"][c]
            lines.append(f"| {front} | {c} | {_pair(sv['steps'], al['steps'])} "
                         f"| {_pair(sv['tokens_per_step'], al['tokens_per_step'])} "
                         f"| {sv['cpu_ms_per_token']['head']} | {sv['cpu_ms_per_token']['worker']} "
                         f"| {al['cpu_ms_per_token']['model']} |")
    prof = out.get("profile")
    if prof:
        lines += ["", f"py-spy, {prof['seconds']:g} s of waves at {prof['level']} concurrent requests, the "
                  f"level of the largest CPU overhead ({RATE} Hz; busy samples only, charged to the "
                  f"innermost frame; busy cores: busy samples per second of wall time / {RATE}):", "",
                  "| front | process | busy cores | innermost frame: share |", "|---|---|---|---|"]
        for front in FRONTS:
            for proc in ("head", "worker"):
                p = prof[front][proc]
                shares = ", ".join(f"{k} {v:.0%}" for k, v in p["innermost"].items() if v >= 0.01)
                lines.append(f"| {front} | {'serve process' if proc == 'head' else 'worker'} "
                             f"| {p['busy_cores']} | {shares} |")
    bad = sum(r[c]["mismatched_texts"] + r[c]["failed"] for r in res.values() for c in r)
    texts = (f"{bad} requests failed or answered another text than the same prompt elsewhere" if bad else
             "every request answered, each prompt with the same text served and alone")
    load = out["loadavg"]
    lines += ["", f"(`{out['command']}`, {out['date']}: checkpoint {s['checkpoint']}, {s['device']}; "
              f"waves of N requests sent at once, each {s['tokens']} greedy tokens (min_tokens = "
              f"max_tokens), {s['waves']} waves per level, implementation and round, the implementations "
              f"interleaved wave by wave, {s['rounds']} round(s); {texts}; {out['cpus']} CPUs, load average "
              f"{load[0]} at the start and {load[1]} at the end: {out['machine']}.)"]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------- the command
def build_checkpoint(directory: str, quick: bool) -> str:
    """The benchmark's checkpoint in ``directory``: the tests' tiny one (``quick``) or it widened."""
    from trio_orch.testing.checkpoints import tiny_checkpoint

    tiny_checkpoint(directory, **({} if quick else SHAPE))
    return directory


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.perf.overhead", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true",
                   help="levels 1 and 4, 4 tokens, one round, the tests' tiny checkpoint: proves it runs")
    p.add_argument("--levels", type=lambda v: [int(x) for x in v.split(",")], default=None, metavar="N,N",
                   help="concurrent requests per wave (default 1,8,32; --quick 1,4)")
    p.add_argument("--tokens", type=int, default=None, help="tokens each request generates (default 32)")
    p.add_argument("--waves", type=int, default=None,
                   help="waves per level, implementation and round (default 10; --quick 2)")
    p.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 2; --quick 1)")
    p.add_argument("--device", default="cpu", help="the model's device, served and alone (default cpu)")
    p.add_argument("--checkpoint", default=None, metavar="DIR",
                   help="a checkpoint directory to use (default: build the widened tiny one in a temporary "
                        "directory)")
    p.add_argument("--py-spy", type=float, default=0.0, metavar="SECONDS",
                   help="also profile each front's serve process and worker with py-spy for this long, at "
                        "the level that cost most (default off; needs py-spy and ptrace rights)")
    p.add_argument("--machine", default="", help="a note on the machine (e.g. 'loaded: 6 engineers' tests')")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the results here")
    p.add_argument("--markdown", default=None, metavar="PATH",
                   help=f"write the tables between {BEGIN} and {END} of this file")
    return p


def settings(args: argparse.Namespace) -> argparse.Namespace:
    """The defaults of the full and the quick run filled in; ValueError for an impossible setting."""
    q = args.quick
    defaults = {"levels": [1, 4] if q else [1, 8, 32], "tokens": 4 if q else 32, "waves": 2 if q else 10,
                "rounds": 1 if q else 2}
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if min(args.levels) < 1 or args.tokens < 1 or args.waves < 1 or args.rounds < 1:
        raise ValueError("--levels, --tokens, --waves and --rounds must be at least 1")
    if max(args.levels) > 32:
        raise ValueError("--levels: at most 32 concurrent requests (the stage's max_batch)")
    return args


def main(argv: list[str] | None = None, progress: Any = None) -> int:
    args = parser().parse_args(argv)
    try:
        settings(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    say = progress or (lambda line: print(line, file=sys.stderr, flush=True))
    load0 = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as d:
        ckpt = args.checkpoint or build_checkpoint(d, args.quick)
        measured = run(args, ckpt, say)
    shape = "the tests' tiny Qwen2" if args.quick else \
        f"tiny Qwen2 widened: hidden {SHAPE['hidden_size']}, {SHAPE['layers']} layers"
    out: dict[str, Any] = {
        "command": " ".join(["python -m bench.perf.overhead",
                             shlex.join(sys.argv[1:] if argv is None else argv)]).rstrip(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpus": os.cpu_count(),
        "loadavg": [round(load0, 1), round(os.getloadavg()[0], 1)],
        "machine": args.machine or "not described",
        "settings": {"levels": args.levels, "tokens": args.tokens, "waves": args.waves,
                     "rounds": args.rounds, "device": args.device, "goal": GOAL,
                     "checkpoint": args.checkpoint or shape},
        **measured}
    publish(out, args.json, args.markdown, markdown, BEGIN, END)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
