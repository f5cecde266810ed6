"""Remote image URLs (``serve --allowed-media-domains``): fetched from allowed hosts only, within bounds.

Every URL here is on a loopback HTTP server the test starts (``http.server``
in a thread on 127.0.0.1): nothing on the internet is contacted.  In
process: the refusals at parse time (no flag, another host, not http(s)),
and :meth:`ChatRequest.fetch_media` -- a fetch, a redirect kept inside the
allowed hosts, and each failure a 400 naming the part: a redirect elsewhere,
a 404, a timeout (the autojump clock), a declared or a streamed body over the
limit (the connection is closed once the limit is passed, not read to its
end).  Served, on both fronts over the omni-in workers: an image fetched
from its URL gives the answer its data: URL gives.
"""

from __future__ import annotations

import base64
import gzip
import io
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import pytest
import trio
from PIL import Image

from tests.waiting import HANG
from trio_orch.openai.chat import ChatRequest, parse_chat_request
from trio_orch.openai.chat_template import ChatInput
from trio_orch.openai.media import MediaPolicy
from trio_orch.openai.protocol import ServedModels
from trio_orch.openai.validation import BadRequest

MODELS = ServedModels("m")
LIMIT = 4096  # the image byte limit of these tests' policy


def png(rgb: tuple[int, int, int]) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (64, 64), rgb).save(buf, format="PNG")
    return buf.getvalue()


@dataclass
class MediaServer:
    """A loopback HTTP server of a few images and misbehaviours; it counts the requests it gets."""

    paths: list[str] = field(default_factory=list)
    release: threading.Event = field(default_factory=threading.Event)  # lets /hang's handler go
    stream_closed: threading.Event = field(default_factory=threading.Event)  # /endless's client left
    port: int = 0

    def url(self, path: str, host: str = "127.0.0.1") -> str:
        return f"http://{host}:{self.port}{path}"


def _handler(state: MediaServer) -> type[BaseHTTPRequestHandler]:
    images = {"/red.png": png((255, 0, 0)), "/blue.png": png((0, 0, 255))}

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:
            pass

        def reply(self, status: int, body: bytes = b"", **headers: str) -> None:
            self.send_response(status)
            for k, v in {"Content-Length": str(len(body)), **headers}.items():
                self.send_header(k.replace("_", "-"), v)
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:
            state.paths.append(self.path)
            p = self.path
            if p in images:
                self.reply(200, images[p], Content_Type="image/png")
            elif p == "/to-red":
                self.reply(302, Location="/red.png")
            elif p == "/to-localhost":  # the same server under a host name that is not allowed
                self.reply(302, Location=state.url("/red.png", "localhost"))
            elif p == "/to-file":
                self.reply(302, Location="file:///etc/passwd")
            elif p == "/loop":
                self.reply(302, Location="/loop")
            elif p == "/big":  # says it is too big before sending any of it
                self.reply(200, b"x" * (LIMIT + 1), Content_Type="image/png")
            elif p == "/gzip":
                self.reply(200, gzip.compress(images["/red.png"]), Content_Encoding="gzip")
            elif p == "/endless":  # no length, never ends: only the client's limit stops it
                self.send_response(200)
                self.send_header("Content-Type", "image/png")
                self.end_headers()
                try:
                    while not state.release.is_set():
                        self.wfile.write(b"\x89PNG" * 1024)
                except OSError:
                    state.stream_closed.set()
            elif p == "/hang":  # accepts the request, answers nothing
                state.release.wait(HANG * 6)
            else:
                self.reply(404, b"no such image")

    return Handler


@pytest.fixture(scope="module")
def media_server() -> Iterator[MediaServer]:
    state = MediaServer()
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(state))
    server.daemon_threads = True
    state.port = server.server_address[1]
    thread = threading.Thread(target=server.serve_forever, name="media-server", daemon=True)
    thread.start()
    try:
        yield state
    finally:
        state.release.set()
        server.shutdown()
        server.server_close()
        thread.join(HANG)


def policy(**kw: Any) -> MediaPolicy:
    return MediaPolicy(**{"allowed_media_domains": frozenset({"127.0.0.1"}), "max_image_bytes": LIMIT, **kw})


def chat_input(media: MediaPolicy) -> ChatInput:
    return ChatInput(media=media).for_kinds(["image-encoder", "audio-encoder", "thinker"])


