"""The head's side of a launch's credentials: a one-time ticket for a slot, handed to the pid launched.

Any process the head launches to connect back to one of its sockets -- a
stage worker to its replica's control socket, and so any later kind of
child -- gets its credentials the same way (:mod:`stages.credentials` has
the whole story)::

    creds = LaunchCredentials(authenticator, slot, "stage 0 replica 0", lambda ticket: payload)
    proc = await trio.lowlevel.open_process([*argv, *creds.argv()], pass_fds=creds.pass_fds, ...)
    creds.started(proc.pid)
    serving = await creds.deliver()     # once the child has them (None: it exited first)
    ...
    creds.close()                       # the child is gone: its ticket opens nothing any more

Only ``proc.pid`` -- or the child it forked to go on in a fresh address space
(``lock_down(fresh=True)``), which is then *the* process of the launch --
gets the payload, only after it locked itself down, and only that process
may take the slot with the ticket inside.  A process that asks in its place
is refused and reported (``handover:stranger``, with a WARNING naming the
slot).
"""

from __future__ import annotations

from collections.abc import Callable

import trio

from stages.auth import Authenticator
from stages.credentials import Handover, HandoverError, Launch

__all__ = ["AUTH_FD_FLAG", "REFUSALS", "LaunchCredentials", "hand_over", "prometheus_counters"]

#: the flag that names the inherited hand-over socket on a launched process's command line
AUTH_FD_FLAG = "--auth-fd"

#: the refusals of a process that tried to take a launched process's place (in /metrics from the start, at 0)
REFUSALS = ("launch:stranger", "launch:stale_ticket", "handover:stranger", "ready:stranger")


class LaunchCredentials:
    """One launch's ticket (registered for ``slot``, a ZAP domain guarded by ``authenticator``) and its
    hand-over.  ``payload(ticket)``: the bytes the launched process is handed (its ticket inside)."""

    def __init__(self, authenticator: Authenticator, slot: str, label: str,
                 payload: Callable[[bytes], bytes]) -> None:
        self.authenticator = authenticator
        self.label = label
        self.launch: Launch = authenticator.launches.open(slot, label)
        self.handover = Handover()
        self._payload = payload(self.launch.ticket)
        self.launched: int | None = None  #: the pid started
        self.pid: int | None = None  #: the pid that got the credentials: it serves, it alone may connect
        self.delivered = False

    @property
    def pass_fds(self) -> tuple[int, ...]:
        return (self.handover.child_fd,)

    def argv(self) -> list[str]:
        """What the command line says of it: the fd of the inherited socket, nothing secret."""
        return [AUTH_FD_FLAG, str(self.handover.child_fd)]

    def started(self, pid: int) -> None:
        """The process was launched as ``pid``: only it (or its fresh child) gets the payload."""
        self.launched = self.pid = pid
        self.authenticator.launches.bind(self.launch, pid)
        self.handover.child_started(self._payload)

    async def deliver(self) -> int | None:
        """Answer the launched process's request for its credentials; refuse (and report) any other's.

        Returns the pid that got them (from then on the only one that may take the slot), or None
        when the launched process exited without asking (its exit is reported elsewhere).
        """
        assert self.launched is not None, "started() first"
        launched = self.launched

        def stranger(asker: int) -> None:
            self.authenticator.report(
                "handover:stranger", f"refused the credentials of {self.label} to pid {asker}: it is not the "
                                     f"process launched for it (pid {launched})")

        def accept(serving: int) -> None:  # before the payload goes: it may connect at once
            self.authenticator.launches.bind(self.launch, serving)

        serving = await hand_over(self.handover, launched, self._payload, stranger, accept)
        if serving is not None:
            self.delivered, self.pid = True, serving
        return serving

    def close(self) -> None:
        """The launch is over: close the hand-over, revoke the ticket (unless a newer launch replaced it)."""
        self.handover.close()
        self.authenticator.launches.close(self.launch)


async def hand_over(handover: Handover, pid: int, payload: bytes,
                    on_stranger: Callable[[int], None] | None = None,
                    on_accept: Callable[[int], None] | None = None) -> int | None:
    """Answer ``handover``'s requests until process ``pid`` (or its fresh child) got ``payload``; the pid
    that got it, or None when ``pid`` exited without asking.  ``on_stranger(asker)``: each refusal;
    ``on_accept(asker)``: the one that gets it, before it is sent."""
    while True:
        await trio.lowlevel.wait_readable(handover.fileno())
        try:
            delivered, asker = handover.answer(pid, payload, on_accept)
        except HandoverError:
            return None
        if delivered:
            return asker
        if asker is not None and on_stranger is not None:
            on_stranger(asker)


#: one counter family of ``/metrics`` (trio_orch.http.metrics.ExtraCounters' shape)
Family = tuple[str, dict[tuple[tuple[str, str], ...], int]]


def prometheus_counters(authenticator: Authenticator) -> dict[str, Family]:
    """The authenticator's refusals by reason, in the ``/metrics`` extra-counters shape."""
    refused = {reason: 0 for reason in REFUSALS} | dict(authenticator.refused)
    return {"trio_orch_auth_refused": (
        "connections and hand-overs refused by the security checks, by reason (launch:stranger: a process "
        "other than the one launched for a slot tried to take it)",
        {(("reason", name),): n for name, n in sorted(refused.items())})}
