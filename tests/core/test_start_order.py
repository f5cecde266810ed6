"""Who starts first: the core's start queue (priority, then deadline, then arrival; aging bounds a wait)."""

from __future__ import annotations

import pytest

from trio_orch.core import Router, Submit, Ticket
from trio_orch.core.actions import stage_io_options


def router(**kw: object) -> Router:
    return Router(1, {0}, max_inflight=[1], **kw)  # type: ignore[arg-type]


def order(r: Router) -> list[str]:
    """Start every queued ticket in the core's order (room is made as each starts)."""
    started = []
    while (t := r.next_ticket()) is not None:
        r.start(t)
        started.append(t.request_id)
        r.requests.pop(t.request_id)  # finished at once: frees nothing we look at here
    return started


def queue(r: Router, rid: str, now: float = 0.0, **kw: object) -> Ticket:
    t = r.accept(rid, "p", **kw)  # type: ignore[arg-type]
    r.enqueue(t, now)
    return t


def test_the_lowest_priority_value_starts_first_then_the_earliest_deadline_then_arrival() -> None:
    r = router()
    queue(r, "low-a", priority=5)
    queue(r, "low-b", priority=5)
    queue(r, "mid-late-deadline", timeout=30)
    queue(r, "mid-no-deadline")
    queue(r, "mid-early-deadline", timeout=10)
    queue(r, "high", priority=-5)
    assert order(r) == ["high", "mid-early-deadline", "mid-late-deadline", "mid-no-deadline",
                        "low-a", "low-b"]


def test_equal_priorities_keep_arrival_order() -> None:
    r = router()
    for i in range(6):
        queue(r, f"r{i}", now=0.1 * i, priority=3)
    assert order(r) == [f"r{i}" for i in range(6)]


def test_a_ticket_that_ended_or_was_withdrawn_while_queued_is_skipped_and_frees_its_place() -> None:
    r = router()
    queue(r, "a", priority=1)
    queue(r, "b", priority=2)
    queue(r, "c", priority=3)
    assert r.start_queued == 3
    r.abort("a")
    assert r.start_queued == 2
    r.withdraw(r.queued["b"])
    assert r.start_queued == 1 and order(r) == ["c"] and r.start_queued == 0


def test_aging_a_request_queued_long_enough_before_goes_ahead_of_a_more_urgent_newcomer() -> None:
    r = router(priority_aging=1.0)
    queue(r, "old-low", now=0.0, priority=5)
    queue(r, "new-high-soon", now=5.5, priority=-5)  # 10 levels better, 5.5 s later: still ahead
    queue(r, "new-high-late", now=11.5, priority=-5)  # more than (5 - -5 + 1) s later: behind
    assert order(r) == ["new-high-soon", "old-low", "new-high-late"]


def test_a_stream_of_more_urgent_requests_never_starves_a_waiting_one() -> None:
    """One start per second while a -5 request arrives every 0.5 s: the 5 still starts."""
    r = router(priority_aging=1.0)
    queue(r, "starved?", now=0.0, priority=5)
    now, n, before = 0.0, 0, []
    while True:
        for _ in range(2):
            now += 0.5
            n += 1
            queue(r, f"urgent{n}", now=now, priority=-5)
        t = r.next_ticket()
        assert t is not None
        r.start(t)
        r.requests.pop(t.request_id)
        if t.request_id == "starved?":
            break
        before.append(t.request_id)
        assert now < 100, "the low-priority request never started"
    # passed only by the requests queued within (5 - -5) epochs of 1 s after it: 0.5 s .. 9.5 s
    assert before == [f"urgent{i}" for i in range(1, 20)]


def test_priority_must_be_an_int() -> None:
    r = router()
    for bad in ("high", 1.5, True, None):
        with pytest.raises(ValueError, match="priority must be an int"):
            r.accept("x", "p", priority=bad)  # type: ignore[arg-type]
        assert not r.is_live("x")


def test_priority_aging_must_be_positive() -> None:
    with pytest.raises(ValueError, match="priority_aging"):
        router(priority_aging=0)


def test_the_schedule_goes_with_a_submit_only_to_stages_that_take_it() -> None:
    r = router()
    t = queue(r, "r", now=100.0, priority=-2, timeout=8)
    [submit] = r.start(t)
    assert type(submit) is Submit
    schedule = r.schedule("r", 103.0)
    assert schedule == (-2, pytest.approx(5.0))
    # a stage that declares it takes them (PrioritizedStageClient) gets them
    assert stage_io_options(submit, schedule, True) == {"priority": -2, "deadline_in": pytest.approx(5.0)}
    assert stage_io_options(submit, schedule, False) == {}  # a plain stage client: nothing new
    assert stage_io_options(submit, (0, None), True) == {}  # the defaults say nothing
    assert r.schedule("unknown", 0.0) == (0, None)
