"""Fault injection for a stage worker: the flags tests and chaos runs give it, and what each one does.

A worker started with any of these flags is a
:class:`~stages.worker.FaultyWorker`: :class:`FaultInjection` over the plain
:class:`~stages.worker.Worker`, overriding the worker's seams (``submit``,
``take_chunk``, ``run_step``, ``finish``, ``stepped``, ``before_start``,
``before_load``) to
misbehave as asked and otherwise doing what the worker does.  A worker
started without them has no fault code on its path at all.

The flags (``python -m stages.worker --help`` groups them):

- start-up: ``--fail-at-startup MSG`` (exit 3 before the ready handshake),
  ``--startup-delay S``;
- every step: ``--step-delay-ms MS`` (a slow stage);
- once, after step N: ``--garbage-after-steps`` (an undecodable message),
  ``--unknown-rid-after-steps`` (an output for a request nobody submitted),
  ``--crash-after-steps`` (exit 17 at once, like kill -9), ``--die-after-steps``
  (a fatal error: ``Dying``, exit 1), ``--hang-after-steps`` (silent until
  killed);
- ``--crash-on-chunk``: exit 17 when the first upstream chunk arrives;
- per request: ``--fail-requests-containing STR`` (refused), and, when a
  request finishes, ``--fault-unknown-rid``, ``--fault-duplicate-finish``,
  ``--fault-oversized`` (``--fault-oversized-bytes``), ``--fault-garbage`` --
  each given as STR applies to requests whose payload repr contains STR,
  given bare to every request.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import TYPE_CHECKING, Any

from stages.schema import seconds_arg
from stages.wire import OutItem, Outputs, RequestError, Submit

if TYPE_CHECKING:
    from stages.base import ReqState
    from stages.worker import Worker

    _Base = Worker
else:
    _Base = object

__all__ = ["FaultInjection", "add_arguments", "injected"]

#: the flags' destinations whose default means "no fault"
_FLAGS = ("fail_at_startup", "startup_delay", "step_delay_ms", "garbage_after_steps",
          "unknown_rid_after_steps", "crash_after_steps", "die_after_steps", "crash_on_chunk",
          "hang_after_steps", "fail_requests_containing", "fault_unknown_rid", "fault_duplicate_finish",
          "fault_oversized", "fault_garbage")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The fault-injection flags of ``python -m stages.worker``."""
    f = p.add_argument_group("fault injection (for tests and chaos runs)")
    f.add_argument("--fail-at-startup", metavar="MSG", default=None,
                   help="print MSG to stderr and exit with code 3 before the ready handshake")
    f.add_argument("--startup-delay", type=seconds_arg, default=0.0, metavar="S",
                   help="sleep S seconds before the ready handshake")
    f.add_argument("--step-delay-ms", type=seconds_arg, default=0.0, metavar="MS",
                   help="sleep MS milliseconds in every step (a slow stage)")
    f.add_argument("--garbage-after-steps", type=int, default=0, metavar="N",
                   help="after step N, send one undecodable message to the orchestrator")
    f.add_argument("--unknown-rid-after-steps", type=int, default=0, metavar="N",
                   help="after step N, send an output for a request id nobody submitted")
    f.add_argument("--crash-after-steps", type=int, default=0, metavar="N",
                   help="after step N, exit at once (code 17) without the Dying sentinel, like kill -9")
    f.add_argument("--die-after-steps", type=int, default=0, metavar="N",
                   help="after step N, fail with a fatal error (sends Dying, exits 1)")
    f.add_argument("--crash-on-chunk", action="store_true",
                   help="exit at once (code 17, like kill -9) when the first upstream chunk arrives "
                        "(a replica dying mid-transfer)")
    f.add_argument("--hang-after-steps", type=int, default=0, metavar="N",
                   help="after step N, stop responding (no heartbeats) until killed")
    f.add_argument("--fail-requests-containing", default=None, metavar="STR",
                   help="refuse (per-request error) every request whose payload repr contains STR")
    f.add_argument("--fault-unknown-rid", nargs="?", const="", default=None, metavar="STR",
                   help="when a request finishes, also send an output for a request id nobody submitted "
                        "(only requests whose payload repr contains STR, if given; else every request)")
    f.add_argument("--fault-duplicate-finish", nargs="?", const="", default=None, metavar="STR",
                   help="report a finished request finished a second time (STR: as above)")
    f.add_argument("--fault-oversized", nargs="?", const="", default=None, metavar="STR",
                   help="send a request's finishing output padded to --fault-oversized-bytes (STR: as above)")
    f.add_argument("--fault-oversized-bytes", type=int, default=2 << 20, metavar="N",
                   help="padding of --fault-oversized (default 2 MiB)")
    f.add_argument("--fault-garbage", nargs="?", const="", default=None, metavar="STR",
                   help="when a request finishes, also send one undecodable message (STR: as above)")


