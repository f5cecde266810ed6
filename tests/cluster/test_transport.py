"""The Trio ZMQ stage client against a raw ZMQ peer standing in for a worker."""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import AsyncIterator, Iterator

import pytest
import trio
import trio.testing
import zmq

from stages.wire import (
    Abort,
    Dying,
    InboundMsg,
    OutboundMsg,
    OutItem,
    Outputs,
    Ready,
    Rpc,
    RpcReply,
    Submit,
    Submits,
    WireCodec,
)
from trio_orch.cluster.transport import ReplicaDied, RpcError, ZmqStageClient
from trio_orch.types import StageUnavailable


@pytest.fixture
def ctx() -> Iterator[zmq.Context]:
    c = zmq.Context()
    yield c
    c.destroy(linger=0)


@pytest.fixture
def addr(tmp_path: object) -> str:
    return f"ipc://{tmp_path}/client.sock"


class Peer:
    """The worker side of the socket, driven synchronously by the test."""

    def __init__(self, ctx: zmq.Context, addr: str) -> None:
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.linger = 0
        self.sock.connect(addr)
        self.out = WireCodec(OutboundMsg)
        self.inc = WireCodec(InboundMsg)

    def send(self, msg: object) -> None:
        self.sock.send_multipart(self.out.encode(msg), copy=False)  # type: ignore[arg-type]

    def recv(self, timeout_ms: int = 5000) -> object:
        assert self.sock.poll(timeout_ms), "nothing arrived at the peer"
        return self.inc.decode(self.sock.recv_multipart())


@pytest.fixture
async def client_peer(ctx: zmq.Context, addr: str) -> AsyncIterator[tuple[ZmqStageClient, Peer]]:
    async with trio.open_nursery() as nursery:
        client = ZmqStageClient(ctx, addr, name="test-client")
        await nursery.start(client.run)
        peer = Peer(ctx, addr)
        yield client, peer
        await client.aclose()
        peer.sock.close()


async def receive_n(client: ZmqStageClient, n: int) -> list:
    got: list = []
    with trio.fail_after(30):
        while len(got) < n:
            got.extend(await client.receive())
    return got


async def test_submit_reaches_the_peer_and_outputs_come_back(client_peer) -> None:
    client, peer = client_peer
    peer.send(Ready(0, 0, os.getpid(), "echo"))
    with trio.fail_after(5):
        ready = await client.wait_ready()
    assert ready.kind == "echo"
    await client.submit("r1", {"x": 1}, downstream=2)
    msg = await trio.to_thread.run_sync(peer.recv)
    assert msg == Submit("r1", {"x": 1}, 2)
    peer.send(Outputs([OutItem("r1", "a"), OutItem("r1", "b", True)]))
    outs = await receive_n(client, 2)
    assert [(o.request_id, o.data, o.finished) for o in outs] == [("r1", "a", False), ("r1", "b", True)]


async def test_burst_of_10000_messages_has_no_missed_wakeup(client_peer) -> None:
    client, peer = client_peer
    n = 10_000
    peer.sock.sndtimeo = 10_000  # if the client stops draining, the thread gives up instead of hanging

    def blast() -> None:  # blocking sends from a thread, as fast as ZMQ takes them
        try:
            for i in range(n):
                peer.send(Outputs([OutItem(f"r{i}", i)]))
        except zmq.Again:
            pass

    thread = threading.Thread(target=blast)
    thread.start()
    try:
        outs = await receive_n(client, n)
    finally:
        thread.join()
    assert [o.data for o in outs] == list(range(n))
    assert client.messages_in == n


async def test_sends_interleaved_with_receives_do_not_lose_wakeups(client_peer) -> None:
    """A send can consume the fd's edge; the owner must drain after sending too."""
    client, peer = client_peer

    def echo_back() -> None:
        for _ in range(500):
            msg = peer.recv()
            peer.send(Outputs([OutItem(msg.request_id, msg.payload, True)]))  # type: ignore[attr-defined]

    thread = threading.Thread(target=echo_back)
    thread.start()
    try:
        for i in range(500):
            await client.submit(f"r{i}", i)
            (out,) = await receive_n(client, 1)
            assert out.data == i
    finally:
        thread.join()


async def test_garbage_frame_is_logged_counted_and_the_socket_keeps_working(client_peer, caplog) -> None:
    client, peer = client_peer
    caplog.set_level(logging.ERROR, logger="trio_orch.cluster.transport")
    peer.sock.send_multipart([b"\xc1\xc1 definitely not msgpack", b"junk"])
    peer.send(Outputs([OutItem("r1", "after the garbage", True)]))
    (out,) = await receive_n(client, 1)
    assert out.data == "after the garbage"
    assert client.garbage_frames == 1
    assert any("garbage" in r.getMessage() and "test-client" in r.getMessage() for r in caplog.records)
    await client.submit("r2", 2)  # sending still works too
    assert (await trio.to_thread.run_sync(peer.recv)) == Submit("r2", 2)


async def test_cancellation_while_waiting_on_the_fd_closes_the_socket(ctx: zmq.Context, addr: str) -> None:
    client = ZmqStageClient(ctx, addr)
    with trio.CancelScope() as scope:
        async with trio.open_nursery() as nursery:
            await nursery.start(client.run)
            await trio.testing.wait_all_tasks_blocked()  # the owner sits in wait_readable
            scope.cancel()
    assert client.sock.closed
    assert not os.path.exists(addr[len("ipc://"):])
    with pytest.raises(StageUnavailable):
        await client.submit("r", 1)
    with pytest.raises(ReplicaDied):
        await client.receive()


