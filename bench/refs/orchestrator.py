"""What the asyncio references share: the vLLM-Omni thread/loop boundary around the routing core.

vLLM-Omni's orchestrator lives in a background thread with its own event loop;
the serving thread talks to it through janus queues (a request queue bounded
at 256, an output queue), the request handler starts a request before its
first ``await`` and submits it, readers only move stage outputs, and one
dispatcher routes them serially.  This module holds the parts every asyncio
variant shares -- the serving-thread calls, request handling, performing the
core's actions, the shutdown cleanup -- so that the variants
(:mod:`bench.refs.omni`, :mod:`bench.refs.taskgroup`) differ only in
how their tasks are started, stopped and supervised, which is what the
comparison is about.  Every decision (acceptance, routing, every terminal) is
made by the same :class:`trio_orch.core.Router` as the Trio orchestrator's;
this module only performs its actions.

The serving thread accepts a request against the core under a lock (the core
is otherwise used by the loop thread alone), as vLLM-Omni's client checks its
own request table before queueing, so a duplicate id is refused at once.

Two deliberate departures from the source, both so the references honour the
same contract as the Trio orchestrator: at shutdown every active or
still-queued request gets its ``shutdown`` terminal (the source does that
only after a fatal error), and a stage whose client dies gets
``replica_died`` terminals for its requests instead of stopping the whole
orchestrator (the source is fail-stop).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Coroutine, Iterable, Mapping, Sequence
from functools import partial
from typing import Any

import janus

from bench.refs.control import RpcMsg, sequential_rpc
from trio_orch.core import (
    Abort,
    Action,
    Emit,
    JoinRefused,
    Router,
    Submit,
    Ticket,
    Update,
    stage_call,
    stage_call_failed,
)
from trio_orch.types import Message, PrioritizedStageClient, ReplicatedStageClient, RpcResult, StageClient

__all__ = ["AbortMsg", "AddMsg", "AsyncioOrchestrator"]

log = logging.getLogger("bench.asyncio")


class AddMsg:
    """An accepted request handed from the serving thread; ``done`` is set once it started."""

    __slots__ = ("done", "ticket")

    def __init__(self, ticket: Ticket, done: threading.Event | None = None) -> None:
        self.ticket = ticket
        self.done = done


class UpdateMsg:
    """``update_request`` handed from the serving thread (same queue: ordered after its add)."""

    __slots__ = ("done", "error", "final", "request_id", "segment")

    def __init__(self, request_id: str, segment: Any, final: bool, done: threading.Event | None) -> None:
        self.request_id = request_id
        self.segment = segment
        self.final = final
        self.done = done
        self.error: Exception | None = None


class AbortMsg:
    """``abort`` handed from the serving thread (same queue as adds, as in vLLM-Omni)."""

    __slots__ = ("request_id",)

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id


class AsyncioOrchestrator:
    """Base of the asyncio references; subclasses provide :meth:`run`.

    Build it inside the loop that will run it (janus queues bind to it).  The
    serving thread calls :meth:`add_request` and :meth:`abort`; output
    batches (lists of messages) come out of :attr:`output_queue`'s ``sync_q``,
    one put per routing step.  A variant's ``run()`` starts
    :meth:`request_handler` and its readers, hands stage outputs to
    :meth:`route` and performs the result with :meth:`perform`, waits with
    :meth:`wait_stop_requested`, sets :attr:`stopping` and ends with :meth:`finish`.
    """

    #: bound the shutdown cleanup (stage aborts, aclose) by ``shutdown_grace``
    bounded_cleanup = False
    #: the implementation's name in the comparison and the benchmark ("": not one, e.g. a base class);
    #: bench.implementations registers every class of bench/refs/ that has one
    variant = ""
    #: one line for the tables' legends
    description = ""
    #: its thread runs the loop with ``asyncio.Runner`` (which cancels leftover tasks on close)
    #: instead of ``new_event_loop`` + ``run_until_complete`` + ``close`` (what vLLM-Omni's thread does)
    use_runner = False
    #: its readers take the push fast path (``pump(deliver)``) of stage clients that offer one
    push_path = False
    #: the seed waits this long at shutdown for attach handshakes in flight (``wait_for``, 10 s)
    join_wait = 10.0

    def __init__(
        self,
        stages: Sequence[StageClient],
        final_stage_ids: Iterable[int],
        *,
        async_chunk: bool = False,
        forward_fn: Callable[..., Any] | None = None,
        prewarm_fn: Callable[[int, Any], Any] | None = None,
        request_queue_size: int = 256,
        shutdown_grace: float = 2.0,
        max_retries: int = 1,
    ) -> None:
        self.stages = list(stages)
        self.router = Router(len(self.stages), final_stage_ids, async_chunk=async_chunk,
                             forward_fn=forward_fn, prewarm_fn=prewarm_fn, max_retries=max_retries)
        self.shutdown_grace = shutdown_grace
        self.loop = asyncio.get_running_loop()
        self.request_queue: janus.Queue[AddMsg | AbortMsg | UpdateMsg | RpcMsg] = janus.Queue(
            maxsize=request_queue_size)
        self.output_queue: janus.Queue[list[Message]] = janus.Queue()
        # Held by the serving thread around accept/withdraw, and by the loop around the core
        # calls that move a request between its tables (start, shutdown).  Other loop-side calls
        # only delete a started request: a concurrent accept of the same id either still sees it
        # (a duplicate, refused) or no longer does (a new incarnation): both orders are correct.
        self.lock = threading.Lock()
        self._sending: set[Ticket] = set()  # accepted; the serving thread is putting them in the queue
        self._dones: dict[Ticket, threading.Event] = {}  # in the core's start queue, callers waiting
        self.stage_deaths: dict[int, str] = {}
        self._stop_requested = asyncio.Event()
        self.stopping = asyncio.Event()  # set by the variant's run() when it stops: loops end
        self._drained = asyncio.Event()
        self._drain_timeout: float | None = None
        self._timers: dict[str, asyncio.TimerHandle] = {}  # per-request deadlines
        self._io_tasks: set[asyncio.Task[None]] = set()
        #: replica joins in progress (member id -> its handshake task) and how the ended ones ended
        self.join_tasks: dict[str, asyncio.Task[None]] = {}
        self.join_outcomes: dict[str, str] = {}
        #: per stage: it orders its work by priority and deadline (a PrioritizedStageClient)
        self.takes_priority = [isinstance(s, PrioritizedStageClient) and bool(s.accepts_priority)
                               for s in self.stages]
        for k, stage in enumerate(self.stages):  # stage clients that report their replicas (a pool)
            if isinstance(stage, ReplicatedStageClient):
                self.router.replicas_changed(k, *stage.replica_counts())  # nothing waits yet
                stage.watch_replicas(partial(self.replicas_changed, k))

    # ------------------------------------------------------------------ serving thread
    def add_request(self, request_id: str, prompt: Any, *, final_stage_id: int | None = None,
                    timeout: float | None = None, done: threading.Event | None = None,
                    resumable: bool = False, sampling: Any = None,
                    companions: Mapping[str, Any] | None = None, priority: int = 0) -> None:
        """(Serving thread.)  Accept a request and queue it; ``done`` is set once it started.

        Raises ``ValueError`` (bad input, duplicate live id) or ``RuntimeError``
        (shutting down) with nothing registered.  Blocks while the request
        queue is full.  ``timeout`` is the request's deadline in seconds;
        ``resumable``, ``sampling``, ``companions`` and ``priority`` as for
        the Trio orchestrator.
        """
        with self.lock:
            ticket = self.router.accept(request_id, prompt, final_stage_id=final_stage_id, timeout=timeout,
                                        resumable=resumable, sampling=sampling, companions=companions,
                                        priority=priority)
            self._sending.add(ticket)
        try:
            if ticket.timeout is not None:  # armed at acceptance, before the add is queued (FIFO)
                self.loop.call_soon_threadsafe(self._set_deadline, ticket)
            self.request_queue.sync_q.put(AddMsg(ticket, done))
        except (janus.SyncQueueShutDown, RuntimeError):
            with self.lock:
                self.router.withdraw(ticket)
            raise RuntimeError("orchestrator is not accepting requests: it has shut down") from None
        finally:
            with self.lock:
                self._sending.discard(ticket)

    def update_request(self, request_id: str, segment: Any, *, final: bool = False,
                       timeout: float = 5.0) -> None:
        """(Serving thread.)  One more input segment; returns once the loop handled it.

        The update travels through the request queue behind the add it
        follows; what the core refuses (``ValueError``) is raised here.
        """
        done = threading.Event()
        msg = UpdateMsg(request_id, segment, final, done)
        try:
            self.request_queue.sync_q.put(msg)
        except janus.SyncQueueShutDown:
            raise RuntimeError("orchestrator is not accepting requests: it has shut down") from None
        if not done.wait(timeout):
            raise TimeoutError(f"update of {request_id!r} was not handled within {timeout}s")
        if msg.error is not None:
            raise msg.error

    def abort(self, request_id: str) -> None:
        """(Serving thread.)  Abort a request, in order with the adds queued before it."""
        try:
            self.request_queue.sync_q.put(AbortMsg(request_id))
        except janus.SyncQueueShutDown:
            pass  # stopped: every request already had its terminal

    def collective_rpc(self, method: str, args: Sequence[Any] = (), kwargs: Mapping[str, Any] | None = None,
                       stage_ids: Iterable[int] | None = None, timeout: float = 5.0) -> list[RpcResult]:
        """(Serving thread.)  ``method`` on every stage, through the request queue; blocks for the answers.

        The variant's :meth:`handle_rpc` decides how (see :mod:`bench.refs.control`).
        Raises ``ValueError`` for invalid stage ids (the core's rule) and
        ``RuntimeError`` once stopped.
        """
        with self.lock:
            targets = self.router.check_stage_ids(stage_ids)
        msg = RpcMsg(method, tuple(args), dict(kwargs or {}), targets, timeout)
        try:
            self.request_queue.sync_q.put(msg)
        except janus.SyncQueueShutDown:
            raise RuntimeError("orchestrator is not running: it has shut down") from None
        return msg.future.result()

    async def handle_rpc(self, msg: RpcMsg) -> None:
        """The seed's shape: awaited stage by stage right here, in the request handler."""
        await sequential_rpc(self.stages, msg)

    # ------------------------------------------------------------------ control (loop thread)
    def request_shutdown(self, timeout: float | None = None) -> None:
        """Begin shutting down; ``timeout`` lets active requests finish first."""
        with self.lock:
            self.router.stop_accepting()
        if not self._stop_requested.is_set():
            self._drain_timeout = timeout
            self._stop_requested.set()
            self._check_drained()

    def _set_deadline(self, ticket: Ticket) -> None:
        """Expire the request ``ticket.timeout`` s after acceptance, queued or running.

        Requests are not tasks, so ``asyncio.timeout`` does not apply; the
        idiom is a ``call_later`` timer whose callback asks the core.
        """
        if not self.router.is_current(ticket):
            return  # it already ended
        assert ticket.timeout is not None
        rid = ticket.request_id
        self._timers[rid] = self.loop.call_later(ticket.timeout, self._expire, rid)

    def _expire(self, request_id: str) -> None:
        self._timers.pop(request_id, None)
        io = self.deliver_emits(self.router.expire(request_id))
        if io:  # the stage aborts, in a side task
            self.spawn(self.perform(io), f"orchestrator-expire-{request_id}")

    def replicas_changed(self, stage_id: int, live: int, total: int) -> None:
        """(Loop thread.)  A stage's ready replicas changed: the core follows; waiting failovers go."""
        if self.stopping.is_set():
            return
        io = self.deliver_emits(self.router.replicas_changed(stage_id, live, total))
        if io:  # the resends, in a side task (as the expiry's aborts)
            self.spawn(self.perform(io), f"orchestrator-failover-{stage_id}")

    def deliver_emits(self, actions: list[Action]) -> list[Action]:
        """Deliver the messages among ``actions`` now; return the stage I/O left to perform."""
        self._deliver([a.message for a in actions if type(a) is Emit])
        return [a for a in actions if type(a) is not Emit]

    def spawn(self, coro: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
        """Run side work (stage aborts) in a task, fire and forget as the source does (variants own it)."""
        task = self.loop.create_task(coro, name=name)
        self._io_tasks.add(task)
        task.add_done_callback(self._io_tasks.discard)
        return task

    async def run(self) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    async def wait_stop_requested(self) -> None:
        """Return once shutdown was requested and the optional drain is over."""
        await self._stop_requested.wait()
        if self._drain_timeout:
            try:
                await asyncio.wait_for(self._drained.wait(), self._drain_timeout)
            except TimeoutError:
                pass

    # ------------------------------------------------------------------ tasks
    async def request_handler(self) -> None:
        """Take adds and aborts from the serving thread, in order.

        An add goes into the core's start queue and the core's next ticket
        starts (priority, deadline, arrival): no admission bound holds
        requests here, so each starts as it arrives, as the vLLM-Omni loop does.
        """
        q = self.request_queue.async_q
        while True:
            msg = await q.get()
            if type(msg) is AddMsg:
                self._enqueue(msg)
                await self._start_queued()
            elif type(msg) is UpdateMsg:
                await self.handle_update(msg)
            elif type(msg) is RpcMsg:
                await self.handle_rpc(msg)
            else:
                await self.perform(self.router.abort(msg.request_id))

    async def handle_update(self, msg: UpdateMsg) -> None:
        """Apply an input update in queue order; the core decides (and refuses)."""
        try:
            try:
                actions = self.router.update(msg.request_id, msg.segment, final=msg.final)
            except ValueError as exc:
                msg.error = exc
                return
            await self.perform(actions)
        finally:
            if msg.done is not None:
                msg.done.set()

    def _enqueue(self, msg: AddMsg) -> None:
        self.router.enqueue(msg.ticket, self.loop.time())
        if msg.done is not None:
            self._dones[msg.ticket] = msg.done

    async def _start_queued(self) -> None:
        """Start every queued ticket, the core's ``next_ticket`` first; release every add's caller."""
        dones = self._dones
        try:
            while (ticket := self.router.next_ticket()) is not None:
                with self.lock:
                    actions = self.router.start(ticket)
                try:
                    await self.perform(actions)
                finally:
                    done = dones.pop(ticket, None)
                    if done is not None:
                        done.set()
        finally:
            for done in dones.values():  # ended while queued: no start to wait for
                done.set()
            dones.clear()

    def route(self, stage_id: int, item: Any) -> list[Action]:
        """Route a stage's output batch or its death; the request handler alone starts requests here."""
        if type(item) is list:
            return self.router.route_many([(stage_id, item)], start=False)
        msg = item.describe(stage_id)
        log.warning("%s", msg)
        self.stage_deaths[stage_id] = msg
        return self.router.stage_died(stage_id, msg)

    # ------------------------------------------------------------------ I/O
    def _deliver(self, msgs: list[Message]) -> None:
        if not msgs:
            return
        timers = self._timers
        if timers:
            for m in msgs:
                if m.finished:
                    handle = timers.pop(m.request_id, None)
                    if handle is not None:
                        handle.cancel()
        self.output_queue.async_q.put_nowait(msgs)
        self._check_drained()

    def _check_drained(self) -> None:
        if self._stop_requested.is_set() and not self.router.live_count:
            self._drained.set()

    async def perform(self, actions: list[Action]) -> None:
        """Deliver the emits at once, then do the stage I/O in decision order."""
        if not actions:
            return
        self._deliver([a.message for a in actions if type(a) is Emit])
        router = self.router
        for i, a in enumerate(actions):
            if type(a) is Submit or type(a) is Update:
                if not router.is_started(a.request_id):
                    continue
                try:
                    stage = self.stages[a.stage_id]
                    prio = type(a) is Submit and self.takes_priority[a.stage_id]
                    schedule = router.schedule(a.request_id, self.loop.time()) if prio else None
                    await stage_call(stage, a, schedule, prio)
                except Exception as exc:
                    why = stage_call_failed(a, exc)
                    await self.perform(router.submit_failed(a.stage_id, a.request_id, why))
                    continue
                for x in router.submitted(a.stage_id, a.request_id):
                    if type(x) is Abort:
                        await self.stage_abort(x)
            elif type(a) is Abort:
                if any(type(b) is Submit and b.stage_id == a.stage_id and b.request_id in a.request_ids
                       for b in actions[i + 1:]):
                    await self._abort_on(a.stage_id, a.request_ids)  # inline: it is submitted there again
                else:
                    await self.stage_abort(a)

    async def stage_abort(self, a: Abort) -> None:
        """Perform one stage abort the core decided on: here, inline (variants may hand it to a task)."""
        await self._abort_on(a.stage_id, a.request_ids)

    async def _abort_on(self, stage_id: int, request_ids: list[str]) -> None:
        try:
            await self.stages[stage_id].abort(request_ids)
        except Exception as exc:
            log.debug("abort %s on stage %d failed: %r", request_ids, stage_id, exc)

    # ------------------------------------------------------------------ membership
    def join_replica(self, stage_id: int, member_id: str, handshake_s: float) -> None:
        """(Loop thread.)  Begin a replica's join: the seed's way, a fire-and-forget handshake task."""
        task = self.loop.create_task(self._attach(stage_id, member_id, handshake_s),
                                     name=f"attach-{member_id}")
        self.join_tasks[member_id] = task
        task.add_done_callback(lambda t, m=member_id: self.join_tasks.pop(m, None))

    async def _attach(self, stage_id: int, member_id: str, handshake_s: float) -> None:
        outcome = "cancelled"
        try:
            try:
                self.router.join(stage_id, member_id)
            except JoinRefused as exc:
                outcome = f"refused:{exc.reason}"
                return
            try:
                await asyncio.sleep(handshake_s)  # the attach handshake (registration, model load, ready)
            except BaseException:
                self.router.left(member_id)
                raise
            outcome = "joined" if self.router.joined(member_id) else "refused:stopping"
        finally:
            self.join_outcomes[member_id] = outcome

    async def wait_joins(self) -> None:
        """The seed's shutdown: wait up to :attr:`join_wait` seconds for the handshakes in flight."""
        pending = list(self.join_tasks.values())
        if pending:
            try:
                await asyncio.wait_for(asyncio.gather(*pending, return_exceptions=True), self.join_wait)
            except TimeoutError:
                log.warning("attach handshakes still running after %.1fs; abandoned", self.join_wait)

    def cancel_joins(self) -> None:
        """The core's rule: shutdown cancels every handshake in progress."""
        for member_id in self.router.joins_to_cancel():
            task = self.join_tasks.get(member_id)
            if task is not None:
                task.cancel()

    # ------------------------------------------------------------------ shutdown
    def _finish_sync(self) -> list[Action]:
        """Refuse new work, give every accepted request its terminal; return the stage I/O left.

        Adds found in the request queue were handed over and get their
        shutdown terminal from the core; adds the serving thread had not put
        yet are withdrawn (its ``put`` raises once the queue is shut down).
        """
        for handle in self._timers.values():
            handle.cancel()
        self._timers.clear()
        rq = self.request_queue
        with self.lock:
            self.router.stop_accepting()
            rq.shutdown()  # the serving thread's put now raises janus.SyncQueueShutDown
            handed_over: set[Ticket] = set()
            while True:
                try:
                    m = rq.async_q.get_nowait()
                except (asyncio.QueueEmpty, janus.AsyncQueueShutDown):
                    break
                if type(m) is AddMsg:
                    handed_over.add(m.ticket)
                    if m.done is not None:
                        m.done.set()
                elif type(m) is UpdateMsg:
                    m.error = RuntimeError("orchestrator shut down before the update was handled")
                    if m.done is not None:
                        m.done.set()
                elif type(m) is RpcMsg:
                    m.refuse("orchestrator shut down before the call was handled")
            for ticket in self._sending - handed_over:
                self.router.withdraw(ticket)
            for done in self._dones.values():
                done.set()
            self._dones.clear()
            actions = self.router.shutdown()
        self._deliver([a.message for a in actions if type(a) is Emit])
        return [a for a in actions if type(a) is not Emit]

    async def finish(self) -> None:
        """Terminals first, then stage aborts and closes (bounded or not), then end of stream."""
        await self.stop_joins()
        io = self._finish_sync()
        try:
            if self.bounded_cleanup:
                try:
                    async with asyncio.timeout(self.shutdown_grace):
                        await self._cleanup_io(io)
                except TimeoutError:
                    log.warning("stage aborts took longer than %.1fs; abandoned", self.shutdown_grace)
                for stage in self.stages:
                    try:
                        async with asyncio.timeout(self.shutdown_grace):
                            await self._close_stage(stage)
                    except TimeoutError:
                        log.warning("closing %r took longer than %.1fs; abandoned",
                                    stage, self.shutdown_grace)
            else:
                await self._cleanup_io(io)
                for stage in self.stages:
                    await self._close_stage(stage)
        finally:
            self.output_queue.shutdown()

    async def stop_joins(self) -> None:
        """What shutdown does to joins in progress: the seed waits for them (variants may cancel)."""
        await self.wait_joins()

    async def _cleanup_io(self, io: list[Action]) -> None:
        for a in io:
            if type(a) is Abort and self.router.available[a.stage_id]:
                await self._abort_on(a.stage_id, a.request_ids)

    async def _close_stage(self, stage: StageClient) -> None:
        try:
            await stage.aclose()
        except Exception as exc:
            log.warning("closing stage %r failed: %r", stage, exc)
