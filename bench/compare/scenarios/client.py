"""Scenarios about the client side: 7, 9, 10 and 11 of the comparison."""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.compare.scenarios.base import (
    CUT,
    LogCapture,
    Scenario,
    start,
    stop_and_drain,
    terminal_stats,
)
from trio_orch.testing import Misbehaviour

# ---------------------------------------------------------------- 7
N7 = 300
SLICE7 = 0.0002  # the consumer's receive deadline: it is cancelled again and again
LIMIT7 = 5.0
PAUSE7 = 0.001  # the producer pauses after every 5 outputs, so the consumer often waits


async def trio_consumer(h: Any) -> tuple[list[Any], int]:
    """In the Trio thread: produce N7 outputs while a consumer receives under tiny deadlines."""
    import trio

    stage = h.stages[0]
    got: list[Any] = []
    timeouts = 0

    async def produce() -> None:
        for i in range(N7):
            stage.emit_nowait("r1", i, i == N7 - 1)
            if i % 5 == 4:
                await trio.sleep(PAUSE7)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(produce)
        with trio.move_on_after(LIMIT7):
            while True:
                with trio.move_on_after(SLICE7) as scope:
                    batch = await h.loop_next_batch()
                if scope.cancelled_caught:
                    timeouts += 1
                    continue
                if batch is None:
                    break
                got.extend(batch)
                if any(m.finished for m in batch):
                    break
    return got, timeouts


async def asyncio_consumer(h: Any) -> tuple[list[Any], int]:
    """In the asyncio loop: the same, with ``asyncio.wait_for`` (omni) or ``asyncio.timeout`` (modern)."""
    import asyncio

    stage = h.stages[0]
    modern = h.name == "asyncio-taskgroup"
    got: list[Any] = []
    timeouts = 0

    async def produce() -> None:
        for i in range(N7):
            stage.emit_nowait("r1", i, i == N7 - 1)
            if i % 5 == 4:
                await asyncio.sleep(PAUSE7)

    prod = asyncio.create_task(produce())
    loop = asyncio.get_running_loop()
    deadline = loop.time() + LIMIT7
    while loop.time() < deadline:
        try:
            if modern:
                async with asyncio.timeout(SLICE7):
                    batch = await h.loop_next_batch()
            else:
                batch = await asyncio.wait_for(h.loop_next_batch(), SLICE7)
        except TimeoutError:
            timeouts += 1
            continue
        if batch is None:
            break
        got.extend(batch)
        if any(m.finished for m in batch):
            break
    await prod
    return got, timeouts


def measure_consumer_cancelled(impl: str) -> dict[str, Any]:
    with LogCapture():
        h = start(impl, 1, {0}, in_loop_consumer=True)
        h.add_request("r1", "p")
        consumer = trio_consumer if h.framework == "trio" else asyncio_consumer
        got, timeouts = h.run_in_loop(consumer, h, timeout=LIMIT7 + CUT)
        m = stop_and_drain(h)
    values = Counter(x.data for x in got if x.request_id == "r1")
    m["sent"] = N7
    m["delivered"] = sum(values.values())
    m["lost"] = sum(1 for i in range(N7) if values[i] == 0)
    m["duplicated"] = sum(c - 1 for c in values.values() if c > 1)
    m["out_of_order"] = sum(1 for a, b in itertools.pairwise(got) if b.data < a.data)
    m["consumer_cancellations"] = timeouts
    m["terminal_seen"] = any(x.finished for x in got)
    return m


def judge_consumer(m: dict[str, Any]) -> tuple[str, str]:
    if m["lost"] or not m["terminal_seen"]:
        return "lost", f"{m['lost']} of {m['sent']} messages lost"
    if m["duplicated"] or m["out_of_order"]:
        return "dup", f"{m['duplicated']} duplicated, {m['out_of_order']} out of order"
    return "ok", (f"all {m['sent']} delivered once, in order, across "
                  f"{m['consumer_cancellations']} cancellations")


