"""Collective RPC in the asyncio references, in the two shapes the comparison sets side by side.

The serving thread's ``collective_rpc`` puts an :class:`RpcMsg` in the request
queue, behind the adds and aborts before it, and blocks on its future.  What
the loop then does is the variant's:

- :func:`sequential_rpc` is the seed's shape: the request handler itself
  awaits each stage in turn (``asyncio.wait_for`` per call).  While one
  replica hangs, the handler is stuck in that await, so every add and abort
  queued behind the call waits until its timeout (and the answers of the
  stages after it wait too).
- :func:`concurrent_rpc` is what a structured variant does: the handler
  hands the call to a task and moves on; the stages are asked concurrently
  in a ``TaskGroup``, each under its own ``asyncio.timeout``.

Which stages are asked is the routing core's rule (``check_stage_ids``, in
the serving thread: an invalid id is a ``ValueError`` there, as in the Trio
orchestrator -- the seed skips it silently).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Sequence
from typing import Any

from trio_orch.types import ControlledStageClient, RpcResult, StageClient

__all__ = ["RpcMsg", "concurrent_rpc", "sequential_rpc"]


class RpcMsg:
    """A collective RPC handed from the serving thread; answered through ``future``."""

    __slots__ = ("args", "future", "kwargs", "method", "targets", "timeout")

    def __init__(self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any], targets: list[int],
                 timeout: float) -> None:
        self.method = method
        self.args = args
        self.kwargs = kwargs
        self.targets = targets
        self.timeout = timeout
        self.future: concurrent.futures.Future[list[RpcResult]] = concurrent.futures.Future()

    def answer(self, results: list[RpcResult]) -> None:
        if not self.future.done():
            self.future.set_result(sorted(results, key=lambda r: (r.stage_id, r.replica)))

    def refuse(self, why: str) -> None:
        if not self.future.done():
            self.future.set_exception(RuntimeError(why))


async def _one(stage_id: int, stage: StageClient, msg: RpcMsg) -> list[RpcResult]:
    if not isinstance(stage, ControlledStageClient):  # the stage declares no rpc
        return [RpcResult(stage_id, -1, None, f"stage {stage_id} takes no rpc calls")]
    try:
        call = stage.rpc(msg.method, msg.args, msg.kwargs, msg.timeout)
        replies = await asyncio.wait_for(call, msg.timeout)
    except TimeoutError:
        why = f"timeout: stage {stage_id} did not answer within {msg.timeout}s"
        return [RpcResult(stage_id, -1, None, why)]
    except Exception as exc:
        return [RpcResult(stage_id, -1, None, f"{type(exc).__name__}: {exc}")]
    return [RpcResult(stage_id, r, v, e) for r, v, e in replies]


async def sequential_rpc(stages: Sequence[StageClient], msg: RpcMsg) -> None:
    """The seed's shape: one stage after the other, awaited where the call was taken."""
    results: list[RpcResult] = []
    try:
        for k in msg.targets:
            results += await _one(k, stages[k], msg)
    finally:
        if len({r.stage_id for r in results}) == len(msg.targets):
            msg.answer(results)
        else:
            msg.refuse("orchestrator stopped during the call")


async def concurrent_rpc(stages: Sequence[StageClient], msg: RpcMsg) -> None:
    """Every stage at once, each under its own deadline (run it in a task of its own)."""
    answers: dict[int, list[RpcResult]] = {}

    async def ask(k: int) -> None:
        answers[k] = await _one(k, stages[k], msg)

    try:
        async with asyncio.TaskGroup() as tg:
            for k in msg.targets:
                tg.create_task(ask(k), name=f"orchestrator-rpc-{k}-{msg.method}")
    finally:
        if len(answers) == len(msg.targets):
            msg.answer([r for k in msg.targets for r in answers[k]])
        else:
            msg.refuse("orchestrator stopped during the call")
