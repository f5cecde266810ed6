"""The routing core: every per-request rule, as a state machine with no I/O.

Events come in as method calls on :class:`Router` (accept, start, update,
route, abort, expire, submit_failed, submitted, stage_died, replicas_changed,
shutdown; membership: join, joined, left, joins_to_cancel); each
returns the list of actions the caller must perform, in order: :class:`Emit`
a message to the user, :class:`Submit` or :class:`Update` a payload to a
stage, :class:`Abort` request ids on a stage.  Queries (``can_start``,
``unavailable_stage``) tell a shell whether to start a queued request now or
refuse a new one at once.  Every decision and every state change happens
synchronously inside the call, before any I/O, so any concurrency shell --
the Trio orchestrator or the asyncio references in ``bench/`` -- drives the
same semantics and a comparison between shells measures the shell alone.

The package must never import trio, asyncio or any other event loop.
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
from trio_orch.core.membership import JoinRefused
from trio_orch.core.router import Router, RouterStatistics
from trio_orch.core.state import RequestState, Ticket

__all__ = ["Abort", "Action", "Emit", "JoinRefused", "RequestState", "Router", "RouterStatistics", "Submit",
           "Ticket", "Update", "stage_call", "stage_call_failed", "stage_call_nowait",
           "stage_io_options"]
