"""``python -m bench.gpu_check OUT``: the checkpoint pipeline and the overhead benchmark on CUDA.

For a machine with a GPU, never part of CI: one command that fits in five
minutes on one GPU and leaves everything it learnt in the folder ``OUT``:

1. ``gpus``: what torch sees (``gpus.json``);
2. ``checkpoint``: the benchmark's checkpoint (the tiny test one, widened)
   built in ``OUT/checkpoint``;
3. ``generate``: ``trio-orch generate --model OUT/checkpoint --device cuda:N``,
   greedy (``generate.log``), N the last GPU;
4. ``placement``: ``trio-orch serve OUT/checkpoint --device cuda:N``: one
   completion, and what its worker reports (``placement.json``: its device,
   its ``CUDA_VISIBLE_DEVICES``, the model's device); then ``serve`` asked for
   one GPU more than there are must exit 2 naming it, before any worker starts;
5. ``overhead``: ``python -m bench.perf.overhead --device cuda`` on that
   checkpoint (``overhead.json`` and ``overhead.md``).

Each step's output goes to ``OUT/<step>.log``; ``OUT/summary.json`` says
which passed, how long each took, and why one failed.  Without CUDA it exits
2 at once, saying so; ``--dry-run`` prints the steps and their commands and
runs nothing (no GPU needed); ``--rehearse`` runs every step on CPU (the
quick benchmark, the tests' checkpoint) to check the script itself before a
GPU is borrowed for it (``tests/bench/test_overhead_bench.py`` does).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["STEPS", "main", "plan"]

#: the steps, in order, and what each does (``--dry-run`` prints these)
STEPS = ("gpus", "checkpoint", "generate", "placement", "overhead")
BUDGET = 290.0  # seconds for the whole check: five minutes, less the start


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "trio_orch.cli", *args]


def plan(out: Path, gpus: int) -> dict[str, list[str]]:
    """Each step's command line (the ones that run in this process say so); ``gpus`` 0: the rehearsal
    on CPU (``--rehearse``)."""
    ckpt, dev = str(out / "checkpoint"), f"cuda:{gpus - 1}" if gpus else "cpu"
    return {
        "gpus": ["(in process) torch.cuda.device_count() and each device's name"],
        "checkpoint": ["(in process) bench.perf.overhead.build_checkpoint", ckpt],
        "generate": _cli("generate", "--model", ckpt, "--device", dev, "--temperature", "0", "--max-tokens",
                         "16", "Hello"),
        "placement": _cli("serve", ckpt, "--device", dev),
        "overhead": [sys.executable, "-m", "bench.perf.overhead", "--device", "cuda" if gpus else "cpu",
                     "--checkpoint", ckpt, "--machine", "GPU check" if gpus else "rehearsal on CPU",
                     "--json", str(out / "overhead.json"), *([] if gpus else ["--quick"])],
    }


def _run(argv: list[str], log: Path, timeout: float) -> None:
    """Run one command in ``log``'s folder, its output into ``log``; RuntimeError naming its exit code."""
    with log.open("w") as f:
        proc = subprocess.run(argv, stdout=f, stderr=subprocess.STDOUT, timeout=max(timeout, 10.0),
                              check=False, cwd=log.parent)
    if proc.returncode != 0:
        raise RuntimeError(f"exit code {proc.returncode} (see {log.name})")


def _gpus(out: Path) -> int:
    import torch

    n = torch.cuda.device_count()
    names = [torch.cuda.get_device_name(i) for i in range(n)]
    (out / "gpus.json").write_text(json.dumps({"count": n, "names": names, "torch": torch.__version__,
                                               "cuda": torch.version.cuda}, indent=2) + "\n")
    return n


