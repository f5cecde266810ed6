"""Shared helpers and rules for the whole suite.

Tests that start processes (stage workers, servers, a Ray head, a CLI run)
carry the ``processes`` mark -- every test under the folders in
:data:`PROCESS_FOLDERS`, and elsewhere the modules that set ``pytestmark``.
The quick loop, ``pytest -m "not processes"``, runs the rest; a test without
the mark that starts a process fails with a message saying so, so the quick
loop stays quick and honest.
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.lowlevel

#: test folders whose every test starts processes (workers, servers, command lines)
PROCESS_FOLDERS = frozenset({"cluster", "serve", "bench"})

TESTS = Path(__file__).resolve().parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        rel = Path(str(item.fspath)).resolve().relative_to(TESTS)
        if rel.parts[0] in PROCESS_FOLDERS:
            item.add_marker(pytest.mark.processes)


@pytest.fixture(autouse=True)
def _no_process_unless_marked(request: pytest.FixtureRequest,
                              monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A test without the ``processes`` mark may not start one (the quick loop must not)."""
    if request.node.get_closest_marker("processes") is None:
        def refuse(self: subprocess.Popen, *args: object, **kwargs: object) -> None:
            raise AssertionError(f"{request.node.nodeid} starts a process: mark it "
                                 "pytest.mark.processes (tests/conftest.py)")

        monkeypatch.setattr(subprocess.Popen, "__init__", refuse)
    yield


def live_task_names() -> list[str]:
    """Names of every task in this run's task tree, from trio's own bookkeeping."""
    names: list[str] = []

    def walk(task: trio.lowlevel.Task) -> None:
        names.append(task.name)
        for nursery in task.child_nurseries:
            for child in nursery.child_tasks:
                walk(child)

    walk(trio.lowlevel.current_root_task())
    return names


def orchestrator_tasks() -> list[str]:
    return [n for n in live_task_names() if n.startswith("trio_orch.")]


@pytest.fixture()
def serving() -> Iterator[Callable[..., Any]]:
    """``serving(front, factory, **kw)``: the app behind a real server on loopback
    (``tests.http_helpers.serve``); whatever the test started is stopped after it."""
    from tests.http_helpers import serve

    started: list[Any] = []

    def start(front: str, factory: Any, **kwargs: Any) -> Any:
        s = serve(front, factory, **kwargs)
        started.append(s)
        return s

    yield start
    for s in reversed(started):
        s.stop()


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A tiny random Qwen2 checkpoint directory (:func:`trio_orch.testing.checkpoints.tiny_checkpoint`:
    a 2-layer model, a BPE trained here, the ChatML template), built once per run; needs the hf extra."""
    pytest.importorskip("transformers")
    from trio_orch.testing.checkpoints import tiny_checkpoint

    return tiny_checkpoint(tmp_path_factory.mktemp("qwen2"), arch="qwen2")


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A tiny random Llama checkpoint (BOS added by its tokenizer and written by its template)."""
    pytest.importorskip("transformers")
    from trio_orch.testing.checkpoints import tiny_checkpoint

    return tiny_checkpoint(tmp_path_factory.mktemp("llama"), arch="llama", seed=1)


@pytest.fixture(scope="session")
def tiny_omni(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Qwen2.5-Omni checkpoint directory (a thinker with vision and audio towers, a talker,
    a DiT and BigVGAN, two speakers: :func:`trio_orch.testing.omni_checkpoint.tiny_qwen_omni`), built once
    per run."""
    pytest.importorskip("transformers")
    from trio_orch.testing.omni_checkpoint import tiny_qwen_omni

    return tiny_qwen_omni(tmp_path_factory.mktemp("omni"))
