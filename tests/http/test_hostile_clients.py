"""Careless and hostile clients against both fronts: every mistake a 4xx, bounded metrics, clean logs.

Real servers on loopback (``serve --loop asyncio``: uvicorn; ``--loop trio``:
the lean server), raw-socket clients where the bytes on the wire are the
point.  Each case once got a 5xx, a traceback, a forged log line or a metric
series of its own; each now gets a 4xx (or a quiet close) and leaves the
server serving.
"""

from __future__ import annotations

import ast
import importlib
import io
import json
import logging
import re
import socket
import threading
from collections.abc import Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from PIL import Image

from tests.http_helpers import FRONTS, HANG, Served, TrioServed, chat, metrics, serve, wait_until
from trio_orch.engine.base import PipelineSpec
from trio_orch.http import logs
from trio_orch.http.limits import HTTPLimits
from trio_orch.http.logs import CLIENT_LOGGERS, REFUSED, ClientText, RateLimitFilter, escaped
from trio_orch.openai.chat_template import ChatInput
from trio_orch.openai.media import MediaPolicy
from trio_orch.testing.toy_pipeline import TOY_STAGE_PARAMS, open_toy_pipeline

ROOT = Path(__file__).resolve().parents[2]
KEY = "k3y"
AUTH = {"authorization": f"Bearer {KEY}"}
#: the body rate measured over 1 s windows: a slow upload holds its slot for 2 s (time for all of them to
#: take one on a busy machine), then loses it
LIMITS = HTTPLimits(max_body_bytes=64 << 10, header_timeout=HANG, body_timeout=HANG, body_rate_window=1.0)


@asynccontextmanager
async def toy_with_images() -> Any:
    """The toy pipeline, its middle stage named an image encoder: chat then takes (and decodes) images."""
    async with open_toy_pipeline(0.001, 0.001) as spec:
        params = [TOY_STAGE_PARAMS[0], type(TOY_STAGE_PARAMS[1])("image-encoder", {}), TOY_STAGE_PARAMS[2]]
        yield PipelineSpec(spec.stages, spec.final_stage_ids, spec.options, params)


@pytest.fixture(scope="module", params=FRONTS)
def served(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[Served | TrioServed]:
    media = tmp_path_factory.mktemp("media")
    buf = io.BytesIO()
    Image.new("RGB", (8, 8), (255, 0, 0)).save(buf, format="PNG")
    (media / "ok.png").write_bytes(buf.getvalue())
    s = serve(request.param, toy_with_images, limits=LIMITS, api_key=KEY,
              chat_input=ChatInput(media=MediaPolicy(allowed_local_media_path=media)))
    s.media = media  # type: ignore[union-attr]
    yield s
    s.stop()


@pytest.fixture()
def client(served: Served | TrioServed) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=served.url, timeout=HANG, headers=AUTH) as c:
        yield c


def exchange(port: int, data: bytes, *, half_close: bool = False) -> bytes:
    """Send ``data`` on a fresh connection; everything the server sends until it closes."""
    with socket.create_connection(("127.0.0.1", port), timeout=HANG) as s:
        s.sendall(data)
        if half_close:
            s.shutdown(socket.SHUT_WR)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
    return out


def post_head(path: str, length: int, *extra: str) -> bytes:
    lines = [f"POST {path} HTTP/1.1", "host: t", f"authorization: Bearer {KEY}",
             "content-type: application/json", f"content-length: {length}", *extra]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def series(client: httpx.Client, family: str) -> set[str]:
    return {k for k in metrics(client) if k.startswith(family)}


# ----------------------------------------------------------------------------- every mistake a 4xx
def body(**fields: Any) -> dict[str, Any]:
    return chat("hi", **fields)


#: (request body, the parameter the 400 names, a fragment of its message)
OUT_OF_RANGE = [
    (body(priority=99999999999999999999), "priority", "signed 64-bit"),
    (body(priority=-(2**63) - 1), "priority", "signed 64-bit"),
    (body(n=0), "n", "between 1 and"),
    (body(top_k=2**40), "top_k", "between -1 and"),
    (body(min_tokens=-1), "min_tokens", "between 0 and"),
    (body(top_logprobs=10**30), "top_logprobs", "between 0 and 20"),
    (body(seed=2**64), "seed", "signed 64-bit"),
    (body(frequency_penalty="1e400"), "frequency_penalty", "a finite number"),  # JSON's 1e400: Python's inf
    (body(stage_sampling={"0": {"max_tokens": 10**30}}), "stage_sampling", "signed 64-bit"),
]


@pytest.mark.parametrize(("payload", "param", "fragment"), OUT_OF_RANGE,
                         ids=[f"{c[1]}" for c in OUT_OF_RANGE])
