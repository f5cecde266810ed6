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
import io
import json
import platform
import shutil
import sys
import time
from pathlib import Path
from typing import Any

__all__ = ["KIND_LEGEND", "VERDICTS", "VERDICT_LINES", "configure", "default_impls", "differences",
           "headline", "markdown_report", "print_table", "run", "run_matrix", "terminal_table", "verdict",
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
        "references (vLLM-Omni event-driven, vLLM-Omni polling, asyncio.TaskGroup with the Trio shell's "
        "design), all driving the same routing core, and print what each one did. Verdicts are derived "
        "from measured numbers by each scenario's stated rule; scenarios that hang are cut by a watchdog "
        "and reported as hangs. Each row's kind says whether a difference in it comes from the "
        "concurrency model (model) or from a choice either model can make (design). "
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


#: what each verdict word means, for the tables' legend (a scenario's rule says when it applies)
VERDICTS: dict[str, str] = {
    "ok": "did what the rule asks",
    "slow": "finished, but only after a second cancellation or a grace period",
    "hang": "did not finish: cut by the watchdog",
    "lost": "a request, message, error or cleanup never arrived",
    "leak": "state or tasks left behind",
    "silent": "an error or a late call went unnoticed",
    "stopped": "the whole orchestrator stopped because of one part",
    "stalled": "a healthy part stopped being served",
    "partial": "only some of the errors were reported",
    "early": "the fault fired before the moment the scenario is about",
    "overrun": "a deadline was kept late",
    "dup": "something arrived twice or out of order",
    "zombie": "work started that nobody asked for",
    "degraded": "went ahead without an input it needed",
    "misreported": "answered, but wrong",
    "blocked": "one slow part held up everybody else",
    "waited": "shutdown waited for work whose outcome was already decided",
    "detached": "returned while its own cleanup was still running",
    "cut": "its cleanup was cut short and never finished",
    "n/a": "the implementation cannot express the scenario (the reason says why)",
    "error": "the scenario's driver failed (not a measurement)",
}

#: what the kind column means
KIND_LEGEND = {
    "model": "the difference comes from the concurrency model (cancellation, shields, threads, tasks)",
    "design": "the difference comes from a choice either model can make",
}


#: the packages whose versions a result names (the real vLLM-Omni's only where it is installed)
VERSIONED = ("trio-orch", "trio", "pyzmq", "torch", "vllm", "vllm-omni")


def package_versions() -> dict[str, str]:
    """The installed versions of :data:`VERSIONED` (absent ones left out): which code a result measured."""
    import importlib.metadata

    found = {}
    for name in VERSIONED:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return found


def run_matrix(numbers: list[int] | None = None, impls: list[str] | None = None,
               progress: bool = True) -> dict[str, Any]:
    """Run the scenarios against the implementations; the JSON-able result.

    ``progress``: a progress bar on stderr where it is a terminal, one line per
    cell where it is not (a log keeps them).
    """
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from bench.compare.scenarios import SCENARIOS, by_number, run_scenario
    from bench.compare.scenarios.base import CUT, GRACE
    from bench.implementations import IMPLEMENTATIONS

    scenarios = [by_number(n) for n in numbers] if numbers else SCENARIOS
    impls = impls or default_impls()
    t0 = time.perf_counter()
    rows = []
    err = Console(stderr=True)
    bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                   console=err, transient=True, disable=not (progress and err.is_terminal))
    with bar:
        task = bar.add_task("compare", total=len(scenarios) * len(impls))
        for sc in scenarios:
            results = {}
            for impl in impls:
                bar.update(task, description=f"{sc.number:2d} {sc.key} · {impl}")
                out = run_scenario(sc, impl)
                bar.advance(task)
                if progress and not err.is_terminal:
                    err.print(f"scenario {sc.number:2d} {sc.key:<24} {impl:<18} {out.verdict:<8} "
                              f"({out.wall_s:.2f} s)", highlight=False, soft_wrap=True)
                results[impl] = out.as_dict()
            rows.append({"number": sc.number, "key": sc.key, "title": sc.title, "kind": sc.kind,
                         "because": sc.because, "question": sc.question, "rule": sc.rule,
                         "results": results})
    return {
        "generated_by": "trio-orch compare",
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "versions": package_versions(),
        "watchdog_cut_s": CUT,
        "shutdown_grace_s": GRACE,
        "implementations": {k: IMPLEMENTATIONS[k].description for k in impls},
        "scenarios": rows,
        "elapsed_s": round(time.perf_counter() - t0, 2),
    }


