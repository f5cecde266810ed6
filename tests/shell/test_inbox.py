"""The dispatcher's inbox and the batch-granular output channel, alone and through the orchestrator."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from trio_orch.shell.inbox import Inbox
from trio_orch.shell.orchestrator import open_orchestrator
from trio_orch.testing import PushScriptedStage
from trio_orch.types import StageOutput


async def test_posts_are_taken_in_order_and_a_waiting_taker_wakes_once_per_batch() -> None:
    inbox: Inbox[int] = Inbox()
    woken: list[list[int]] = []

    async def taker() -> None:
        while True:
            await inbox.wait()
            batch = inbox.take()
            if not batch:
                return
            woken.append(batch)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(taker)
        await trio.testing.wait_all_tasks_blocked()
        for i in range(5):  # between checkpoints: one wake-up takes all five
            inbox.post(i)
        await trio.testing.wait_all_tasks_blocked()
        inbox.post(5)
        await trio.testing.wait_all_tasks_blocked()
        inbox.close()
    assert woken == [[0, 1, 2, 3, 4], [5]]


async def test_a_closed_inbox_refuses_posts_keeps_what_was_queued_and_closes_idempotently() -> None:
    inbox: Inbox[str] = Inbox()
    inbox.post("a")
    inbox.close()
    inbox.close()
    with pytest.raises(trio.ClosedResourceError):
        inbox.post("b")
    await inbox.wait()  # closed: returns at once
    assert inbox.take() == ["a"] and inbox.take() == [] and inbox.closed


async def test_a_cancelled_wait_leaves_no_waiter_and_a_second_taker_is_refused(
        autojump_clock: trio.testing.MockClock) -> None:
    inbox: Inbox[int] = Inbox()
    with trio.move_on_after(0.1):  # cancelled while parked
        await inbox.wait()
    inbox.post(1)  # no stale waiter to reschedule
    assert inbox.take() == [1]
    async with trio.open_nursery() as nursery:
        nursery.start_soon(inbox.wait)
        await trio.testing.wait_all_tasks_blocked()
        with pytest.raises(trio.BusyResourceError):
            await inbox.wait()
        inbox.post(2)
    assert len(inbox) == 1


async def test_next_batch_takes_every_ready_message_and_next_output_the_rest_in_order() -> None:
    stage = PushScriptedStage(0)
    async with open_orchestrator([stage], {0}) as orch:
        for rid in ("x", "y"):
            await orch.add_request(rid, "p")
        await trio.testing.wait_all_tasks_blocked()
        for i in range(6):  # one burst: routed and delivered in a few batches, before any checkpoint
            stage.emit_batch_nowait([StageOutput("x" if i % 2 else "y", i, False)])
        await trio.testing.wait_all_tasks_blocked()
        first = await orch.next_output()  # one message of a delivered batch: the rest stays buffered
        batch = await orch.next_batch()
        assert [first.data] + [m.data for m in batch] == list(range(6))
        with pytest.raises(trio.WouldBlock):
            orch.next_output_nowait()
        stage.emit_batch_nowait([StageOutput("x", "end", True), StageOutput("y", "end", True)])
        ends = [await orch.next_output(), await orch.next_output()]
        assert {m.request_id for m in ends} == {"x", "y"} and all(m.finished for m in ends)
    with pytest.raises(trio.EndOfChannel):
        await orch.next_batch()
