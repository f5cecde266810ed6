"""Control-plane rules: which stages a collective call addresses, and pausing.

A collective RPC is not a request: it never touches request state.  What
the core decides is the target set -- all stages, or the ones named, each
checked (an invalid stage id is an error, never silently skipped).

Pausing stops *starting* requests: accepted requests wait, queued, until
``resume`` (their callers see backpressure, not an error).  The mode says
what happens to the requests already started: ``"wait"`` lets them finish,
``"abort"`` ends them now (terminal ``aborted``), ``"keep"`` leaves them in
place while the shell freezes the workers.  The pause is *complete* once no
started request is left (``"keep"``: at once).
"""

from __future__ import annotations

from collections.abc import Iterable

from trio_orch.core.actions import Action
from trio_orch.core.state import NOTHING, CoreState
from trio_orch.types import OrchError

__all__ = ["PAUSE_MODES", "check_pause_mode", "check_stage_ids", "pause", "pause_complete", "resume"]

PAUSE_MODES = ("wait", "abort", "keep")


def check_pause_mode(mode: object) -> str:
    """A pause mode is one of :data:`PAUSE_MODES`; raises ValueError (the caller checks it first)."""
    if mode not in PAUSE_MODES:
        raise ValueError(f"pause mode must be one of {', '.join(PAUSE_MODES)}, got {mode!r}")
    return mode  # type: ignore[return-value]


def check_stage_ids(state: CoreState, stage_ids: Iterable[int] | None) -> list[int]:
    """The stages a collective call goes to, sorted; ``None``: every stage.  Raises ValueError."""
    if stage_ids is None:
        return list(range(state.num_stages))
    if isinstance(stage_ids, (str, bytes)) or not isinstance(stage_ids, Iterable):
        raise ValueError(f"stage_ids must be a collection of stage numbers, got {stage_ids!r}")
    chosen = list(stage_ids)
    bad = [k for k in chosen if isinstance(k, bool) or not isinstance(k, int)
           or not 0 <= k < state.num_stages]
    if bad:
        raise ValueError(f"invalid stage ids {bad}: stages are 0..{state.num_stages - 1}")
    if not chosen:
        raise ValueError("stage_ids is empty: name at least one stage (or None for all)")
    return sorted(set(chosen))


def pause(state: CoreState, mode: str = "wait") -> list[Action]:
    """Start no request from now on; with ``"abort"`` end the started ones.  Raises ValueError."""
    state.paused = check_pause_mode(mode)
    if mode != "abort":
        return NOTHING
    actions: list[Action] = []
    for req in list(state.requests.values()):
        rid = req.request_id
        actions.extend(state.end(req, OrchError(rid, None, "aborted", "aborted by pause(mode='abort')")))
    return actions


def resume(state: CoreState) -> None:
    """Start requests again."""
    state.paused = None


def pause_complete(state: CoreState) -> bool:
    """The pause asked for is in effect: nothing started is left (``"keep"``: at once)."""
    return state.paused == "keep" or (state.paused is not None and not state.requests)
