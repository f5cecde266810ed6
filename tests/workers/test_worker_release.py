"""A worker that stops serving hands its held requests' cache slots back to the model it leaves behind.

A headless worker that lost the orchestrator registers again with the same
model; the requests it held were given up by the orchestrator (or failed
over), so their slots must be free for the next registration's requests.
In process: a real worker object over a real ipc socket, no worker process.
"""

from __future__ import annotations

import os
from pathlib import Path

import zmq

from stages.registry import build_model
from stages.wire import Submit
from stages.worker import Worker, build_parser


def _worker(ctx: zmq.Context, address: str, model: object) -> Worker:
    args = build_parser().parse_args(["--connect", address, "--kind", "thinker", "--max-batch", "2"])
    args.parent_pid = os.getppid()
    return Worker(args, model, ctx)  # type: ignore[arg-type]


def test_a_worker_released_after_it_stopped_leaves_every_slot_free_for_the_next(tmp_path: Path) -> None:
    address = f"ipc://{tmp_path}/control"
    ctx = zmq.Context()
    orchestrator = ctx.socket(zmq.ROUTER)
    orchestrator.bind(address)
    model = build_model("thinker", {}, device="cpu", seed=1, slots=2)
    try:
        first = _worker(ctx, address, model)
        for rid in ("a", "b", "c"):  # two take the slots at the first step, one waits
            first.submit(Submit(rid, "hello"))
        first.step()
        assert len(first.active) == 2 and len(first.waiting) == 1
        first.release_held()
        first.close()
        assert not first.active and not first.waiting

        second = _worker(ctx, address, model)  # the next registration, the same model
        for rid in ("d", "e"):
            second.submit(Submit(rid, "hello"))
        second.step()
        second.step()
        assert set(second.active) == {"d", "e"}
        assert second.stats["errors"] == 0  # neither request lacked a cache slot
        second.release_held()
        second.close()
    finally:
        orchestrator.close(linger=0)
        ctx.term()