#: verdict -> style in the terminal table
_STYLE = {"ok": "green", "n/a": "dim", "error": "bold red"}


def _table(result: dict[str, Any]) -> Any:
    """The rich table: scenarios down, implementations across, each cell ``verdict: headline``."""
    from rich import box
    from rich.table import Table
    from rich.text import Text

    impls = list(result["implementations"])
    table = Table(box=box.SIMPLE_HEAD, show_lines=True, expand=False, pad_edge=False)
    table.add_column("#", justify="right", no_wrap=True)
    table.add_column("kind", no_wrap=True)
    table.add_column("scenario", ratio=2, overflow="fold")
    for i in impls:
        table.add_column(i, ratio=3, overflow="fold", min_width=len(i))
    for sc in result["scenarios"]:
        cells = []
        for i in impls:
            r = sc["results"][i]
            cell = Text(f"{r['verdict']}", style=_STYLE.get(r["verdict"], "bold yellow"))
            cell.append(f": {r['headline']}", style="")
            cells.append(cell)
        table.add_row(str(sc["number"]), sc.get("kind", "?"), sc["title"], *cells)
    return table


def _verdict_legend(result: dict[str, Any]) -> list[str]:
    """One line per verdict word the table uses."""
    used = {r["verdict"] for sc in result["scenarios"] for r in sc["results"].values()}
    return [f"{v}: {VERDICTS.get(v, 'see the scenario rule (--markdown)')}"
            for v in sorted(used, key=lambda v: (v != "ok", v))]


def _legend(result: dict[str, Any]) -> list[str]:
    """The verdicts the table uses, then the kinds."""
    return [*_verdict_legend(result), *(f"{k}: {why}" for k, why in KIND_LEGEND.items())]


def _legend_text(result: dict[str, Any]) -> str:
    return "Legend\n" + "\n".join(f"  {line}" for line in _legend(result))


def terminal_table(result: dict[str, Any], columns: int | None = None) -> str:
    """The table and its legend as plain text, ``columns`` wide (default: the terminal's, 120 unknown).

    Cells wrap at word boundaries onto more lines; a word longer than its
    column is folded, never cut off.
    """
    from rich.console import Console

    width = columns or shutil.get_terminal_size((120, 24)).columns
    console = Console(width=width, file=io.StringIO(), color_system=None, force_terminal=False,
                      legacy_windows=False)
    print_table(result, console)
    return console.file.getvalue().rstrip("\n")


def print_table(result: dict[str, Any], console: Any) -> None:
    """Print the table and its legend on ``console`` (a :class:`rich.console.Console`)."""
    console.print(_table(result))
    console.print(_legend_text(result), highlight=False)


def differences(result: dict[str, Any], left: str = "trio", right: str = "asyncio-taskgroup"
                ) -> dict[str, list[int]]:
    """Rows where ``left`` and ``right`` got different verdicts, by kind; and where ``left`` did worse.

    Keys: ``model``, ``design`` (rows that differ), ``left_worse`` (``left`` not
    ok where ``right`` was), ``equal`` (same verdict).  Empty where either
    column is missing.
    """
    out: dict[str, list[int]] = {"model": [], "design": [], "left_worse": [], "equal": []}
    for sc in result["scenarios"]:
        res = sc["results"]
        if left not in res or right not in res:
            continue
        a, b = res[left]["verdict"], res[right]["verdict"]
        if a == b:
            out["equal"].append(sc["number"])
            continue
        out[sc.get("kind", "design")].append(sc["number"])
        if a != "ok" and b == "ok":
            out["left_worse"].append(sc["number"])
    return out


def _rows(numbers: list[int]) -> str:
    return ", ".join(str(n) for n in numbers) or "none"


