"""Faults a scripted stage can be told to have, shared by the Trio and asyncio flavours.

The comparison scenarios need stage clients that misbehave in the ways real
ones do (a receive that swallows a cancellation, an abort that never returns,
a close that raises...).  Both flavours read the same description so a
scenario states the fault once and every implementation gets the same stage.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Misbehaviour"]


@dataclass(slots=True)
class Misbehaviour:
    """What a scripted stage does wrong; the default does nothing wrong."""

    #: receive() catches the framework's cancellation once and waits again.
    swallow_cancel_once: bool = False
    #: receive() raises this instead of the cancellation when it is cancelled.
    cancel_error: BaseException | None = None
    #: abort() never returns (it waits forever; it can be cancelled).
    hang_abort: bool = False
    #: aclose() never returns (it waits forever; it can be cancelled).
    hang_aclose: bool = False
    #: aclose() takes this long (seconds) before closing.
    aclose_delay: float = 0.0
    #: aclose() raises this.
    aclose_error: BaseException | None = None
    #: every submit() starts a background helper task (a heartbeat that sleeps for an hour).
    helper_per_submit: bool = False
