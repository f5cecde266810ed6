"""The routing core: every per-request rule, as a state machine with no I/O.

What must live here
-------------------

1. **Every decision about a request.**  Whether it is accepted, when it
   starts, where each output goes, when and how it ends (its one terminal),
   what a stage's death, a failover, an abort, a deadline, a pause or an
   input segment does to it.  A shell (the Trio orchestrator, the asyncio
   references in ``bench/``) holds no such rule: it moves events in and
   performs the actions that come out.
2. **Every change of request state, inside one synchronous call.**
   :meth:`Router.route_many` (``core/events.py``) takes the events a shell
   collected, applies each with the rule that owns it, starts what can
   start, and returns the actions -- :class:`Emit` a message to the user,
   :class:`Submit` or :class:`Update` a payload to a stage, :class:`Abort`
   request ids on a stage -- in the order to perform them.  The caller-side
   acceptance of a new request (``admission.accept``: validate, reserve its
   id) is the one rule called elsewhere, because the contract makes it
   happen in the caller, before its first checkpoint.
3. **Nothing that waits.**  No event loop (trio, asyncio, any other) is
   imported, no clock is read (a shell passes ``now``), no stage is called:
   that keeps the rules checkable one event at a time and lets every shell
   drive the same semantics, so a comparison between shells measures the
   shell alone.

The state is one object (:class:`~trio_orch.core.state.CoreState`, which
:class:`Router` is); the rules are plain functions over it, one module per
concern, each importing only modules below it: ``state`` (tables and the
terminal primitives) < ``control``, ``membership``, ``companions``,
``failover`` < ``streaming`` < ``admission`` < ``routing`` < ``events``
(``route_many``) < ``router`` (the facade).  ``docs/design.md`` lists every
rule and the one function that implements it.
"""

from trio_orch.core.actions import (
    Abort,
    Action,
    Emit,
    Submit,
    Update,
    stage_call,
    stage_call_failed,
    stage_call_nowait,
    stage_io_options,
)
from trio_orch.core.events import (
    AbortRequest,
    Enqueue,
    Event,
    Expire,
    InputSegment,
    Pause,
    ReplicasChanged,
    Resume,
    Shutdown,
    StageLost,
    SubmitFailed,
    Submitted,
)
from trio_orch.core.membership import JoinRefused
from trio_orch.core.router import Router, RouterStatistics
from trio_orch.core.state import RequestState, Ticket

__all__ = ["Abort", "AbortRequest", "Action", "Emit", "Enqueue", "Event", "Expire", "InputSegment",
           "JoinRefused", "Pause", "ReplicasChanged", "RequestState", "Resume", "Router", "RouterStatistics",
           "Shutdown", "StageLost", "Submit", "SubmitFailed", "Submitted", "Ticket", "Update", "stage_call",
           "stage_call_failed", "stage_call_nowait", "stage_io_options"]
