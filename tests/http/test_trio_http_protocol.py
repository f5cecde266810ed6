"""The lean server's sans-I/O core on bytes alone: request heads through h11, responses framed by hand."""

from __future__ import annotations

import pytest

from trio_orch.serve.framing import simple_response, status_line
from trio_orch.serve.trio_http.protocol import (
    CLOSED,
    END,
    NEED_DATA,
    BadRequest,
    Mode,
    RequestHead,
    RequestReader,
    response_head,
)

GET = b"GET /a%20b/c?x=1&y=2 HTTP/1.1\r\nHost: t\r\nX-Thing: V\r\n\r\n"


def head_of(data: bytes, max_head_bytes: int = 1 << 16) -> RequestHead:
    reader = RequestReader(max_head_bytes)
    reader.feed(data)
    event = reader.next_event()
    assert isinstance(event, RequestHead), event
    return event


def test_a_head_parses_into_the_scope_shapes() -> None:
    head = head_of(GET)
    assert (head.method, head.http_version, head.target) == ("GET", "1.1", b"/a%20b/c?x=1&y=2")
    assert head.path == "/a b/c" and head.raw_path == b"/a%20b/c" and head.query_string == b"x=1&y=2"
    assert head.headers == [(b"host", b"t"), (b"x-thing", b"V")]  # names lower-case, values as sent
    assert head.keep_alive and not head.expect_continue and not head.websocket


def test_an_absolute_form_target_keeps_only_its_path() -> None:
    head = head_of(b"GET http://example.com/p/q?z HTTP/1.1\r\nHost: example.com\r\n\r\n")
    assert head.raw_path == b"/p/q" and head.query_string == b"z"


@pytest.mark.parametrize(("version", "connection", "keep"), [
    ("1.1", None, True), ("1.1", "close", False), ("1.1", "Keep-Alive, Close", False),
    ("1.0", None, False), ("1.0", "keep-alive", True)])
def test_keep_alive_is_what_the_client_asked(version: str, connection: str | None, keep: bool) -> None:
    extra = f"Connection: {connection}\r\n" if connection else ""
    assert head_of(f"GET / HTTP/{version}\r\nHost: t\r\n{extra}\r\n".encode()).keep_alive is keep