S7 = Scenario(
    7, "consumer-cancelled", "consumer cancelled mid-stream",
    f"A stage streams {N7} outputs while the consumer, in the orchestrator's loop, receives under a "
    f"{SLICE7 * 1e3:.1f} ms deadline (trio.move_on_after / asyncio.wait_for / asyncio.timeout) and "
    "retries. Messages lost or duplicated?",
    "lost if any output never reached the consumer; dup if one came twice or out of order; else ok",
    measure_consumer_cancelled, judge_consumer,
    lambda m: f"{m['delivered']}/{m['sent']} delivered, {m['consumer_cancellations']} cancellations",
    needs=frozenset({"in_loop"}),
    kind="model",
    because=(
        "a cancelled receive on a Trio memory channel or an asyncio/janus queue either hands over an "
        "item or raises having taken none"
    ),
)


# ---------------------------------------------------------------- 9
DEADLINE9 = 0.3
SLACK9 = 0.1


def _wait_terminal(h: Any, rid: str, until: float) -> float | None:
    """perf_counter time at which ``rid``'s terminal was consumed, or None by ``until``."""
    while True:
        left = until - time.perf_counter()
        if left <= 0:
            return None
        try:
            msg = h.next_output(timeout=left)
        except Exception:
            return None
        if msg.request_id == rid and msg.finished:
            return time.perf_counter()


def _deadline_then_abort(h: Any, rid: str, t_add: float) -> float | None:
    """Wait for ``rid``'s terminal until its deadline, then abort; seconds past the deadline (None: cut)."""
    deadline = t_add + DEADLINE9
    t_term = _wait_terminal(h, rid, deadline)
    if t_term is None:
        h.abort(rid)
        t_term = _wait_terminal(h, rid, deadline + CUT)
    return None if t_term is None else t_term - deadline


def measure_deadline(impl: str) -> dict[str, Any]:
    """The serving thread's per-request deadline: wait for the terminal until it, then abort.

    First alone (``plain``), then while the stage's submit() blocks for another
    request (``saturated``).
    """
    with LogCapture():
        h = start(impl, 1, {0})
        t_add = time.perf_counter()
        h.add_request("plain", "p")  # the stage never answers it
        plain = _deadline_then_abort(h, "plain", t_add)
        t_add = time.perf_counter()
        h.add_request("slow", "p")  # never answered either
        h.hold_submits(0)
        h.add_request("other", "p", wait=False)  # its submit blocks: the stage is saturated
        saturated = _deadline_then_abort(h, "slow", t_add)
        h.release_submits(0)
        # the orchestrator's own deadline (add_request(deadline=...)), stage saturated again
        t_add = time.perf_counter()
        h.add_request("timed", "p", deadline=DEADLINE9)
        h.hold_submits(0)
        h.add_request("other2", "p", wait=False)
        t_term = _wait_terminal(h, "timed", t_add + DEADLINE9 + CUT)
        native = None if t_term is None else t_term - (t_add + DEADLINE9)
        h.release_submits(0)
        m = stop_and_drain(h)
    m["deadline_s"] = DEADLINE9
    m["overrun_plain_s"] = plain
    m["overrun_s"] = saturated
    m["overrun_cut"] = plain is None or saturated is None
    m["overrun_orchestrator_deadline_s"] = native
    m["timed_kind"] = next((getattr(x, "kind", "output") for x in h.received
                            if x.request_id == "timed" and x.finished), None)
    m.update(terminal_stats(h.received, ["plain", "slow", "other", "timed", "other2"]))
    return m


