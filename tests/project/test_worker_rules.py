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
