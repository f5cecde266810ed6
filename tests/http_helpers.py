"""What the HTTP tests share: the app under a real server on loopback (both fronts), SSE/metrics parsing.

``serve(front, factory)`` starts the one app (:func:`~trio_orch.http.app.create_app`)
the way ``trio-orch serve --loop FRONT`` does, with each front's own
``HTTPServer``: ``"asyncio"`` -- the thread adapter :class:`ThreadEngine` and
uvicorn with the serve command's settings (:class:`Served`); ``"trio"`` -- the
:class:`TrioEngine` and the lean Trio server in one Trio run
(:class:`TrioServed`, in a thread of its own so the test can be a plain
client).  The ``serving`` fixture (tests/conftest.py)
stops whatever a test started with it.
"""

from __future__ import annotations

import functools
import io
import json
import socket
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import replace
from functools import partial
from typing import Any

import httpx
import numpy as np
import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

from tests.waiting import HANG, wait_until  # the HTTP tests import them from here too
from trio_orch.engine import ThreadEngine, TrioEngine
from trio_orch.http.app import create_app
from trio_orch.http.limits import HTTPLimits
from trio_orch.http.metrics import FrontMetrics
from trio_orch.openai import audio_out
from trio_orch.serve import asyncio_front, trio_front


def listening_socket(backlog: int) -> socket.socket:
    """A loopback socket listening on a free port, as the serve command makes it."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(backlog)
    return sock


class Served:
    """A ThreadEngine + the app under uvicorn (the serve command's settings, head deadline) in a thread."""

    front_name = "asyncio"

    def __init__(self, engine: ThreadEngine, *, limits: HTTPLimits | None = None, max_connections: int = 1000,
                 model_name: str = "toy", **app_kwargs: Any) -> None:
        self.engine = engine
        self.limits = limits or HTTPLimits()
        self.front = FrontMetrics()
        self.sock = listening_socket(self.limits.backlog)
        connections = replace(self.limits, max_connections=max_connections)
        self.server = asyncio_front.HTTPServer(self.sock, connections)
        self.deadline = self.server.deadline  # uvicorn's head deadline (the tests watch its closes)
        more = app_kwargs.pop("extra_metrics", None)
        app = create_app(engine, model_name=model_name, limits=self.limits, front=self.front,
                         extra_metrics=lambda: {**(more() if more else {}), **self.server.counters()},
                         **app_kwargs)
        self.thread = threading.Thread(target=self.server.serve, args=(app,), daemon=True)
        self.thread.start()
        wait_until(lambda: self.server.started, "uvicorn started")
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"

    def open_connections(self) -> int:
        """HTTP connections uvicorn holds open now (a WebSocket session counts once upgraded)."""
        return self.server.open_connections()

    def stop(self) -> None:
        self.server.stop()
        self.thread.join(HANG)
        self.engine.close()
        assert not self.thread.is_alive()
        assert self.sock.fileno() == -1, "the listening socket was left open"


class TrioServed:
    """A TrioEngine + the app under the lean Trio server, in one Trio run (``serve --loop trio``)."""

    front_name = "trio"

    def __init__(self, factory: Any, *, engine_options: dict[str, Any] | None = None,
                 limits: HTTPLimits | None = None, model_name: str = "toy", **app_kwargs: Any) -> None:
        self.engine = TrioEngine(factory, **(engine_options or {}))
        self.limits = limits or HTTPLimits()
        self.front = FrontMetrics()
        app_kwargs.pop("max_connections", None)  # the threaded front's limit
        self.sock = listening_socket(self.limits.backlog)
        self.server = trio_front.HTTPServer(self.sock, self.limits, graceful_timeout=2.0)
        self.state = self.server.state
        more = app_kwargs.pop("extra_metrics", None)
        self.app_kwargs = {"model_name": model_name, "limits": self.limits, "front": self.front,
                           "extra_metrics": lambda: {**(more() if more else {}), **self.server.counters()},
                           **app_kwargs}
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._ready = threading.Event()
        self._token: trio.lowlevel.TrioToken | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._thread, daemon=True)
        self.thread.start()
        wait_until(self._ready.is_set, "the Trio front started")
        if self.error is not None:
            raise RuntimeError("the Trio front did not start") from self.error

    def _thread(self) -> None:
        try:
            trio.run(self._main)
        except BaseException as exc:
            self.error = exc
        finally:
            self._ready.set()

    async def _main(self) -> None:
        self._token = trio.lowlevel.current_trio_token()
        async with trio.open_nursery() as nursery:
            await nursery.start(self.engine.run)
            app = create_app(self.engine, **self.app_kwargs)
            await nursery.start(self.server.serve, app)
            self._ready.set()

    def _stop_both(self) -> None:
        """In the run: the server stops (its drain), and the engine with it."""
        self.server.stop()
        self.engine.request_stop()

    def open_connections(self) -> int:
        """HTTP connections the lean server holds open now (a WebSocket session counts)."""
        return self.server.open_connections()

    def stop(self) -> None:
        if self._token is not None:
            try:
                self._token.run_sync_soon(self._stop_both)
            except trio.RunFinishedError:
                pass
        self.thread.join(HANG)
        self.sock.close()
        assert not self.thread.is_alive()
        if self.error is not None:
            raise self.error


FRONTS = ("asyncio", "trio")