def judge_deadline(m: dict[str, Any]) -> tuple[str, str]:
    native = m["overrun_orchestrator_deadline_s"]
    tail = ("; the orchestrator's own deadline: " + ("no terminal (cut)" if native is None else
            f"{native * 1e3:.1f} ms late ({m['timed_kind']})"))
    if m["overrun_cut"] or native is None:
        return "hang", f"a client-side deadline got no terminal within {CUT} s of it{tail}"
    worst = max(m["overrun_plain_s"], m["overrun_s"], native)
    if worst > SLACK9:
        return "overrun", f"a terminal came {worst:.3f} s after its deadline{tail}"
    return "ok", f"every terminal at most {worst * 1e3:.1f} ms after its deadline{tail}"


def _ms(v: float | None) -> str:
    return "cut" if v is None else f"{v * 1e3:.0f} ms"


S9 = Scenario(
    9, "deadline", "per-request timeout on a stage that never answers",
    f"A request's stage never answers; its client gives it {DEADLINE9} s, then aborts -- once alone, once "
    "while the stage is saturated (its submit() blocks for another request). Then the same deadline kept "
    "by the orchestrator itself (add_request(deadline=...): Trio's deadline keeper task; asyncio: a "
    "loop.call_later timer), stage saturated. How late is each terminal?",
    f"hang if a terminal did not come within {CUT} s of its deadline; overrun if one came more than "
    f"{SLACK9} s late; else ok",
    measure_deadline, judge_deadline,
    lambda m: (f"client abort: {_ms(m['overrun_plain_s'])} alone, {_ms(m['overrun_s'])} saturated; "
               f"own deadline: {_ms(m['overrun_orchestrator_deadline_s'])}"),
    needs=frozenset({"deadline"}),
    kind="design",
    because=(
        "where an abort is queued (behind the adds, or straight to the dispatcher) and who keeps per-"
        "request deadlines is the shell's choice"
    ),
)


# ---------------------------------------------------------------- 10
IN_FLIGHT10 = 6
REPO = Path(__file__).resolve().parents[3]


def measure_sigint(impl: str) -> dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    argv = [sys.executable, "-m", "bench.compare.sigint_child", impl, str(IN_FLIGHT10)]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
                            env=env)
    m: dict[str, Any] = {"in_flight": IN_FLIGHT10}
    assert proc.stdout is not None
    ready = proc.stdout.readline().strip()
    while ready and ready != "READY":  # an implementation's library may log to stdout first (vLLM does)
        ready = proc.stdout.readline().strip()
    if ready != "READY":
        proc.kill()
        _, err = proc.communicate()
        raise RuntimeError(f"child did not get ready: {ready!r} {err[-500:]}")
    t0 = time.perf_counter()
    proc.send_signal(signal.SIGINT)
    try:
        out, _err = proc.communicate(timeout=2 * CUT)
        m["exit_s"] = time.perf_counter() - t0
        m["exit_hung"] = False
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _err = proc.communicate()
        m["exit_s"] = 2 * CUT
        m["exit_hung"] = True
    m["returncode"] = proc.returncode
    report = next((json.loads(x) for x in reversed(out.splitlines()) if x.startswith("{")), {})
    m["terminals"] = report.get("terminals")
    m["shutdown_s"] = report.get("shutdown_s")
    m["hung"] = report.get("hung", True)
    return m


def judge_sigint(m: dict[str, Any]) -> tuple[str, str]:
    if m["exit_hung"]:
        return "hang", f"the process had not exited {m['exit_s']:.1f} s after SIGINT (killed)"
    if m["terminals"] != m["in_flight"]:
        return "lost", f"{m['terminals']} of {m['in_flight']} in-flight requests got a terminal"
    return "ok", f"exited {m['exit_s']:.2f} s after SIGINT, all {m['in_flight']} terminals delivered"


