"""The engine served over ZMQ to an API-server process's :class:`RemoteEngine`: one seam, decided in the head.

Both sides run here in one Trio run, over real ipc sockets guarded as a
front's are (a launch ticket from the launched pid, checked by the ZAP
handler); ``tests/serve/test_api_servers.py`` runs them as processes.
"""

from __future__ import annotations

import asyncio
import os
import queue
import shutil
import tempfile
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import numpy as np
import pytest
import trio
import zmq

from stages.auth import Authenticator, Security
from tests.engine.test_engine_api import declared, kind, shape
from tests.waiting import await_until, trio_until
from trio_orch import OrchError, OrchOutput
from trio_orch.engine import EngineClient, EngineClosed, Overloaded, ThreadEngine, TrioEngine, static_pipeline
from trio_orch.engine.bridge import HostedEngine
from trio_orch.http.metrics import FrontMetrics, render
from trio_orch.serve.fronts.host import EngineHost
from trio_orch.serve.fronts.remote import RemoteEngine
from trio_orch.testing import ScriptedStage
from trio_orch.testing.toy_pipeline import toy_pipeline


@asynccontextmanager
async def served(factory: Any, fronts: int = 1, connect: bool = True, **engine_options: Any
                 ) -> AsyncIterator[tuple[TrioEngine, EngineHost, list[RemoteEngine]]]:
    """An engine, its host with ``fronts`` slots, and a :class:`RemoteEngine` per slot (connected in this
    run, unless ``connect`` is false: then whoever hosts it runs it)."""
    directory = tempfile.mkdtemp(prefix="trio-orch-test-")
    ctx = zmq.Context()
    security = Security.new_pipeline()
    authenticator = Authenticator(ctx, security.secret).start()
    engine = TrioEngine(factory, **engine_options)
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(engine.run)
            host = EngineHost(engine, ctx, directory, fronts, security=security, authenticator=authenticator)
            remotes = []
            for slot in host.slots:
                launch = authenticator.launches.open(slot.zap_domain, f"front {slot.index}")
                authenticator.launches.bind(launch, os.getpid())  # this process is "the front launched"
                await nursery.start(slot.run)
                remote = RemoteEngine(ctx, slot.address, Security(security.secret, ticket=launch.ticket),
                                      name=f"front {slot.index}")
                remotes.append(remote)
            nursery.start_soon(host.watch_state)
            for remote in remotes if connect else ():
                with trio.fail_after(10):
                    await nursery.start(remote.run)
            yield engine, host, remotes
            nursery.cancel_scope.cancel()
        host.close()
    finally:
        authenticator.stop()
        ctx.destroy(linger=0)
        shutil.rmtree(directory, ignore_errors=True)


def test_the_remote_engine_satisfies_the_protocol_member_by_member() -> None:
    ctx = zmq.Context()
    try:
        remote = RemoteEngine(ctx, "ipc:///nonexistent")
        assert isinstance(remote, EngineClient)
        for name, member in declared(EngineClient).items():
            got = getattr(remote, name)
            if isinstance(member, property):
                assert not callable(got), name
                continue
            assert kind(got) == kind(member), name
            assert shape(got) == shape(member), name
        remote.sock.close()
    finally:
        ctx.destroy(linger=0)


def test_both_engines_have_what_the_thread_adapter_needs_of_a_hosted_engine() -> None:
    """``HostedEngine`` declares it; the adapter hosts either engine, so each has it, member by member."""
    ctx = zmq.Context()
    try:
        remote = RemoteEngine(ctx, "ipc:///nonexistent")
        for engine in (TrioEngine(static_pipeline([ScriptedStage(0)], {0})), remote):
            assert isinstance(engine, HostedEngine)
            for name, member in declared(HostedEngine).items():
                got = getattr(engine, name)
                if isinstance(member, property):
                    assert not callable(got), name
                    continue
                what = (type(engine).__name__, name)
                assert kind(got) == kind(member), what
                assert [p[:2] for p in shape(got)] == [p[:2] for p in shape(member)], what
        remote.sock.close()
    finally:
        ctx.destroy(linger=0)