def body(*urls: str) -> dict[str, Any]:
    parts = [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    return {"messages": [{"role": "user", "content": [{"type": "text", "text": "what is this?"}, *parts]}]}


def parse(*urls: str, media: MediaPolicy | None = None, defer: bool = True) -> ChatRequest:
    return parse_chat_request(body(*urls), MODELS, chat=chat_input(media or policy()), defer_remote=defer)


def refused(*urls: str, media: MediaPolicy | None = None, defer: bool = True) -> BadRequest:
    with pytest.raises(BadRequest) as err:
        parse(*urls, media=media, defer=defer)
    return err.value


async def fetch_refused(req: ChatRequest) -> BadRequest:
    with pytest.raises(BadRequest) as err:
        await req.fetch_media()
    return err.value


# ------------------------------------------------------------------------------ refused before any fetch


def test_a_remote_url_is_refused_without_the_flag_on_another_host_or_scheme(
        media_server: MediaServer) -> None:
    before = len(media_server.paths)
    err = refused(media_server.url("/red.png"), media=MediaPolicy())
    assert err.param == "messages[0].content[1]"
    assert "not fetched" in str(err) and "--allowed-media-domains" in str(err)
    err = refused(media_server.url("/red.png", "localhost"))
    assert "host 'localhost'" in str(err) and "127.0.0.1" in str(err)
    # a parse that does not defer the fetch (a caller that cannot fetch) says so even for an allowed host
    assert "fetched for chat completions only" in str(refused(media_server.url("/red.png"), defer=False))
    assert "unsupported image URL scheme 'ftp'" in str(refused("ftp://127.0.0.1/red.png"))
    assert len(media_server.paths) == before  # none of them reached the server


def test_the_allowed_hosts_are_host_names_or_addresses_compared_exactly() -> None:
    p = MediaPolicy(allowed_media_domains=frozenset({"Images.Example.COM.", "[::1]", "10.0.0.7"}))
    assert p.allowed_media_domains == {"images.example.com", "::1", "10.0.0.7"}
    for bad in ("http://example.com", "example.com:8080", "", "a/b"):
        with pytest.raises(ValueError, match="not a URL or host:port"):
            MediaPolicy(allowed_media_domains=frozenset({bad}))
    with pytest.raises(ValueError, match="collection of host names"):
        MediaPolicy(allowed_media_domains="example.com")  # type: ignore[arg-type]
    sub = refused("http://cdn.images.example.com/a.png", media=p)  # a subdomain is another host
    assert "not one of the allowed media domains" in str(sub)


# ------------------------------------------------------------------------------------------- fetched


async def test_an_allowed_url_is_fetched_and_decoded_as_its_data_url_is(media_server: MediaServer) -> None:
    data_url = "data:image/png;base64," + base64.b64encode(png((255, 0, 0))).decode()
    inline = parse(data_url).images[0]
    req = parse(media_server.url("/red.png"), data_url, media_server.url("/to-red"),
                media_server.url("/blue.png"))
    assert len(req.remote) == 3
    with pytest.raises(RuntimeError, match="fetch_media"):
        req.payload()  # nothing unfetched goes to a stage
    await req.fetch_media()
    red, again, redirected, blue = req.images
    assert red.shape == (64, 64, 3) and (red == inline).all() and (again == inline).all()
    assert (redirected == inline).all()
    assert tuple(blue[0, 0]) == (0, 0, 255)
    assert req.payload()["images"][0] is red


@pytest.mark.parametrize(("path", "says"), [
    ("/to-localhost", "host 'localhost' (redirected from"),
    ("/to-file", "is not an http(s) URL"),
    ("/loop", "more than 5 redirects"),
    ("/missing.png", "the server answered 404"),
    ("/big", f"over the limit of {LIMIT} bytes"),
    ("/gzip", "gzip-encoded"),
])
async def test_a_fetch_that_fails_is_a_400_naming_its_part(media_server: MediaServer, path: str,
                                                            says: str) -> None:
    data_url = "data:image/png;base64," + base64.b64encode(png((1, 2, 3))).decode()
    err = await fetch_refused(parse(data_url, media_server.url(path)))
    assert err.param == "messages[0].content[2]" and says in str(err), str(err)


async def test_a_body_over_the_limit_is_cut_off_while_it_streams(media_server: MediaServer) -> None:
    err = await fetch_refused(parse(media_server.url("/endless")))
    assert f"over the limit of {LIMIT} bytes" in str(err)
    # the client hung up: the server's next write failed (it would write forever otherwise)
    assert await trio.to_thread.run_sync(media_server.stream_closed.wait, HANG)


async def test_a_host_that_does_not_answer_times_out(media_server: MediaServer,
                                                     autojump_clock: trio.testing.MockClock) -> None:
    err = await fetch_refused(parse(media_server.url("/hang"), media=policy(fetch_timeout=7.0)))
    assert err.param == "messages[0].content[1]" and "timed out after 7 s" in str(err)


async def test_a_host_that_refuses_the_connection_is_a_400() -> None:
    with trio.socket.socket() as sock:  # a port bound but never listening: the connection is refused
        await sock.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{sock.getsockname()[1]}/red.png"
        err = await fetch_refused(parse(url))
    assert "failed (ConnectError" in str(err) and err.param == "messages[0].content[1]"


# --------------------------------------------------------------------------------------------- served


@pytest.fixture(scope="module", params=["asyncio", "trio"])
def omni_remote(request: pytest.FixtureRequest) -> Iterator[Any]:
    from tests.http.test_omni_serving import OMNI, worker_server

    yield from worker_server(request.param, OMNI,
                             chat_input=ChatInput(media=MediaPolicy(allowed_media_domains=frozenset({"127.0.0.1"}))))


@pytest.mark.processes
def test_served_an_image_fetched_from_its_url_answers_as_its_data_url(media_server: MediaServer,
                                                                      omni_remote: Any) -> None:
    # the media server first: its listening socket is then no growth the served fixture's leak probe sees
    from tests.http.test_omni_serving import answer, ask, png_url

    with httpx.Client(base_url=omni_remote.url, timeout=HANG * 6) as c:
        inline = answer(c, {"type": "image_url", "image_url": {"url": png_url((255, 0, 0))}})
        fetched = answer(c, {"type": "image_url", "image_url": {"url": media_server.url("/red.png")}})
        blue = answer(c, {"type": "image_url", "image_url": {"url": media_server.url("/blue.png")}})
        assert fetched == inline and blue != fetched
        for url, says in ((media_server.url("/to-localhost"), "is not one of the allowed media domains"),
                          (media_server.url("/endless"), "over the limit of"),
                          ("https://example.com/a.png", "is not one of the allowed media domains")):
            r = ask(c, {"type": "image_url", "image_url": {"url": url}})
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["param"] == "messages[0].content[1]" and says in err["message"], err
