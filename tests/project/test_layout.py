"""The project's modules: each bench module imports on its own, no import cycle, no private reach-ins.

Imports are read with ``ast`` (module-level and lazy ones inside functions;
``if TYPE_CHECKING:`` blocks never run and are left out), and every bench
module is imported in a fresh interpreter of its own, so a module that only
works after some other module happened to be imported first fails here.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
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
@pytest.mark.processes
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


# ---------------------------------------------------------------------- the tree's import rules
#: each package of trio_orch and its layer: a module imports only from its own layer or lower ones
LAYERS: dict[str, int] = {
    "trio_orch.types": 0, "trio_orch.histogram": 0,
    "trio_orch.core": 1,
    "trio_orch.shell": 2,
    "trio_orch.cluster": 3, "trio_orch.engine": 3,
    "trio_orch.testing": 4,
    "trio_orch.openai": 5,
    "trio_orch.http": 6,
    "trio_orch.serve": 7,
    "trio_orch.cli": 8,
}
#: same layer, never each other: the worker processes' clients and the engine meet only in a factory
APART = {("trio_orch.cluster", "trio_orch.engine"), ("trio_orch.engine", "trio_orch.cluster")}


def package_of(module: str) -> str | None:
    """The layered package (a key of LAYERS) that ``module`` belongs to; None for the root package."""
    for pkg in LAYERS:
        if module == pkg or module.startswith(pkg + "."):
            return pkg
    return None


def layering_violations(graph: dict[str, set[str]]) -> list[str]:
    bad = []
    for module, deps in graph.items():
        if not module.startswith("trio_orch."):
            continue
        own = package_of(module)
        assert own is not None, f"{module} is in no layer: add its package to LAYERS"
        for dep in deps:
            other = package_of(dep)
            if other is None or other == own:
                continue
            if LAYERS[other] > LAYERS[own] or (own, other) in APART:
                bad.append(f"{module} imports {dep}")
    return sorted(bad)


def test_layering_violations_are_found() -> None:
    graph = {"trio_orch.core.x": {"trio_orch.shell.y"}, "trio_orch.shell.y": {"trio_orch.core.x"},
             "trio_orch.engine.z": {"trio_orch.cluster.w"}, "trio_orch.cluster.w": set()}
    assert layering_violations(graph) == ["trio_orch.core.x imports trio_orch.shell.y",
                                          "trio_orch.engine.z imports trio_orch.cluster.w"]


def test_trio_orch_imports_go_one_way() -> None:
    """types < core < shell < {cluster, engine} < testing < openai < http < serve < cli (lazy imports too)."""
    graph = project_graph()
    assert {"trio_orch.shell.orchestrator", "trio_orch.engine.bridge", "trio_orch.cli.main"} <= set(graph)

    assert layering_violations(graph) == []


#: the packages that reach the engine through its seam only (trio_orch/engine/api.py)
THROUGH_THE_SEAM = ("trio_orch.http", "trio_orch.cli")


def seam_violations(graph: dict[str, set[str]]) -> list[str]:
    """Modules of :data:`THROUGH_THE_SEAM` that import an engine module other than ``engine.api``."""
    return sorted(f"{m} imports {d}" for m, deps in graph.items() if m.startswith(THROUGH_THE_SEAM)
                  for d in deps if d.startswith("trio_orch.engine") and d != "trio_orch.engine.api")


def test_seam_violations_are_found() -> None:
    graph = {"trio_orch.http.x": {"trio_orch.engine", "trio_orch.engine.api"},
             "trio_orch.cli.y": {"trio_orch.engine.bridge"}, "trio_orch.serve.z": {"trio_orch.engine"}}
    assert seam_violations(graph) == ["trio_orch.cli.y imports trio_orch.engine.bridge",
                                      "trio_orch.http.x imports trio_orch.engine"]


def test_http_and_cli_reach_the_engine_through_its_seam_only() -> None:
    """The HTTP app and the commands type and call the engine as ``EngineClient`` (engine/api.py), never
    the thread adapter or the engine itself: either engine, or a remote one, serves them."""
    graph = project_graph()
    assert any(d == "trio_orch.engine.api" for m, deps in graph.items() if m.startswith("trio_orch.http")
               for d in deps)
    assert seam_violations(graph) == []


def test_the_command_line_never_imports_the_http_app() -> None:
    """cli/ shares request handling with the HTTP routes through trio_orch.openai, never through http/."""
    graph = project_graph()
    bad = sorted(f"{m} imports {d}" for m, deps in graph.items() if m.startswith("trio_orch.cli")
                 for d in deps if d.startswith("trio_orch.http"))
    assert bad == []


#: the web frameworks and HTTP servers the OpenAI request handling must not pull in
WEB_FRAMEWORKS = frozenset({"starlette", "fastapi", "uvicorn", "hypercorn", "h11", "wsproto", "websockets",
                            "aiohttp"})


def third_party_imports(path: Path) -> set[str]:
    """The top-level names of the packages outside the project that ``path`` imports (lazy ones too)."""
    found: set[str] = set()
    for node in _runtime_nodes(ast.parse(path.read_text())):
        if isinstance(node, ast.Import | ast.ImportFrom):
            found |= third_party_imports_of(node)
    return found - set(PACKAGES)


def reached_from(graph: dict[str, set[str]], start: str) -> set[str]:
    """Every project module ``start`` imports, directly or through others (itself included)."""
    seen, todo = {start}, [start]
    while todo:
        for dep in graph[todo.pop()]:
            if dep not in seen:
                seen.add(dep)
                todo.append(dep)
    return seen


def test_the_openai_request_handling_imports_no_web_framework_not_even_transitively() -> None:
    files = {m: p for pkg in PACKAGES for m, p in module_files(pkg).items()}
    graph = project_graph()
    openai_modules = [m for m in graph if m.startswith("trio_orch.openai")]
    assert {"trio_orch.openai.chat", "trio_orch.openai.validation", "trio_orch.openai.tokenizer"} <= set(
        openai_modules)
    assert "starlette" in third_party_imports(files["trio_orch.http.app"])  # the check sees imports
    bad = {m: sorted({f"{r}: {name}" for r in reached_from(graph, m)
                      for name in third_party_imports(files[r]) & WEB_FRAMEWORKS})
           for m in openai_modules}
    assert {m: v for m, v in bad.items() if v} == {}


def audio_writers(path: Path) -> list[str]:
    """Where ``path`` writes an audio file: ``wave.open`` for writing, ``soundfile.write`` or a
    ``SoundFile`` opened to write, or PyAV (``import av``: this project only encodes with it)."""
    found = []
    for node in _runtime_nodes(ast.parse(path.read_text())):
        if isinstance(node, ast.Import | ast.ImportFrom) and "av" in third_party_imports_of(node):
            found.append(f"{path.name}:{node.lineno}: imports av")
        if not isinstance(node, ast.Call):
            continue
        call = ast.unparse(node.func)
        modes = [ast.unparse(a) for a in node.args[1:2]] + [ast.unparse(k.value) for k in node.keywords
                                                              if k.arg == "mode"]
        if (call == "soundfile.write" or (call == "wave.open" and any("w" in m for m in modes))
                or (call == "soundfile.SoundFile" and any("w" in m for m in modes))):
            found.append(f"{path.name}:{node.lineno}: {call}")
    return found


def third_party_imports_of(node: ast.Import | ast.ImportFrom) -> set[str]:
    """The top-level package names one import statement names."""
    if isinstance(node, ast.Import):
        return {a.name.split(".")[0] for a in node.names}
    return {node.module.split(".")[0]} if node.module and node.level == 0 else set()


def test_audio_files_are_written_by_the_one_encoder_only() -> None:
    files = {m: p for pkg in PACKAGES for m, p in module_files(pkg).items()}
    assert len(audio_writers(files["trio_orch.openai.audio_out"])) >= 3  # the check sees wave, soundfile, av
    bad = {m: w for m, p in files.items() if m != "trio_orch.openai.audio_out" and (w := audio_writers(p))}
    assert bad == {}


def test_the_worker_side_imports_nothing_from_trio_orch() -> None:
    """stages/ holds the worker and the contract it needs (wire, auth, config): the head depends on it."""
    graph = project_graph()
    bad = {m: deps for m, deps in graph.items() if m.startswith("stages")
           and any(d.startswith("trio_orch") for d in deps)}
    assert bad == {}
    text = "\n".join(p.read_text() for p in (ROOT / "stages").rglob("*.py"))
    assert "trio_orch" not in text  # not even in a string (an import by name, a dotted path)


def test_trio_orch_has_few_top_level_modules() -> None:
    top = sorted(p.name for p in (ROOT / "trio_orch").glob("*.py"))
    assert len(top) <= 8, top
    packages = {p.name for p in (ROOT / "trio_orch").iterdir() if (p / "__init__.py").exists()}
    assert packages >= {"core", "shell", "cluster", "engine", "http", "serve", "cli", "testing"}


def _exported(tree: ast.Module) -> list[str]:
    for node in tree.body:
        if (isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__"
                                                 for t in node.targets)
                and isinstance(node.value, (ast.List, ast.Tuple))):
            return [e.value for e in node.value.elts if isinstance(e, ast.Constant)]
    return []


def reexports(path: Path) -> list[str]:
    """Names in ``__all__`` that the module imports instead of defining (only ``__init__`` may)."""
    tree = ast.parse(path.read_text())
    imported = {a.asname or a.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                for a in node.names}
    return [n for n in _exported(tree) if n in imported]


def test_only_package_init_files_reexport() -> None:
    files = [p for pkg in PACKAGES for p in module_files(pkg).values() if p.name != "__init__.py"]
    found = {str(p.relative_to(ROOT)): names for p in files if (names := reexports(p))}
    assert found == {}


def _private_methods(cls: ast.ClassDef) -> set[str]:
    return {n.name for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
            and n.name.startswith("_") and not n.name.startswith("__")}


def hooks_overridden_across_packages() -> list[str]:
    """A subclass in one package that overrides a private method of its base class from another one."""
    files = {m: p for pkg in PACKAGES for m, p in module_files(pkg).items()}
    classes: dict[tuple[str, str], ast.ClassDef] = {}
    trees = {m: ast.parse(p.read_text()) for m, p in files.items()}
    for m, tree in trees.items():
        for node in tree.body:
            if isinstance(node, ast.ClassDef):
                classes[(m, node.name)] = node
    bad = []
    for m, tree in trees.items():
        origin = {a.asname or a.name: node.module for node in ast.walk(tree)
                  if isinstance(node, ast.ImportFrom) and node.module for a in node.names}
        for node in tree.body:
            if not isinstance(node, ast.ClassDef):
                continue
            for base in node.bases:
                name = ast.unparse(base)
                src = origin.get(name)
                if src is None or (src, name) not in classes:
                    continue
                if package_of(src) == package_of(m) and src.split(".")[0] == m.split(".")[0]:
                    continue
                if common := _private_methods(node) & _private_methods(classes[(src, name)]):
                    bad.append(f"{m}.{node.name} overrides {sorted(common)} of {src}.{name}")
    return bad


def test_no_private_hook_is_overridden_across_packages() -> None:
    assert hooks_overridden_across_packages() == []


def test_every_layout_rule_in_the_design_doc_names_a_test_that_exists() -> None:
    """docs/design.md's table of the tree's rules names, for each rule, the test that checks it."""
    doc = (ROOT / "docs" / "design.md").read_text()
    block = doc.split("<!-- layout-rules:begin -->")[1].split("<!-- layout-rules:end -->")[0]
    rows = re.findall(r"^\| (.+?) \| `([\w/.]+\.py)::(\w+)` \|$", block, re.M)
    assert len(rows) >= 8
    missing = []
    for rule, file, name in rows:
        path = ROOT / (file if file.startswith("tests/") else f"tests/project/{file}")
        names = {n.name for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.FunctionDef)}
        if name not in names:
            missing.append(f"{rule}: {file}::{name}")
    assert missing == []


# ---------------------------------------------------------------------- probes and long classes
#: what a probed object is called when it is a stage client (a stage, a replica, a pool, a client)
STAGE_CLIENT = re.compile(r"stage|client|replica|pool", re.I)


def stage_client_probes(source: str, name: str = "<source>") -> list[str]:
    """``getattr``/``hasattr`` calls on something named like a stage client: an ability probed, not
    declared (the stage-client Protocols declare them; cluster/, which makes the clients, may look)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id in ("getattr", "hasattr") and node.args
                and STAGE_CLIENT.search(ast.unparse(node.args[0]))):
            found.append(f"{name}:{node.lineno} {ast.unparse(node)}")
    return found


