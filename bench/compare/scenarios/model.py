"""Scenarios about the concurrency model itself: 18 to 21 of the comparison.

Each puts the same code -- a client library, a stage client, the application
that owns the orchestrator -- under Trio and under asyncio, written the
idiomatic way of each, and measures what the model does with it: a deadline
that a library swallows once (18), blocking work in a worker thread when
shutdown cancels it (19), the application cancelling the orchestrator twice
while it cleans up (20), a stage client's cleanup that awaits after its
submit was cancelled (21), the application's error while a stage swallows
the group's cancellation (22).  The asyncio reference ``asyncio-taskgroup`` has
every design choice of the Trio shell (see :mod:`bench.refs.taskgroup`), so
what differs in these rows is the model; row 21 is one where Trio does worse.

The real vLLM-Omni (:class:`~bench.drivers.vllm_omni.VllmOmniDriver`) gets
the same code at the equivalent place of its own: its stage clients are
vLLM's engine-core clients (the driver's fed ones), whose ``shutdown()`` is
synchronous and whose submit is ``add_request_async`` (19, 21); an
application owns its orchestrator as its engine does, the task its own
loop thread runs (20: cancelled from the application's thread), or runs it
next to its front in one TaskGroup in a loop of its own (22: its ``run()``
ends by cancelling every task of the loop it runs in, so not the driver's).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from bench.compare.scenarios.base import (
    CUT,
    GRACE,
    LogCapture,
    Scenario,
    shut_fmt,
    start,
    stop_and_drain,
    terminal_stats,
)
from bench.drivers.base import Driver, Unsupported
from bench.drivers.vllm_omni import VllmOmniDriver, build_orchestrator, run_in_own_loop
from bench.drivers.vllm_omni_stage import FedEngineClient
from bench.refs.orchestrator import AddMsg, AsyncioOrchestrator
from bench.refs.testing import AsyncScriptedStage
from trio_orch.shell.orchestrator import Orchestrator
from trio_orch.testing import Misbehaviour, ScriptedStage


def _stage(h: Driver, k: int) -> Any:
    """Stage ``k`` of ``h``: a scripted stage or vLLM-Omni's fed engine-core client (else not expressible)."""
    stage = h.stages[k]
    if not isinstance(stage, (ScriptedStage, AsyncScriptedStage, FedEngineClient)):
        raise Unsupported(f"{h.name}: its stage clients are its own; the scenario replaces one of its calls")
    return stage


def _ignore_submit(stage_id: int, request_id: str) -> None:
    """A fed client's submit hook where nobody waits for the submit."""


def _orchestrator_class(h: Driver) -> type:
    """The class of ``h``'s orchestrator, to build a second one with this project's constructor."""
    orch = getattr(h, "orch", None)
    if orch is None:
        raise Unsupported(f"{h.name}: no orchestrator object to build a second one from")
    if not isinstance(orch, (Orchestrator, AsyncioOrchestrator)):
        raise Unsupported(f"{h.name}: its orchestrator is not built from (stages, final stages) as this "
                          f"project's shells are ({type(orch).__module__}.{type(orch).__qualname__})")
    return type(orch)


# ---------------------------------------------------------------- 18
DEADLINE18 = 0.05
SLACK18 = 0.1


async def trio_swallowed_deadline(h: Driver) -> dict[str, Any]:
    """A client waits for output under a deadline; its library catches the cancellation once, retries."""
    import trio

    swallowed = 0

    async def library_next() -> Any:
        nonlocal swallowed
        while True:
            try:
                return await h.loop_next_batch()
            except trio.Cancelled:
                if swallowed:
                    raise
                swallowed += 1  # "a cancellation here is spurious: retry"

    t0 = trio.current_time()
    with trio.move_on_after(CUT) as watchdog, trio.move_on_after(DEADLINE18) as deadline:
        await library_next()
    return {"returned_s": trio.current_time() - t0, "deadline_ended_wait": deadline.cancelled_caught,
            "cut": watchdog.cancelled_caught, "swallowed": swallowed}


