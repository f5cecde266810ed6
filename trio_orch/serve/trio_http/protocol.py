"""The sans-I/O half of the lean server: request heads in (through h11), response framing out (by hand).

Parsing stays with h11 -- the same parser uvicorn uses, with its
head-size bound and its error hints (400, 431), and the framing rules both
fronts add to it (:class:`~trio_orch.serve.framing.StrictConnection`: 400 for
Content-Length with Transfer-Encoding, 505 for an unknown version) -- but h11
is asked only about the client's side.  A response is framed here: one status line and the
headers, then each body chunk as the app hands it over (``content-length``
when the app gave one, chunked for HTTP/1.1 otherwise, close-delimited for
HTTP/1.0; no body for HEAD, 1xx, 204 and 304).  That is the point of the
lean server: a streamed chunk costs one small ``bytes`` formatting here and
one write, instead of an h11 event, a lock and a checkpoint per chunk.

Each request cycle gets a fresh h11 connection fed with what the
previous one had not parsed yet (:class:`RequestReader`), so the client's
side never waits on a server-side h11 state this module does not keep.
Nothing here touches a socket: it is unit-tested on bytes alone.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from urllib.parse import unquote

import h11

from trio_orch.serve.framing import StrictConnection, http_date, status_line

__all__ = ["CLOSED", "END", "NEED_DATA", "BadRequest", "Framing", "Headers", "Mode", "RequestHead",
           "RequestReader", "parse_head", "response_head"]

Headers = list[tuple[bytes, bytes]]

#: the request body has ended (:meth:`RequestReader.next_event`)
END = "end"
#: more bytes are needed from the client (:meth:`RequestReader.next_event`)
NEED_DATA = "need-data"
#: the client closed its side before a new request (:meth:`RequestReader.next_event`)
CLOSED = "closed"

_NO_BODY_STATUSES = frozenset({204, 304})
_BAD_HEADER_BYTES = (b"\r", b"\n", b"\0")


class BadRequest(Exception):
    """What h11 refuses from a client: answer ``status`` (400; 431 for a head too large; 501, 505), then
    close."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status


@dataclass(frozen=True)
class RequestHead:
    """One parsed request head, in the shapes the ASGI scope wants."""

    method: str
    target: bytes
    http_version: str  #: "1.0" or "1.1"
    headers: Headers  #: names lower-case, as h11 gives them
    keep_alive: bool  #: the client did not ask to close (HTTP/1.0: it asked to keep alive)
    expect_continue: bool  #: ``Expect: 100-continue``
    websocket: bool  #: an ``Upgrade: websocket`` request

    @property
    def raw_path(self) -> bytes:
        """The path of the target, still percent-encoded (an absolute-form target's authority dropped)."""
        path = self.target.partition(b"?")[0]
        if not path.startswith(b"/") and b"://" in path:
            path = b"/" + path.split(b"://", 1)[1].partition(b"/")[2]
        return path or b"/"

    @property
    def path(self) -> str:
        """The percent-decoded path (UTF-8, as ASGI asks)."""
        return unquote(self.raw_path.decode("latin-1"))

    @property
    def query_string(self) -> bytes:
        return self.target.partition(b"?")[2]


def _tokens(headers: Headers, name: bytes) -> set[bytes]:
    """The comma-separated tokens of every ``name`` header, lower-case."""
    return {t.strip().lower() for k, v in headers if k == name for t in v.split(b",")}


def parse_head(request: h11.Request) -> RequestHead:
    headers = list(request.headers)  # h11 lower-cases the names
    version = request.http_version.decode()
    connection = _tokens(headers, b"connection")
    keep_alive = b"close" not in connection and (version != "1.0" or b"keep-alive" in connection)
    upgrade = _tokens(headers, b"upgrade")
    return RequestHead(method=request.method.decode("ascii"), target=request.target,
                       http_version=version, headers=headers, keep_alive=keep_alive,
                       expect_continue=b"100-continue" in _tokens(headers, b"expect"),
                       websocket=b"websocket" in upgrade and b"upgrade" in connection)


