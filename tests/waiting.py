"""Waiting on another thread's state: the suite's only bounded real-time polls.

A test in one Trio run waits on events, ``trio.testing.wait_all_tasks_blocked``
or the autojump clock.  A test that drives the thread adapter, a server on
loopback or a worker process cannot: the state it waits for changes in
another thread or process, which neither Trio's clock nor its scheduler
sees.  These helpers poll such a condition with a bound (:data:`HANG`); the
bound only turns a hang into a failure naming what was awaited -- it
asserts nothing about timing.  ``tests/project/test_no_real_sleeps.py``
lets real-time sleeps live here and nowhere else in the in-process tests.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import trio
import trio.testing

HANG = 10.0  #: seconds before a wait is declared a hang (it asserts nothing about timing)
POLL = 0.002  #: seconds between two looks at the condition


def wait_until(pred: Callable[[], bool], what: str = "condition", hang: float = HANG) -> None:
    """Block this thread until ``pred()`` holds; fail naming ``what`` after ``hang`` seconds."""
    end = time.monotonic() + hang
    while not pred():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(POLL)


async def await_until(pred: Callable[[], bool], what: str = "condition", hang: float = HANG) -> None:
    """:func:`wait_until` for asyncio code: the loop keeps running while it waits."""
    end = time.monotonic() + hang
    while not pred():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(POLL)


async def trio_until(pred: Callable[[], bool], what: str = "condition", hang: float = HANG) -> None:
    """:func:`wait_until` for a Trio test whose condition is reached across a socket or another thread
    (a message through the kernel, the ZAP handler's thread): the run keeps running while it waits."""
    end = time.monotonic() + hang
    while not pred():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        await trio.sleep(POLL)


def settle(engine: Any) -> None:
    """Return once every task in the thread adapter's Trio run waits: what was posted to it so far
    (requests, updates, aborts) has been taken up as far as it can go.  No polling: the run's own
    scheduler says when it is idle.  Call it from a plain thread (``asyncio.to_thread`` from asyncio)."""
    engine.run_in_trio(trio.testing.wait_all_tasks_blocked)


def run_async(coro_fn: Callable[[], Any], hang: float = 3 * HANG) -> Any:
    """``asyncio.run`` of ``coro_fn()`` in this thread, failing after ``hang`` seconds instead of hanging."""
    async def main() -> Any:
        async with asyncio.timeout(hang):
            return await coro_fn()
    return asyncio.run(main())