async def asyncio_swallowed_deadline(h: Driver) -> dict[str, Any]:
    """The same client with ``asyncio.timeout``; the watchdog is a second, outer timeout."""
    import asyncio

    swallowed = 0

    async def library_next() -> Any:
        nonlocal swallowed
        while True:
            try:
                return await h.loop_next_batch()
            except asyncio.CancelledError:
                if swallowed:
                    raise
                swallowed += 1

    loop = asyncio.get_running_loop()
    t0 = loop.time()
    ended = cut = False
    try:
        async with asyncio.timeout(CUT):
            try:
                async with asyncio.timeout(DEADLINE18):
                    await library_next()
            except TimeoutError:
                ended = True
    except TimeoutError:
        cut = True
    return {"returned_s": loop.time() - t0, "deadline_ended_wait": ended, "cut": cut, "swallowed": swallowed}


def measure_swallowed_deadline(impl: str) -> dict[str, Any]:
    with LogCapture():
        h = start(impl, 1, {0}, in_loop_consumer=True)
        client = trio_swallowed_deadline if h.framework == "trio" else asyncio_swallowed_deadline
        m = h.run_in_loop(client, h, timeout=2 * CUT)
        m.update(stop_and_drain(h))
    m["deadline_s"] = DEADLINE18
    return m


def judge_swallowed_deadline(m: dict[str, Any]) -> tuple[str, str]:
    if m["cut"]:
        return "hang", (f"the {m['deadline_s'] * 1e3:.0f} ms deadline never ended the wait (the library "
                        f"swallowed its only cancellation); the {CUT} s watchdog did")
    late = m["returned_s"] - m["deadline_s"]
    if late > SLACK18:
        return "overrun", f"the wait ended {late * 1e3:.0f} ms after its deadline"
    return "ok", (f"the wait ended {max(late, 0) * 1e3:.0f} ms after its deadline, although the library "
                  f"swallowed {m['swallowed']} cancellation")


S18 = Scenario(
    18, "swallowed-deadline", "a client deadline, and a library that swallows one cancellation",
    f"A client in the orchestrator's loop waits for output under a {DEADLINE18 * 1e3:.0f} ms deadline "
    "(trio.move_on_after / asyncio.timeout); the library it calls catches the cancellation once, calls it "
    "spurious and waits again. Does the deadline still end the wait?",
    f"hang if only the {CUT} s watchdog ended the wait; overrun if the deadline ended it more than "
    f"{SLACK18 * 1e3:.0f} ms late; else ok",
    measure_swallowed_deadline, judge_swallowed_deadline,
    lambda m: ("cut by the watchdog" if m["cut"] else f"ended after {m['returned_s'] * 1e3:.0f} ms")
    + f" (deadline {m['deadline_s'] * 1e3:.0f} ms), swallowed {m['swallowed']}",
    needs=frozenset({"in_loop"}),
    kind="model",
    because=(
        "a Trio deadline is a cancel scope that stays cancelled, so the library's retry is cancelled "
        "again; asyncio.timeout cancels the task once, and a swallowed CancelledError is gone"
    ),
)


# ---------------------------------------------------------------- 19
BLOCK19 = 1.0


def _thread_close(h: Driver, stage: Any, record: dict[str, Any]) -> tuple[str, Callable[[], Any]]:
    """The stage's close, doing its blocking part (a socket linger, a client's join) in a worker thread.

    Returns the name of the call it replaces and the replacement: an
    awaitable ``aclose``; for vLLM-Omni's stage clients, whose ``shutdown()``
    its orchestrator calls synchronously from its loop (no await possible),
    a ``shutdown`` that does what it did and hands the blocking part to the
    loop's default executor (``run_in_executor``, what ``asyncio.to_thread``
    wraps).
    """

    def blocking() -> None:
        record["thread"] = threading.current_thread()
        time.sleep(BLOCK19)
        record["finished"] = time.perf_counter()

    if isinstance(stage, FedEngineClient):
        import asyncio

        orig = stage.shutdown

        def shutdown_offloaded() -> None:
            orig()
            stage.closed = True
            stage.close_future = asyncio.get_running_loop().run_in_executor(None, blocking)

        return "shutdown", shutdown_offloaded
    if h.framework == "trio":
        import trio

        async def aclose_trio() -> None:
            stage.closed = True
            await trio.to_thread.run_sync(blocking, abandon_on_cancel=True)

        return "aclose", aclose_trio
    import asyncio

    async def aclose_asyncio() -> None:
        stage.closed = True
        await asyncio.to_thread(blocking)

    return "aclose", aclose_asyncio


