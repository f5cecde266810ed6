"""What every part of the Trio shell shares: one object, as Trio's own ``Runner`` is for its run.

The shell is a handful of small classes around this state, one per concern
(trio's ``_run.py`` pattern: ``Runner`` holds the run, ``CancelScope``,
``Nursery`` and ``Task`` beside it): :class:`~trio_orch.shell.dispatch.Dispatch`
(the one decide-and-perform path), :class:`~trio_orch.shell.intake.Intake`
(admission into the core's start queue),
:class:`~trio_orch.shell.outputs.OutputStream` (where decided messages go),
:class:`~trio_orch.shell.control.ControlPlane` (pause, collective calls,
confirmed aborts), and :class:`~trio_orch.shell.orchestrator.Orchestrator`,
the public facade that opens the nursery.  They share the core, the stages
with the abilities each declared, the lifecycle, and the few waiters that a
decision may release -- nothing else.
"""

from __future__ import annotations

from collections.abc import Sequence

import trio

from trio_orch.core import Router
from trio_orch.shell.deadlines import DeadlineKeeper
from trio_orch.types import StageAbilities, StageClient

__all__ = ["ShellState"]


class ShellState:
    """The core, the stages and what they can do, the run's lifecycle, and the waiters on decisions.

    ``phase``: new -> running -> stopping -> stopped.  The core's start queue
    holds ``request_queue_size`` accepted requests, plus the one next in line
    while nothing holds the starts (``starts_held``: stage I/O of earlier
    decisions is still being awaited); an add that finds it full waits in the
    request channel.  The waiters (``room``, ``pause_waiter``, ``draining``) are what
    a decision may release: :meth:`after_decision` looks at them, and
    :class:`~trio_orch.shell.dispatch.Dispatch` calls it only when one is set.
    """

    def __init__(self, router: Router, stages: Sequence[StageClient], *, queue_size: int,
                 shutdown_grace: float, rpc_timeout: float) -> None:
        self.router = router
        self.stages = list(stages)
        #: what each stage client declared it can do (read once: no probing on any path)
        self.abilities = [StageAbilities.of(s) for s in self.stages]
        self.queue_size = queue_size
        #: stage I/O decided earlier is still being awaited: no request starts until it is done
        self.starts_held = False
        self.shutdown_grace = shutdown_grace
        self.rpc_timeout = rpc_timeout
        self.phase = "new"
        self.nursery: trio.Nursery | None = None  #: the run nursery while it accepts tasks
        self.deadlines = DeadlineKeeper()
        self.stage_deaths: dict[int, str] = {}
        #: Enqueue events posted and not yet taken by the dispatcher (they count towards the queue)
        self.enqueues_pending = 0
        # ---- what a decision may release
        self.room: trio.Event | None = None  #: the intake waits for room in the start queue
        self.pause_waiter: trio.Event | None = None  #: a pause waits until it is complete
        self.draining = False  #: shutdown was asked for: the run waits until nothing is live
        self.stop_requested = trio.Event()
        self.drained = trio.Event()
        self.stopped = trio.Event()

    @property
    def spawning(self) -> bool:
        """Side tasks (stage aborts, collective calls) may still start in the run nursery."""
        return self.nursery is not None and not self.nursery.cancel_scope.cancel_called

    def queue_full(self) -> bool:
        """The core's start queue (with the adds on their way into it) holds all it may."""
        size = self.queue_size
        limit = size if self.starts_held and size else size + 1
        return self.router.start_queued + self.enqueues_pending >= limit

    def after_decision(self) -> None:
        """Release what the last decision may have made true: room, a complete pause, the drain."""
        room = self.room
        if room is not None and not self.queue_full():
            self.room = None
            room.set()
        waiter = self.pause_waiter
        if waiter is not None and self.router.pause_complete():
            self.pause_waiter = None
            waiter.set()
        if self.draining and not self.router.live_count:
            self.drained.set()
