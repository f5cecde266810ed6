"""Hostile HTTP clients for the chaos matrix: slow uploads and a request-smuggling attempt.

Raw sockets (trio), because the bytes on the wire are the attack:

* :func:`slow_uploads` -- connections that send a chat request's head with
  ``Content-Length: 100`` and then one body byte a second, as many as the
  server reads bodies at once (``--max-body-reads``): without a minimum body
  rate they hold every read slot for the body timeout and every POST waits;
* :func:`smuggle` -- a POST with both ``Content-Length`` and
  ``Transfer-Encoding: chunked`` whose body is ``0\\r\\n\\r\\n`` followed by a
  ``GET /v1/models``: the server must answer the POST 400 and close the
  connection, never serving the request hidden in its body (RFC 9112 6.3).

Each returns what the attackers saw; :class:`~bench.chaos.server.HttpFault`
runs them beside its load and turns that into the row.
"""

from __future__ import annotations

import re
from urllib.parse import urlsplit

import trio

__all__ = ["SMUGGLED", "SlowUploads", "slow_uploads", "smuggle", "statuses"]

#: the request hidden in the smuggling attempt's body
SMUGGLED = b"GET /v1/models HTTP/1.1\r\nhost: chaos\r\n\r\n"
_TIMEOUT = 30.0


def statuses(reply: bytes) -> list[int]:
    """The status of every response in ``reply`` (raw bytes of one connection)."""
    return [int(m) for m in re.findall(rb"^HTTP/1\.[01] (\d{3}) ", reply, re.M)]


def _address(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    return parts.hostname or "127.0.0.1", parts.port or 80


def _post_head(length: int, *extra: bytes) -> bytes:
    return b"\r\n".join([b"POST /v1/chat/completions HTTP/1.1", b"host: chaos",
                         b"content-type: application/json", b"content-length: %d" % length, *extra,
                         b"", b""])


class SlowUploads:
    """What :func:`slow_uploads` saw: each attacker's answer (a status, or ``none`` if it got none)."""

    def __init__(self) -> None:
        self.answers: dict[str, int] = {}
        self.started = 0  #: attackers whose head and first byte went out

    def count(self, answer: str) -> None:
        self.answers[answer] = self.answers.get(answer, 0) + 1


async def slow_uploads(url: str, n: int, stop: trio.Event, seen: SlowUploads, byte_every: float = 1.0
                       ) -> None:
    """``n`` uploads of a 100-byte body, one byte each ``byte_every`` seconds, until answered or ``stop``."""
    host, port = _address(url)

    async def one() -> None:
        reply = b""
        try:
            stream = await trio.open_tcp_stream(host, port)
        except OSError:
            seen.count("refused")
            return
        async with stream:
            try:
                await stream.send_all(_post_head(100) + b"{")
                seen.started += 1
                while not stop.is_set():
                    with trio.move_on_after(byte_every) as waited:
                        chunk = await stream.receive_some(65536)
                        if not chunk:
                            break
                        reply += chunk
                    if waited.cancelled_caught:
                        await stream.send_all(b" ")
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                pass  # reset after its answer: what was read still counts
        got = statuses(reply)
        seen.count(str(got[0]) if got else "none")

    async with trio.open_nursery() as nursery:
        for _ in range(n):
            nursery.start_soon(one)


async def smuggle(url: str, n: int) -> dict[str, int]:
    """``n`` smuggling attempts, one after the other; how each ended.

    ``refused``: one 400 and the connection closed (right); ``served``: more
    than one answer came (the hidden request was served); ``kept``: one
    answer but the connection stayed open; ``other``: anything else.
    """
    host, port = _address(url)
    body = b"0\r\n\r\n" + SMUGGLED
    attempt = _post_head(len(body), b"transfer-encoding: chunked") + body
    seen: dict[str, int] = {}
    for _ in range(n):
        reply = b""
        closed = False
        with trio.move_on_after(_TIMEOUT):
            try:
                async with await trio.open_tcp_stream(host, port) as stream:
                    await stream.send_all(attempt)
                    while chunk := await stream.receive_some(65536):
                        reply += chunk
                    closed = True
            except (trio.BrokenResourceError, OSError):
                closed = True
        got = statuses(reply)
        kind = ("served" if len(got) > 1 else "refused" if got == [400] and closed
                else "kept" if got == [400] else "other")
        seen[kind] = seen.get(kind, 0) + 1
    return seen