def measure_thread_at_shutdown(impl: str) -> dict[str, Any]:
    record: dict[str, Any] = {}
    with LogCapture():
        h = start(impl, 2, {1})
        stage = _stage(h, 0)
        h.call(setattr, stage, *_thread_close(h, stage, record))
        h.add_request("r1", "p")
        t0 = time.perf_counter()
        rep = h.shutdown(wait=CUT + BLOCK19)
        if rep.hung:
            h.abandon()
        ended = h.join(CUT + BLOCK19)
        t_end = time.perf_counter()
        worker = record.get("thread")
        still_running = "finished" not in record
        h.drain(0.3)
    m: dict[str, Any] = {
        "shutdown_s": rep.seconds, "hung": rep.hung, "cut_s": CUT + BLOCK19 if rep.hung else None,
        "loop_thread_ended": ended, "loop_thread_end_s": t_end - t0,
        "call_s": BLOCK19, "grace_s": GRACE,
        "call_running_at_loop_end": still_running,
        "worker_daemon": None if worker is None else worker.daemon,
    }
    # a non-daemon thread still running the call when the loop ended holds the process's exit
    m["holds_process_exit"] = bool(still_running and worker is not None and not worker.daemon)
    return m


def judge_thread_at_shutdown(m: dict[str, Any]) -> tuple[str, str]:
    if m["hung"] or not m["loop_thread_ended"]:
        return "hang", f"run() or the loop thread had not ended after {CUT + m['call_s']:.1f} s"
    bound = m["grace_s"] + 0.3
    if m["shutdown_s"] > bound:
        return "waited", (f"run() returned after {m['shutdown_s']:.2f} s: its cleanup waited for the "
                          f"{m['call_s']:g} s call in the thread")
    if m["loop_thread_end_s"] > bound:
        return "waited", (f"run() returned after {m['shutdown_s']:.2f} s, but the loop ended only after "
                          f"{m['loop_thread_end_s']:.2f} s: its runner waited for the thread")
    if m["holds_process_exit"]:
        return "waited", "the loop ended, but a non-daemon thread still runs the call: the process waits"
    return "ok", (f"the loop ended after {m['loop_thread_end_s']:.2f} s; the abandoned call finishes on its "
                  "own in a daemon thread")


S19 = Scenario(
    19, "thread-at-shutdown", "shutdown while a stage's cleanup runs in a worker thread",
    f"Stage 0's aclose() does its blocking part ({BLOCK19:g} s) in a worker thread "
    "(trio.to_thread.run_sync(abandon_on_cancel=True) / asyncio.to_thread); shutdown, whose cleanup is "
    f"bounded by {GRACE} s where the implementation bounds it. When do run() and the loop end, and does "
    "anything still hold the process?",
    "hang if run() or the loop thread did not end; waited if run() or the loop ended more than grace + "
    "0.3 s after shutdown began, or a non-daemon thread still runs the call (the process's exit waits for "
    "it); else ok",
    measure_thread_at_shutdown, judge_thread_at_shutdown,
    lambda m: (f"{shut_fmt(m)}, loop ended after {m['loop_thread_end_s']:.2f} s"
               + (", call still running" if m["call_running_at_loop_end"] else "")
               + (" in a daemon thread" if m["call_running_at_loop_end"] and m["worker_daemon"] else "")),
    kind="model",
    because=(
        "Trio abandons a cancelled thread call if asked (abandon_on_cancel) and its run never waits for "
        "one; asyncio.to_thread's await is cancelled but the thread runs on in the default executor, "
        "which asyncio.Runner joins at close and the interpreter joins at exit"
    ),
)


# ---------------------------------------------------------------- 20
SLOW20 = 0.3
GAP20 = 0.05


def _tracked(stages: list[Any], done: list[int]) -> None:
    """Each stage's aclose records when it completed (``closed`` is set as it begins)."""
    for s in stages:
        orig = s.aclose

        async def aclose(orig: Any = orig, k: int = s.stage_id) -> None:
            await orig()
            done.append(k)

        s.aclose = aclose