S10 = Scenario(
    10, "sigint", "SIGINT to a process running the orchestrator in a background thread",
    f"A process serves {IN_FLIGHT10} streaming requests from its main thread, the orchestrator in a "
    "background thread; SIGINT. Its main thread catches KeyboardInterrupt and shuts the orchestrator down. "
    "Exit time, terminals delivered?",
    "hang if the process has not exited within the watchdog; lost if an in-flight request got no terminal; "
    "else ok",
    measure_sigint, judge_sigint,
    lambda m: (f"exit {m['exit_s']:.2f} s, terminals {m['terminals']}/{m['in_flight']}"),
    kind="model",
    because=(
        "in both models SIGINT reaches only the main thread (Python runs signal handlers there), so a"
        " server with the orchestrator in a thread gets KeyboardInterrupt in its serving thread"
    ),
)


# ---------------------------------------------------------------- 11
PROBE_CUT = 1.0


def _probe(fn: Callable[[], Any]) -> str:
    """``ok``, ``error:<Type>`` or ``hang`` (no return within PROBE_CUT s)."""
    result: list[str] = []

    def run() -> None:
        try:
            fn()
            result.append("ok")
        except BaseException as exc:
            cause = exc.__cause__ or exc
            result.append(f"error:{type(exc).__name__}"
                          + (f"({type(cause).__name__})" if cause is not exc else ""))

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(PROBE_CUT)
    return result[0] if result else "hang"


def measure_bridge_after(impl: str) -> dict[str, Any]:
    with LogCapture():
        h = start(impl, 2, {1}, misbehaviour={0: Misbehaviour(aclose_delay=0.4)})
        h.add_request("r1", "p")
        h.request_shutdown()
        time.sleep(0.15)  # inside the cleanup: stage 0's aclose() is slow
        during = {
            "add_request": _probe(lambda: h.add_request("late1", "p", timeout=PROBE_CUT)),
            "call": _probe(lambda: h.call(lambda: None, timeout=PROBE_CUT)),
        }
        m = stop_and_drain(h)
        h.join(CUT)
        after = {
            "add_request": _probe(lambda: h.add_request("late2", "p", timeout=PROBE_CUT)),
            "abort": _probe(lambda: h.abort("r1")),
            "call": _probe(lambda: h.call(lambda: None, timeout=PROBE_CUT)),
            "emit": _probe(lambda: h.emit(0, "r1", "x")),
            "next_output": _probe(lambda: h.next_output(timeout=PROBE_CUT)),
        }
    m["during_shutdown"] = during
    m["after_shutdown"] = after
    accepted = [r for r, res in (("late1", during["add_request"]), ("late2", after["add_request"]))
                if res == "ok"]
    m["accepted_late"] = accepted
    m.update(terminal_stats(h.received, ["r1", *accepted]))
    return m


def judge_bridge(m: dict[str, Any]) -> tuple[str, str]:
    probes = {**{f"during.{k}": v for k, v in m["during_shutdown"].items()},
              **{f"after.{k}": v for k, v in m["after_shutdown"].items()}}
    hangs = [k for k, v in probes.items() if v == "hang"]
    if hangs:
        return "hang", "blocked: " + ", ".join(hangs)
    if m["accepted_late"] and m["without_terminal"]:
        return "silent", f"accepted {m['accepted_late']} while stopping and never answered"
    return "ok", "every late call raised at once or was a documented no-op"


S11 = Scenario(
    11, "bridge-after-shutdown", "the thread bridge used during and after shutdown",
    "From the serving thread: add_request and a round-trip call while the orchestrator is cleaning up, "
    "then add_request, abort, a call, an emit and next_output after it stopped. Error or hang?",
    f"hang if any call blocked for {PROBE_CUT} s; silent if a late request was accepted and never got a "
    "terminal; else ok",
    measure_bridge_after, judge_bridge,
    lambda m: "after: " + ", ".join(f"{k}={v}" for k, v in m["after_shutdown"].items()),
    kind="design",
    because=(
        "both thread bridges refuse once the loop is gone (trio.from_thread raises RunFinishedError, "
        "call_soon_threadsafe on a closed loop and a shut-down janus queue raise RuntimeError)"
    ),
)
