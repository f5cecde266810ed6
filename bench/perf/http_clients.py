"""The load generator's HTTP/1.1 clients: raw requests on non-blocking sockets, little CPU each.

On a 2-core box the load generator shares the cores with the server: an
asyncio client spent as much CPU on a burst as the server and its workers
together.  These speak raw HTTP/1.1 (``connection: close``), one epoll per
process, and time a request from the moment it was written.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import select
import socket
import time
from collections.abc import Callable
from typing import Any

from bench.perf.serving import split_url

__all__ = ["at_once", "burst_client", "idle_client", "one_request", "raw_request", "waiting_client"]


def at_once(host: str, port: int, n: int, request: bytes, timeout: float = 120.0) -> list[tuple[int, float]]:
    """``n`` fresh connections at once, each writing ``request``: [(status, seconds), ...], 0 if cut.

    Seconds run from writing the request to the end of the answer (the
    server's FIN).  Minimal Python per connection, so that the client takes
    little of the CPU it shares with the server.
    """
    ep = select.epoll()
    conns: dict[int, list[Any]] = {}  # fd -> [socket, time written (0: not yet), answer]
    out: list[tuple[int, float]] = []
    for _ in range(n):
        s = socket.socket()
        s.setblocking(False)
        s.connect_ex((host, port))
        conns[s.fileno()] = [s, 0.0, bytearray()]
        ep.register(s.fileno(), select.EPOLLOUT)
    end = time.perf_counter() + timeout

    def done(fd: int, status: int) -> None:
        c = conns.pop(fd)
        out.append((status, time.perf_counter() - (c[1] or time.perf_counter())))
        ep.unregister(fd)
        c[0].close()

    while conns and time.perf_counter() < end:
        for fd, _ev in ep.poll(1.0):
            c = conns[fd]
            if not c[1]:  # connected (or failed): write the request
                try:
                    c[0].sendall(request)
                except OSError:
                    done(fd, 0)
                    continue
                c[1] = time.perf_counter()
                ep.modify(fd, select.EPOLLIN)
                continue
            try:
                data = c[0].recv(65536)
            except OSError:
                done(fd, 0)
                continue
            if data:
                c[2] += data
                continue
            m = re.match(rb"HTTP/1\.1 (\d+)", bytes(c[2][:12]))
            done(fd, int(m.group(1)) if m else 0)
    for fd in list(conns):
        done(fd, 0)
    ep.close()
    return out


def raw_request(host: str, body: bytes) -> bytes:
    return (f"POST /v1/chat/completions HTTP/1.1\r\nhost: {host}\r\nconnection: close\r\n"
            f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n").encode() + body


def burst_client(url: str, n: int, body: bytes, out: Any, cpus: set[int] | None = None) -> None:
    """A client process: ``n`` requests at once; puts [(status, seconds), ...] on ``out``."""
    if cpus:
        os.sched_setaffinity(0, cpus)
    host, port = split_url(url)
    out.put(at_once(host, port, n, raw_request(host, body)))


def idle_client(url: str, n: int, ready: Any, done: Any) -> None:
    """Hold ``n`` idle connections until told to stop."""
    host, port = split_url(url)

    async def run() -> None:
        conns = []
        for _ in range(n):
            try:
                conns.append(await asyncio.open_connection(host, port))
            except OSError:
                break
        ready.put(len(conns))
        await asyncio.get_running_loop().run_in_executor(None, done.get)
        for _, w in conns:
            w.close()

    asyncio.run(run())


def one_request(host: str, port: int, request: bytes, after_write: Callable[[], None] | None = None,
                timeout: float = 120.0) -> tuple[int, float, Any]:
    """One request on a fresh connection: (status, seconds from writing it to the end of the answer,
    the answer's JSON or None).  ``after_write`` runs right after the request was written."""
    with socket.create_connection((host, port), timeout=timeout) as s:
        t0 = time.perf_counter()
        s.sendall(request)
        if after_write is not None:
            after_write()
        data = bytearray()
        while chunk := s.recv(65536):
            data += chunk
        took = time.perf_counter() - t0
    head, _, body = bytes(data).partition(b"\r\n\r\n")
    m = re.match(rb"HTTP/1\.1 (\d+)", head)
    try:
        payload = json.loads(body)
    except ValueError:
        payload = None
    return (int(m.group(1)) if m else 0), took, payload


def waiting_client(url: str, n: int, body: bytes, go: Any, out: Any, cpus: set[int] | None = None) -> None:
    """A client process: ``n`` requests at once each time ``go`` is set (until terminated)."""
    if cpus:
        os.sched_setaffinity(0, cpus)
    host, port = split_url(url)
    request = raw_request(host, body)
    while True:
        go.wait()
        go.clear()
        out.put(at_once(host, port, n, request))