async def _trio_cancelled_twice(h: Driver) -> dict[str, Any]:
    """The application runs an orchestrator in its own scopes and cancels it twice during the cleanup."""
    import trio

    stages = [ScriptedStage(k, misbehaviour=Misbehaviour(aclose_delay=SLOW20)) for k in range(2)]
    closed: list[int] = []
    _tracked(stages, closed)
    orch = _orchestrator_class(h)(stages, {1}, shutdown_grace=GRACE)
    msgs: list[Any] = []
    at_return: dict[str, Any] = {}
    outer, inner = trio.CancelScope(), trio.CancelScope()
    returned = trio.Event()

    def snapshot() -> dict[str, Any]:
        ended = False
        while True:
            try:
                msgs.append(orch.next_output_nowait())
            except trio.WouldBlock:
                break
            except trio.EndOfChannel:
                ended = True
                break
        return {"closed": len(closed), "stream_ended": ended, "terminals": sum(m.finished for m in msgs)}

    async def app() -> None:
        try:
            with outer, inner:
                await orch.run()
        finally:
            at_return.update(snapshot())
            returned.set()

    async with trio.open_nursery() as n:
        n.start_soon(app)
        while not orch.running:
            await trio.sleep(0.001)
        orch.add_request_nowait("r1", "p")
        await trio.sleep(0.02)
        inner.cancel()  # the application cancels the orchestrator...
        with trio.move_on_after(CUT):
            while not any(s.closed for s in stages):
                await trio.sleep(0.001)
        await trio.sleep(GAP20)
        outer.cancel()  # ... and again, while it is closing its stages
        with trio.move_on_after(CUT) as cut:
            await returned.wait()
        await trio.sleep(SLOW20 * 2 + GRACE)
    return {"at_return": at_return, "returned": not cut.cancelled_caught,
            "later": {"closed": len(closed), "terminals": sum(m.finished for m in msgs)}}


async def _asyncio_cancelled_twice(h: Driver) -> dict[str, Any]:
    """The same application: the orchestrator's run() in a task it cancels twice."""
    import asyncio

    import janus

    stages = [AsyncScriptedStage(k, misbehaviour=Misbehaviour(aclose_delay=SLOW20)) for k in range(2)]
    closed: list[int] = []
    _tracked(stages, closed)
    orch = _orchestrator_class(h)(stages, {1}, shutdown_grace=GRACE)
    msgs: list[Any] = []
    at_return: dict[str, Any] = {}

    def snapshot(_task: Any = None) -> None:
        ended = False
        while True:
            try:
                msgs.extend(orch.output_queue.async_q.get_nowait())
            except asyncio.QueueEmpty:
                break
            except janus.AsyncQueueShutDown:
                ended = True
                break
        at_return.update({"closed": len(closed), "stream_ended": ended,
                          "terminals": sum(m.finished for m in msgs)})

    task = asyncio.create_task(orch.run())
    task.add_done_callback(snapshot)
    await asyncio.sleep(0.02)
    with orch.lock:
        ticket = orch.router.accept("r1", "p")
    orch.request_queue.async_q.put_nowait(AddMsg(ticket, None))
    await asyncio.sleep(0.02)
    task.cancel()  # the application cancels the orchestrator...
    t_end = asyncio.get_running_loop().time() + CUT
    while not any(s.closed for s in stages) and asyncio.get_running_loop().time() < t_end:
        await asyncio.sleep(0.001)
    await asyncio.sleep(GAP20)
    task.cancel()  # ... and again, while it is closing its stages
    done, _ = await asyncio.wait({task}, timeout=CUT)
    await asyncio.sleep(SLOW20 * 2 + GRACE)
    later = sum(m.finished for m in msgs)
    try:
        while True:
            later += sum(m.finished for m in orch.output_queue.async_q.get_nowait())
    except (asyncio.QueueEmpty, janus.AsyncQueueShutDown):
        pass
    return {"at_return": at_return, "returned": bool(done),
            "later": {"closed": len(closed), "terminals": later}}


def _vllm_omni_cancelled_twice(impl: str) -> dict[str, Any]:
    """The application owns vLLM-Omni's orchestrator as its engine does, and cancels it twice.

    Its engine runs ``Orchestrator.run()`` in the one task of a loop thread
    of its own; the application, in its thread, cancels that task, and again
    while the stages close.  vLLM's client ``shutdown()`` is synchronous, so
    a slow close blocks that loop for its time.
    """
    slow = Misbehaviour(aclose_delay=SLOW20)
    h = start(impl, 2, {1}, misbehaviour={0: slow, 1: slow})
    closed: list[float] = []  # when each stage's shutdown() completed
    for s in h.stages:
        orig = s.shutdown

        def shutdown(orig: Callable[[], None] = orig) -> None:
            orig()
            closed.append(time.perf_counter())

        h.call(setattr, s, "shutdown", shutdown)
    h.add_request("r1", "p")
    time.sleep(0.02)
    h.cancel_run()  # the application cancels the orchestrator...
    h.wait_until(lambda: any(s.shutdown_calls for s in h.stages), CUT)
    time.sleep(GAP20)
    second_sent = h.cancel_run()  # ... and again, while it is closing its stages
    returned = h.wait_until(lambda: h.stopped, CUT)
    time.sleep(SLOW20 * 2 + GRACE)
    _, ended = h.drain(1.0)
    terminals = sum(m.finished for m in h.received)
    at = h.returned_at if h.returned_at is not None else float("inf")
    stop_and_drain(h)
    return {"at_return": {"closed": sum(1 for t in closed if t <= at), "stream_ended": ended,
                          "terminals": terminals},
            "returned": returned, "later": {"closed": len(closed), "terminals": terminals},
            "second_cancel_sent": second_sent, "run_error": repr(h.run_error)}