def headline(result: dict[str, Any]) -> str:
    """What differs because of the model and what because of design, computed from the verdicts."""
    scs = result["scenarios"]
    kinds = {k: [sc["number"] for sc in scs if sc.get("kind") == k] for k in KIND_LEGEND}
    lines = [f"{len(scs)} scenarios: {len(kinds['model'])} model rows ({_rows(kinds['model'])}), "
             f"{len(kinds['design'])} design rows ({_rows(kinds['design'])})."]
    d = differences(result)
    if any(d.values()):
        lines.append(
            f"`trio` and `asyncio-taskgroup` (the asyncio reference with every design choice of the Trio "
            f"shell) differ in {len(d['model']) + len(d['design'])} rows: {len(d['model'])} because of the "
            f"model ({_rows(d['model'])}), {len(d['design'])} because of design ({_rows(d['design'])}); "
            f"`trio` is the worse of the two in {_rows(d['left_worse'])}; equal in {len(d['equal'])} "
            f"({_rows(d['equal'])}).")
    for omni in ("omni-event", "omni-poll"):
        o = differences(result, "trio", omni)
        if any(o.values()):
            lines.append(f"`{omni}` (the seed's shape) differs from `trio` in {_rows(o['model'])} because of "
                         f"the model and in {_rows(o['design'])} because of design.")
    return " ".join(lines)


#: the verdict's length, at most (one line per implementation compared with trio, and four more)
VERDICT_LINES = 10


def verdict(result: dict[str, Any], base: str = "trio") -> list[str]:
    """The closing block: per implementation the rows it passed; ``base``'s misses; how each differs from it.

    Every count comes from the verdicts of this run (n/a cells are left out
    of an implementation's total: the scenario has no counterpart there);
    at most :data:`VERDICT_LINES` lines at 80 columns.
    """
    impls = list(result["implementations"])
    scs = result["scenarios"]
    lines = [f"Verdict: {len(scs)} scenarios x {len(impls)} implementations, {result['elapsed_s']} s"]
    passed = []
    for i in impls:
        said = [sc["results"][i]["verdict"] for sc in scs if i in sc["results"]]
        expressible = [v for v in said if v != "n/a"]
        na = len(said) - len(expressible)
        passed.append(f"{i} {expressible.count('ok')}/{len(expressible)}" + (f" ({na} n/a)" if na else ""))
    lines.append("  ok: " + ", ".join(passed))
    if base in impls:
        missed = [f"{sc['number']} {sc['results'][base]['verdict']}" for sc in scs
                  if sc["results"].get(base, {}).get("verdict", "ok") not in ("ok", "n/a")]
        lines.append(f"  {base} not ok in: {', '.join(missed) or 'none'}")
        for other in impls:
            if other == base:
                continue
            d = differences(result, base, other)
            lines.append(f"  {base} vs {other}: {len(d['model']) + len(d['design'])} rows differ "
                         f"({len(d['model'])} model, {len(d['design'])} design); {base} worse in "
                         f"{_rows(d['left_worse'])}")
    errors = [f"{sc['number']} {i}" for sc in scs for i, r in sc["results"].items() if r.get("driver_error")]
    lines.append(f"  driver errors: {', '.join(errors) or 'none'}; the rules and reasons: --markdown PATH")
    return lines


def markdown_report(result: dict[str, Any]) -> str:
    """A computed headline, the table, then per scenario its kind, question, rule and each reason."""
    impls = list(result["implementations"])
    out = [
        f"**Headline.** {headline(result)}",
        "",
        "| # | kind | scenario | " + " | ".join(f"`{i}`" for i in impls) + " |",
        "|---|---|---|" + "---|" * len(impls),
    ]
    for sc in result["scenarios"]:
        cells = [f"**{sc['results'][i]['verdict']}** — {sc['results'][i]['headline']}" for i in impls]
        out.append(f"| {sc['number']} | {sc.get('kind', '?')} | {sc['title']} | "
                   + " | ".join(c.replace("|", "/") for c in cells) + " |")
    out.append("")
    out.append("Verdicts: " + "; ".join(f"**{line.split(': ', 1)[0]}** {line.split(': ', 1)[1]}"
                                         for line in _verdict_legend(result)) + ".")
    out.append("")
    out.append("Kinds: " + "; ".join(f"**{k}**: {why}" for k, why in KIND_LEGEND.items()) + ".")
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
        out.append(f"Kind: **{sc.get('kind', '?')}** — {sc.get('because', '')}.")
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
    from rich.console import Console
    from rich.text import Text

    console = Console()
    print_table(result, console)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.json}")
    if args.markdown:
        write_markdown(args.markdown, markdown_report(result))
        print(f"wrote {args.markdown}")
    console.print(Text("\n".join(verdict(result))))  # the report ends with its verdict
    # n/a cells are not errors: nothing failed, the scenario has no counterpart there
    errors = sum(1 for sc in result["scenarios"] for r in sc["results"].values() if r["driver_error"])
    return 1 if errors else 0