async def test_a_streamed_request_crosses_with_arrays_as_frames_and_the_pipeline_as_the_head_has_it() -> None:
    stage = ScriptedStage(0)
    async with served(static_pipeline([stage], {0})) as (_engine, host, (remote,)):
        assert remote.running and remote.final_stage_ids == {0}
        audio = np.arange(6, dtype=np.float32).reshape(2, 3)
        handle = await remote.add_request_async({"text": "hi", "image": audio}, request_id="r1")
        assert handle.rejection is None and handle.request_id == "r1"
        await trio_until(lambda: bool(stage.submissions), "the submit on the stage")
        rid, payload = stage.submissions[0]
        assert rid == "r1" and np.array_equal(payload["image"], audio)
        await stage.emit("r1", np.ones(4, dtype=np.int16))
        await stage.emit("r1", "done", finished=True)
        got = [m async for m in handle]
        assert [type(m) for m in got] == [OrchOutput, OrchOutput] and got[-1].finished
        assert np.array_equal(got[0].data, np.ones(4, dtype=np.int16))
        stats = await remote.stats_async()
        assert stats.admitted == 1 and stats.terminals_by_kind == {"finished": 1}
        assert host.slots[0].requests == 1 and not host.slots[0].handles


async def test_a_request_left_early_is_aborted_in_the_head_with_one_terminal() -> None:
    stage = ScriptedStage(0)
    async with served(static_pipeline([stage], {0})) as (engine, host, (remote,)):
        handle = await remote.add_request_async("x")
        await stage.emit(handle.request_id, "a")
        async for _batch in handle.batches():
            break  # the client left after its first chunk
        await trio_until(lambda: engine.demux.terminals_by_kind.get("aborted") == 1 and bool(stage.aborts),
                         "the aborted terminal, then the abort on the stage")
        assert stage.aborts == [handle.request_id]
        assert sum((await remote.stats_async()).terminals_by_kind.values()) == 1
        assert not host.slots[0].handles


async def test_refusals_cross_as_the_errors_the_app_expects() -> None:
    stage = ScriptedStage(0)
    async with served(static_pipeline([stage], {0}, max_inflight=[1]), request_queue_size=1, max_waiting=1,
                      admission_timeout=0.0
                      ) as (_engine, _host, (remote,)):
        with pytest.raises(ValueError, match="final_stage_id"):
            await remote.add_request_async("x", final_stage_id=5)
        first, *_ = [await remote.add_request_async(p) for p in "abc"]  # started, waiting, queued
        with pytest.raises(Overloaded) as shed:
            await remote.add_request_async("d")
        assert shed.value.retry_after > 0
        await trio_until(lambda: remote.shedding, "the head's state pushed to the front")
        remote.abort(first.request_id)
        got = [m async for m in first]
        assert isinstance(got[-1], OrchError) and got[-1].kind == "aborted"
        await remote.pause_async("keep")
        await trio_until(lambda: remote.paused == "keep", "the pause pushed to the front")
        await remote.resume_async()


async def test_request_ids_are_the_heads_unique_across_fronts() -> None:
    async with served(toy_pipeline(token_delay=0.0, audio_delay=0.0), fronts=2) as (_engine, host, remotes):
        ids = set()
        async with trio.open_nursery() as nursery:
            async def one(remote: RemoteEngine) -> None:
                handle = await remote.add_request_async("hello there")
                ids.add(handle.request_id)
                msgs = [m async for m in handle]
                assert msgs[-1].finished and isinstance(msgs[-1], OrchOutput)

            for i in range(8):
                nursery.start_soon(one, remotes[i % 2])
        assert len(ids) == 8
        assert [slot.requests for slot in host.slots] == [4, 4]
        with pytest.raises(ValueError, match="duplicate request id"):  # an id another front holds
            h = await remotes[0].add_request_async("x", request_id="dup")
            await remotes[1].add_request_async("y", request_id="dup")
        h.close()


