"""The realtime session: its protocol (no I/O), then over a real uvicorn server and a real WebSocket client.

Served tests use the in-process toy pipeline (its stages record updates and
aborts) or real worker processes; the acceptance test runs ``trio-orch serve``
and the documented example client (``docs/realtime_client.py``) as a user would.
"""

from __future__ import annotations

import base64
import importlib.util
import io
import json
import os
import re
import signal
import subprocess
import sys
import time
import wave
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import ClientConnection, connect

from tests.conftest import live_task_names
from tests.http.test_server import wait_until
from tests.http_helpers import FRONTS, serve
from trio_orch.http.limits import HTTPLimits
from trio_orch.http.realtime import Append, Cancel, RealtimeSession, Start
from trio_orch.testing import child_pids, worker_alive
from trio_orch.testing.toy_pipeline import toy_pipeline
from trio_orch.types import OrchError, OrchOutput

ROOT = Path(__file__).resolve().parents[2]
HANG = 30.0
OUTPUTS = ["text", "codes", "audio"]


def load_example_client() -> Any:
    spec = importlib.util.spec_from_file_location("realtime_client", ROOT / "docs" / "realtime_client.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ---------------------------------------------------------------------------- the protocol, no I/O
def session(**kw: Any) -> RealtimeSession:
    return RealtimeSession("s", final_stage_ids={0, 2}, outputs=OUTPUTS, max_event_bytes=1000,
                           max_buffer_chars=50, **kw)


def ev(kind: str, **fields: Any) -> str:
    return json.dumps({"type": kind, **fields})


def error_code(events: list[dict[str, Any]]) -> str:
    assert len(events) == 1 and events[0]["type"] == "error", events
    return events[0]["error"]["code"]


@pytest.mark.parametrize(("frame", "code"), [
    (b"\x00\x01", "binary_frame"),
    (ev("input_text_buffer.append", text="x" * 2000), "event_too_large"),
    ("{not json", "invalid_json"),
    ("[1, 2]", "invalid_event"),
    (json.dumps({"text": "hi"}), "missing_type"),
    (ev("conversation.item.create"), "unknown_event"),
    (ev("input_text_buffer.append", text=5), "invalid_text"),
    (ev("input_text_buffer.append", text="y" * 60), "input_text_buffer_overflow"),
    (ev("input_text_buffer.commit"), "input_text_buffer_empty"),
    (ev("input_text_buffer.commit", final="yes"), "invalid_final"),
    (ev("session.finish"), "input_text_buffer_empty"),
    (ev("response.cancel"), "no_response"),
    (ev("session.update", session={"modalities": ["audio"]}), "invalid_modalities"),
    (ev("session.update", session={"voice": "x"}), "invalid_session"),
])
def test_a_bad_event_gets_an_error_naming_it_and_changes_nothing(frame: str | bytes, code: str) -> None:
    s = session()
    empty = code == "input_text_buffer_empty"  # refused because nothing is buffered
    if not empty:
        s.receive(ev("input_text_buffer.append", text="kept"))
    events, actions = s.receive(frame)
    assert error_code(events) == code and actions == []
    assert events[0]["error"]["message"]
    if empty:
        s.receive(ev("input_text_buffer.append", text="kept"))
    assert s.receive(ev("input_text_buffer.commit")) == (
        [{"type": "input_text_buffer.committed", "segment": 0, "final": False}], [Start("kept", True, None)])


def test_deeply_nested_json_is_refused_without_harm() -> None:
    s = RealtimeSession("s", final_stage_ids={0}, max_event_bytes=10**7)
    assert error_code(s.receive("[" * 200_000 + "]" * 200_000)[0]) == "invalid_json"


def test_errors_echo_the_client_event_id() -> None:
    events, _ = session().receive(json.dumps({"type": "input_text_buffer.commit", "event_id": "e7"}))
    assert events[0]["error"]["event_id"] == "e7"


def test_commits_start_the_request_then_update_it_and_finish_closes_the_input() -> None:
    s = session()
    s.receive(ev("input_text_buffer.append", text="Hel"))
    s.receive(ev("input_text_buffer.append", text="lo"))
    assert s.receive(ev("input_text_buffer.commit"))[1] == [Start("Hello", True, None)]
    s.receive(ev("input_text_buffer.append", text="again"))
    assert s.receive(ev("input_text_buffer.commit"))[1] == [Append("again", False)]
    s.receive(ev("input_text_buffer.append", text="dropped"))
    assert s.receive(ev("input_text_buffer.clear")) == ([{"type": "input_text_buffer.cleared"}], [])
    assert s.receive(ev("session.finish")) == ([], [Append(None, True)])  # an empty final segment
    assert error_code(s.receive(ev("input_text_buffer.append", text="late"))[0]) == "input_closed"
    assert s.receive(ev("response.cancel")) == ([], [Cancel()])


def test_finish_with_text_commits_it_as_the_final_segment() -> None:
    s = session()
    s.receive(ev("input_text_buffer.append", text="only"))
    assert s.receive(ev("session.finish"))[1] == [Start("only", False, None)]  # one segment: not resumable
    s = session()
    s.receive(ev("input_text_buffer.append", text="a"))
    s.receive(ev("input_text_buffer.commit"))
    s.receive(ev("input_text_buffer.append", text="b"))
    assert s.receive(ev("session.finish"))[1] == [Append("b", True)]


def test_modalities_choose_where_the_request_stops_and_only_before_it_starts() -> None:
    s = session()
    events, _ = s.receive(ev("session.update", session={"modalities": ["text"]}))
    assert events[0]["type"] == "session.updated" and events[0]["session"]["modalities"] == ["text"]
    s.receive(ev("input_text_buffer.append", text="hi"))
    assert s.receive(ev("input_text_buffer.commit"))[1] == [Start("hi", True, 0)]
    late = s.receive(ev("session.update", session={"modalities": ["text"]}))[0]
    assert error_code(late) == "session_active"
    no_audio = RealtimeSession("t", final_stage_ids={0}, outputs=["text"])
    assert no_audio.opened()[0]["session"]["modalities"] == ["text"]
    bad = no_audio.receive(ev("session.update", session={"modalities": ["text", "audio"]}))[0]
    assert error_code(bad) == "invalid_modalities"


def out(stage: int, data: Any, seg: int, done: bool = False, finished: bool = False) -> OrchOutput:
    return OrchOutput("resp_s", stage, data, finished, segment=seg, segment_done=done)


def test_outputs_become_deltas_and_a_segment_is_done_once_every_final_stage_closed_it() -> None:
    s = session()
    s.receive(ev("input_text_buffer.append", text="hi"))
    s.receive(ev("input_text_buffer.commit"))
    assert s.request_started(frozenset({0, 2}))[0]["type"] == "response.created"
    pcm = np.array([0.5, -0.5], np.float32)
    assert [e["type"] for e in s.output(out(0, {"text": "ab"}, 0))] == ["response.text.delta"]
    got = s.output(out(0, {"text": "c"}, 0, done=True))
    assert [(e["type"], e.get("text")) for e in got] == [("response.text.delta", None),
                                                          ("response.text.done", "abc")]
    (audio,) = s.output(out(2, {"pcm": pcm, "sample_rate": 24000}, 0))
    assert audio["type"] == "response.audio.delta" and audio["segment"] == 0
    assert np.frombuffer(base64.b64decode(audio["delta"]), "<i2").tolist() == [16383, -16383]
    got = s.output(out(2, {"pcm": np.zeros(0, np.float32), "sample_rate": 24000}, 0, done=True))
    assert [e["type"] for e in got] == ["response.audio.done", "response.segment.done"]
    got = s.output(out(2, None, 1, done=True, finished=True))  # the empty final segment
    assert [e["type"] for e in got] == ["response.audio.done", "response.done"]
    assert got[-1]["response"]["status"] == "completed"
    assert s.output(out(0, {"text": "late"}, 1)) == []  # nothing after response.done
    assert error_code(s.receive(ev("input_text_buffer.append", text="x"))[0]) == "response_ended"


@pytest.mark.parametrize(("kind", "status"), [("aborted", "cancelled"), ("stage_failed", "failed"),
                                              ("timeout", "failed")])
def test_a_terminal_error_ends_the_response_with_its_status(kind: str, status: str) -> None:
    s = session()
    s.receive(ev("input_text_buffer.append", text="hi"))
    s.receive(ev("input_text_buffer.commit"))
    s.request_started(frozenset({0, 2}))
    (done,) = s.output(OrchError("resp_s", 1, kind, "why"))
    assert done["response"]["status"] == status and done["response"]["status_details"]["type"] == kind
    assert s.ended


def test_a_single_segment_response_is_closed_by_its_terminal() -> None:
    s = session()
    s.receive(ev("input_text_buffer.append", text="hi"))
    s.receive(ev("session.finish"))
    s.request_started(frozenset({0, 2}))
    s.output(OrchOutput("resp_s", 0, {"text": "yo"}, False))
    got = s.output(OrchOutput("resp_s", 2, {"pcm": np.zeros(4, np.float32)}, True))
    assert [e["type"] for e in got] == ["response.audio.delta", "response.text.done", "response.audio.done",
                                        "response.segment.done", "response.done"]


# ---------------------------------------------------------------------------- over a real server
class Server:
    """The realtime endpoint behind a front (``tests.http_helpers.serve``: the serve command's app and
    settings); ``max_message``: the largest frame (``--max-body-bytes``)."""

    def __init__(self, front: str, factory: Any, outputs: list[str] | None = None,
                 max_message: int = 256 * 1024) -> None:
        self.served = serve(front, factory, model_name="test", outputs=outputs,
                            limits=HTTPLimits(max_body_bytes=max_message))
        self.engine = self.served.engine
        self.url = f"ws://127.0.0.1:{self.served.port}/v1/realtime"

    @contextmanager
    def connect(self) -> Iterator[ClientConnection]:
        with connect(self.url, open_timeout=HANG) as ws:
            assert json.loads(ws.recv(timeout=HANG))["type"] == "session.created"
            yield ws

    def idle(self) -> bool:
        return self.engine.stats().active_requests == 0

    def stop(self) -> None:
        self.served.stop()


@pytest.fixture(scope="module", params=FRONTS)
def toy(request: pytest.FixtureRequest) -> Iterator[Server]:
    s = Server(request.param, toy_pipeline(token_delay=0.01, audio_delay=0.005))
    yield s
    s.stop()


def recv_until(ws: ClientConnection, kind: str) -> list[dict[str, Any]]:
    events = []
    while True:
        e = json.loads(ws.recv(timeout=HANG))
        events.append(e)
        if e["type"] == kind:
            return events


def check_answered_in_turn(log: list[Any], n: int) -> bytes:
    """Each segment got text and audio deltas before the next was sent; return the audio."""
    commits = [i for i, (d, e) in enumerate(log) if d == "sent" and e["type"] == "input_text_buffer.commit"]
    assert len(commits) == n
    for seg, start in enumerate(commits):
        end = commits[seg + 1] if seg + 1 < n else len(log)
        got = [e for d, e in log[start:end] if d == "recv" and e.get("segment") == seg]
        kinds = {e["type"] for e in got}
        assert {"response.text.delta", "response.audio.delta", "response.segment.done"} <= kinds, (seg, kinds)
        later = [e["segment"] for d, e in log[start:end] if d == "recv" and "segment" in e
                 and e["type"] != "input_text_buffer.committed"]
        assert all(x == seg for x in later) if seg + 1 < n else all(x >= seg for x in later)
    assert log[-1][1]["type"] == "response.done" and log[-1][1]["response"]["status"] == "completed"
    return b"".join(base64.b64decode(e["delta"]) for d, e in log
                    if d == "recv" and e["type"] == "response.audio.delta")


def test_the_example_client_gets_each_segment_answered_before_it_sends_the_next(
        toy: Server, tmp_path: Path) -> None:
    client = load_example_client()
    wav = tmp_path / "session.wav"
    log = client.talk(toy.url, ["Hello", "How are you", "Bye"], pause=0, out=str(wav), show=False)
    audio = check_answered_in_turn(log, 3)
    texts = ["".join(e["delta"] for d, e in log if d == "recv" and e["type"] == "response.text.delta"
                     and e["segment"] == s) for s in range(3)]
    assert texts == ["You said: Hello", "You said: How are you", "You said: Bye"]
    with wave.open(str(wav)) as w:
        assert (w.getnchannels(), w.getsampwidth(), w.getframerate()) == (1, 2, 24000)
        assert w.readframes(w.getnframes()) == audio and len(audio) > 0
    wait_until(toy.idle, "no request left")


def test_bad_frames_get_errors_and_the_same_socket_still_works(toy: Server) -> None:
    with toy.connect() as ws:
        for frame in [b"\x00binary", "not json", json.dumps({"type": "nope"}),
                      json.dumps({"type": "input_text_buffer.append", "text": "x" * 200_000}),
                      json.dumps({"type": "input_text_buffer.commit"})]:
            ws.send(frame)
            e = json.loads(ws.recv(timeout=HANG))
            assert e["type"] == "error", e
        ws.send(json.dumps({"type": "input_text_buffer.append", "text": "still here"}))
        ws.send(json.dumps({"type": "session.finish"}))
        events = recv_until(ws, "response.done")
    assert "".join(e["delta"] for e in events if e["type"] == "response.text.delta") == "You said: still here"
    wait_until(toy.idle, "no request left")


def test_closing_the_socket_mid_stream_aborts_the_request_on_every_stage(toy: Server) -> None:
    stages = toy.engine.stages
    with toy.connect() as ws:
        ws.send(json.dumps({"type": "input_text_buffer.append", "text": "a long answer " * 30}))
        ws.send(json.dumps({"type": "input_text_buffer.commit"}))
        rid = recv_until(ws, "response.text.delta")[-1]["response_id"]
    wait_until(toy.idle, "the request ended")
    holders = [s for s in stages if any(r == rid for r, _ in s.submissions)]
    assert holders
    wait_until(lambda: all(rid in s.aborts for s in holders), "every stage holding it saw the abort")
    assert toy.engine.stats().terminals_by_kind.get("aborted", 0) >= 1


def test_a_frame_over_the_transport_limit_closes_only_that_session(toy: Server) -> None:
    with toy.connect() as ws:
        ws.send(json.dumps({"type": "input_text_buffer.append", "text": "started"}))
        ws.send(json.dumps({"type": "input_text_buffer.commit"}))
        recv_until(ws, "response.created")
        ws.send("x" * 300_000)  # over the server's ws_max_size: the server closes the connection (1009)
        with pytest.raises(ConnectionClosed):
            while True:
                ws.recv(timeout=HANG)
    wait_until(toy.idle, "the session's request was aborted")
    client = load_example_client()  # the server still serves
    assert client.talk(toy.url, ["ok"], pause=0, out=None, show=False)[-1][1]["type"] == "response.done"


def test_cancel_ends_the_response_and_the_session_says_so_afterwards(toy: Server) -> None:
    with toy.connect() as ws:
        ws.send(json.dumps({"type": "input_text_buffer.append", "text": "words " * 50}))
        ws.send(json.dumps({"type": "input_text_buffer.commit"}))
        recv_until(ws, "response.text.delta")
        ws.send(json.dumps({"type": "response.cancel"}))
        done = recv_until(ws, "response.done")[-1]
        ws.send(json.dumps({"type": "input_text_buffer.append", "text": "more"}))
        err = recv_until(ws, "error")[-1]
    assert done["response"]["status"] == "cancelled"
    assert err["error"]["code"] == "response_ended"
    wait_until(toy.idle, "no request left")


# ---------------------------------------------------------------------------- real worker processes
TINY_TOML = """
[pipeline]
final_stages = [0, 2]

[[stages]]
kind = "thinker"
[stages.model]
d_model = 32
layers = 1
heads = 2
max_new_tokens = 10
min_new_tokens = 10

[[stages]]
kind = "talker"
[stages.model]
d_model = 32
layers = 1
heads = 2
chunk_frames = 4

[[stages]]
kind = "code2wav"
[stages.model]
dim = 16
upsample = [4, 3]
chunk_frames = 4
"""


@pytest.mark.slow
@pytest.mark.processes
def test_a_session_closed_mid_stream_leaves_nothing_on_the_workers(tmp_path: Path) -> None:
    from stages.config import load_config
    from trio_orch.cluster.launcher import open_pipeline

    (tmp_path / "tiny.toml").write_text(TINY_TOML)
    cfg = load_config(str(tmp_path / "tiny.toml"))
    s = Server("asyncio", lambda: open_pipeline(cfg), OUTPUTS)
    try:
        def worker_stats() -> list[dict[str, Any]]:  # over each worker's stats RPC
            return [s.engine.run_in_trio(r.rpc, "stats") for pool in s.engine.stages for r in pool.replicas]

        tasks_before = sorted(s.engine.run_sync_in_trio(live_task_names))
        with s.connect() as ws:
            ws.send(json.dumps({"type": "input_text_buffer.append", "text": "Hello"}))
            ws.send(json.dumps({"type": "input_text_buffer.commit"}))
            recv_until(ws, "response.segment.done")
            ws.send(json.dumps({"type": "input_text_buffer.append", "text": "and then"}))
            ws.send(json.dumps({"type": "input_text_buffer.commit"}))
            recv_until(ws, "response.text.delta")
            held = worker_stats()
        wait_until(s.idle, "the request ended")
        wait_until(lambda: all(st["active"] == st["waiting"] == st["sessions"] == 0 for st in worker_stats()),
                   "the workers let the session go")
        wait_until(lambda: sorted(s.engine.run_sync_in_trio(live_task_names)) == tasks_before,
                   "no task left for the session")
        assert [st["sessions"] for st in held] == [1, 1, 1]  # it was held on every stage
        assert all(st["aborts"] == 1 for st in worker_stats())
        assert s.engine.stats().terminals_by_kind == {"aborted": 1}
    finally:
        s.stop()


@pytest.mark.slow
@pytest.mark.processes
def test_trio_orch_serve_and_the_example_client_as_a_user_would(tmp_path: Path) -> None:
    """Serve; three segments through the documented client; a playable WAV; nothing left after Ctrl-C."""
    (tmp_path / "tiny.toml").write_text(TINY_TOML)
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    proc = subprocess.Popen([sys.executable, "-m", "trio_orch.cli", "serve", "--port", "0", "--config",
                             str(tmp_path / "tiny.toml")], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env)
    try:
        assert proc.stdout is not None
        url = None
        start = time.monotonic()
        while url is None and time.monotonic() - start < 60:
            line = proc.stdout.readline()
            if not line:
                break
            m = re.search(r"serving on http://(\S+)", line)
            url = m.group(1) if m else None
        assert url, "serve did not report its address"
        workers = child_pids(proc.pid)
        assert len(workers) >= 3
        client = load_example_client()
        wav = tmp_path / "out" / "session.wav"
        wav.parent.mkdir()
        log = client.talk(f"ws://{url}/v1/realtime", ["Hello", "How are you?", "Goodbye"], pause=0.2,
                          out=str(wav), show=False)
        audio = check_answered_in_turn(log, 3)
        with wave.open(io.BytesIO(wav.read_bytes())) as w:
            assert (w.getnchannels(), w.getsampwidth(), w.getframerate()) == (1, 2, 24000)
            pcm = np.frombuffer(w.readframes(w.getnframes()), "<i2")
        assert pcm.tobytes() == audio and len(pcm) == 3 * 10 * 2 * 12 and np.abs(pcm).max() > 0
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 130  # stopped by a signal (documented exit code)
        wait_until(lambda: not any(worker_alive(p) for p in workers), "worker processes gone")
        assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "tiny.toml"]  # no ipc file left
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
