"""No test that stays in one process sleeps real time; a process test sleeps only to poll.

A real sleep in an in-process test is either a race ("long enough, usually")
or dead time in the quick loop.  Such a test waits on an event, on
``trio.testing.wait_all_tasks_blocked``, or on virtual time: ``trio.sleep``
and a timeout meant to run out (``move_on_after``) are allowed in a test that
takes pytest-trio's ``autojump_clock`` (and in a helper only such tests use).
State another thread or process changes is polled through tests/waiting.py,
the one file allowed to sleep.  A test that
starts processes (tests/conftest.py ``PROCESS_FOLDERS``, or marked
``processes``) may sleep between two looks at a condition, inside a loop --
never one bare pause that hopes the other side got there.

The files are read with :mod:`ast`, nothing is imported or run.
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from tests.conftest import PROCESS_FOLDERS, TESTS

#: files (relative to tests/) that may sleep real time anywhere in them, and why
ALLOWED_FILES: dict[str, str] = {
    # the bounded polls of state that another thread or process changes: no event in the
    # test's Trio run sees that change, and the bound turns a hang into a named failure
    "waiting.py": "bounded cross-thread and cross-process polls",
}

#: process-test functions ("file::name") whose sleep is not inside a polling loop, and why
UNPOLLED: dict[str, str] = {
    # a pause that lets the reader task reach its recv; asyncio.sleep(0) does the same without
    # waiting. The file belongs to the compare work, which is changing it: remove this entry then.
    "bench/test_compare.py::test_premise_of_scenario_3_pyzmq_close_cancels_a_pending_recv": "see above",
}

#: (module, function) -> "real" (always wall-clock), "trio" (the run's clock: virtual under autojump)
#: or "timeout" (a Trio timeout that is there to run out, so it waits as long as a sleep would;
#: ``fail_after`` is left out: it only guards against a hang and waits for nothing)
SLEEPS = {("time", "sleep"): "real", ("asyncio", "sleep"): "real",
          ("trio", "sleep"): "trio", ("trio", "sleep_until"): "trio",
          ("trio", "move_on_after"): "timeout", ("trio", "move_on_at"): "timeout"}


@dataclass
class Unit:
    """A module-level function or class: what a sleep belongs to, and who uses it."""

    name: str
    node: ast.AST
    is_test: bool
    processes: bool  #: a test marked ``processes``
    virtual: bool  #: takes ``autojump_clock`` or builds a MockClock: ``trio.sleep`` waits on virtual time
    refs: set[str] = field(default_factory=set)  #: names it loads or takes as fixtures


@dataclass(frozen=True)
class Found:
    path: str
    line: int
    call: str
    unit: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.call}(...) in {self.unit}"


def _is_processes_mark(node: ast.AST) -> bool:
    return any(isinstance(n, ast.Attribute) and n.attr == "processes"
               and isinstance(n.value, ast.Attribute) and n.value.attr == "mark" for n in ast.walk(node))


def module_is_processes(tree: ast.Module) -> bool:
    """``pytestmark = pytest.mark.processes`` (alone or in a list) at module level."""
    return any(isinstance(st, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "pytestmark"
                                                   for t in st.targets) and _is_processes_mark(st.value)
               for st in tree.body)


def _makes_a_mock_clock(node: ast.AST) -> bool:
    """It builds a ``trio.testing.MockClock`` (for its own ``trio.run(..., clock=...)``)."""
    def name(f: ast.expr) -> str | None:
        return f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
    return any(isinstance(n, ast.Call) and name(n.func) == "MockClock" for n in ast.walk(node))


def _imported_names(tree: ast.Module) -> dict[str, tuple[str, str | None]]:
    """Local name -> (module, attribute): ``import time as t`` gives t -> (time, None),
    ``from trio import sleep`` gives sleep -> (trio, sleep)."""
    names: dict[str, tuple[str, str | None]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                names[a.asname or a.name] = (a.name, None)
        elif isinstance(node, ast.ImportFrom) and node.module:
            for a in node.names:
                names[a.asname or a.name] = (node.module, a.name)
    return names


def sleep_calls(tree: ast.AST, imported: dict[str, tuple[str, str | None]]) -> Iterator[tuple[ast.Call, str,
                                                                                             str]]:
    """Every call in SLEEPS that waits (``sleep(0)`` is a checkpoint, not a wait)."""
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        module, attr = None, None
        if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id in imported:
            module, attr = imported[f.value.id][0], f.attr
        elif isinstance(f, ast.Name) and f.id in imported:
            module, attr = imported[f.id]
        kind = SLEEPS.get((module or "", attr or ""))
        if kind is None:
            continue
        arg = node.args[0] if node.args else None
        if attr == "sleep" and isinstance(arg, ast.Constant) and arg.value == 0:
            continue
        yield node, kind, f"{module}.{attr}"


def units(tree: ast.Module) -> list[Unit]:
    out = []
    for st in tree.body:
        if not isinstance(st, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            continue
        is_test = not isinstance(st, ast.ClassDef) and st.name.startswith("test_")
        args: list[str] = [] if isinstance(st, ast.ClassDef) else [
            a.arg for a in (*st.args.posonlyargs, *st.args.args, *st.args.kwonlyargs)]
        unit = Unit(st.name, st, is_test,
                    processes=is_test and any(_is_processes_mark(d) for d in st.decorator_list),
                    virtual="autojump_clock" in args or _makes_a_mock_clock(st))
        unit.refs = {n.id for n in ast.walk(st) if isinstance(n, ast.Name)} | set(args)
        out.append(unit)
    return out


def covered(unit: Unit, ok: Callable[[Unit], bool], every: list[Unit],
            seen: frozenset[str] = frozenset()) -> bool:
    """``ok`` holds for ``unit``, or ``unit`` is a helper and it holds for everything that uses it."""
    if ok(unit):
        return True
    if unit.is_test or unit.name in seen:
        return False
    users = [u for u in every if u is not unit and unit.name in u.refs]
    return bool(users) and all(covered(u, ok, every, seen | {unit.name}) for u in users)


def in_a_loop(unit: Unit, call: ast.Call) -> bool:
    """The call sits in a ``while`` or ``for`` body of its unit: it paces a poll."""
    for loop in ast.walk(unit.node):
        if isinstance(loop, ast.While | ast.For | ast.AsyncFor) and any(n is call for n in ast.walk(loop)):
            return True
    return False


def check(source: str, rel: str) -> tuple[list[Found], list[Found]]:
    """(real sleeps in in-process tests, bare pauses in process tests) of one file."""
    tree = ast.parse(source)
    imported = _imported_names(tree)
    everything = units(tree)
    whole_file_processes = Path(rel).parts[0] in PROCESS_FOLDERS or module_is_processes(tree)
    in_process: list[Found] = []
    unpolled: list[Found] = []
    claimed: set[int] = set()
    for unit in everything:
        for call, kind, name in sleep_calls(unit.node, imported):
            claimed.add(id(call))
            found = Found(rel, call.lineno, name, unit.name)
            if kind != "real" and covered(unit, lambda u: u.virtual, everything):
                continue  # virtual time: the autojump clock skips it, nothing waits
            if whole_file_processes or covered(unit, lambda u: u.processes, everything):
                if kind != "timeout" and not in_a_loop(unit, call) and f"{rel}::{unit.name}" not in UNPOLLED:
                    unpolled.append(found)
            else:
                in_process.append(found)
    for call, _, name in sleep_calls(tree, imported):  # at module level, outside every function
        if id(call) not in claimed and not whole_file_processes:
            in_process.append(Found(rel, call.lineno, name, "<module>"))
    return in_process, unpolled


@functools.cache
def scan() -> tuple[list[Found], list[Found]]:
    in_process: list[Found] = []
    unpolled: list[Found] = []
    for path in sorted(TESTS.rglob("*.py")):
        rel = path.relative_to(TESTS).as_posix()
        if rel in ALLOWED_FILES:
            continue
        a, b = check(path.read_text(), rel)
        in_process += a
        unpolled += b
    return in_process, unpolled


def test_no_in_process_test_sleeps_real_time() -> None:
    in_process, _ = scan()
    assert not in_process, (
        "in-process tests sleeping real time -- wait on an event or trio.testing.wait_all_tasks_blocked, "
        "take autojump_clock (trio.sleep is then virtual), or poll another thread through "
        "tests/waiting.py:\n" + "\n".join(map(str, in_process)))


def test_a_process_test_sleeps_only_between_looks_at_a_condition() -> None:
    _, unpolled = scan()
    assert not unpolled, ("process tests pausing instead of polling a condition (sleep inside a bounded "
                          "loop that checks it):\n" + "\n".join(map(str, unpolled)))


def test_every_allow_list_entry_still_names_something() -> None:
    for rel in ALLOWED_FILES:
        assert (TESTS / rel).is_file(), rel
    for key in UNPOLLED:
        rel, name = key.split("::")
        tree = ast.parse((TESTS / rel).read_text())
        assert name in {u.name for u in units(tree)}, f"{key}: gone -- remove it from UNPOLLED"


PLANTED = '''
import time, trio
import pytest

def helper():
    time.sleep(0.1)

async def virtual_helper():
    await trio.sleep(5)

async def test_real(): await trio.sleep(0.05)
async def test_wall_clock_under_autojump(autojump_clock): time.sleep(0.01)
async def test_virtual(autojump_clock): await trio.sleep(60); await virtual_helper()
async def test_checkpoint(): await trio.sleep(0)
async def test_times_out():
    with trio.move_on_after(0.01):
        await trio.sleep_forever()
async def test_guarded():
    with trio.fail_after(10):
        await trio.sleep(0)
def test_own_clock(): trio.run(trio.sleep, 9, clock=trio.testing.MockClock(autojump_threshold=0))
def test_uses_helper(): helper()

@pytest.mark.processes
async def test_pause(): await trio.sleep(0.05)

@pytest.mark.processes
async def test_poll():
    while not done():
        await trio.sleep(0.01)
'''


def test_the_scan_finds_planted_sleeps_and_passes_the_right_ones() -> None:
    in_process, unpolled = check(PLANTED, "shell/test_planted.py")
    assert sorted(f.unit for f in in_process) == ["helper", "test_real", "test_times_out",
                                                  "test_wall_clock_under_autojump"]
    assert [f.unit for f in unpolled] == ["test_pause"]
    in_process, unpolled = check(PLANTED, "cluster/test_planted.py")  # a process folder: polls only
    assert in_process == []
    assert sorted(f.unit for f in unpolled) == ["helper", "test_pause", "test_real",
                                                "test_wall_clock_under_autojump"]