def serve(front: str, factory: Any, *, engine_options: dict[str, Any] | None = None,
          **served_kwargs: Any) -> Served | TrioServed:
    """The app over ``factory``'s pipeline behind ``front`` (one of :data:`FRONTS`), started.

    ``served_kwargs``: :func:`~trio_orch.http.app.create_app`'s arguments, ``limits`` and (asyncio
    only) ``max_connections``.
    """
    if front == "trio":
        return TrioServed(factory, engine_options=engine_options, **served_kwargs)
    return Served(ThreadEngine(factory, **(engine_options or {})).start(), **served_kwargs)


#: how long worker processes may take to start behind a test server (a loaded machine: torch imports)
WORKER_STARTUP = 120.0


def worker_server(front: str, config: Any, *, prepare: Callable[[Any], None] | None = None,
                  **served_kwargs: Any) -> Iterator[Served | TrioServed]:
    """``config``'s worker processes behind ``front`` (a generator: yields it started, stops it);
    none of them, nor a socket or file, is left after.  ``prepare(pipe)``: called with the running
    pipeline before it is served (a test's look at what crosses between stages).  ``served_kwargs``:
    as :func:`serve`'s (default ``model_name="tiny"`` and the config's output modalities)."""
    from contextlib import asynccontextmanager

    import pytest

    from trio_orch.cluster.launcher import open_pipeline
    from trio_orch.testing import LeakProbe

    probe = LeakProbe()

    @asynccontextmanager
    async def factory() -> Any:
        async with open_pipeline(config) as pipe:
            probe.saw(pipe.pids)
            probe.saw_dir(pipe.tmpdir)
            if prepare is not None:
                prepare(pipe)
            yield pipe

    # worker processes take longer to start than the helper's bound for an in-process one: both fronts
    # wait for them up to WORKER_STARTUP (the thread bridge's own timeout; the helper's wait for the run)
    options = {"startup_timeout": WORKER_STARTUP} if front == "asyncio" else {}
    kwargs = {"model_name": "tiny", "outputs": config.outputs(), **served_kwargs}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sys.modules[__name__], "wait_until", partial(wait_until, hang=WORKER_STARTUP))
        served = serve(front, factory, engine_options=options, **kwargs)
    try:
        yield served
    finally:
        served.stop()
    leaks = probe.leaks()
    assert leaks == {"processes": 0, "fds": 0, "ipc_files": 0}, leaks


def chat(text: str, **kw: Any) -> dict[str, Any]:
    return {"model": "toy", "messages": [{"role": "user", "content": text}], **kw}


def sse_events(lines: Iterator[str]) -> list[Any]:
    """Parse an SSE body into JSON objects, with the final ``[DONE]`` kept as the string."""
    events: list[Any] = []
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def deltas(events: list[Any]) -> list[dict[str, Any]]:
    return [e["choices"][0]["delta"] for e in events if isinstance(e, dict) and e.get("choices")]


def running_and_waiting(url: str, threads: list[threading.Thread], running: int, waiting: int,
                        model: str = "toy") -> list[tuple[float, float]]:
    """Start ``threads`` (each a request), read vLLM's running/waiting gauges until they show ``running``
    and ``waiting``, join the threads: every reading seen, the last one once all ended."""
    for t in threads:
        t.start()
    seen: list[tuple[float, float]] = []
    with httpx.Client(base_url=url, timeout=HANG) as c:
        def read() -> tuple[float, float]:
            m = metrics(c)
            seen.append((m[f"vllm:num_requests_running{{engine=0,model_name={model}}}"],
                         m[f"vllm:num_requests_waiting{{engine=0,model_name={model}}}"]))
            return seen[-1]

        wait_until(lambda: read() == (running, waiting), f"{running} running, {waiting} waiting")
        for t in threads:
            t.join(HANG * 4)
        read()
    return seen


def metrics(client: httpx.Client) -> dict[str, float]:
    """``/metrics`` parsed by prometheus_client's own parser, as ``name{label=value,...}`` -> value."""
    r = client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(r.text):  # raises on malformed exposition text
        for s in fam.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def without_pyav(monkeypatch: pytest.MonkeyPatch) -> None:
    """As on an install without the ``audio`` extra: ``import av`` fails, and the audio encoder asks
    anew which formats it can write (its cache of the real answer is kept for after the test)."""
    monkeypatch.setitem(sys.modules, "av", None)
    monkeypatch.setattr(audio_out, "writable", functools.cache(audio_out.writable.__wrapped__))


def aac_samples(data: bytes, rate: int) -> Any:
    """An ADTS AAC stream at ``rate`` (asserting that is what it is), decoded by PyAV (FFmpeg) to float
    samples, less the encoder's 1024 priming samples (its last frame is padded, so up to 1023 more)."""
    av = pytest.importorskip("av")  # the audio extra (dev installs it)
    with av.open(io.BytesIO(data)) as f:
        stream = f.streams.audio[0]
        assert f.format.name == "aac" and stream.codec_context.name == "aac"
        assert stream.codec_context.sample_rate == rate
        return np.concatenate([frame.to_ndarray().reshape(-1) for frame in f.decode(stream)])[1024:]


def g711_samples(data: bytes, law: str) -> Any:
    """Headerless G.711 (``law``: ``ULAW`` or ``ALAW``) at 8 kHz -> float samples, decoded by libsndfile."""
    import soundfile

    samples, _ = soundfile.read(io.BytesIO(data), samplerate=8000, channels=1, format="RAW", subtype=law,
                                dtype="float32")
    return samples
