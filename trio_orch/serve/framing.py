"""RFC 9112 request framing that h11 leaves to the server, for both fronts' HTTP/1.1 parsers.

Both fronts parse requests with h11 (uvicorn's H11 protocol, the lean
server's :class:`~trio_orch.serve.trio_http.protocol.RequestReader`), and
h11 leaves three rules to its user.  :class:`StrictConnection` is h11's
server side with them, so the two fronts cannot disagree:

* a request with both ``Content-Length`` and ``Transfer-Encoding`` is
  refused (400) and nothing after it on the connection is parsed (RFC 9112
  6.3: the framing is ambiguous, and a proxy in front may have read the
  bytes after it as a request of its own -- request smuggling);
* an HTTP version other than 1.0 and 1.1 is refused (505);
* the head limit holds however the bytes arrive: h11 bounds a head still
  incomplete, and a head that came whole in one read is measured here (431).

A refusal is an h11 ``RemoteProtocolError`` (its status hint the answer),
kept as :attr:`StrictConnection.refusal` and raised again by every later
``next_event``.  :func:`error_answer` is the whole answer the server gives
itself (OpenAI's error shape, ``connection: close``; :func:`simple_response`
frames it), and :data:`LINGER_SECONDS`
/ :data:`LINGER_BYTES` bound the lingering close that lets a client still
sending read it rather than a reset.
"""

from __future__ import annotations

import http
import time
from email.utils import formatdate

import h11

from trio_orch.http.limits import json_response
from trio_orch.openai.validation import error_body

__all__ = ["LINGER_BYTES", "LINGER_SECONDS", "StrictConnection", "error_answer", "error_code", "http_date",
           "simple_response", "status_line"]

#: how long a closing connection keeps reading (and dropping) its client's input, so the close is no reset
LINGER_SECONDS = 2.0
#: and how much of it at most (a body announced over the limit and sent anyway: its 413 must arrive)
LINGER_BYTES = 64 << 20

#: the HTTP versions served
VERSIONS = frozenset({b"1.0", b"1.1"})

_STATUS_LINES: dict[int, bytes] = {}
_CODES = {431: "request_header_too_large", 501: "not_implemented", 505: "http_version_not_supported"}


def status_line(status: int) -> bytes:
    line = _STATUS_LINES.get(status)
    if line is None:
        try:
            phrase = http.HTTPStatus(status).phrase
        except ValueError:
            phrase = ""
        line = _STATUS_LINES[status] = f"HTTP/1.1 {status} {phrase}\r\n".encode("latin-1")
    return line


_date_cache: tuple[int, bytes] = (0, b"")


def http_date() -> bytes:
    """The ``Date`` header's value, formatted once a second."""
    global _date_cache
    now = int(time.time())
    if _date_cache[0] != now:
        _date_cache = (now, formatdate(now, usegmt=True).encode())
    return _date_cache[1]

def simple_response(status: int, body: bytes, content_type: bytes = b"application/json",
                    extra: list[tuple[bytes, bytes]] | None = None) -> bytes:
    """A whole answer the server gives itself (400, 431, 500, 503): always ``connection: close``."""
    head = [status_line(status), b"content-type: %b\r\n" % content_type,
            b"content-length: %d\r\n" % len(body), b"date: %b\r\n" % http_date()]
    head += [b"%b: %b\r\n" % kv for kv in extra or ()]
    return b"".join([*head, b"connection: close\r\n\r\n", body])


def error_code(status: int) -> str:
    """The OpenAI-shaped error code of a refused request head."""
    return _CODES.get(status, "bad_request")


def error_answer(status: int, message: str, code: str, kind: str = "invalid_request_error",
                 extra: dict[str, str] | None = None) -> bytes:
    """A whole JSON error answer in the app's shape (OpenAI's ``{"error": ...}``), closing."""
    headers, body = json_response(status, error_body(message, kind, None, code), extra)
    return simple_response(status, body, extra=[kv for kv in headers
                                                if kv[0] not in (b"content-type", b"content-length")])


def check_framing(request: h11.Request, head_bytes: int, max_head_bytes: int) -> None:
    """Raise h11's ``RemoteProtocolError`` for a request head the rules above refuse."""
    if request.http_version not in VERSIONS:
        raise h11.RemoteProtocolError(f"HTTP/{request.http_version.decode('latin-1')} is not supported",
                                      error_status_hint=505)
    if head_bytes > max_head_bytes:
        raise h11.RemoteProtocolError(f"the request head is over {max_head_bytes} bytes",
                                      error_status_hint=431)
    names = {name for name, _ in request.headers}
    if b"content-length" in names and b"transfer-encoding" in names:
        raise h11.RemoteProtocolError("a request with both Content-Length and Transfer-Encoding",
                                      error_status_hint=400)


class StrictConnection(h11.Connection):
    """h11's server side with the framing rules of the module docstring."""

    def __init__(self, max_head_bytes: int) -> None:
        super().__init__(h11.SERVER, max_incomplete_event_size=max_head_bytes)
        self.max_head_bytes = max_head_bytes
        self.refusal: h11.RemoteProtocolError | None = None  #: why the connection was refused, once it was
        self._fed = 0  #: bytes received in all
        self._cycle_start = 0  #: of them, where the current request's head began

    def receive_data(self, data: bytes) -> None:
        self._fed += len(data)
        super().receive_data(data)

    def start_next_cycle(self) -> None:
        super().start_next_cycle()
        self._cycle_start = self._fed - len(self.trailing_data[0])

    def next_event(self) -> h11.Event | type[h11.NEED_DATA] | type[h11.PAUSED]:
        if self.refusal is not None:
            raise self.refusal
        try:
            event = super().next_event()
            if isinstance(event, h11.Request):
                head = self._fed - len(self.trailing_data[0]) - self._cycle_start
                check_framing(event, head, self.max_head_bytes)
        except h11.RemoteProtocolError as exc:
            self.refusal = exc
            raise
        return event
