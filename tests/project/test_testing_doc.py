"""docs/testing.md points at tests by ``file::name``: every one it names exists.

A test renamed or moved would otherwise leave the guide pointing at nothing.
``::name`` alone refers to the file named last before it.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "testing.md"
REF = re.compile(r"(tests/[\w/]+\.py)?::(\w+)")


def references() -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    last = ""
    for m in REF.finditer(DOC.read_text()):
        last = m[1] or last
        out.append((last, m[2]))
    return out


def test_every_test_the_testing_guide_names_exists() -> None:
    refs = references()
    assert len(refs) >= 20  # the guide's examples, read
    missing = []
    for rel, name in refs:
        path = ROOT / rel
        tree = ast.parse(path.read_text()) if path.is_file() else ast.Module(body=[], type_ignores=[])
        names = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}
        if name not in names:
            missing.append(f"{rel}::{name}")
    assert not missing, f"docs/testing.md names tests that do not exist: {missing}"