async def test_aclose_from_another_task_wakes_the_owner(ctx: zmq.Context, addr: str) -> None:
    client = ZmqStageClient(ctx, addr)
    async with trio.open_nursery() as nursery:
        await nursery.start(client.run)
        await trio.testing.wait_all_tasks_blocked()
        with trio.fail_after(5):
            await client.aclose()  # notify_closing: the owner leaves wait_readable and closes
    assert client.sock.closed


async def test_dying_sentinel_delivers_earlier_outputs_then_raises(client_peer) -> None:
    client, peer = client_peer
    peer.send(Outputs([OutItem("r1", "last words")]))
    peer.send(Dying("out of memory"))
    (out,) = await receive_n(client, 1)
    assert out.data == "last words"
    with pytest.raises(ReplicaDied, match="out of memory"):
        await client.receive()
    with pytest.raises(StageUnavailable, match="dead"):
        await client.submit("r2", 1)


async def test_missed_heartbeats_mark_the_replica_dead(ctx: zmq.Context, addr: str,
                                                       autojump_clock: trio.testing.MockClock) -> None:
    client = ZmqStageClient(ctx, addr, heartbeat_timeout=5.0)
    peer = Peer(ctx, addr)
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(client.run)
            peer.send(Ready(0, 0, os.getpid(), "echo"))
            await client.wait_ready()
            with pytest.raises(ReplicaDied, match="missed heartbeats"):
                await client.receive()  # nothing more comes: the clock jumps past the timeout
            assert trio.current_time() >= 5.0
            await client.aclose()
    finally:
        peer.sock.close()


async def test_rpc_round_trip(client_peer) -> None:
    client, peer = client_peer

    def answer() -> None:
        call = peer.recv()
        peer.send(RpcReply(call.call_id, {"method": call.method}))  # type: ignore[attr-defined]

    thread = threading.Thread(target=answer)
    thread.start()
    try:
        assert await client.rpc("health") == {"method": "health"}
    finally:
        thread.join()


async def test_rpc_arguments_errors_timeouts_and_acknowledged_aborts(client_peer) -> None:
    client, peer = client_peer
    seen: list[object] = []

    def answer() -> None:
        call = peer.recv()  # an rpc with arguments: answered with an error
        seen.append(call)
        peer.send(RpcReply(call.call_id, None, "sleep: ValueError: bad level"))  # type: ignore[attr-defined]
        abort = peer.recv()  # an abort asking for a confirmation
        seen.append(abort)
        peer.send(RpcReply(abort.ack, ["r1"]))  # type: ignore[attr-defined]
        seen.append(peer.recv())  # the third call is never answered

    thread = threading.Thread(target=answer)
    thread.start()
    try:
        with pytest.raises(RpcError, match="bad level"):
            await client.rpc("sleep", [3], {"now": True})
        assert await client.abort_confirmed(["r1", "r2"]) == ["r1"]
        with pytest.raises(TimeoutError, match=r"no answer within 0\.2s"):
            await client.rpc("health", timeout=0.2)
    finally:
        thread.join()
    assert seen[0] == Rpc(seen[0].call_id, "sleep", [3], {"now": True})  # type: ignore[attr-defined]
    assert seen[1] == Abort(["r1", "r2"], seen[1].ack) and seen[1].ack  # type: ignore[attr-defined]
    assert seen[2].method == "health"  # type: ignore[attr-defined]


async def test_submits_to_a_busy_replica_from_one_pass_leave_as_one_message(client_peer) -> None:
    """Idle replica: a submit is sent from the caller (no owner wake-up).  Busy replica: held for the
    owner's next turn, and everything held by then leaves as one ``Submits`` message; any other message
    sends the held ones first.  Counted in messages, never timed."""
    client, peer = client_peer
    peer.send(Ready(0, 0, os.getpid(), "echo"))
    with trio.fail_after(5):
        await client.wait_ready()
    await trio.testing.wait_all_tasks_blocked()  # the owner waits on the socket
    client.submit_nowait("r0", 0)
    assert client.messages_out == 1  # sent before any checkpoint: the replica held nothing
    seen: list[int] = []
    go = trio.Event()

    async def submitter(i: int) -> None:
        await go.wait()
        client.submit_nowait(f"b{i}", i)
        seen.append(client.messages_out)

    async with trio.open_nursery() as nursery:  # five tasks submit in the same scheduler pass
        for i in range(5):
            nursery.start_soon(submitter, i)
        await trio.testing.wait_all_tasks_blocked()
        go.set()
    assert seen == [1] * 5  # r0 is working: every one of them was held
    await trio.testing.wait_all_tasks_blocked()
    assert client.messages_out == 2  # ... and they left together, at the owner's turn
    first = await trio.to_thread.run_sync(peer.recv)
    burst = await trio.to_thread.run_sync(peer.recv)
    assert first == Submit("r0", 0)
    assert type(burst) is Submits  # (in the order the tasks ran: Trio shuffles a pass's batch)
    assert sorted(m.request_id for m in burst.items) == [f"b{i}" for i in range(5)]

    peer.send(Outputs([OutItem("r0", "x", True), *(OutItem(f"b{i}", "x", True) for i in range(5))]))
    await receive_n(client, 6)
    client.submit_nowait("r1", 1)
    assert client.messages_out == 3  # idle again once it finished everything: at once
    client.submit_nowait("r2", 2)  # r1 is working: held
    client.abort_nowait(["r1", "r2"])  # sends the held submit first, then the abort
    await trio.testing.wait_all_tasks_blocked()
    client.submit_nowait("r3", 3)  # aborted requests do not keep the replica busy: at once
    assert client.messages_out == 6
    got = [await trio.to_thread.run_sync(peer.recv) for _ in range(4)]
    assert [type(m).__name__ for m in got] == ["Submit", "Submit", "Abort", "Submit"]
    assert [getattr(m, "request_id", None) for m in got] == ["r1", "r2", None, "r3"]