def measure_cancelled_twice(impl: str) -> dict[str, Any]:
    with LogCapture():
        h = start(impl, 1, {0})
        if isinstance(h, VllmOmniDriver):
            stop_and_drain(h)
            m = _vllm_omni_cancelled_twice(impl)
        else:
            app = _trio_cancelled_twice if h.framework == "trio" else _asyncio_cancelled_twice
            m = h.run_in_loop(app, h, timeout=3 * CUT + 2 * SLOW20 + GRACE)
            stop_and_drain(h)
    m["stages"] = 2
    return m


def judge_cancelled_twice(m: dict[str, Any]) -> tuple[str, str]:
    if not m["returned"]:
        return "hang", f"run() had not returned {CUT} s after the second cancellation"
    at, later, n = m["at_return"], m["later"], m["stages"]
    if at["closed"] == n and at["stream_ended"] and at["terminals"] == 1:
        return "ok", "when run() returned every stage was closed and the request had its terminal"
    if at["closed"] == n and not later["terminals"]:
        return "lost", "when run() returned every stage was closed, but the request never got a terminal"
    if later["closed"] == n:
        return "detached", (f"run() returned with {at['closed']} of {n} stages closed; its cleanup went on "
                            "without it and finished later")
    return "cut", f"the second cancellation cut the cleanup: {later['closed']} of {n} stages ever closed"


S20 = Scenario(
    20, "cancelled-twice", "the application cancels the orchestrator twice while it cleans up",
    f"The application runs an orchestrator in a scope (Trio) or a task (asyncio) of its own and cancels it; "
    f"{GAP20 * 1e3:.0f} ms into its cleanup (each stage's aclose() takes {SLOW20:g} s) it cancels it again "
    "(a second Ctrl-C, an outer deadline). When run() returns, is the cleanup done?",
    f"hang if run() had not returned {CUT} s after the second cancellation; ok if, when it returned, every "
    "stage was closed and the request had its terminal; lost if every stage was closed but the request never "
    "got a terminal; detached if its cleanup finished only after it returned; cut if the cleanup never "
    "finished",
    measure_cancelled_twice, judge_cancelled_twice,
    lambda m: (f"at return: {m['at_return'].get('closed', 0)}/{m['stages']} stages closed, "
               f"terminals {m['at_return'].get('terminals', 0)}; "
               f"later: {m['later']['closed']}/{m['stages']}"),
    needs=frozenset({"in_loop"}),
    kind="model",
    because=(
        "a Trio shielded cancel scope protects the code inside it, so run() returns once the cleanup is "
        "done; asyncio.shield protects only the inner task, so the awaiting run() still ends at the "
        "next cancellation and the cleanup goes on without it"
    ),
)


# ---------------------------------------------------------------- 21
def _notifying_submit(h: Driver, stage: Any, notices: list[str]) -> tuple[str, Callable[..., Any]]:
    """A stage client whose interrupted submit tells its worker to drop the half-sent request.

    The same code in both models, unshielded: the notice is a send, i.e. an
    ``await`` in the cleanup path.  Returns the name of the call it wraps
    and the wrapper: ``submit``; for vLLM-Omni's stage clients
    ``add_request_async``, what its stage pool awaits to submit.
    """
    name = "add_request_async" if isinstance(stage, FedEngineClient) else "submit"
    orig = getattr(stage, name)
    if h.framework == "trio":
        import trio

        async def submit_trio(request_id: str, payload: Any, **kw: Any) -> None:
            try:
                await orig(request_id, payload, **kw)
            except BaseException:
                await trio.sleep(0)  # send "drop request_id" to the worker
                notices.append(request_id)
                raise

        return name, submit_trio
    import asyncio

    async def submit_asyncio(request: Any, *args: Any, **kw: Any) -> None:
        try:
            await orig(request, *args, **kw)
        except BaseException:
            await asyncio.sleep(0)
            notices.append(getattr(request, "request_id", request))
            raise

    return name, submit_asyncio


