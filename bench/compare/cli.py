"""``trio-orch compare``: cancellation semantics measured side by side.

Runs the scenario matrix (:mod:`bench.compare.scenarios`) against every
implementation that runs the comparison (:mod:`bench.implementations`: the
Trio orchestrator and the asyncio references, all on the same routing core;
with ``--impl``, also the real vLLM-Omni where it is installed) and prints a
table; ``--json`` and ``--markdown`` write the full results.  Every cell is
computed from measurements taken while the command runs: change an
implementation and the table changes.  A scenario an implementation cannot
express is an ``n/a`` cell with the reason, not an error.
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

__all__ = ["configure", "default_impls", "markdown_report", "run", "run_matrix", "terminal_table",
           "write_markdown"]


def default_impls() -> list[str]:
    """The columns of a plain run: the implementations on the project's routing core."""
    from bench.implementations import names

    return names("scripted")


def configure(parser: argparse.ArgumentParser) -> None:
    from bench.implementations import SKIPPED, names

    impls = [*names("compare"), *SKIPPED]
    parser.description = (
        "Run the cancellation/fault scenario matrix against the Trio orchestrator and the asyncio "
        "references (vLLM-Omni event-driven, vLLM-Omni polling, asyncio.TaskGroup), all driving the same "
        "routing core, and print what each one did. Verdicts are derived from measured numbers by each "
        "scenario's stated rule; scenarios that hang are cut by a watchdog and reported as hangs. "
        "--impl vllm-omni adds the real vLLM-Omni where it is installed; a scenario it cannot express "
        "is an n/a cell with the reason."
    )
    parser.add_argument("--only", type=int, action="append", metavar="N",
                        help="run only scenario N (see --list); repeat for several")
    parser.add_argument("--impl", action="append", metavar="NAME",
                        help=f"run this implementation (repeatable; default: {', '.join(default_impls())}); "
                             f"any of {', '.join(impls)} (vllm-omni*: where vLLM-Omni is installed, "
                             "bench/setup_vllm_omni.sh)")
    parser.add_argument("--json", type=Path, metavar="PATH", help="write every measurement as JSON here")
    parser.add_argument("--markdown", type=Path, metavar="PATH",
                        help="write the table and per-scenario details as markdown here; in an existing "
                             f"file that has {BEGIN} ... {END}, only that block is replaced")
    parser.add_argument("--list", action="store_true", help="list the scenarios and exit")
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress lines on stderr")


def run_matrix(numbers: list[int] | None = None, impls: list[str] | None = None,
               progress: bool = True) -> dict[str, Any]:
    """Run the scenarios against the implementations; the JSON-able result."""
    from bench.compare.scenarios import SCENARIOS, by_number, run_scenario
    from bench.compare.scenarios.base import CUT, GRACE
    from bench.implementations import IMPLEMENTATIONS

    scenarios = [by_number(n) for n in numbers] if numbers else SCENARIOS
    impls = impls or default_impls()
    t0 = time.perf_counter()
    rows = []
    total, done = len(scenarios) * len(impls), 0
    for sc in scenarios:
        results = {}
        for impl in impls:
            done += 1
            if progress:
                print(f"[{done:2d}/{total}] scenario {sc.number:2d} {sc.key:<22} {impl:<18}",
                      end="", file=sys.stderr, flush=True)
            out = run_scenario(sc, impl)
            if progress:
                print(f" {out.verdict:<8} ({out.wall_s:.2f} s)", file=sys.stderr, flush=True)
            results[impl] = out.as_dict()
        rows.append({"number": sc.number, "key": sc.key, "title": sc.title, "question": sc.question,
                     "rule": sc.rule, "results": results})
    return {
        "generated_by": "trio-orch compare",
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "watchdog_cut_s": CUT,
        "shutdown_grace_s": GRACE,
        "implementations": {k: IMPLEMENTATIONS[k].description for k in impls},
        "scenarios": rows,
        "elapsed_s": round(time.perf_counter() - t0, 2),
    }


def _cell(r: dict[str, Any]) -> str:
    return f"{r['verdict']}: {r['headline']}"