def test_expect_continue_and_websocket_upgrades_are_seen() -> None:
    head = head_of(b"POST / HTTP/1.1\r\nHost: t\r\nExpect: 100-continue\r\nContent-Length: 3\r\n\r\n")
    assert head.expect_continue
    ws = head_of(b"GET /ws HTTP/1.1\r\nHost: t\r\nConnection: keep-alive, Upgrade\r\nUpgrade: websocket\r\n"
                 b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n")
    assert ws.websocket


def test_a_body_comes_in_chunks_then_end_and_a_pipelined_request_waits_for_its_cycle() -> None:
    reader = RequestReader(1 << 16)
    reader.feed(b"POST /p HTTP/1.1\r\nHost: t\r\nContent-Length: 10\r\n\r\nhello")
    assert isinstance(reader.next_event(), RequestHead)
    assert reader.next_event() == b"hello"
    assert reader.next_event() is NEED_DATA
    reader.feed(b"world" + GET)
    assert reader.next_event() == b"world"
    assert reader.next_event() is END
    assert reader.next_event() is NEED_DATA  # the next request is not this cycle's
    assert reader.leftover() == GET
    reader.next_cycle()
    assert isinstance(reader.next_event(), RequestHead) and reader.buffered == len(GET)


def test_a_chunked_request_body_is_decoded() -> None:
    reader = RequestReader(1 << 16)
    reader.feed(b"POST / HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n"
                b"3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n")
    events = [reader.next_event() for _ in range(4)]
    assert isinstance(events[0], RequestHead) and b"".join(events[1:3]) == b"abcde" and events[3] is END


def test_a_client_that_closes_between_requests_is_closed_not_an_error() -> None:
    reader = RequestReader(1 << 16)
    reader.feed(b"")
    assert reader.next_event() is CLOSED and reader.eof


def test_a_malformed_head_is_400_and_a_head_over_the_limit_431() -> None:
    reader = RequestReader(1 << 16)
    reader.feed(b"GET / HTTP/1.1\r\nno colon here\r\n\r\n")
    with pytest.raises(BadRequest) as bad:
        reader.next_event()
    assert bad.value.status == 400
    reader = RequestReader(100)
    reader.feed(b"GET / HTTP/1.1\r\nHost: t\r\nX-Big: " + b"x" * 200)
    with pytest.raises(BadRequest) as big:
        reader.next_event()
    assert big.value.status == 431


def test_a_whole_head_over_the_limit_in_one_read_is_431_and_a_pipelined_one_is_measured_alone() -> None:
    head = b"GET / HTTP/1.1\r\nHost: t\r\nX-Big: " + b"x" * 200 + b"\r\n\r\n"
    reader = RequestReader(150)
    reader.feed(head)  # complete in one read: h11 alone would take it
    with pytest.raises(BadRequest) as big:
        reader.next_event()
    assert big.value.status == 431
    small = b"GET /a HTTP/1.1\r\nHost: t\r\n\r\n"
    reader = RequestReader(len(small) + 10)
    reader.feed(small * 3)  # three heads in one read, each under the limit
    for _ in range(3):
        assert isinstance(reader.next_event(), RequestHead) and reader.next_event() is END
        reader.next_cycle()


def test_a_request_with_content_length_and_transfer_encoding_is_400_and_nothing_after_it_is_parsed() -> None:
    smuggled = b"0\r\n\r\nGET /v1/models HTTP/1.1\r\nHost: t\r\n\r\n"
    # a coding h11 does not speak is its own refusal first: 501, as RFC 9112 6.1 asks
    for te, status in ((b"chunked", 400), (b"Chunked", 400), (b"gzip, chunked", 501)):
        reader = RequestReader(1 << 16)
        reader.feed(b"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nContent-Length: %d\r\n"
                    b"Transfer-Encoding: %b\r\n\r\n%b" % (len(smuggled), te, smuggled))
        with pytest.raises(BadRequest) as bad:
            reader.next_event()
        assert bad.value.status == status
        assert status == 501 or "both Content-Length and Transfer-Encoding" in str(bad.value)
        with pytest.raises(BadRequest):  # refused for good: the smuggled request is never reached
            reader.next_event()


@pytest.mark.parametrize("version", [b"9.9", b"2.0", b"0.9", b"1.2"])
def test_an_http_version_other_than_10_and_11_is_505(version: bytes) -> None:
    reader = RequestReader(1 << 16)
    reader.feed(b"GET / HTTP/%b\r\nHost: t\r\n\r\n" % version)
    with pytest.raises(BadRequest) as bad:
        reader.next_event()
    assert bad.value.status == 505 and f"HTTP/{version.decode()} is not supported" in str(bad.value)


def test_a_head_cut_by_the_clients_close_is_400() -> None:
    reader = RequestReader(1 << 16)
    reader.feed(b"GET / HTTP/1.1\r\nHos")
    assert reader.next_event() is NEED_DATA
    reader.feed(b"")
    with pytest.raises(BadRequest):
        reader.next_event()


def test_without_a_length_an_http11_answer_is_chunked_and_kept_alive() -> None:
    sse = [(b"content-type", b"text/event-stream")]
    head, framing = response_head(200, sse, head_of(GET), keep_alive=True)
    lines = head.split(b"\r\n")
    assert lines[0] == b"HTTP/1.1 200 OK" and b"transfer-encoding: chunked" in lines
    assert b"content-type: text/event-stream" in lines and any(x.startswith(b"date: ") for x in lines)
    assert b"connection: close" not in lines and head.endswith(b"\r\n\r\n")
    assert framing.mode is Mode.CHUNKED and framing.keep_alive
    assert framing.body(b"data: 1\n\n", True) == b"9\r\ndata: 1\n\n\r\n"
    assert framing.body(b"", True) == b""  # an empty chunk would end the body
    assert framing.body(b"x", False) == b"1\r\nx\r\n0\r\n\r\n"


def test_an_empty_last_chunk_just_ends_a_chunked_body() -> None:
    _, framing = response_head(200, [], head_of(GET), keep_alive=True)
    assert framing.body(b"", False) == b"0\r\n\r\n"


def test_a_content_length_is_kept_and_held_to() -> None:
    head, framing = response_head(200, [(b"Content-Length", b"5")], head_of(GET), keep_alive=True)
    assert b"content-length: 5" in head.split(b"\r\n") and b"transfer-encoding" not in head
    assert framing.mode is Mode.LENGTH
    assert framing.body(b"abc", True) == b"abc" and framing.body(b"de", False) == b"de" and framing.keep_alive
    with pytest.raises(ValueError, match="more body"):
        framing.body(b"!", False)
    _, short = response_head(200, [(b"content-length", b"5")], head_of(GET), keep_alive=True)
    short.body(b"abc", False)
    assert not short.keep_alive  # short of its length: only a close ends it


def test_http10_without_a_length_is_close_delimited() -> None:
    head, framing = response_head(200, [], head_of(b"GET / HTTP/1.0\r\n\r\n"), keep_alive=True)
    assert framing.mode is Mode.CLOSE and not framing.keep_alive and b"connection: close" in head
    assert b"transfer-encoding" not in head and framing.body(b"raw", True) == b"raw"
    keep = head_of(b"GET / HTTP/1.0\r\nConnection: keep-alive\r\n\r\n")
    head, framing = response_head(200, [(b"content-length", b"2")], keep, keep_alive=True)
    assert framing.keep_alive and b"connection: keep-alive" in head


@pytest.mark.parametrize("status", [204, 304])
def test_head_and_bodyless_statuses_answer_without_a_body(status: int) -> None:
    head_req = head_of(b"HEAD / HTTP/1.1\r\nHost: t\r\n\r\n")
    head, framing = response_head(200, [(b"content-length", b"42")], head_req, keep_alive=True)
    assert framing.mode is Mode.NONE and b"content-length: 42" in head
    assert framing.body(b"x" * 42, False) == b""
    head, framing = response_head(status, [], head_of(GET), keep_alive=True)
    assert framing.mode is Mode.NONE and b"transfer-encoding" not in head and framing.keep_alive


def test_the_apps_connection_close_and_transfer_encoding_are_the_servers_to_write() -> None:
    head, framing = response_head(503, [(b"connection", b"close"), (b"transfer-encoding", b"gzip")],
                                  head_of(GET), keep_alive=True)
    assert not framing.keep_alive and head.count(b"connection: close") == 1
    assert b"gzip" not in head and b"transfer-encoding: chunked" in head
    head, _ = response_head(200, [], head_of(GET), keep_alive=False)  # the server's own reason (drain)
    assert b"connection: close" in head


def test_a_header_with_a_line_break_is_refused() -> None:
    with pytest.raises(ValueError, match="line break"):
        response_head(200, [(b"x-evil", b"a\r\nset-cookie: b")], head_of(GET), keep_alive=True)


def test_status_lines_and_the_servers_own_answers() -> None:
    assert status_line(431) == b"HTTP/1.1 431 Request Header Fields Too Large\r\n"
    assert status_line(599) == b"HTTP/1.1 599 \r\n"
    answer = simple_response(400, b'{"e":1}')
    head, _, body = answer.partition(b"\r\n\r\n")
    assert body == b'{"e":1}' and b"content-length: 7" in head and b"connection: close" in head