class RequestReader:
    """The client's side of a connection: bytes in, request heads and body chunks out.

    ``next_event()`` returns a :class:`RequestHead`, body ``bytes``, :data:`END`,
    :data:`NEED_DATA` or :data:`CLOSED`, and raises :class:`BadRequest`.
    """

    def __init__(self, max_head_bytes: int) -> None:
        self.max_head_bytes = max_head_bytes
        self._conn = StrictConnection(max_head_bytes)
        self.buffered = 0  #: bytes fed since the cycle began (a head in progress if > 0)

    def feed(self, data: bytes) -> None:
        """Bytes from the client; ``b""`` when it closed its side."""
        self.buffered += len(data)
        self._conn.receive_data(data)

    @property
    def eof(self) -> bool:
        """The client closed its side (whatever it sent before is still parsed)."""
        return self._conn.trailing_data[1]

    def next_event(self) -> RequestHead | bytes | str:
        try:
            event = self._conn.next_event()
        except h11.RemoteProtocolError as exc:
            raise BadRequest(exc.error_status_hint, str(exc)) from None
        if isinstance(event, h11.Data):
            return bytes(event.data)
        if isinstance(event, h11.Request):
            return parse_head(event)
        if isinstance(event, h11.EndOfMessage):
            return END
        if event is h11.NEED_DATA:
            return NEED_DATA
        if isinstance(event, h11.ConnectionClosed):
            return CLOSED
        return NEED_DATA  # PAUSED: the request is done, the rest waits for the next cycle

    def leftover(self) -> bytes:
        """What the client sent past the current request (pipelined, or a WebSocket's first frames)."""
        return bytes(self._conn.trailing_data[0])

    def next_cycle(self) -> None:
        """Start on the next request, keeping what is already buffered for it."""
        data, closed = self._conn.trailing_data
        self._conn = StrictConnection(self.max_head_bytes)
        self.buffered = 0
        if data:
            self.feed(bytes(data))
        if closed:
            self._conn.receive_data(b"")


class Mode(enum.Enum):
    LENGTH = "content-length"
    CHUNKED = "chunked"
    CLOSE = "close-delimited"
    NONE = "no body"


class Framing:
    """How one response's body goes on the wire, and whether the connection may carry another request."""

    __slots__ = ("keep_alive", "mode", "remaining")

    def __init__(self, mode: Mode, keep_alive: bool, length: int = 0) -> None:
        self.mode = mode
        self.keep_alive = keep_alive
        self.remaining = length

    def body(self, data: bytes, more: bool) -> bytes:
        """The bytes to write for one ``http.response.body`` message (ValueError past a content-length)."""
        mode = self.mode
        if mode is Mode.CHUNKED:
            if not more:
                return b"%x\r\n%b\r\n0\r\n\r\n" % (len(data), data) if data else b"0\r\n\r\n"
            return b"%x\r\n%b\r\n" % (len(data), data) if data else b""
        if mode is Mode.LENGTH:
            self.remaining -= len(data)
            if self.remaining < 0:
                raise ValueError("the app sent more body than its content-length")
            if not more and self.remaining:
                self.keep_alive = False  # short of its content-length: only a close ends it
            return data
        return data if mode is Mode.CLOSE else b""


def response_head(status: int, headers: Headers, request: RequestHead, *, keep_alive: bool
                  ) -> tuple[bytes, Framing]:
    """The status line and headers of the app's response, and its :class:`Framing`.

    ``keep_alive``: whether the server would keep the connection (the
    request's wish and the server's own state); the app's ``connection:
    close`` and a close-delimited body end it too.  The app's
    ``transfer-encoding`` is replaced by the framing chosen here.
    """
    out = [status_line(status)]
    length: int | None = None
    has_date = False
    for name, value in headers:
        name = name.lower()
        if any(b in name or b in value for b in _BAD_HEADER_BYTES):
            raise ValueError(f"a response header with a line break or NUL: {name!r}")
        if name == b"content-length":
            if length is not None or not value.strip().isdigit():
                raise ValueError(f"a bad or repeated content-length: {value!r}")
            length = int(value)
        elif name == b"transfer-encoding":
            continue
        elif name == b"connection":
            if b"close" in value.lower():
                keep_alive = False
                continue  # written below, once
        elif name == b"date":
            has_date = True
        out.append(b"%b: %b\r\n" % (name, value))
    if status < 200 or status in _NO_BODY_STATUSES or request.method == "HEAD":
        mode = Mode.NONE
    elif length is not None:
        mode = Mode.LENGTH
    elif request.http_version == "1.1":
        mode = Mode.CHUNKED
        out.append(b"transfer-encoding: chunked\r\n")
    else:
        mode = Mode.CLOSE
        keep_alive = False
    if not has_date:
        out.append(b"date: %b\r\n" % http_date())
    if not keep_alive:
        out.append(b"connection: close\r\n")
    elif request.http_version == "1.0":
        out.append(b"connection: keep-alive\r\n")
    out.append(b"\r\n")
    return b"".join(out), Framing(mode, keep_alive, length or 0)
