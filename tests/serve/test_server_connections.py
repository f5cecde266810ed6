"""How each front ends a response on the wire: raw HTTP/1.1 clients over loopback, both fronts.

Client libraries keep connections alive and stop reading at the end of the
body, so they miss a server that never closes a ``Connection: close``
connection or never re-arms its keep-alive timer after a streamed answer.
These clients read raw bytes to the end of the connection instead.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator

import pytest
import trio

from tests.http_helpers import FRONTS, HANG, Served, TrioServed, chat, deltas, serve, sse_events
from trio_orch.http.limits import HTTPLimits
from trio_orch.testing.toy_pipeline import toy_pipeline

END = b"\r\n0\r\n\r\n"  # the last chunk of a chunked body


def request(body: dict, *, close: bool) -> bytes:
    """A whole POST to the chat route -- head and body -- as one buffer (one write)."""
    data = json.dumps(body).encode()
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nhost: test\r\ncontent-type: application/json\r\n"
            f"content-length: {len(data)}\r\n" + ("connection: close\r\n" if close else "") + "\r\n")
    return head.encode() + data


def read_to_eof(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (socket.timeout if it never does)."""
    sock.settimeout(HANG)
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def read_stream(sock: socket.socket) -> bytes:
    """One streamed answer on a kept-alive connection: up to the end of its chunked body."""
    sock.settimeout(HANG)
    data = b""
    while not (b"data: [DONE]" in data and data.endswith(END)):
        chunk = sock.recv(65536)
        assert chunk, f"the server closed a kept-alive connection mid-answer: {data[-200:]!r}"
        data += chunk
    return data


@pytest.fixture(scope="module", params=FRONTS)
def served(request: pytest.FixtureRequest) -> Iterator[Served | TrioServed]:
    s = serve(request.param, toy_pipeline(token_delay=0.001, audio_delay=0.001),
              limits=HTTPLimits(keep_alive_timeout=0.5, header_timeout=0.5))
    yield s
    s.stop()


@pytest.mark.parametrize("stream", [True, False])
def test_connection_close_in_one_write_gets_the_whole_answer_and_the_close(served: Served | TrioServed,
                                                                           stream: bool) -> None:
    before = served.front.disconnects
    with socket.create_connection(("127.0.0.1", served.port)) as sock:
        sock.sendall(request(chat("close after this", stream=stream), close=True))
        data = read_to_eof(sock)
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200")
    if stream:
        assert body.endswith(END)
        events = sse_events(iter(body.decode().splitlines()))
        assert events[-1] == "[DONE]"
        assert "".join(d.get("content", "") for d in deltas(events)) == "You said: close after this"
    else:
        answer = json.loads(body)
        assert answer["choices"][0]["message"]["content"] == "You said: close after this"
    assert served.front.disconnects == before  # a finished answer is not a client that left


def test_a_kept_alive_connection_serves_streams_back_to_back_then_times_out_idle(
        served: Served | TrioServed) -> None:
    before = served.front.disconnects
    with socket.create_connection(("127.0.0.1", served.port)) as sock:
        for i in range(3):
            sock.sendall(request(chat(f"turn {i}", stream=True), close=False))
            assert read_stream(sock).startswith(b"HTTP/1.1 200")
        # idle after a streamed answer: the server's keep-alive timer closes the connection
        assert read_to_eof(sock) == b""
    assert served.front.disconnects == before


async def _client(port: int, body: dict, requests: int, *, close: bool) -> int:
    """``requests`` streamed answers, each to its end; one connection each (close) or one for all."""
    done = 0
    stream = None
    try:
        for _ in range(requests):
            if stream is None:
                stream = await trio.open_tcp_stream("127.0.0.1", port)
            await stream.send_all(request(body, close=close))
            data = b""
            while not (b"data: [DONE]" in data and data.endswith(END)):
                chunk = await stream.receive_some(65536)
                assert chunk, f"the server closed the connection mid-answer: {data[:200]!r}"
                data += chunk
                assert data[:12] in b"HTTP/1.1 200", data[:200]
            if close:
                while await stream.receive_some(65536):
                    pass  # the server closes it
                await stream.aclose()
                stream = None
            done += 1
    finally:
        if stream is not None:
            await stream.aclose()
    return done


@pytest.mark.slow
@pytest.mark.parametrize("front", FRONTS)
def test_concurrent_streaming_clients_over_worker_processes_all_finish(front: str) -> None:
    from stages.config import echo_config
    from trio_orch.cluster.launcher import open_pipeline

    clients, each = 32, 4
    s = serve(front, lambda: open_pipeline(echo_config(3, outputs=4)),
              engine_options={"request_queue_size": 4 * clients})
    try:
        finished: list[int] = []

        async def main() -> None:
            with trio.fail_after(120):  # a generous bound: a stalled stream fails, a slow box does not
                async with trio.open_nursery() as nursery:
                    for i in range(clients):
                        async def one(i: int = i) -> None:
                            body = chat(f"client {i}", stream=True, modalities=["text", "audio"])
                            finished.append(await _client(s.port, body, each, close=bool(i % 2)))
                        nursery.start_soon(one)

        trio.run(main)
        assert finished == [each] * clients
        assert s.front.disconnects == 0
    finally:
        s.stop()