async def test_a_dropped_front_leaves_each_of_its_requests_aborted_once_and_the_other_front_serves() -> None:
    stage = ScriptedStage(0)
    async with served(static_pipeline([stage], {0}), fronts=2) as (engine, host, (a, b)):
        held = [await a.add_request_async(f"a{i}") for i in range(3)]
        other = await b.add_request_async("b0")
        host.slots[0].drop()  # front 0 died
        await trio_until(lambda: engine.demux.terminals_by_kind.get("aborted") == 3 == len(stage.aborts),
                         "three aborted terminals, then their aborts on the stage")
        assert sorted(stage.aborts) == sorted(h.request_id for h in held)
        await stage.emit(other.request_id, "done", finished=True)
        assert [m.finished async for m in other] == [True]


async def test_a_stranger_with_a_stale_ticket_never_becomes_a_peer() -> None:
    stage = ScriptedStage(0)
    async with served(static_pipeline([stage], {0})) as (_engine, host, (_remote,)):
        slot = host.slots[0]
        ctx = zmq.Context()
        try:
            rogue = RemoteEngine(ctx, slot.address, Security(b"x", ticket=b"0" * 64), name="rogue")
            async with trio.open_nursery() as nursery:
                nursery.start_soon(rogue.run)
                await trio_until(lambda: host.authenticator.refused.get("launch:stale_ticket", 0) >= 1,
                                 "the ZAP handler's refusal")
                assert not rogue.running and rogue.final_stage_ids == frozenset()  # never welcomed
                nursery.cancel_scope.cancel()
        finally:
            ctx.destroy(linger=0)
        assert slot.requests == 0


async def test_a_request_whose_engine_stops_ends_with_its_terminal_and_the_front_then_refuses() -> None:
    stage = ScriptedStage(0)
    async with served(static_pipeline([stage], {0})) as (engine, _host, (remote,)):
        handle = await remote.add_request_async("x")
        engine.request_stop(0)
        msgs = [m async for m in handle]
        assert isinstance(msgs[-1], OrchError) and msgs[-1].kind == "shutdown"
        await trio_until(lambda: not remote.running, "the head's stop pushed to the front")
        assert remote.closed_reason
        with pytest.raises(EngineClosed):
            await remote.add_request_async("y")


async def test_statistics_carry_every_fronts_http_counters_summed_by_the_head() -> None:
    stage = ScriptedStage(0)
    async with served(static_pipeline([stage], {0}), fronts=2) as (_engine, host, (a, b)):
        for i, remote in enumerate((a, b)):
            remote.front = FrontMetrics()
            remote.front.count("/v1/chat/completions", 200)
            remote.front.count_finished("stop")
            remote.front.rtf.observe(0.5 + i)
        stats = await a.stats_async()
        summed = FrontMetrics.summed([stats.fronts])
        assert summed.requests == {("/v1/chat/completions", 200): 2}
        assert summed.finished["stop"] == 2 and summed.rtf.count == 2 and summed.rtf.sum == 2.0
        text = render(stats, a.front).decode()
        assert 'trio_orch_http_requests_total{route="/v1/chat/completions",status="200"} 2.0' in text
        host.slots[1].drop()  # a front that leaves: its counters stay in the totals
        host.slots[1].reset()
        b.front.count("/v1/chat/completions", 200)  # (not asked any more)
        stats = await a.stats_async()
        assert FrontMetrics.summed([stats.fronts]).requests == {("/v1/chat/completions", 200): 2}


