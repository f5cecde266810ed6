""":class:`trio_orch.testing.ScriptedStage` with the comparison scenarios' faults.

The Trio twin of :mod:`bench.refs.testing`: the same :class:`Misbehaviour`
applied with Trio's primitives.  A Trio stage client cannot start a task that
nobody owns, so ``helper_per_submit`` needs the nursery of whoever owns the
stage (the application's); ``close_under_reader`` closes the stage's receive
channel under the blocked reader, which is what a Trio socket or channel does.
"""

from __future__ import annotations

from typing import Any

import trio

from bench.misbehaviour import Misbehaviour
from trio_orch.testing import ScriptedStage
from trio_orch.types import StageOutput

__all__ = ["TrioScriptedStage"]


class TrioScriptedStage(ScriptedStage):
    """A :class:`ScriptedStage` that can misbehave as told."""

    #: no push fast path: the orchestrator must call receive(), where the faults live
    pump = None

    def __init__(self, stage_id: int = 0, *, name: str | None = None,
                 misbehaviour: Misbehaviour | None = None,
                 helper_nursery: trio.Nursery | None = None) -> None:
        super().__init__(stage_id, name=name)
        self.misbehaviour = misbehaviour or Misbehaviour()
        self.helper_nursery = helper_nursery
        self.swallowed_cancels = 0

    def close_under_reader(self) -> None:
        """A blocked or later receive fails as a Trio resource closed under it does."""
        self._recv.close()

    async def submit(self, request_id: str, payload: Any) -> None:
        await super().submit(request_id, payload)
        if self.misbehaviour.helper_per_submit and self.helper_nursery is not None:
            self.helper_nursery.start_soon(trio.sleep, 3600, name=f"{self.name}.heartbeat[{request_id}]")

    async def abort(self, request_ids: list[str]) -> None:
        if self.misbehaviour.hang_abort and not (self.dead or self.closed):
            await trio.sleep_forever()
        await super().abort(request_ids)

    async def receive(self) -> list[StageOutput]:
        mb = self.misbehaviour
        while True:
            try:
                return await super().receive()
            except trio.Cancelled:
                if mb.cancel_error is not None:
                    raise mb.cancel_error from None
                if mb.swallow_cancel_once and self.swallowed_cancels == 0:
                    self.swallowed_cancels += 1
                    continue
                raise

    async def aclose(self) -> None:
        self.closed = True
        self._send.close()
        mb = self.misbehaviour
        if mb.hang_aclose:
            await trio.sleep_forever()
        if mb.aclose_delay:
            await trio.sleep(mb.aclose_delay)
        if mb.aclose_error is not None:
            raise mb.aclose_error
        await trio.lowlevel.checkpoint()