def test_probes_of_stage_clients_are_found() -> None:
    source = ("def f(stage, args, obj):\n"
              "    a = getattr(stage, 'pump', None)\n"
              "    b = hasattr(self.stages[k], 'rpc')\n"
              "    c = getattr(args, 'stage_ids', None)\n"  # a namespace, not a stage client
              "    return getattr(obj, 'x')\n")
    assert stage_client_probes(source, "m.py") == ["m.py:2 getattr(stage, 'pump', None)",
                                                   "m.py:3 hasattr(self.stages[k], 'rpc')"]


#: a class longer than this needs a reason in docs/design.md's list of long classes
LONG_CLASS = 500


def class_lengths(source: str, module: str) -> dict[str, int]:
    """``module.Class`` -> its length in lines, for every class ``source`` defines at any depth."""
    return {f"{module}.{n.name}": n.end_lineno - n.lineno + 1  # type: ignore[operator]
            for n in ast.walk(ast.parse(source)) if isinstance(n, ast.ClassDef)}


def unlisted_long_classes(lengths: dict[str, int], listed: set[str]) -> list[str]:
    """The classes over :data:`LONG_CLASS` lines the list does not name, and what it names that is
    no such class, or one in the shell or the core (where none may be that long)."""
    long = {c for c, n in lengths.items() if n > LONG_CLASS}
    bad = [f"{c} ({lengths[c]} lines) is not in docs/design.md's list of long classes"
           for c in sorted(long - listed)]
    bad += [f"{c} is listed but is no class over {LONG_CLASS} lines" for c in sorted(listed - long)]
    bad += [f"{c} is in the shell or the core" for c in sorted(listed)
            if c.startswith(("trio_orch.shell.", "trio_orch.core."))]
    return bad