async def test_a_resumable_request_takes_its_segments_through_the_front() -> None:
    stage = ScriptedStage(0)
    async with served(static_pipeline([stage], {0})) as (_engine, _host, (remote,)):
        handle = await remote.add_request_async("first", resumable=True)
        await handle.update("second")
        await handle.update("third", final=True)
        await trio_until(lambda: stage.final_updates == [handle.request_id], "the last segment on the stage")
        assert stage.resumable == [handle.request_id]
        assert [seg for _, seg in stage.updates] == ["second", "third"]
        with pytest.raises(ValueError):  # an unknown request: the head's error, raised in the front
            await remote.update_request_async("nobody", "x")
        handle.abort()
        got = [m async for m in handle]
        assert isinstance(got[-1], OrchError) and got[-1].kind == "aborted"



def test_the_thread_adapter_hosts_a_remote_engine_for_asyncio_code() -> None:
    """``serve --api-server-count N --loop asyncio``: the front's RemoteEngine runs in the adapter's Trio
    thread, its asyncio forms as a local engine's; the head is another Trio run (here a thread)."""
    stage = ScriptedStage(0)
    handed: queue.SimpleQueue[Any] = queue.SimpleQueue()
    done = threading.Event()

    async def head() -> None:
        async with served(static_pipeline([stage], {0}), connect=False) as (engine, host, (remote,)):
            handed.put((trio.lowlevel.current_trio_token(), engine, host, remote))
            await trio.to_thread.run_sync(done.wait)

    thread = threading.Thread(target=trio.run, args=(head,))
    thread.start()
    token, head_engine, host, remote = handed.get(timeout=30)

    def emit(rid: str, data: Any, finished: bool = False) -> None:
        trio.from_thread.run(partial(stage.emit, rid, data, finished=finished), trio_token=token)

    async def use(engine: ThreadEngine) -> None:
        # a stream: the head's batches reach this loop, the terminal last
        gen = engine.generate_batches("hi")
        first = asyncio.ensure_future(gen.__anext__())
        await await_until(lambda: bool(stage.submissions), "the submit on the stage")
        rid = stage.submissions[0][0]
        emit(rid, np.ones(3, dtype=np.int16))
        assert np.array_equal((await first)[0].data, np.ones(3, dtype=np.int16))
        emit(rid, "done", finished=True)
        assert (await gen.__anext__())[-1].finished
        # a resumable request's segments, then an abort: one aborted terminal
        handle = await engine.add_request_async("first", resumable=True, want_timings=True)
        assert handle.rejection is None and handle.request_id != rid
        await handle.update("second", final=True)
        await await_until(lambda: stage.final_updates == [handle.request_id], "the segment on the stage")
        engine.abort(handle.request_id)
        got = [m async for m in handle]
        assert isinstance(got[-1], OrchError) and got[-1].kind == "aborted"
        # a client that leaves early: the head aborts its request
        left = engine.generate_batches("x")
        pending = asyncio.ensure_future(left.__anext__())
        await await_until(lambda: len(stage.submissions) == 3, "the third submit")
        pending.cancel()
        await await_until(lambda: head_engine.demux.terminals_by_kind.get("aborted") == 2, "its abort")
        with pytest.raises(ValueError, match="final_stage_id"):  # the head's refusal, raised here
            await engine.add_request_async("x", final_stage_id=5)
        stats = await engine.stats_async()
        assert stats.admitted == 3 and stats.terminals_by_kind == {"finished": 1, "aborted": 2}
        await engine.pause_async("keep")  # the control plane, through the adapter's executor form
        await await_until(lambda: engine.paused == "keep", "the pause pushed to the front")
        await engine.resume_async()

    try:
        engine = ThreadEngine.hosting(remote, startup_timeout=30, name="front 0")
        engine.start()
        try:
            assert engine.running and engine.final_stage_ids == {0}
            asyncio.run(use(engine))
            assert host.slots[0].requests == 4 and not host.slots[0].handles  # each ended in the head
        finally:
            engine.close()
        assert not engine.thread_alive
        with pytest.raises(EngineClosed):
            engine.abort("any")
    finally:
        done.set()
        thread.join(30)
    assert not thread.is_alive()

