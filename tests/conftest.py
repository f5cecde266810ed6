"""Shared helpers for the pytest-trio suite."""

from __future__ import annotations

import trio
import trio.lowlevel


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
