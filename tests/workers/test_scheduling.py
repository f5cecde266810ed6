"""A worker's waiting requests join the batch by priority, deadline, arrival (stages/scheduling.py)."""

from __future__ import annotations

import msgspec

from stages.scheduling import WaitingQueue, batch_key
from stages.wire import Submit


def drain(q: WaitingQueue[str]) -> list[str]:
    return [q.pop() for _ in range(len(q))]


def test_the_lowest_priority_joins_first_then_the_earliest_deadline_then_arrival() -> None:
    q: WaitingQueue[str] = WaitingQueue()
    q.push("low-a", priority=5, now=0.1)
    q.push("low-b", priority=5, now=0.2)
    q.push("mid-no-deadline", now=0.3)
    q.push("mid-deadline", deadline=9.0, now=0.4)
    q.push("high", priority=-5, now=0.5)
    assert len(q) == 5 and sorted(q) == sorted(["low-a", "low-b", "mid-no-deadline", "mid-deadline", "high"])
    assert drain(q) == ["high", "mid-deadline", "mid-no-deadline", "low-a", "low-b"]
    assert not q


def test_aging_a_request_that_arrived_epochs_earlier_goes_first() -> None:
    q: WaitingQueue[str] = WaitingQueue(aging=1.0)
    q.push("old-low", priority=2, now=0.0)
    q.push("new-high", priority=-2, now=3.5)  # 4 levels better, 3 epochs later: ahead
    q.push("newer-high", priority=-2, now=5.0)  # 5 epochs later: behind
    assert drain(q) == ["new-high", "old-low", "newer-high"]
    assert batch_key(0, None, 2.5, 7, aging=1.0)[0] == 2


def test_remove_takes_one_request_out_wherever_it_waits() -> None:
    q: WaitingQueue[str] = WaitingQueue()
    names = [f"r{i}" for i in range(4)]  # the worker's requests are objects: removed by identity
    for i, prio in enumerate([3, 1, 2, 0]):
        q.push(names[i], priority=prio, now=float(i) / 10)
    q.remove(names[2])
    assert drain(q) == ["r3", "r1", "r0"]


def test_a_submit_from_an_older_head_decodes_with_priority_0_and_no_deadline() -> None:
    old = msgspec.msgpack.encode(["submit", "r1", "payload", -1, None, False])  # the fields it knew
    msg = msgspec.msgpack.decode(old, type=Submit)
    assert (msg.request_id, msg.priority, msg.deadline_in) == ("r1", 0, None)
    new = msgspec.msgpack.decode(msgspec.msgpack.encode(Submit("r2", "p", priority=-3, deadline_in=2.5)),
                                 type=Submit)
    assert (new.priority, new.deadline_in) == (-3, 2.5)
