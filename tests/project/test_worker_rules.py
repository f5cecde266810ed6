"""The workers' own rule table in docs/design.md names functions that exist on the worker side."""

from __future__ import annotations

import importlib
import pathlib
import re

DOC = pathlib.Path(__file__).parents[2] / "docs" / "design.md"


def worker_rule_table() -> list[tuple[str, str]]:
    block = DOC.read_text().split("<!-- worker-rules:begin -->")[1].split("<!-- worker-rules:end -->")[0]
    return [(m[1].strip(), m[2]) for m in re.finditer(r"^\| (.+?) \| `(stages(?:\.\w+)+)` \|$", block, re.M)]


def test_every_worker_rule_names_one_existing_function_in_stages() -> None:
    rows = worker_rule_table()
    assert rows, "the worker rule table is empty"
    for rule, path in rows:
        module, _, name = path.rpartition(".")
        fn = getattr(importlib.import_module(module), name, None)
        assert callable(fn), f"{rule}: {path} does not exist"


#: an option as ``--help`` lists it, at the start of its line
OPTION = r"^\s+(--[a-z][a-z-]*[a-z])"


def test_the_worker_has_no_fault_injection_of_its_own() -> None:
    """Every fault flag is declared and handled in stages/faults.py; stages/worker.py names none."""
    import argparse

    from stages import faults
    from stages.worker import FaultyWorker, Worker, build_parser

    group = argparse.ArgumentParser()
    faults.add_arguments(group)
    flags = set(re.findall(OPTION, group.format_help(), re.M)) - {"--help"}
    assert len(flags) >= 15 and "--crash-after-steps" in flags
    worker_source = (DOC.parents[1] / "stages" / "worker.py").read_text()
    assert not [f for f in flags if f in worker_source or f[2:].replace("-", "_") in worker_source]
    assert flags <= set(re.findall(OPTION, build_parser().format_help(), re.M))  # still the worker's flags
    # a worker given no fault flag runs the plain worker; any one of them makes it the faulty one
    plain = build_parser().parse_args(["--connect", "ipc:///x"])
    assert not faults.injected(plain) and issubclass(FaultyWorker, Worker)
    for argv in (["--step-delay-ms", "5"], ["--fault-garbage"], ["--crash-on-chunk"]):
        assert faults.injected(build_parser().parse_args(["--connect", "ipc:///x", *argv])), argv
