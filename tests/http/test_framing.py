"""The framing rules both fronts parse through (:class:`~trio_orch.serve.framing.StrictConnection`), on
bytes alone -- here as uvicorn uses it: one h11 connection for every request of a keep-alive connection."""

from __future__ import annotations

import h11
import pytest

from trio_orch.serve.framing import StrictConnection, error_answer, error_code


def respond(conn: StrictConnection) -> None:
    conn.send(h11.Response(status_code=200, headers=[("content-length", "0")]))
    conn.send(h11.EndOfMessage())


def test_the_head_limit_measures_each_request_s_head_alone_across_cycles() -> None:
    conn = StrictConnection(200)
    body = b"x" * 1000  # far over the head limit: a body is not a head
    conn.receive_data(b"POST /a HTTP/1.1\r\nhost: t\r\ncontent-length: 1000\r\n\r\n" + body)
    assert isinstance(conn.next_event(), h11.Request)
    assert isinstance(conn.next_event(), h11.Data) and isinstance(conn.next_event(), h11.EndOfMessage)
    respond(conn)
    conn.start_next_cycle()
    conn.receive_data(b"GET /b HTTP/1.1\r\nhost: t\r\n\r\n")  # a small head after a large body: parsed
    assert isinstance(conn.next_event(), h11.Request)
    conn.next_event()
    respond(conn)
    conn.start_next_cycle()
    conn.receive_data(b"GET /c HTTP/1.1\r\nhost: t\r\nx-big: " + b"y" * 300 + b"\r\n\r\n")  # whole, too big
    with pytest.raises(h11.RemoteProtocolError) as big:
        conn.next_event()
    assert big.value.error_status_hint == 431 and conn.refusal is big.value


def test_a_refusal_is_for_good_and_its_answer_is_the_app_s_json_shape() -> None:
    conn = StrictConnection(1 << 16)
    conn.receive_data(b"POST / HTTP/1.1\r\nhost: t\r\ncontent-length: 5\r\ntransfer-encoding: chunked\r\n\r\n"
                      b"0\r\n\r\nGET /hidden HTTP/1.1\r\nhost: t\r\n\r\n")
    for _ in range(2):  # the hidden request is never reached
        with pytest.raises(h11.RemoteProtocolError) as bad:
            conn.next_event()
        assert bad.value.error_status_hint == 400
    answer = error_answer(400, f"malformed request: {bad.value}", error_code(400))
    assert answer.startswith(b"HTTP/1.1 400 Bad Request\r\n") and b"connection: close\r\n" in answer
    assert answer.endswith(b'"code":"bad_request"}}')
    assert b"both Content-Length and Transfer-Encoding" in answer
    assert [error_code(s) for s in (431, 501, 505)] == ["request_header_too_large", "not_implemented",
                                                        "http_version_not_supported"]