def measure_cleanup_await(impl: str) -> dict[str, Any]:
    notices: list[str] = []
    with LogCapture():
        h = start(impl, 2, {1})
        stage = _stage(h, 0)
        h.call(setattr, stage, *_notifying_submit(h, stage, notices))
        h.hold_submits(0)  # the submit waits (a full socket): shutdown cancels it there
        h.add_request("r1", "p", wait=False)
        submitting = h.wait_until(lambda: "r1" in h.router.requests, CUT)
        time.sleep(0.05)
        m = stop_and_drain(h)
    m.update(terminal_stats(h.received, ["r1"]))
    m["submit_in_progress"] = submitting
    m["notices_sent"] = len(notices)
    return m


def judge_cleanup_await(m: dict[str, Any]) -> tuple[str, str]:
    if m["hung"]:
        return "hang", f"run() had not returned after {m['cut_s']} s"
    if not m["notices_sent"]:
        return "lost", ("the stage client's cleanup never reached its worker: its await was cancelled too "
                        "(it needed a shield)")
    if m["without_terminal"]:
        return "lost", "the request got no terminal"
    return "ok", "the cancelled submit's cleanup ran its await and reached the worker"


S21 = Scenario(
    21, "cleanup-await", "a stage client's cleanup awaits after its submit was cancelled",
    "Stage 0's submit() is blocked (the worker's socket is full) when shutdown cancels it; the stage "
    "client's except-clause then sends the worker a 'drop this request' notice -- an await -- and re-raises. "
    "The same code in both models, without a shield. Does the notice get out?",
    "hang if shutdown hangs; lost if the notice never reached the stage or the request got no terminal; "
    "else ok",
    measure_cleanup_await, judge_cleanup_await,
    lambda m: f"{shut_fmt(m)}, notices sent: {m['notices_sent']}",
    kind="model",
    because=(
        "Trio's cancellation is level-triggered, so an await in cleanup code inside a cancelled scope is "
        "cancelled too unless shielded (CancelScope(shield=True)); asyncio delivered its one "
        "CancelledError, so the cleanup's await runs"
    ),
)


# ---------------------------------------------------------------- 22
CRASH22 = 0.02


async def _trio_sibling_crash(h: Driver) -> dict[str, Any]:
    """The application's nursery: the orchestrator, and a front task that crashes."""
    import trio

    stages = [ScriptedStage(0, misbehaviour=Misbehaviour(swallow_cancel_once=True)), ScriptedStage(1)]
    orch = _orchestrator_class(h)(stages, {1}, shutdown_grace=GRACE)
    t_crash: list[float] = []

    async def front() -> None:
        await trio.sleep(CRASH22)
        t_crash.append(trio.current_time())
        raise RuntimeError("E-front crashed")

    seen: BaseException | None = None
    with trio.move_on_after(CUT) as watchdog:
        try:
            async with trio.open_nursery() as n:
                n.start_soon(orch.run)
                n.start_soon(front)
        except BaseException as exc:  # the nursery's ExceptionGroup
            seen = exc
    return {"surfaced_after_s": trio.current_time() - t_crash[0] if seen is not None else None,
            "cut": watchdog.cancelled_caught, "error": repr(seen),
            "swallowed": stages[0].swallowed_cancels}


async def _asyncio_sibling_crash(h: Driver) -> dict[str, Any]:
    """The same application with ``asyncio.TaskGroup``."""
    stages = [AsyncScriptedStage(0, misbehaviour=Misbehaviour(swallow_cancel_once=True)),
              AsyncScriptedStage(1)]
    return await _taskgroup_app(stages, _orchestrator_class(h)(stages, {1}, shutdown_grace=GRACE))


async def _vllm_omni_sibling_crash(h: VllmOmniDriver) -> dict[str, Any]:
    """The same application over vLLM-Omni's orchestrator, in its loop (see :func:`run_in_own_loop`)."""
    stages = [FedEngineClient(0, False, _ignore_submit, Misbehaviour(swallow_cancel_once=True)),
              FedEngineClient(1, True, _ignore_submit)]
    return await _taskgroup_app(stages, build_orchestrator(stages, event_driven=h.event_driven).orch)