def test_long_classes_and_the_list_are_compared() -> None:
    lengths = {"trio_orch.engine.a.A": 600, "trio_orch.shell.b.B": 501, "trio_orch.core.c.C": 20}
    assert unlisted_long_classes(lengths, {"trio_orch.engine.a.A"}) == [
        "trio_orch.shell.b.B (501 lines) is not in docs/design.md's list of long classes"]
    assert unlisted_long_classes(lengths, {"trio_orch.engine.a.A", "trio_orch.shell.b.B", "x.Y"}) == [
        "x.Y is listed but is no class over 500 lines", "trio_orch.shell.b.B is in the shell or the core"]


# ---------------------------------------------------------------------- the shell and the core
SHELL, CORE = ROOT / "trio_orch" / "shell", ROOT / "trio_orch" / "core"
#: a class longer than this in shell/ or core/ is one concern too many (docs/design.md gives the reasons
#: for the few over ~400 lines)
MAX_CLASS_LINES = 500


def long_classes(folder: Path, limit: int = MAX_CLASS_LINES) -> list[str]:
    out = []
    for path in sorted(folder.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and (n := node.end_lineno - node.lineno + 1) > limit:  # type: ignore[operator]
                out.append(f"{path.name}:{node.name} is {n} lines")
    return out


def test_no_class_in_the_shell_or_the_core_is_over_500_lines() -> None:
    assert long_classes(SHELL) == [] and long_classes(CORE) == []
    assert long_classes(SHELL, 50) != []  # the scan sees the classes


def _functions_calling(folder: Path, attr: str) -> list[str]:
    """``file:function`` for every function in ``folder`` that calls ``x.attr(...)`` or ``attr(...)``."""
    found = []
    for path in sorted(folder.glob("*.py")):
        tree = ast.parse(path.read_text())
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                if isinstance(node, ast.Call) and (
                        (isinstance(node.func, ast.Attribute) and node.func.attr == attr)
                        or (isinstance(node.func, ast.Name) and node.func.id == attr)):
                    found.append(f"{path.name}:{fn.name}")
                    break
    return sorted(set(found))


def test_the_core_routing_entry_is_called_from_exactly_one_function_of_the_shell() -> None:
    """Every change of request state goes through ``route_many``, from one place: ``Dispatch.decide``."""
    assert _functions_calling(SHELL, "route_many") == ["dispatch.py:decide"]


#: what the shell may touch on the core besides route_many: the caller-side acceptance (the contract
#: makes it happen before the caller's first checkpoint), membership (not request state), and queries
SHELL_MAY_USE = {
    "route_many", "accept", "withdraw", "stop_accepting", "check_update", "check_stage_ids",
    "check_pause_mode", "join", "joined", "left", "joins_to_cancel",
    "is_started", "schedule", "can_start", "capacity", "pause_complete", "statistics",
    "queued", "requests", "start_queued", "live_count", "paused", "available", "dropped_outputs"}


def test_the_shell_changes_request_state_only_through_route_many() -> None:
    used = {node.attr for path in SHELL.glob("*.py") for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Attribute) and isinstance(node.value, (ast.Name, ast.Attribute))
            and ast.unparse(node.value).endswith("router")}
    assert "route_many" in used and used <= SHELL_MAY_USE, used - SHELL_MAY_USE