def _placement(out: Path, argv: list[str], gpus: int, timeout: float) -> None:
    """Serve on the last GPU: one completion, the worker's own account of where it runs; then one GPU
    too many must be refused (exit 2) before any worker starts."""
    import urllib.request

    from bench.perf.serving import start_server, stop_server
    from stages.placement import VISIBLE, place
    from trio_orch.serve.credentials import TOKEN_ENV

    serve = argv[argv.index("serve") + 1:]  # start_server adds the command and --port 0
    asked = serve[serve.index("--device") + 1]
    timeout = max(timeout, 10.0)
    proc, url = start_server(serve, env={TOKEN_ENV: "gpu-check"})
    try:
        body = json.dumps({"prompt": "Hello", "max_tokens": 8, "temperature": 0}).encode()
        req = urllib.request.Request(f"{url}/v1/completions", body, {"content-type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout) as r:
            answer = json.loads(r.read())
        stats = urllib.request.Request(f"{url}/admin/stats", headers={"Authorization": "Bearer gpu-check"})
        with urllib.request.urlopen(stats, timeout=timeout) as r:
            worker = json.loads(r.read())["results"][0]["value"]
    finally:
        stop_server(proc)
    want = place(asked).env[VISIBLE]  # the head's GPU of that index, as the launcher names it
    where: dict[str, Any] = {"asked": asked, "device": worker["device"], "want_visible": want,
                             "cuda_visible_devices": worker["cuda_visible_devices"],
                             "model_device": worker["model"].get("device"),
                             "answer": answer["choices"][0]["text"]}
    too_many = subprocess.run([*argv[:argv.index("--device") + 1], f"cuda:{gpus}", "--port", "0"],
                              capture_output=True, text=True, timeout=timeout)
    where["refused"] = {"device": f"cuda:{gpus}", "exit": too_many.returncode,
                        "stderr": too_many.stderr.strip()}
    (out / "placement.json").write_text(json.dumps(where, indent=2) + "\n")
    if where["device"] != place(asked).device or where["cuda_visible_devices"] != want \
            or not str(where["model_device"]).startswith(asked.split(":")[0]):
        raise RuntimeError(f"the worker was not placed as asked: {where}")
    if too_many.returncode != 2 or not re.search(rf"device cuda:{gpus} asked for", too_many.stderr):
        raise RuntimeError(f"cuda:{gpus} was not refused with exit 2: {where['refused']}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.gpu_check", description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path, help="folder for the results (created)")
    p.add_argument("--dry-run", action="store_true", help="print the steps and their commands; run nothing")
    p.add_argument("--rehearse", action="store_true",
                   help="run every step on CPU instead (the quick benchmark): the script checked end to end "
                        "before a GPU is borrowed for it")
    p.add_argument("--steps", default=",".join(STEPS), metavar="A,B",
                   help=f"the steps to run, in their order (default all: {','.join(STEPS)}; gpus and "
                        "checkpoint always run)")
    args = p.parse_args(argv)
    chosen = {x.strip() for x in args.steps.split(",") if x.strip()}
    if unknown := sorted(chosen - set(STEPS)):
        p.error(f"--steps: unknown step(s) {', '.join(unknown)} (known: {', '.join(STEPS)})")
    chosen |= {"gpus", "checkpoint"}
    if args.dry_run:
        for step, cmd in plan(args.out, 0 if args.rehearse else 1).items():
            if step in chosen:
                print(f"{step}: {' '.join(cmd)}")
        return 0
    import torch

    if not args.rehearse and not torch.cuda.is_available():
        print(f"error: no CUDA device here (torch {torch.__version__}, CUDA build: {torch.version.cuda}): "
              "this check is for a machine with a GPU; --dry-run shows what it would run", file=sys.stderr)
        return 2
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    end = time.monotonic() + BUDGET
    summary: dict[str, Any] = {"steps": {}}
    gpus = 0
    commands = plan(out, 0 if args.rehearse else torch.cuda.device_count())

    def gpus_step() -> None:
        nonlocal gpus
        gpus = 0 if args.rehearse else _gpus(out)

    def checkpoint_step() -> None:
        from bench.perf.overhead import build_checkpoint

        build_checkpoint(str(out / "checkpoint"), quick=args.rehearse)

    def overhead_step() -> None:
        _run(commands["overhead"], out / "overhead.log", end - time.monotonic())
        from bench.perf.overhead import markdown

        (out / "overhead.md").write_text(markdown(json.loads((out / "overhead.json").read_text())))

    steps: dict[str, Callable[[], None]] = {
        "gpus": gpus_step, "checkpoint": checkpoint_step,
        "generate": lambda: _run(commands["generate"], out / "generate.log", end - time.monotonic()),
        "placement": lambda: _placement(out, commands["placement"], gpus, end - time.monotonic()),
        "overhead": overhead_step}
    ok = True
    for name in (n for n in STEPS if n in chosen):
        t0 = time.monotonic()
        try:
            steps[name]()
            result: dict[str, Any] = {"ok": True}
        except Exception as exc:  # recorded, and the steps that need it are skipped below
            result, ok = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}, False
        result["seconds"] = round(time.monotonic() - t0, 1)
        summary["steps"][name] = result
        print(f"{name}: {'ok' if result['ok'] else result['error']} ({result['seconds']} s)", flush=True)
        if not result["ok"] and name in ("gpus", "checkpoint"):
            break  # nothing after them can run
    summary["ok"] = ok
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"wrote {out}/summary.json", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
