"""Hypothesis: random interleavings of every event kind against the routing core.

After every step: each accepted request has at most one terminal and nothing
follows it; nothing is emitted for a cleaned-up request; state is never
re-created by an output; in async-chunk mode a ``finished=True`` message only
appears once every submitted stage finished.  At teardown a shutdown gives
every request still active its terminal, so each accepted request ends with
exactly one.
"""

from __future__ import annotations

from typing import Any

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from trio_orch.core import Emit, Router, Submit
from trio_orch.types import OrchError, OrchOutput, StageOutput

IDS = st.sampled_from(["a", "b", "c", "d", "e", "ghost"])
STAGES = st.integers(0, 2)


class RouterMachine(RuleBasedStateMachine):
    async_chunk = False

    def __init__(self) -> None:
        super().__init__()
        self.router = Router(3, {0, 2}, async_chunk=self.async_chunk,
                             prewarm_fn=lambda k, p: f"warm{k}", forward_fn=lambda k, p, o: list(o))
        self.live: dict[str, int] = {}  # rid -> incarnation number
        self.terminals: dict[tuple[str, int], int] = {}  # (rid, incarnation) -> terminal count
        self.incarnations = 0
        self.submitted: dict[str, set[int]] = {}
        self.fed_finished: dict[str, set[int]] = {}
        self.tickets: list[tuple[Any, int]] = []  # every accepted ticket, with its incarnation

    # ---------------------------------------------------------------- helpers
    def apply(self, actions: list) -> None:
        for a in actions:
            if isinstance(a, Submit):
                assert a.request_id in self.live, f"submit for a request that is not live: {a}"
                assert a.stage_id not in self.submitted[a.request_id], "stage submitted twice"
                self.submitted[a.request_id].add(a.stage_id)
            elif isinstance(a, Emit):
                self.check_message(a.message)

    def check_message(self, msg: OrchOutput | OrchError) -> None:
        rid = msg.request_id
        assert rid in self.live, f"message after cleanup (or for a request never added): {msg}"
        if msg.finished:
            if self.async_chunk and isinstance(msg, OrchOutput):
                assert self.submitted[rid] <= self.fed_finished[rid], (
                    f"finished=True before every submitted stage finished: {msg}")
            self.terminals[(rid, self.live.pop(rid))] += 1
            assert not self.router.is_live(rid), "state kept after the terminal"

    # ---------------------------------------------------------------- rules
    def register(self, rid: str) -> None:
        assert rid not in self.live
        self.incarnations += 1
        self.live[rid] = self.incarnations
        self.terminals[(rid, self.incarnations)] = 0
        self.submitted[rid] = set()
        self.fed_finished[rid] = set()

    @rule(rid=IDS, final=st.sampled_from([None, None, 0, 1, 2, 5]))
    def add(self, rid: str, final: int | None) -> None:
        try:
            actions = self.router.add(rid, f"prompt-{rid}", final)
        except ValueError:
            assert rid in self.live or final == 5
            return
        self.register(rid)
        self.apply(actions)

    @rule(rid=IDS, final=st.sampled_from([None, 0, 2]))
    def accept(self, rid: str, final: int | None) -> None:
        """Accepted but left queued: ends by start, abort, expire or shutdown."""
        try:
            ticket = self.router.accept(rid, f"prompt-{rid}", final_stage_id=final)
        except ValueError:
            assert rid in self.live
            return
        self.register(rid)
        self.tickets.append((ticket, self.live[rid]))

    @rule(data=st.data())
    def start(self, data: st.DataObject) -> None:
        """Start any ticket ever accepted, stale ones included (they must start nothing)."""
        if not self.tickets:
            return
        ticket, incarnation = data.draw(st.sampled_from(self.tickets))
        current = self.live.get(ticket.request_id) == incarnation and self.router.is_queued(ticket.request_id)
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
        if self.live.get(rid) == incarnation and self.router.queued.get(rid) is ticket:
            self.router.withdraw(ticket)
            del self.live[rid]
            del self.terminals[(rid, incarnation)]
        else:
            before = set(self.router.queued)
            self.router.withdraw(ticket)
            assert set(self.router.queued) == before

    @rule(rid=IDS, stage=STAGES, finished=st.booleans())
    def output(self, rid: str, stage: int, finished: bool) -> None:
        was_live = rid in self.router  # started (a queued request holds no stage)
        dropped = self.router.dropped_outputs
        if finished and rid in self.live and stage in self.submitted[rid]:
            self.fed_finished[rid].add(stage)
        actions = self.router.route(stage, StageOutput(rid, f"d{stage}", finished))
        if not was_live:
            assert self.router.dropped_outputs == dropped + 1
            assert rid not in self.router, "an output re-created request state"
            assert actions == []
        self.apply(actions)

    @rule(rid=IDS, stage=STAGES, kind=st.sampled_from(["stage_failed", "replica_died"]))
    def stage_error(self, rid: str, stage: int, kind: str) -> None:
        self.apply(self.router.route(stage, StageOutput(rid, None, True, "boom", kind)))

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
        for rid in self.live:
            assert stage not in self.submitted[rid] - self.fed_finished[rid] or rid in self.router

    @rule(stage=STAGES)
    def stage_back(self, stage: int) -> None:
        self.router.set_available(stage, True)

    # ---------------------------------------------------------------- invariants
    @invariant()
    def at_most_one_terminal(self) -> None:
        assert all(n <= 1 for n in self.terminals.values())

    @invariant()
    def router_tracks_exactly_the_live_requests(self) -> None:
        assert set(self.router.requests) | set(self.router.queued) == set(self.live)
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


TestRouterNormalMode = RouterMachine.TestCase
TestRouterNormalMode.settings = settings(max_examples=150, stateful_step_count=60, deadline=None)
TestRouterAsyncChunk = AsyncChunkRouterMachine.TestCase
TestRouterAsyncChunk.settings = settings(max_examples=150, stateful_step_count=60, deadline=None)