def test_no_decision_in_the_shell_reads_the_wall_clock() -> None:
    """What is decided together comes from structure (what is in flight), never from the time between
    events; deadlines and priority aging use ``trio.current_time()``."""
    text = "\n".join(p.read_text() for p in SHELL.glob("*.py"))
    assert "perf_counter" not in text and "BURST_GAP" not in text
    assert "time.monotonic" not in text and "import time" not in text


def test_no_stage_client_is_probed_outside_the_cluster_package() -> None:
    """The shell, the core, the engine and the fronts ask a stage client only what its declared
    abilities say; ``cluster/`` makes the clients and may look at them."""
    files = [p for pkg in ("trio_orch",) for m, p in module_files(pkg).items()
             if not m.startswith("trio_orch.cluster")]
    assert any(p.name == "orchestrator.py" for p in files)
    found = [hit for p in files for hit in stage_client_probes(p.read_text(), str(p.relative_to(ROOT)))]
    assert found == []


def listed_long_classes() -> set[str]:
    doc = (ROOT / "docs" / "design.md").read_text()
    block = doc.split("<!-- long-classes:begin -->")[1].split("<!-- long-classes:end -->")[0]
    return set(re.findall(r"^\| `([\w.]+)` \|", block, re.M))


def test_every_class_over_500_lines_is_in_the_design_docs_list() -> None:
    lengths: dict[str, int] = {}
    for pkg in PACKAGES:
        for module, path in module_files(pkg).items():
            lengths.update(class_lengths(path.read_text(), module))
    assert lengths["trio_orch.engine.bridge.ThreadEngine"] > 50  # the scan reads every class
    assert listed_long_classes() and unlisted_long_classes(lengths, listed_long_classes()) == []