def test_an_integer_out_of_range_is_a_400_naming_it_not_a_5xx(client: httpx.Client, payload: dict[str, Any],
                                                               param: str, fragment: str) -> None:
    raw = json.dumps(payload).replace('"1e400"', "1e400")
    r = client.post("/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] is not None and err["param"].startswith(param) and fragment in err["message"]
    assert metrics(client).get("trio_orch_errors_total{kind=stage_unavailable}", 0) == 0  # no stage saw it


def test_unknown_fields_stay_ignored_with_a_200(client: httpx.Client) -> None:
    r = client.post("/v1/chat/completions", json=body(some_new_field=10**40, another={"x": [1]}))
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "You said: hi"


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/tokenize"])
def test_a_file_path_with_a_nul_byte_is_a_400(served: Served | TrioServed, client: httpx.Client,
                                              route: str) -> None:
    media: Path = served.media  # type: ignore[union-attr]
    for url, status in ((f"file://{media}/ok.png%00x", 400), (f"file://{media}/ok.png\u0000x", 400)):
        part = {"type": "image_url", "image_url": {"url": url}}
        r = client.post(route, json={"messages": [{"role": "user", "content": [part]}]})
        assert r.status_code == status, r.text
        assert "NUL" in r.json()["error"]["message"]
        assert r.json()["error"]["param"] == "messages[0].content[0]"
    ok = {"type": "image_url", "image_url": {"url": f"file://{media}/ok.png"}}
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": [ok]}]})
    assert r.status_code == 200, r.text  # the same file without the NUL is read


def test_a_body_short_of_its_length_then_a_half_close_is_a_quiet_close_logged_once_at_info(
        served: Served | TrioServed, client: httpx.Client, caplog: pytest.LogCaptureFixture) -> None:
    before = metrics(client)["trio_orch_http_client_disconnects_total"]
    with caplog.at_level(logging.INFO):
        head = post_head("/v1/chat/completions", 100)
        reply = exchange(served.port, head + b'{"messages": ', half_close=True)
        wait_until(lambda: metrics(client)["trio_orch_http_client_disconnects_total"] == before + 1,
                   "the disconnect counted")
    assert reply == b"" or reply.startswith(b"HTTP/1.1 400"), reply
    assert [r for r in caplog.records if r.levelno >= logging.ERROR] == []
    lines = [r for r in caplog.records if "during its upload" in r.getMessage()]
    assert len(lines) == 1 and lines[0].levelno == logging.INFO and lines[0].exc_info is None
    assert client.post("/v1/chat/completions", json=chat("still here")).status_code == 200


# ----------------------------------------------------------------------------- slow uploads
@pytest.mark.slow
def test_slow_uploads_lose_their_read_slots_and_a_normal_request_is_served_meanwhile(
        served: Served | TrioServed, client: httpx.Client) -> None:
    """Every read slot taken by an upload trickling 10 bytes a second: a normal chat request sent
    meanwhile is answered (without the minimum rate it would wait for the body timeout), and each
    slow upload gets a 408 that says why."""
    slow = [socket.create_connection(("127.0.0.1", served.port), timeout=HANG)
            for _ in range(LIMITS.max_body_reads)]
    stop = threading.Event()

    def trickle() -> None:
        while not stop.wait(0.1):
            for s in slow:
                try:
                    s.send(b" ")
                except OSError:  # refused and closed: its answer is read below
                    pass

    dripper = threading.Thread(target=trickle, daemon=True)
    try:
        for s in slow:
            s.sendall(post_head("/v1/chat/completions", 1000) + b"{")
        wait_until(lambda: metrics(client)["trio_orch_http_body_reads"] == LIMITS.max_body_reads,
                   "every read slot taken by a slow upload")
        dripper.start()
        r = client.post("/v1/chat/completions", json=chat("not stalled"))
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == "You said: not stalled"
        stop.set()
        dripper.join(HANG)
        for s in slow:
            reply = b""
            while chunk := s.recv(65536):
                reply += chunk
            assert statuses(reply) == [408] and b"slower than 1024 bytes/s" in reply, reply
    finally:
        stop.set()
        for s in slow:
            s.close()
    wait_until(lambda: metrics(client)["trio_orch_http_body_reads"] == 0, "no slot held")


# ----------------------------------------------------------------------------- RFC 9112 framing
def statuses(reply: bytes) -> list[int]:
    return [int(m) for m in re.findall(rb"^HTTP/1\.1 (\d{3}) ", reply, re.M)]


def test_content_length_with_transfer_encoding_is_400_and_the_smuggled_request_is_never_served(
        served: Served | TrioServed, client: httpx.Client) -> None:
    """Were the hidden request served, its answer would follow the 400 on this connection.  It is a
    GET to no route: its 404 would be counted, too."""
    smuggled = f"0\r\n\r\nGET /smuggled HTTP/1.1\r\nhost: t\r\nauthorization: Bearer {KEY}\r\n\r\n".encode()
    counted = "trio_orch_http_requests_total{route=unmatched,status=404}"
    before = metrics(client).get(counted, 0)
    head = post_head("/v1/chat/completions", len(smuggled), "transfer-encoding: chunked")
    reply = exchange(served.port, head + smuggled)  # read to the end: the server closes the connection
    assert statuses(reply) == [400], reply
    assert b"both Content-Length and Transfer-Encoding" in reply and b'"error"' in reply
    assert metrics(client).get(counted, 0) == before
    assert client.get("/smuggled").status_code == 404 and metrics(client)[counted] == before + 1


@pytest.mark.parametrize("version", [b"9.9", b"2.0"])
def test_an_unknown_http_version_is_refused(served: Served | TrioServed, version: bytes) -> None:
    reply = exchange(served.port, b"GET /health HTTP/%b\r\nhost: t\r\n\r\n" % version)
    assert statuses(reply) == [505] and b"http_version_not_supported" in reply
    reply = exchange(served.port, b"GET /health HTTP/1.0\r\nhost: t\r\n\r\n")
    assert reply.startswith(b"HTTP/1.1 200")  # 1.0 is served


@pytest.mark.parametrize("pieces", [1, 50])
def test_the_head_limit_holds_however_the_bytes_arrive(served: Served | TrioServed, pieces: int) -> None:
    head = (b"GET /health HTTP/1.1\r\nhost: t\r\nx-big: " + b"a" * (70 << 10) + b"\r\n\r\n")
    assert len(head) > LIMITS.max_head_bytes
    with socket.create_connection(("127.0.0.1", served.port), timeout=HANG) as s:
        step = -(-len(head) // pieces)
        for i in range(0, len(head), step):
            try:
                s.sendall(head[i:i + step])
            except OSError:  # refused mid-head: the answer is already on its way
                break
        reply = b""
        while chunk := s.recv(65536):
            reply += chunk
    assert statuses(reply) == [431] and b"request_header_too_large" in reply


def test_a_413_reaches_a_client_still_sending_a_large_body(served: Served | TrioServed) -> None:
    """The body is announced (and sent) far over the limit: the answer comes at once, and the close
    waits for the client to finish sending, so the client reads it rather than a reset."""
    size = 50 << 20
    reply = exchange(served.port, post_head("/v1/chat/completions", size) + b"x" * size)
    assert statuses(reply) == [413] and b"request_too_large" in reply


# ----------------------------------------------------------------------------- bounded metrics
def test_random_paths_add_no_metric_series_once_the_first_unmatched_one_exists(
        served: Served | TrioServed, client: httpx.Client) -> None:
    with httpx.Client(base_url=served.url, timeout=HANG) as anonymous:  # no key: 401s
        for c in (client, anonymous):
            c.get("/no/such/route/0")
        before = series(client, "trio_orch_http_requests_total")
        assert "trio_orch_http_requests_total{route=unmatched,status=404}" in before
        assert "trio_orch_http_requests_total{route=unmatched,status=401}" in before
        for i in range(1, 100):
            assert client.get(f"/no/such/route/{i}").status_code == 404
            assert anonymous.get(f"/v1/{i}%0a", headers={"x": "y"}).status_code == 401
            assert anonymous.post(f"/nothing-{i}", json={}).status_code == 401
        r = anonymous.get("/v1/models/some%2Fmodel")  # a template with a parameter: its template
        assert r.status_code == 401
    after = series(client, "trio_orch_http_requests_total")
    assert after - before <= {"trio_orch_http_requests_total{route=/v1/models/{name:path},status=401}"}
    assert not any("/no/such" in s or "nothing-" in s for s in after)
    assert metrics(client)["trio_orch_http_requests_total{route=unmatched,status=404}"] >= 100


def test_a_matched_route_refused_is_counted_under_its_template(client: httpx.Client) -> None:
    before = metrics(client).get("trio_orch_http_requests_total{route=/v1/chat/completions,status=405}", 0)
    assert client.get("/v1/chat/completions").status_code == 405
    after = metrics(client)["trio_orch_http_requests_total{route=/v1/chat/completions,status=405}"]
    assert after == before + 1


# ----------------------------------------------------------------------------- clean logs
def client_records(records: list[logging.LogRecord]) -> list[logging.LogRecord]:
    return [r for r in records if r.name in CLIENT_LOGGERS or r.name.startswith("trio_orch")]


def test_a_line_break_in_a_path_or_a_header_forges_no_log_line(served: Served | TrioServed,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG):
        close = b" HTTP/1.1\r\nhost: t\r\nconnection: close\r\n\r\n"
        exchange(served.port, b"GET /x%0aFORGED%0d%0aline%1b[2J" + close)
        exchange(served.port, b"GET /v1/models/x%0aFORGED" + close)
        # a header value may carry obs-text: latin-1 0x85 is NEL, a line break to many log readers
        data = post_head("/v1/chat/completions", 2, "connection: close").replace(
            b"content-type: application/json", b"content-type: text/\x85FORGED")
        reply = exchange(served.port, data + b"{}")
    assert reply.startswith(b"HTTP/1.1 415")
    seen = client_records(caplog.records)
    shown = [r.getMessage() for r in seen]
    assert any("\\x85forged" in m for m in shown), shown  # the 415's line: the client's text, escaped
    assert all(m.isprintable() for m in shown), [m for m in shown if not m.isprintable()]
    assert not any(line.startswith("FORGED") for m in shown for line in m.splitlines())


def test_the_escape_keeps_the_arguments_shape_and_passes_plain_text_as_it_is() -> None:
    access = logging.LogRecord("uvicorn.access", logging.INFO, __file__, 1, '%s - "%s %s HTTP/%s" %d',
                               ("1.2.3.4:5", "GET", "/a\nb\u2028c\x1b", "1.1", 404), None)
    assert ClientText().filter(access)
    assert access.args == ("1.2.3.4:5", "GET", "/a\\nb\\u2028c\\x1b", "1.1", 404)  # still by position
    assert access.getMessage() == '1.2.3.4:5 - "GET /a\\nb\\u2028c\\x1b HTTP/1.1" 404'
    plain = "refused a request to /v1/chat/completions (400): 'n' must be between 1 and 2147483647"
    assert escaped(plain) is plain
    exc = ValueError("bad\r\nthing")
    rec = logging.LogRecord("trio_orch.http", logging.ERROR, __file__, 1, "error: %s", (exc,), None)
    assert ClientText().filter(rec) and rec.getMessage() == "error: bad\\r\\nthing"


def test_repeated_401_and_404_lines_are_one_per_interval_with_a_count_and_others_pass() -> None:
    logs.guard_logs()  # what create_app does (and again: once only)
    logs.guard_logs()
    flt, = [f for f in logging.getLogger("trio_orch.http").filters if isinstance(f, RateLimitFilter)
            and f.key is logs.flooded_refusal]
    fresh = RateLimitFilter(key=flt.key, interval=3600)

    def refusal(status: int) -> logging.LogRecord:
        return logging.LogRecord("trio_orch.http", logging.WARNING, __file__, 1, REFUSED,
                                 ("unmatched", status, "a valid API key is required"), None)

    assert sum(fresh.filter(refusal(401)) for _ in range(1000)) == 1
    assert sum(fresh.filter(refusal(404)) for _ in range(1000)) == 1
    assert all(fresh.filter(refusal(400)) for _ in range(10))  # a malformed request: each one said
    fresh.interval = 0.0
    nxt = refusal(401)
    assert fresh.filter(nxt) and "999 more like this" in nxt.getMessage()


def test_every_logger_of_the_front_escapes_client_text() -> None:
    """Each logger the app's and the servers' modules write to is one the escape is installed on."""
    folders = [ROOT / "trio_orch" / sub for sub in ("http", "openai", "serve/trio_http")]
    named: dict[str, str] = {}
    for path in (p for folder in folders for p in folder.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and ast.unparse(node.func) == "logging.getLogger" and node.args
                    and isinstance(node.args[0], ast.Constant)):
                named[str(node.args[0].value)] = str(path.relative_to(ROOT))
    assert named and {n: p for n, p in named.items() if n not in CLIENT_LOGGERS} == {}
    logs.guard_logs()  # what create_app does
    for name in CLIENT_LOGGERS:
        assert any(isinstance(f, ClientText) for f in logging.getLogger(name).filters), name


def test_a_model_name_with_a_line_break_is_refused_in_one_line(client: httpx.Client,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        r = client.post("/v1/chat/completions", json={**chat("hi"), "model": "m\nFORGED"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert all(r.getMessage().isprintable() for r in client_records(caplog.records))


def test_every_front_rule_in_the_design_doc_names_an_existing_function() -> None:
    block = (ROOT / "docs" / "design.md").read_text().split("<!-- front-rules:begin -->")[1].split(
        "<!-- front-rules:end -->")[0]
    rows = re.findall(r"^\| (.+?) \| `(trio_orch(?:\.\w+)+)` \|$", block, re.M)
    assert len(rows) >= 3
    for rule, path in rows:
        module, _, name = path.rpartition(".")
        found = getattr(importlib.import_module(module), name, None)
        assert callable(found), f"{rule}: {path} does not exist"
