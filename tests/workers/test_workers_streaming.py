"""Resumable requests through real worker processes: more input mid-request, in both modes.

Every pipeline is opened with ``checked_pipeline`` (no process, ipc file or fd
survives it); every test also asks the workers themselves (``stats`` RPC)
that no request or session is left on them.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import trio

from stages.config import echo_config
from tests.workers.test_workers import checked_pipeline, tiny_speech_config
from trio_orch import OrchError, Orchestrator, OrchOutput
from trio_orch.cluster.launcher import Pipeline
from trio_orch.types import Message, StageUnavailable

pytestmark = pytest.mark.processes  # real worker processes or servers

TOKENS = 12  # tiny thinker: exactly this many tokens per segment
SAMPLES_PER_TOKEN = 2 * 12  # talker frames per token x vocoder hop


async def until_segment_done(orch: Orchestrator, stage_ids: tuple[int, ...],
                             timeout: float = 30) -> list[Message]:
    """Outputs up to the ones closing the current segment at every stage of ``stage_ids`` (or a terminal).

    Each final stage closes it in its own message, in no fixed order: with async chunks, stage 0 sends its
    last chunk downstream before its own close, so the last stage's close may reach the head first.
    """
    msgs: list[Message] = []
    open_at = set(stage_ids)
    with trio.fail_after(timeout):
        while open_at:
            m = await orch.next_output()
            msgs.append(m)
            if m.finished:
                break
            if isinstance(m, OrchOutput) and m.segment_done:
                open_at.discard(m.stage_id)
    return msgs


async def until_terminal(orch: Orchestrator, timeout: float = 30) -> list[Message]:
    msgs: list[Message] = []
    with trio.fail_after(timeout):
        while not (msgs and msgs[-1].finished):
            msgs.append(await orch.next_output())
    return msgs


async def worker_stats(pipe: Pipeline) -> list[dict[str, Any]]:
    return [await c.rpc("stats") for pool in pipe.stages for c in pool.replicas]


async def nothing_left(pipe: Pipeline) -> list[dict[str, Any]]:
    """Wait until every worker holds no request and no session; return their stats."""
    with trio.fail_after(10):
        while True:
            stats = await worker_stats(pipe)
            if all(s["active"] == s["waiting"] == s["sessions"] == 0 for s in stats):
                return stats
            await trio.sleep(0.02)


@pytest.mark.slow
@pytest.mark.parametrize("async_chunk", [False, True], ids=["normal", "async_chunk"])
async def test_three_segments_each_answered_with_text_and_audio_before_the_next(async_chunk: bool) -> None:
    async with checked_pipeline(tiny_speech_config(async_chunk=async_chunk)) as pipe:
        orch = Orchestrator(pipe.stages, **pipe.orchestrator_kwargs())
        async with trio.open_nursery() as nursery:
            await nursery.start(orch.run)
            await orch.add_request("r1", "Hello", resumable=True)
            per_segment = [await until_segment_done(orch, (0, 2))]
            await orch.update_request("r1", "how are you")
            per_segment.append(await until_segment_done(orch, (0, 2)))
            await orch.update_request("r1", "bye", final=True)
            per_segment.append(await until_terminal(orch))
            stats = await nothing_left(pipe)
            await orch.shutdown()
    for i, msgs in enumerate(per_segment):
        assert all(isinstance(m, OrchOutput) for m in msgs), msgs
        assert {m.segment for m in msgs} == {i}  # nothing of a later segment came early
        text = "".join(m.data["text"] for m in msgs if m.stage_id == 0)
        assert len(text) == TOKENS and text.isprintable()
        pcm = np.concatenate([m.data["pcm"] for m in msgs if m.stage_id == 2])
        assert len(pcm) == TOKENS * SAMPLES_PER_TOKEN and np.abs(pcm).max() > 0.01
        assert sorted(m.stage_id for m in msgs if m.segment_done) == [0, 2]  # one close per final stage
    assert sum(m.finished for msgs in per_segment for m in msgs) == 1
    assert per_segment[-1][-1].finished
    assert [s["updates"] for s in stats] == [2, 2, 2]  # each stage got both later segments
    assert [s["segments_finished"] for s in stats] == [3, 3, 3]
    assert [s["submits"] for s in stats] == [1, 1, 1]  # one request, never restarted


@pytest.mark.slow
@pytest.mark.parametrize("async_chunk", [False, True], ids=["normal", "async_chunk"])
async def test_segments_sent_at_once_are_answered_in_order_and_an_empty_one_closes_the_input(
        async_chunk: bool) -> None:
    """Updates that arrive while earlier segments still run wait their turn on every stage;
    a None segment is empty: every stage closes it without new output."""
    async with checked_pipeline(tiny_speech_config(async_chunk=async_chunk)) as pipe:
        orch = Orchestrator(pipe.stages, **pipe.orchestrator_kwargs())
        async with trio.open_nursery() as nursery:
            await nursery.start(orch.run)
            await orch.add_request("r1", "one", resumable=True)
            await orch.update_request("r1", "two")
            await orch.update_request("r1", None, final=True)
            msgs = await until_terminal(orch)
            await nothing_left(pipe)
            await orch.shutdown()
    assert all(isinstance(m, OrchOutput) for m in msgs), msgs
    for stage in (0, 2):
        mine = [m for m in msgs if m.stage_id == stage]
        assert [m.segment for m in mine] == sorted(m.segment for m in mine)  # never interleaved
        assert [m.segment for m in mine if m.segment_done] == [0, 1, 2]
    text = ["".join(m.data["text"] for m in msgs if m.stage_id == 0 and m.segment == s and m.data)
            for s in range(3)]
    assert [len(t) for t in text] == [TOKENS, TOKENS, 0]
    pcm = [sum(len(m.data["pcm"]) for m in msgs if m.stage_id == 2 and m.segment == s and m.data)
           for s in range(3)]
    assert pcm == [TOKENS * SAMPLES_PER_TOKEN] * 2 + [0]


@pytest.mark.slow
@pytest.mark.parametrize(("async_chunk", "parked"), [(False, True), (True, False)],
                         ids=["normal-between_segments", "async_chunk-mid_segment"])
async def test_abort_mid_session_leaves_nothing_on_any_worker(async_chunk: bool, parked: bool) -> None:
    async with checked_pipeline(tiny_speech_config(async_chunk=async_chunk)) as pipe:
        orch = Orchestrator(pipe.stages, **pipe.orchestrator_kwargs())
        async with trio.open_nursery() as nursery:
            await nursery.start(orch.run)
            await orch.add_request("r1", "Hello", resumable=True)
            await until_segment_done(orch, (0, 2))
            if not parked:
                await orch.update_request("r1", "more to say")
                with trio.fail_after(30):
                    while (await orch.next_output()).segment == 0:
                        pass
            before = await worker_stats(pipe)
            await orch.abort("r1")
            msgs = await until_terminal(orch)
            stats = await nothing_left(pipe)
            await orch.shutdown()
    assert isinstance(msgs[-1], OrchError) and msgs[-1].kind == "aborted"
    assert all(s["sessions"] == 1 for s in before)  # it was held on every stage ...
    assert all(s["aborts"] == 1 for s in stats)  # ... and the abort reached every one


async def test_the_pool_sends_updates_to_the_bound_replica_and_refuses_bad_ones() -> None:
    cfg = echo_config(1, replicas=2, outputs=2)
    async with checked_pipeline(cfg) as pipe:
        pool = pipe.stages[0]  # nobody calls receive(): every request stays bound
        await pool.submit("plain", "x")
        await pool.submit("a", "a0", resumable=True)
        await pool.submit("b", "b0", resumable=True)
        where = pool.replica_of("b")
        with pytest.raises(ValueError, match="not submitted as resumable"):
            await pool.update("plain", "y")
        with pytest.raises(StageUnavailable, match="not active here"):
            await pool.update("nobody", "y")
        await pool.update("b", "b1", final=True)
        with pytest.raises(ValueError, match="final segment"):
            await pool.update("b", "b2")
        with trio.fail_after(10):
            while (await pool.replicas[where].rpc("stats"))["updates"] < 1:
                await trio.sleep(0.01)
        other = (await pool.replicas[1 - where].rpc("stats"))["updates"]
    assert pool.replica_of("a") != where and other == 0


async def test_a_session_stays_bound_across_segments_and_is_released_after_the_final_one() -> None:
    async with checked_pipeline(echo_config(2, outputs=2, final_stage_ids=[1])) as pipe:
        orch = Orchestrator(pipe.stages, **pipe.orchestrator_kwargs())
        async with trio.open_nursery() as nursery:
            await nursery.start(orch.run)
            await orch.add_request("r1", "a", resumable=True)
            first = await until_segment_done(orch, (1,))
            bound = [pool.replica_of("r1") for pool in pipe.stages]
            await orch.update_request("r1", "b", final=True)
            rest = await until_terminal(orch)
            released = [pool.replica_of("r1") for pool in pipe.stages]
            await orch.shutdown()
    assert bound == [0, 0] and released == [None, None]
    assert [m.data for m in first] == ["a", "a"] and [m.data for m in rest] == ["b", "b"]
    assert rest[-1].finished and not any(m.finished for m in first)


def test_the_asyncio_twin_client_streams_segments_to_a_worker_too() -> None:
    """bench/'s asyncio ZMQ client submits resumable requests and sends updates like the Trio one."""
    import asyncio

    from bench.refs.launcher import open_worker_stages

    async def main() -> list[list[tuple[Any, bool]]]:
        async with asyncio.timeout(30), open_worker_stages(echo_config(1, outputs=2)) as (client,):
            await client.submit("r1", "a", resumable=True)
            segments: list[list[tuple[Any, bool]]] = []
            for update in ("b", None):
                got: list[tuple[Any, bool]] = []
                while not (got and got[-1][1]):  # a segment ends with a finished output
                    got.extend((out.data, out.finished) for out in await client.receive())
                segments.append(got)
                if update is not None:
                    await client.update("r1", update, final=True)
            await client.aclose()
            with pytest.raises(StageUnavailable, match="closed"):
                await client.update("r1", "late")
            return segments

    assert asyncio.run(main()) == [[("a", False), ("a", True)], [("b", False), ("b", True)]]