def terminal_table(result: dict[str, Any], columns: int | None = None) -> str:
    """Scenarios down, implementations across; each cell ``verdict: key number``.

    Fits ``columns`` (default: the terminal's width, 120 when unknown): cells
    wrap onto more lines instead of being cut.
    """
    impls = list(result["implementations"])
    head = ["#", "scenario", *impls]
    rows = []
    for sc in result["scenarios"]:
        rows.append([str(sc["number"]), sc["title"], *(_cell(sc["results"][i]) for i in impls)])
    total = columns or shutil.get_terminal_size((120, 24)).columns
    scenario_w = 24
    cell_w = max(12, (total - 2 - scenario_w - 3 * (len(impls) + 1)) // max(1, len(impls)))
    widths = [2, scenario_w] + [cell_w] * len(impls)

    def block(cells: list[str]) -> list[str]:
        wrapped = [textwrap.wrap(c, w) or [""] for c, w in zip(cells, widths, strict=True)]
        height = max(len(w) for w in wrapped)
        return [" | ".join((w[i] if i < len(w) else "").ljust(widths[j])
                           for j, w in enumerate(wrapped)).rstrip() for i in range(height)]

    lines = block(head)
    lines.append("-+-".join("-" * w for w in widths))
    for row in rows:
        lines.extend(block(row))
    return "\n".join(lines)


def markdown_report(result: dict[str, Any]) -> str:
    """The table plus, per scenario, the question, the rule and each implementation's reason."""
    impls = list(result["implementations"])
    out = [
        "| # | scenario | " + " | ".join(f"`{i}`" for i in impls) + " |",
        "|---|---|" + "---|" * len(impls),
    ]
    for sc in result["scenarios"]:
        cells = [f"**{sc['results'][i]['verdict']}** — {sc['results'][i]['headline']}" for i in impls]
        out.append(f"| {sc['number']} | {sc['title']} | " + " | ".join(c.replace("|", "/") for c in cells)
                   + " |")
    out.append("")
    out.append(f"Watchdog cut: {result['watchdog_cut_s']} s; shutdown grace (where an implementation bounds "
               f"its cleanup): {result['shutdown_grace_s']} s. Python {result['python']}, "
               f"{result['platform']}; {result['elapsed_s']} s in all.")
    out.append("")
    out.append("Implementations:")
    out.append("")
    for k, v in result["implementations"].items():
        out.append(f"- `{k}`: {v}")
    for sc in result["scenarios"]:
        out.append("")
        out.append(f"### {sc['number']}. {sc['title']}")
        out.append("")
        out.append(sc["question"])
        out.append("")
        out.append(f"Rule: {sc['rule']}.")
        out.append("")
        for i in impls:
            r = sc["results"][i]
            out.append(f"- `{i}`: **{r['verdict']}** — {r['reason']}")
    return "\n".join(out) + "\n"


BEGIN, END = "<!-- compare:begin -->", "<!-- compare:end -->"


def write_markdown(path: Path, report: str) -> None:
    """Write ``report``; into an existing file with the markers, replace only what is between them."""
    if path.exists():
        text = path.read_text()
        if BEGIN in text and END in text:
            head, rest = text.split(BEGIN, 1)
            _, tail = rest.split(END, 1)
            path.write_text(f"{head}{BEGIN}\n{report}{END}{tail}")
            return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(report)


def run(args: argparse.Namespace) -> int:
    from bench.compare.scenarios import SCENARIOS, by_number

    if args.list:
        for sc in SCENARIOS:
            print(f"{sc.number:2d}  {sc.key:<22} {sc.title}")
        return 0
    from bench.implementations import lookup

    try:
        numbers = args.only and [by_number(n).number for n in args.only]
        for name in args.impl or []:
            if "compare" not in lookup(name).supports:
                raise ValueError(f"implementation {name!r} does not run the comparison")
    except ValueError as exc:
        print(f"trio-orch compare: {exc}", file=sys.stderr)
        return 2
    result = run_matrix(numbers or None, args.impl, progress=not args.quiet)
    print(terminal_table(result))
    print(f"\n{result['elapsed_s']} s. The rules and reasons: --markdown PATH.")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.json}")
    if args.markdown:
        write_markdown(args.markdown, markdown_report(result))
        print(f"wrote {args.markdown}")
    # n/a cells are not errors: nothing failed, the scenario has no counterpart there
    errors = sum(1 for sc in result["scenarios"] for r in sc["results"].values() if r["driver_error"])
    return 1 if errors else 0
