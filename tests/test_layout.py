"""The project's modules: each bench module imports on its own, no import cycle, no private reach-ins.

Imports are read with ``ast`` (module-level and lazy ones inside functions;
``if TYPE_CHECKING:`` blocks never run and are left out), and every bench
module is imported in a fresh interpreter of its own, so a module that only
works after some other module happened to be imported first fails here.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("bench", "trio_orch", "stages")


def module_files(package: str) -> dict[str, Path]:
    """Dotted module name -> file, for every module of ``package`` (packages by their __init__)."""
    out: dict[str, Path] = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _runtime_nodes(tree: ast.AST) -> list[ast.AST]:
    """Every node, except those under ``if TYPE_CHECKING:`` (imports for the type checker only)."""
    nodes: list[ast.AST] = []
    todo = [tree]
    while todo:
        node = todo.pop()
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            todo.extend(node.orelse)
            continue
        nodes.append(node)
        todo.extend(ast.iter_child_nodes(node))
    return nodes


def imported_modules(path: Path, known: set[str]) -> set[str]:
    """The project modules ``path`` imports (the longest known prefix of each imported name)."""
    names: set[str] = set()
    for node in _runtime_nodes(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
    found: set[str] = set()
    for name in names:
        while name and name not in known:
            name = name.rpartition(".")[0]
        if name:
            found.add(name)
    return found


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle (a list of modules, first == last), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(v: str) -> list[str] | None:
        state[v] = 1
        path.append(v)
        for w in sorted(graph[v]):
            if state.get(w) == 1:
                return [*path[path.index(w):], w]
            if w not in state and (cycle := visit(w)) is not None:
                return cycle
        path.pop()
        state[v] = 2
        return None

    for v in sorted(graph):
        if v not in state and (cycle := visit(v)) is not None:
            return cycle
    return None


def project_graph() -> dict[str, set[str]]:
    files = {m: p for pkg in PACKAGES for m, p in module_files(pkg).items()}
    return {m: imported_modules(p, set(files)) - {m} for m, p in files.items()}


def test_find_cycle_finds_one() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycle_in_the_project() -> None:
    graph = project_graph()
    assert {"bench.implementations", "bench.drivers.base", "bench.chaos.faults"} <= set(graph)
    assert find_cycle(graph) is None


def test_the_asyncio_references_and_the_drivers_do_not_import_the_jobs() -> None:
    """The layers point one way: refs <- drivers <- implementations <- compare / perf / chaos."""
    graph = project_graph()
    for module, deps in graph.items():
        if module.startswith(("bench.refs", "bench.drivers")):
            bad = {d for d in deps if d.startswith(("bench.compare", "bench.perf", "bench.chaos",
                                                    "bench.implementations"))}
            assert not bad, f"{module} imports {bad}"
        if module.startswith(("trio_orch", "stages")):
            assert not {d for d in deps if d.startswith("bench")}, f"{module} imports bench"


@pytest.mark.slow
def test_every_bench_module_imports_on_its_own() -> None:
    modules = list(module_files("bench"))

    def load(module: str) -> tuple[str, int, str]:
        proc = subprocess.run([sys.executable, "-c", f"import {module}"], cwd=ROOT, capture_output=True,
                              text=True, timeout=120)
        return module, proc.returncode, proc.stderr[-800:]

    with ThreadPoolExecutor(max_workers=4) as pool:
        failed = [(m, err) for m, rc, err in pool.map(load, modules) if rc != 0]
    assert len(modules) > 20 and not failed, failed


#: documented public API of the standard library despite the underscore
PUBLIC_UNDERSCORE = {"os._exit", "sys._getframe"}


def _defined_privates(tree: ast.AST) -> set[str]:
    """Private names a module defines itself: functions, classes, attributes it assigns, slots."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            names.add(node.value)  # __slots__ entries
    return {n for n in names if n.startswith("_")}


def _private_reach_ins(path: Path) -> list[str]:
    """``from m import _x``, and ``obj._x`` for a private name the module does not define itself.

    Inside its own module a class may touch the private state of another
    instance of itself (or of a sibling class it defines); anything else is
    a reach-in.
    """
    tree = ast.parse(path.read_text())
    own = _defined_privates(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            found += [f"{path.name}:{node.lineno} imports {a.name}" for a in node.names
                      if a.name.startswith("_") and not a.name.startswith("__")]
        elif (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
              and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))
              and node.attr not in own and ast.unparse(node) not in PUBLIC_UNDERSCORE):
            found.append(f"{path.name}:{node.lineno} uses {ast.unparse(node)}")
    return found


def test_no_private_name_used_outside_its_module() -> None:
    files = [p for pkg in PACKAGES for p in module_files(pkg).values()]
    files += sorted((ROOT / "tests").rglob("*.py"))
    assert any(p.name == "test_compare.py" for p in files) and any(p.name == "bridge.py" for p in files)
    found = [hit for p in files for hit in _private_reach_ins(p)]
    assert not found, found