def injected(args: argparse.Namespace) -> bool:
    """Does the command line ask for any fault?"""
    return any(getattr(args, name, None) not in (None, 0, 0.0, False) for name in _FLAGS)


def _applies(flag: str | None, payload: Any) -> bool:
    """A ``--fault-*`` flag given as STR applies to a payload whose repr contains STR (given bare: all)."""
    return flag is not None and flag in repr(payload)


_GARBAGE = [b"\xc1 this is not msgpack", b"junk"]


class FaultInjection(_Base):
    """The faults of the flags above, over a worker's seams (mixed in before the worker class)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        #: finished requests a per-request fault applies to, sent after the step's outputs
        self.faulty: list[tuple[ReqState, OutItem]] = []

    @classmethod
    def before_start(cls, args: argparse.Namespace) -> int | None:
        """Before anything (credentials, sockets): ``--fail-at-startup`` exits 3."""
        if args.fail_at_startup:
            print(f"worker stage {args.stage_id}: {args.fail_at_startup}", file=sys.stderr, flush=True)
            return 3
        return None

    @classmethod
    def before_load(cls, args: argparse.Namespace) -> None:
        """Before the model loads: ``--startup-delay`` waits (while the parent lives)."""
        deadline = time.monotonic() + args.startup_delay
        while time.monotonic() < deadline and os.getppid() == args.parent_pid:
            time.sleep(min(0.1, deadline - time.monotonic()))

    def submit(self, msg: Submit) -> None:
        fail = self.args.fail_requests_containing
        if fail and fail in repr(msg.payload) and self.find(msg.request_id) is None:
            self.stats["errors"] += 1
            self.send(RequestError(msg.request_id, f"stage {self.args.stage_id} refused the request: "
                                                   f"injected failure (payload contains {fail!r})"))
            return
        super().submit(msg)

    def take_chunk(self, chunk: Any) -> None:
        if self.args.crash_on_chunk:
            self.stats["chunks_in"] += 1
            os._exit(17)  # like kill -9 while the upstream's data arrives
        super().take_chunk(chunk)

    def run_step(self, batch: list[ReqState]) -> list[Any]:
        if self.args.step_delay_ms:
            time.sleep(self.args.step_delay_ms / 1000)
        return super().run_step(batch)

    def finish(self, req: ReqState, item: OutItem, items: list[OutItem]) -> None:
        """A request whose per-request fault applies finishes after this step's outputs, misbehaving."""
        a = self.args
        if any(_applies(flag, req.payload) for flag in (
                a.fault_unknown_rid, a.fault_duplicate_finish, a.fault_oversized, a.fault_garbage)):
            self.faulty.append((req, item))
        else:
            super().finish(req, item, items)

    def stepped(self) -> None:
        super().stepped()
        faulty, self.faulty = self.faulty, []
        for req, item in faulty:
            self.stats["outputs"] += 1
            self._finish_with_faults(req, item)
        self._after_step()

    def _finish_with_faults(self, state: ReqState, item: OutItem) -> None:
        """Send a finished request's terminal output, misbehaving as its ``--fault-*`` flags say.

        Each fault is a message of its own, so the orchestrator sees exactly one
        per faulty request.
        """
        a, req, payload = self.args, item.request_id, state.payload
        if _applies(a.fault_unknown_rid, payload):
            self.send(Outputs([OutItem(f"never-given-{req}", "stray", True, None, item.t_produced)]))
        if _applies(a.fault_garbage, payload):
            self.sock.send_multipart(_GARBAGE)
        if _applies(a.fault_oversized, payload):
            item = OutItem(req, {"blob": bytes(a.fault_oversized_bytes)}, True, None, item.t_produced)
        self.send(Outputs([item]))
        if _applies(a.fault_duplicate_finish, payload):
            self.send(Outputs([OutItem(req, "again", True, None, item.t_produced)]))

    def _after_step(self) -> None:
        a, n = self.args, self.stats["steps"]
        if a.garbage_after_steps and n == a.garbage_after_steps:
            self.sock.send_multipart(_GARBAGE)
        if a.unknown_rid_after_steps and n == a.unknown_rid_after_steps:
            self.send(Outputs([OutItem("no-such-request", "stray", False, None, time.perf_counter())]))
        if a.crash_after_steps and n >= a.crash_after_steps:
            os._exit(17)  # like kill -9: no Dying sentinel
        if a.die_after_steps and n >= a.die_after_steps:
            raise RuntimeError(f"injected fatal error after {n} steps")
        if a.hang_after_steps and n >= a.hang_after_steps:
            while os.getppid() == self.parent:  # silent: no heartbeats; the launcher must kill us
                time.sleep(0.2)
            self.check_parent()  # the parent is gone: stop as the worker does then
