"""A worker's waiting queue never starves a request: aging bounds how long more urgent ones pass it."""

from __future__ import annotations

from stages.scheduling import AGING, WaitingQueue


def test_a_stream_of_urgent_submits_never_starves_a_waiting_low_priority_one() -> None:
    """The batch takes one request a second while two ``-5`` ones arrive every second."""
    q: WaitingQueue[str] = WaitingQueue(aging=1.0)
    q.push("low", priority=5, now=0.0)
    now, n, ahead = 0.0, 0, []
    while True:
        for _ in range(2):
            now += 0.5
            n += 1
            q.push(f"urgent{n}", priority=-5, now=now)
        got = q.pop()
        if got == "low":
            break
        ahead.append(got)
        assert now < 100, "the low-priority request never joined the batch"
    # passed only by the ones that arrived within (5 - -5) epochs of 1 s after it: 0.5 s .. 9.5 s
    assert ahead == [f"urgent{i}" for i in range(1, 20)]


def test_within_one_epoch_equal_levels_go_by_deadline_across_epochs_by_level() -> None:
    """The key is (priority + arrival epoch, deadline, arrival): a deadline only breaks ties of level."""
    q: WaitingQueue[str] = WaitingQueue(aging=1.0)
    q.push("early-epoch-late-deadline", priority=0, deadline=100.0, now=0.2)
    q.push("same-epoch-early-deadline", priority=0, deadline=10.0, now=0.9)
    q.push("next-epoch-earliest-deadline", priority=0, deadline=5.0, now=1.1)  # one level worse by age
    q.push("next-epoch-one-better", priority=-1, deadline=50.0, now=1.2)  # level 0 again: its deadline counts
    assert [q.pop() for _ in range(4)] == ["same-epoch-early-deadline", "next-epoch-one-better",
                                           "early-epoch-late-deadline", "next-epoch-earliest-deadline"]


def test_the_worker_ages_by_the_heads_default() -> None:
    """The worker's epoch (not sent on the wire) is the orchestrator's default ``priority_aging``."""
    from trio_orch.core import Router

    assert WaitingQueue().aging == AGING == Router(1, {0}).priority_aging
