"""What the routing core asks its shell to do.

Actions are plain slotted values compared by content, so tests can state the
expected result of an event as a list literal.  A shell performs them in
order: :class:`Emit` at once (delivery to the user), :class:`Submit` and
:class:`Update` in decision order (stage I/O), :class:`Abort` as
best-effort cleanup.
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Any

from trio_orch.types import Message

__all__ = ["Abort", "Action", "Emit", "Submit", "Update", "stage_call", "stage_call_failed",
           "stage_call_nowait", "stage_io_options"]


class Submit:
    """Send ``payload`` for ``request_id`` to stage ``stage_id``.

    ``resumable``: more input segments will follow (as :class:`Update` actions), so
    the stage must keep the request after it finishes a segment.
    ``sampling``: the request's parameters for this stage (None: the stage's
    defaults), passed through uninterpreted.  ``companion_of``: this is a
    companion of that request and must run on the same replica.
    """

    __slots__ = ("companion_of", "payload", "request_id", "resumable", "sampling", "stage_id")

    def __init__(self, stage_id: int, request_id: str, payload: Any, resumable: bool = False,
                 sampling: Any = None, companion_of: str | None = None) -> None:
        self.stage_id = stage_id
        self.request_id = request_id
        self.payload = payload
        self.resumable = resumable
        self.sampling = sampling
        self.companion_of = companion_of

    def __repr__(self) -> str:
        more = ", resumable=True" if self.resumable else ""
        more += f", sampling={self.sampling!r}" if self.sampling is not None else ""
        more += f", companion_of={self.companion_of!r}" if self.companion_of is not None else ""
        return f"Submit({self.stage_id}, {self.request_id!r}, {self.payload!r}{more})"

    def __eq__(self, other: object) -> bool:
        return type(other) is Submit and self.key() == other.key()

    def key(self) -> tuple[Any, ...]:
        """Everything that identifies this action (what equality compares)."""
        return (self.stage_id, self.request_id, self.payload, self.resumable, self.sampling,
                self.companion_of)

    __hash__ = None  # type: ignore[assignment]


class Update:
    """Send one more input segment of a resumable request to a stage that already has it.

    ``final``: the last segment; the stage may let the request go once it
    finished this one.  ``sampling`` as for :class:`Submit`.
    """

    __slots__ = ("final", "payload", "request_id", "sampling", "stage_id")

    def __init__(self, stage_id: int, request_id: str, payload: Any, final: bool = False,
                 sampling: Any = None) -> None:
        self.stage_id = stage_id
        self.request_id = request_id
        self.payload = payload
        self.final = final
        self.sampling = sampling

    def __repr__(self) -> str:
        more = ", final=True" if self.final else ""
        more += f", sampling={self.sampling!r}" if self.sampling is not None else ""
        return f"Update({self.stage_id}, {self.request_id!r}, {self.payload!r}{more})"

    def __eq__(self, other: object) -> bool:
        return type(other) is Update and (
            self.stage_id, self.request_id, self.payload, self.final, self.sampling) == (
            other.stage_id, other.request_id, other.payload, other.final, other.sampling)

    __hash__ = None  # type: ignore[assignment]


class Abort:
    """Abort ``request_ids`` on stage ``stage_id`` (best effort, stage-side cleanup)."""

    __slots__ = ("request_ids", "stage_id")

    def __init__(self, stage_id: int, request_ids: list[str]) -> None:
        self.stage_id = stage_id
        self.request_ids = request_ids

    def __repr__(self) -> str:
        return f"Abort({self.stage_id}, {self.request_ids!r})"

    def __eq__(self, other: object) -> bool:
        return type(other) is Abort and (self.stage_id, self.request_ids) == (
            other.stage_id, other.request_ids)

    __hash__ = None  # type: ignore[assignment]


class Emit:
    """Deliver ``message`` (an :class:`OrchOutput` or :class:`OrchError`) to the user."""

    __slots__ = ("message",)

    def __init__(self, message: Message) -> None:
        self.message = message

    def __repr__(self) -> str:
        return f"Emit({self.message!r})"

    def __eq__(self, other: object) -> bool:
        return type(other) is Emit and self.message == other.message

    __hash__ = None  # type: ignore[assignment]


Action = Submit | Update | Abort | Emit


def stage_io_options(action: Submit | Update, schedule: tuple[int, float | None] | None = None,
                     priority: bool = False) -> dict[str, Any]:
    """The keyword arguments a shell passes to ``stage.submit``/``stage.update`` for ``action``.

    Only what is set, so stage clients that know neither resumable requests
    nor sampling parameters keep working unchanged.  ``schedule`` (the
    request's priority and seconds left, ``admission.schedule``) goes with a
    submit to a stage client that declares it takes them (``priority``: it is a
    ``PrioritizedStageClient``), when it says anything (a priority other than
    0, or a deadline).
    """
    opts: dict[str, Any] = {}
    if priority and schedule is not None and type(action) is Submit:
        prio, left = schedule
        if prio:
            opts["priority"] = prio
        if left is not None:
            opts["deadline_in"] = left
    if type(action) is Update:
        if action.final:
            opts["final"] = True
    else:
        if action.resumable:
            opts["resumable"] = True
        if action.companion_of is not None:
            opts["companion_of"] = action.companion_of
    if action.sampling is not None:
        opts["sampling"] = action.sampling
    return opts


def stage_call(stage: Any, action: Submit | Update, schedule: tuple[int, float | None] | None = None,
               priority: bool = False) -> Awaitable[Any]:
    """The stage client's coroutine for ``action`` (``update`` or ``submit``), not yet awaited.

    Every shell awaits it in its own framework; the keyword arguments are
    only those :func:`stage_io_options` sets, so plain clients keep working.
    Nothing runs here: the core still does no I/O.
    """
    opts = stage_io_options(action, schedule, priority)
    if type(action) is Update:
        return stage.update(action.request_id, action.payload, **opts)
    if opts:
        return stage.submit(action.request_id, action.payload, **opts)
    return stage.submit(action.request_id, action.payload)


def stage_call_nowait(stage: Any, action: Submit, schedule: tuple[int, float | None] | None = None,
                      priority: bool = False) -> bool:
    """Do a submit synchronously on a stage client that declares ``submit_nowait``; whether it did.

    Only for a :class:`~trio_orch.types.NowaitSubmitClient` (the shell knows
    which stages are).  False: nothing was done (the client cannot now), and
    the shell awaits :func:`stage_call` as usual.
    """
    return bool(stage.submit_nowait(action.request_id, action.payload,
                                    **stage_io_options(action, schedule, priority)))


def stage_call_failed(action: Submit | Update, exc: BaseException) -> str:
    """The message of the terminal of a request whose submit or update raised ``exc``."""
    what = "update" if type(action) is Update else "submit"
    return f"{what} to stage {action.stage_id} failed: {type(exc).__name__}: {exc}"
