"""Hypothesis: random interleavings of every event kind against the routing core.

After every step: each accepted request has at most one terminal and nothing
follows it; nothing is emitted for a cleaned-up request; state is never
re-created by an output; a ``finished=True`` output only appears once the
input is closed and every submitted stage closed every input segment (the
terminal gate, streaming included); every stage gets each input segment
exactly once, in order, the last one marked final -- and once more, from the
first, after a failover (a ``replica_died`` where the stage had answered
nothing, at most ``max_retries`` times; with no live replica it waits and is
sent once ``replicas_changed`` reports one; async-chunk requests restart on
every stage while nothing was shown).  Requests come in three
shapes: added at once, accepted and left queued (started later, or ended
while queued, or withdrawn), and resumable (more input segments by update).
At teardown a shutdown gives every request still live its terminal, so each
accepted request ends with exactly one.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from trio_orch.core import Emit, Router, Submit, Update
from trio_orch.types import OrchError, OrchOutput, StageOutput

IDS = st.sampled_from(["a", "b", "c", "d", "e", "ghost"])
#: companion ids: their own (x:neg) or one of the request ids (a namespace clash, refused)
COMPANION_IDS = st.lists(st.sampled_from(["a:neg", "b:neg", "c:neg", "x:neg", "a", "b"]), max_size=2,
                         unique=True)
STAGES = st.integers(0, 2)


class Model:
    """What the test knows about one incarnation of a request."""

    def __init__(self, incarnation: int, resumable: bool, final: int = 2) -> None:
        self.incarnation = incarnation
        self.final = final  # its final stage
        self.waiting: int | None = None  # the stage its failover waits at for a live replica
        self.shown = False  # an output of a final stage was routed (shown or held): no restart
        self.resumable = resumable
        self.segments = 1  # input segments given (the prompt is segment 0)
        self.input_closed = not resumable
        self.opened: dict[int, int] = {}  # stage -> submit + updates received
        self.closed: dict[int, int] = {}  # stage -> finished outputs fed while a segment was open
        self.final_sent: set[int] = set()  # stages told "this is the last segment"
        self.companions: dict[str, bool] = {}  # companion id -> finished stage 0
        self.answered: set[int] = set()  # stages that produced an output for it (no failover there)
        self.retries = 0
        self.stale: set[str] = set()  # ids whose death a failover already handled

    def done(self, k: int) -> bool:
        return self.input_closed and self.closed.get(k, 0) == self.segments


class RouterMachine(RuleBasedStateMachine):
    async_chunk = False
    max_retries = 2

    def __init__(self) -> None:
        super().__init__()
        self.router = Router(3, {0, 2}, async_chunk=self.async_chunk, max_inflight=[2, None, 1],
                             prewarm_fn=lambda k, p: f"warm{k}:{p}", forward_fn=lambda k, p, o: list(o),
                             max_retries=self.max_retries)
        self.live: dict[str, Model] = {}
        self.terminals: dict[tuple[str, int], int] = {}  # (rid, incarnation) -> terminal count
        self.incarnations = 0
        self.tickets: list[tuple[Any, int]] = []  # every accepted ticket, with its incarnation
        self.parent_of: dict[str, str] = {}  # live companion id -> its parent
        self.clock = 0.0  # the shell's clock, for the start queue

    # ---------------------------------------------------------------- helpers
    def apply(self, actions: list) -> None:
        for a in actions:
            if isinstance(a, Submit) and a.companion_of is not None:
                parent = self.live.get(a.companion_of)
                assert parent is not None and a.request_id in parent.companions and a.stage_id == 0, a
                assert self.parent_of.get(a.request_id) == a.companion_of
                continue
            if isinstance(a, (Submit, Update)):
                m = self.live.get(a.request_id)
                assert m is not None, f"stage I/O for a request that is not live: {a}"
                k = a.stage_id
                n = m.opened.get(k, 0)
                assert isinstance(a, Submit) == (n == 0), f"submit must come first, exactly once: {a}"
                assert n < m.segments, f"more segments sent to stage {k} than given: {a}"
                if k == 0 or self.async_chunk:  # the input itself: segment n, in order
                    want = f"seg{n}" if k == 0 else f"warm{k}:seg{n}"
                    assert a.payload == want, f"segment out of order on stage {k}: {a}"
                last = m.input_closed and n + 1 == m.segments
                if isinstance(a, Update):
                    assert a.final == last, f"final flag wrong: {a}"
                elif m.resumable:
                    assert a.resumable == (not last), f"resumable flag wrong: {a}"
                if last:
                    m.final_sent.add(k)
                if k == 1 and m.companions:
                    assert all(m.companions.values()), f"forwarded before every companion finished: {a}"
                m.opened[k] = n + 1
            elif isinstance(a, Emit):
                self.check_message(a.message)

    def check_message(self, msg: OrchOutput | OrchError) -> None:
        rid = msg.request_id
        m = self.live.get(rid)
        assert m is not None, f"message after cleanup (or for a request never added): {msg}"
        if msg.finished:
            if isinstance(msg, OrchOutput):
                assert all(m.done(k) for k in m.opened), (
                    f"finished=True before every submitted stage closed every segment: {msg}")
                assert m.final_sent == set(m.opened), f"a stage never got its last segment: {msg}"
            ended = self.live.pop(rid)
            self.terminals[(rid, ended.incarnation)] += 1
            assert not self.router.is_live(rid), "state kept after the terminal"
            for cid in ended.companions:
                del self.parent_of[cid]
                assert cid not in self.router.companion_of, "a companion outlived its parent"

    def register(self, rid: str, resumable: bool = False, companions: tuple[str, ...] = (),
                 final: int | None = None) -> None:
        assert rid not in self.live
        self.incarnations += 1
        self.live[rid] = Model(self.incarnations, resumable, 2 if final is None else final)
        self.terminals[(rid, self.incarnations)] = 0
        for cid in companions:
            self.live[rid].companions[cid] = False
            self.parent_of[cid] = rid

    @rule(rid=IDS, cids=COMPANION_IDS)
    def add_with_companions(self, rid: str, cids: list[str]) -> None:
        """A parent with companions (CFG): refused if any id clashes with a live one."""
        clash = rid in self.live or rid in self.parent_of or any(
            c == rid or c in self.live or c in self.parent_of for c in cids)
        try:
            actions = self.router.add(rid, "seg0", companions={c: f"neg-{c}" for c in cids})
        except ValueError:
            assert clash or (self.async_chunk and cids), "companions refused without a reason"
            return
        assert not clash and not (self.async_chunk and cids)
        self.register(rid, companions=tuple(cids))
        self.apply(actions)

    # ---------------------------------------------------------------- rules
    @rule(rid=IDS, final=st.sampled_from([None, None, 0, 1, 2, 5]), resumable=st.booleans())
    def add(self, rid: str, final: int | None, resumable: bool) -> None:
        try:
            actions = self.router.add(rid, "seg0", final, resumable=resumable)
        except ValueError:
            assert rid in self.live or rid in self.parent_of or final == 5
            return
        self.register(rid, resumable, final=final)
        self.apply(actions)

    @rule(rid=IDS, final=st.sampled_from([None, 0, 2]), resumable=st.booleans())
    def accept(self, rid: str, final: int | None, resumable: bool) -> None:
        """Accepted but left queued: ends by start, abort, expire or shutdown."""
        try:
            ticket = self.router.accept(rid, "seg0", final_stage_id=final, resumable=resumable)
        except ValueError:
            assert rid in self.live or rid in self.parent_of
            return
        self.register(rid, resumable, final=final)
        self.tickets.append((ticket, self.live[rid].incarnation))

    @rule(data=st.data())
    def start(self, data: st.DataObject) -> None:
        """Start any ticket ever accepted, stale ones included (they must start nothing)."""
        if not self.tickets:
            return
        ticket, incarnation = data.draw(st.sampled_from(self.tickets))
        m = self.live.get(ticket.request_id)
        current = m is not None and m.incarnation == incarnation and self.router.is_queued(ticket.request_id)
        actions = self.router.start(ticket)
        if not current:
            assert actions == [], "a stale ticket started something"
        self.apply(actions)

    @rule(data=st.data())
    def withdraw(self, data: st.DataObject) -> None:
        """A shell that could not queue a ticket withdraws it: no terminal, the id is free."""
        if not self.tickets:
            return
        ticket, incarnation = data.draw(st.sampled_from(self.tickets))
        rid = ticket.request_id
        m = self.live.get(rid)
        if m is not None and m.incarnation == incarnation and self.router.queued.get(rid) is ticket:
            self.router.withdraw(ticket)
            del self.live[rid]
            del self.terminals[(rid, incarnation)]
        else:
            before = set(self.router.queued)
            self.router.withdraw(ticket)
            assert set(self.router.queued) == before

    @rule(rid=IDS, final=st.booleans())
    def update(self, rid: str, final: bool) -> None:
        m = self.live.get(rid)
        segment = f"seg{m.segments}" if m is not None else "seg?"
        try:
            actions = self.router.update(rid, segment, final=final)
        except ValueError:
            assert m is None or not m.resumable or m.input_closed
            return
        assert m is not None and m.resumable and not m.input_closed
        m.segments += 1
        m.input_closed = final
        self.apply(actions)

    @precondition(lambda self: any(m.resumable and not m.input_closed for m in self.live.values()))
    @rule(data=st.data(), final=st.booleans())
    def update_live(self, data: st.DataObject, final: bool) -> None:
        """An update for a live resumable request (random ids mostly test the refusals)."""
        open_inputs = sorted(rid for rid, m in self.live.items() if m.resumable and not m.input_closed)
        if open_inputs:
            self.update(data.draw(st.sampled_from(open_inputs)), final)

    @rule(rid=IDS | st.sampled_from(["a:neg", "b:neg", "x:neg"]), stage=STAGES, finished=st.booleans())
    def output(self, rid: str, stage: int, finished: bool) -> None:
        parent = self.parent_of.get(rid)
        if parent is not None and rid not in self.live:  # a companion's output: collected, never shown
            m = self.live[parent]
            routed = (rid in self.router.companion_of and stage == 0 and not m.companions[rid]
                      and m.waiting != 0)  # while its parent's failover waits there, no replica holds it
            dropped = self.router.dropped_outputs
            if routed and finished:
                m.companions[rid] = True
            actions = self.router.route(stage, StageOutput(rid, f"n{stage}", finished))
            assert routed or (actions == [] and self.router.dropped_outputs == dropped + 1)
            self.apply(actions)
            return
        was_live = rid in self.router  # started (a queued request holds no stage)
        dropped = self.router.dropped_outputs
        m = self.live.get(rid)
        open_here = m is not None and was_live and m.opened.get(stage, 0) > m.closed.get(stage, 0)
        if open_here:
            assert m is not None
            m.answered.add(stage)
            m.shown = m.shown or stage in (0, 2)
            if finished:
                m.closed[stage] = m.closed.get(stage, 0) + 1
        actions = self.router.route(stage, StageOutput(rid, f"d{stage}", finished))
        if not open_here:
            assert self.router.dropped_outputs == dropped + 1, "an output for no open segment was routed"
            assert actions == []
        assert was_live or rid not in self.router, "an output re-created request state"
        self.apply(actions)

    @precondition(lambda self: any(m.opened for m in self.live.values()))
    @rule(data=st.data(), finished=st.sampled_from([True, True, False]))
    def progress(self, data: st.DataObject, finished: bool) -> None:
        """An output where a segment is open (random outputs mostly miss): drives requests deep."""
        open_at = sorted((rid, k) for rid, m in self.live.items() if rid in self.router
                         for k in m.opened if m.opened[k] > m.closed.get(k, 0))
        open_at += sorted((cid, 0) for m in self.live.values() for cid, done in m.companions.items()
                          if not done)
        if open_at:
            rid, stage = data.draw(st.sampled_from(open_at))
            self.output(rid, stage, finished)

    @rule(rid=IDS | st.sampled_from(["a:neg", "b:neg"]), stage=STAGES,
          kind=st.sampled_from(["stage_failed", "replica_died"]))
    def stage_error(self, rid: str, stage: int, kind: str) -> None:
        parent = self.parent_of.get(rid)
        owner = parent if parent is not None and rid not in self.live else rid
        m = self.live.get(owner)
        started = m is not None and owner in self.router
        companion_open = owner != rid and stage == 0 and m is not None and not m.companions[rid]
        stale = started and kind == "replica_died" and rid in m.stale and (owner == rid or companion_open)
        # a request whose failover waits for a replica is on no replica there (async-chunk: anywhere)
        unheld = started and not stale and m.waiting is not None and (m.waiting == stage or self.async_chunk)
        retry = (started and not stale and not unheld and kind == "replica_died" and self.may_retry(m, stage)
                 and (owner == rid or companion_open))
        restart = retry and self.async_chunk
        actions = self.router.route(stage, StageOutput(rid, None, True, "boom", kind))
        if stale:
            assert actions == [], f"a death a failover already handled was routed: {actions}"
            m.stale.discard(rid)
            return
        if unheld:
            assert actions == [], f"an output for a request no replica holds was routed: {actions}"
            return
        if restart:
            assert m is not None
            assert not any(isinstance(a, Emit) for a in actions), f"a restart emitted: {actions}"
            m.retries += 1
            m.opened, m.closed, m.final_sent, m.answered = {}, {}, set(), set()
            down = [k for k in range(m.final + 1) if not self.router.available[k]]
            m.waiting = down[0] if down else None
            submits = [a for a in actions if isinstance(a, Submit)]
            assert [a.stage_id for a in submits] == ([] if down else list(range(m.final + 1))), actions
            self.apply(actions)
            return
        if retry and not self.router.available[stage]:
            assert m is not None
            assert actions == [], f"a failover with no live replica sent something: {actions}"
            m.retries += 1
            m.waiting = stage
            m.opened[stage] = 0
            m.final_sent.discard(stage)
            if stage == 0 and m.companions:
                m.stale = {c for c, done in m.companions.items() if not done} | {owner}
                m.stale.discard(rid)
                m.companions = dict.fromkeys(m.companions, False)
            return
        if retry:
            assert m is not None
            assert not any(isinstance(a, Emit) for a in actions), f"a failover emitted: {actions}"
            first = actions[0]
            assert isinstance(first, Submit) and (first.stage_id, first.request_id) == (stage, owner), actions
            m.retries += 1
            m.opened[stage] = 0  # the same inputs again, from the first (apply checks the order)
            m.final_sent.discard(stage)
            if stage == 0 and m.companions:
                m.stale = {c for c, done in m.companions.items() if not done} | {owner}
                m.stale.discard(rid)
                m.companions = dict.fromkeys(m.companions, False)
        elif companion_open:
            assert [a.message.request_id for a in actions if isinstance(a, Emit)] == [parent]
        self.apply(actions)

    @precondition(lambda self: any(m.opened for m in self.live.values()))
    @rule(data=st.data())
    def replica_died_where_open(self, data: st.DataObject) -> None:
        """A replica dies holding a request (or a companion) where it is open: drives failovers."""
        open_at = sorted((rid, k) for rid, m in self.live.items() if rid in self.router
                         for k in m.opened if not m.done(k))
        open_at += sorted((cid, 0) for m in self.live.values() for cid, done in m.companions.items()
                          if not done)
        if open_at:
            rid, stage = data.draw(st.sampled_from(open_at))
            self.stage_error(rid, stage, "replica_died")

    def may_retry(self, m: Model | None, stage: int) -> bool:
        """Would a replica's death at ``stage`` resend the request (see RoutingRules.failover)?"""
        if m is None or m.retries >= self.max_retries or m.waiting is not None:
            return False
        if self.async_chunk:
            return not m.resumable and not m.shown and stage in m.opened and not m.done(stage)
        return stage in m.opened and not m.done(stage) and stage not in m.answered

    @rule(rid=IDS)
    def abort(self, rid: str) -> None:
        self.apply(self.router.abort(rid))

    @rule(rid=IDS)
    def expire(self, rid: str) -> None:
        self.apply(self.router.expire(rid))

    @rule(rid=IDS, stage=STAGES)
    def submit_failed(self, rid: str, stage: int) -> None:
        self.apply(self.router.submit_failed(stage, rid, "could not submit"))

    @rule(stage=STAGES)
    def stage_died(self, stage: int) -> None:
        self.apply(self.router.stage_died(stage, "died"))
        for rid, m in self.live.items():
            assert stage not in m.opened or m.done(stage) or not self.router.is_live(rid) or (
                rid in self.router and stage not in self.router.requests[rid].open_stages)

    @rule(stage=STAGES)
    def stage_back(self, stage: int) -> None:
        self.router.set_available(stage, True)

    @rule(stage=STAGES, live=st.integers(0, 2))
    def replicas(self, stage: int, live: int) -> None:
        """A stage's replicas change; with a live one, the failovers that waited for it are sent."""
        resumed = [rid for rid, m in self.live.items() if m.waiting == stage] if live else []
        actions = self.router.replicas_changed(stage, live, 2)
        assert self.router.available[stage] == (live > 0)
        assert resumed or actions == [], f"nothing waited, yet something was sent: {actions}"
        for rid in resumed:
            m = self.live[rid]
            down = [k for k in range(m.final + 1) if not self.router.available[k]] if self.async_chunk else []
            m.waiting = down[0] if down else None
        sent = [a.request_id for a in actions if isinstance(a, Submit) and a.companion_of is None]
        assert sorted(set(sent)) == sorted(r for r in resumed if self.live[r].waiting is None), actions
        self.apply(actions)

    @rule(data=st.data())
    def start_when_the_core_says_so(self, data: st.DataObject) -> None:
        """What a shell does: start a queued ticket only once ``can_start`` says yes."""
        queued = sorted(self.router.queued)
        if not queued:
            return
        ticket = self.router.queued[data.draw(st.sampled_from(queued))]
        if self.router.can_start(ticket):
            self.apply(self.router.start(ticket))
        else:
            assert not self.router.has_room(ticket.final_stage_id)

    @rule(data=st.data(), priority=st.integers(-3, 3), later=st.floats(0, 3))
    def enqueue(self, data: st.DataObject, priority: int, later: float) -> None:
        """A shell queues a ticket (stale ones included: nothing happens) in the start queue."""
        if not self.tickets:
            return
        ticket, _ = data.draw(st.sampled_from(self.tickets))
        if ticket.order is None:
            ticket.priority = priority  # as if accepted with it
        self.clock += later
        self.router.enqueue(ticket, self.clock)

    @rule()
    def start_next(self) -> None:
        """What the Trio shell does: start the core's next ticket once ``can_start`` says yes."""
        ticket = self.router.next_ticket()
        if ticket is not None and self.router.can_start(ticket):
            self.apply(self.router.start(ticket))

    # ---------------------------------------------------------------- invariants
    @invariant()
    def the_start_queue_holds_the_queued_tickets_and_gives_the_smallest_key(self) -> None:
        waiting = [t for t in self.router.queued.values() if t.order is not None]
        assert self.router.start_queued == len(waiting)
        nxt = self.router.next_ticket()
        assert (nxt is None) == (not waiting)
        if nxt is not None:
            assert nxt.order == min(t.order for t in waiting if t.order is not None)

    @invariant()
    def claims_count_the_started_requests_that_still_have_to_pass_each_stage(self) -> None:
        want = [0, 0, 0]
        for req in self.router.requests.values():
            for k in range(req.final_stage_id + 1):
                if k not in req.finished:
                    want[k] += 1
        assert self.router.claims == want

    @invariant()
    def at_most_one_terminal(self) -> None:
        assert all(n <= 1 for n in self.terminals.values())

    @invariant()
    def router_tracks_exactly_the_live_requests(self) -> None:
        assert set(self.router.requests) | set(self.router.queued) == set(self.live)
        assert self.router.companion_of == self.parent_of
        assert not set(self.router.requests) & set(self.router.queued)
        stats = self.router.statistics()
        assert stats.live == len(self.live)
        assert sum(stats.terminals_by_kind.values()) == sum(self.terminals.values())

    def teardown(self) -> None:
        self.apply(self.router.shutdown())
        assert not self.live and len(self.router) == 0 and not self.router.queued
        assert all(n == 1 for n in self.terminals.values()), self.terminals


class AsyncChunkRouterMachine(RouterMachine):
    async_chunk = True


# CI replays one fixed set of examples (a red run names a change, not a lucky draw); elsewhere each run
# searches afresh.  TRIO_ORCH_HYPOTHESIS_EXAMPLES searches longer.
SETTINGS = settings(max_examples=int(os.environ.get("TRIO_ORCH_HYPOTHESIS_EXAMPLES", "200")),
                    stateful_step_count=60, deadline=None, derandomize=bool(os.environ.get("CI")))
TestRouterNormalMode = RouterMachine.TestCase
TestRouterNormalMode.settings = SETTINGS
TestRouterAsyncChunk = AsyncChunkRouterMachine.TestCase
TestRouterAsyncChunk.settings = SETTINGS
TestRouterNormalMode = pytest.mark.slow(TestRouterNormalMode)
TestRouterAsyncChunk = pytest.mark.slow(TestRouterAsyncChunk)