async def _taskgroup_app(stages: list[Any], orch: Any) -> dict[str, Any]:
    """The application's ``asyncio.TaskGroup``: ``orch.run()`` and a front task that crashes."""
    import asyncio

    loop = asyncio.get_running_loop()
    t_crash: list[float] = []
    seen: list[BaseException] = []

    async def front() -> None:
        await asyncio.sleep(CRASH22)
        t_crash.append(loop.time())
        raise RuntimeError("E-front crashed")

    async def app() -> None:
        try:
            async with asyncio.TaskGroup() as tg:
                tg.create_task(orch.run())
                tg.create_task(front())
        except BaseException as exc:
            seen.append(exc)
            t_seen.append(loop.time())

    t_seen: list[float] = []
    task = asyncio.create_task(app())
    swept = False
    try:
        done, _ = await asyncio.wait({task}, timeout=CUT)
        if not done:  # a group cancels its children at most once more: end the swallowing stage's wait
            stages[0].emit_nowait("unblock", None)
            await asyncio.wait({task}, timeout=CUT)
    except asyncio.CancelledError:  # an all_tasks() sweep in the orchestrator cancelled this task too
        swept, done = True, {task} if task.done() else set()
    return {"surfaced_after_s": t_seen[0] - t_crash[0] if done and t_seen else None,
            "cut": not done and not swept, "swept": swept, "error": repr(seen[0]) if seen else None,
            "swallowed": stages[0].swallowed_cancels}


def measure_sibling_crash(impl: str) -> dict[str, Any]:
    with LogCapture() as logs:
        h = start(impl, 1, {0})
        if isinstance(h, VllmOmniDriver):
            m, loop_ended = run_in_own_loop(lambda: _vllm_omni_sibling_crash(h), timeout=3 * CUT,
                                            end_wait=CUT)
            m["application_loop_ended"] = loop_ended  # its tasks may wait on each other for good
        else:
            app = _trio_sibling_crash if h.framework == "trio" else _asyncio_sibling_crash
            m = h.run_in_loop(app, h, timeout=3 * CUT)
        stop_and_drain(h)
    m["reported"] = "E-front crashed" in (m["error"] or "")
    # the asyncio-taskgroup reference says so when its stop deadline had to cancel a second time
    m["second_cancel_logged"] = any("cancelled them again" in r for r in logs.records)
    return m


def judge_sibling_crash(m: dict[str, Any]) -> tuple[str, str]:
    if m.get("swept"):
        return "lost", ("the orchestrator's all_tasks() sweep cancelled the application's own tasks; it got "
                        f"{m['error'] or 'nothing'} instead of the front's error")
    if m["cut"]:
        return "hang", (f"the front's error had not reached the application {CUT} s after the crash: the "
                        "group waits for a child that swallowed its one cancellation")
    if not m["reported"]:
        return "lost", f"the application got {m['error']} instead of the front's error"
    if m["surfaced_after_s"] > GRACE / 2:
        return "slow", (f"the front's error reached the application {m['surfaced_after_s']:.2f} s after the "
                        "crash: only a second cancellation ended the orchestrator")
    return "ok", (f"the front's error reached the application {m['surfaced_after_s'] * 1e3:.0f} ms after the "
                  "crash")


S22 = Scenario(
    22, "sibling-crash", "the application's front crashes while a stage swallows a cancellation",
    "The application runs the orchestrator next to its front in one nursery / TaskGroup; the front crashes, "
    "so the group cancels the orchestrator, one of whose stages catches the cancellation once and waits "
    "again. How long until the front's error reaches the application?",
    f"hang if it had not within {CUT} s; lost if the application got another error; slow if it took more "
    f"than {GRACE / 2} s; else ok",
    measure_sibling_crash, judge_sibling_crash,
    lambda m: ("the application's tasks swept" if m.get("swept") else "error not surfaced (cut)"
               if m["cut"] else f"error surfaced after {m['surfaced_after_s'] * 1e3:.0f} ms")
    + f", swallowed {m['swallowed']}",
    needs=frozenset({"in_loop"}),
    kind="model",
    because=(
        "an error leaves a nursery or a TaskGroup only once every sibling has ended; a Trio nursery's "
        "cancellation stays in force, a TaskGroup cancels each child once (and once more when its own "
        "task is cancelled again)"
    ),
)
