"""Images and audio through a real server to encoder workers and the thinker; the chat template over HTTP.

A real server on loopback, on both fronts (the ``serving`` fixture's helper,
module-scoped here: workers take a while to start), over the omni-in
pipeline's worker processes (image-encoder -> audio-encoder ->
thinker): the same text and seed with a red and a blue image, or a low and
a high tone (WAV or FLAC; a FLAC answers as the WAV of its samples), give
different answers; a corrupt image, or a remote URL on a server not started
with ``--allowed-media-domains``, is a 400 naming its part, before anything
reaches a stage or the URL's host.  Remote URLs that are allowed:
tests/http/test_media_remote.py.  The chat template over HTTP is
tests/http/test_template_serving.py.
"""

from __future__ import annotations

import base64
import io
import socket
import wave
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import httpx
import numpy as np
import pytest
import soundfile
from PIL import Image

from stages.config import PipelineConfig, StageConfig, builtin_config
from tests import http_helpers
from tests.http_helpers import FRONTS, HANG, Served, TrioServed, serve
from tests.waiting import wait_until
from trio_orch.cluster.launcher import open_pipeline
from trio_orch.testing import LeakProbe

pytestmark = pytest.mark.processes  # worker processes behind a real server

STARTUP = 120.0
SMALL = {"d_model": 32, "layers": 1, "heads": 2}
OMNI = builtin_config("omni-in")
for _st in OMNI.stages:
    if _st.kind == "thinker":
        _st.model = dict(SMALL)
THINKER = PipelineConfig([StageConfig("thinker", model=dict(SMALL))]).validate()


def worker_server(front: str, config: PipelineConfig, **app: Any) -> Iterator[Served | TrioServed]:
    """``config``'s workers behind ``front``; no process, descriptor or ipc file is left after."""
    probe = LeakProbe()

    @asynccontextmanager
    async def factory() -> AsyncIterator[Any]:
        async with open_pipeline(config) as pipe:
            probe.saw(pipe.pids)
            probe.saw_dir(pipe.tmpdir)
            yield pipe

    options = {"startup_timeout": STARTUP} if front == "asyncio" else {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(http_helpers, "wait_until", partial(wait_until, hang=STARTUP))
        served = serve(front, factory, engine_options=options, model_name="omni", outputs=config.outputs(),
                       **app)
    try:
        yield served
    finally:
        served.stop()
    assert probe.leaks() == {"processes": 0, "fds": 0, "ipc_files": 0}


@pytest.fixture(scope="module", params=FRONTS)
def omni(request: pytest.FixtureRequest) -> Iterator[Served | TrioServed]:
    yield from worker_server(request.param, OMNI)


def png_url(rgb: tuple[int, int, int]) -> str:
    buf = io.BytesIO()
    Image.new("RGB", (64, 64), rgb).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def wav_b64(freq: float, rate: int = 16000) -> str:
    t = np.arange(rate // 2) / rate
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes((0.5 * np.sin(2 * np.pi * freq * t) * 32767).astype("<i2").tobytes())
    return base64.b64encode(buf.getvalue()).decode()


def ask(c: httpx.Client, part: dict[str, Any]) -> httpx.Response:
    body = {"model": "omni", "seed": 11, "max_tokens": 16, "temperature": 0.9,
            "messages": [{"role": "user", "content": [{"type": "text", "text": "What is this?"}, part]}]}
    return c.post("/v1/chat/completions", json=body)


def answer(c: httpx.Client, part: dict[str, Any]) -> str:
    r = ask(c, part)
    assert r.status_code == 200, r.text
    text: str = r.json()["choices"][0]["message"]["content"]
    assert text
    return text


def test_a_red_and_a_blue_image_give_different_answers_and_the_same_one_the_same(omni: Served) -> None:
    with httpx.Client(base_url=omni.url, timeout=HANG) as c:
        red = answer(c, {"type": "image_url", "image_url": {"url": png_url((255, 0, 0))}})
        blue = answer(c, {"type": "image_url", "image_url": {"url": png_url((0, 0, 255))}})
        assert red != blue
        assert answer(c, {"type": "image_url", "image_url": {"url": png_url((255, 0, 0))}}) == red


def test_two_tones_give_different_answers(omni: Served) -> None:
    with httpx.Client(base_url=omni.url, timeout=HANG) as c:
        low = answer(c, {"type": "input_audio", "input_audio": {"data": wav_b64(220), "format": "wav"}})
        high = answer(c, {"type": "input_audio", "input_audio": {"data": wav_b64(1760), "format": "wav"}})
        assert low != high


def test_a_flac_of_a_tone_answers_as_its_wav_and_two_tones_differ(omni: Served) -> None:
    def flac_b64(freq: float) -> str:  # the WAV's very samples, losslessly
        samples, rate = soundfile.read(io.BytesIO(base64.b64decode(wav_b64(freq))), dtype="int16")
        buf = io.BytesIO()
        soundfile.write(buf, samples, rate, format="FLAC", subtype="PCM_16")
        return base64.b64encode(buf.getvalue()).decode()

    def sound(data: str, fmt: str) -> dict[str, Any]:
        return {"type": "input_audio", "input_audio": {"data": data, "format": fmt}}

    with httpx.Client(base_url=omni.url, timeout=HANG) as c:
        low = answer(c, sound(flac_b64(220), "flac"))
        assert low == answer(c, sound(wav_b64(220), "wav"))
        assert low != answer(c, sound(flac_b64(1760), "flac"))


def test_a_corrupt_png_or_a_remote_url_is_a_400_naming_the_part(omni: Served) -> None:
    corrupt = "data:image/png;base64," + base64.b64encode(b"\x89PNG\r\n\x1a\n" + b"\0" * 40).decode()
    with socket.create_server(("127.0.0.1", 0)) as listener, \
            httpx.Client(base_url=omni.url, timeout=HANG) as c:
        # this server was started without --allowed-media-domains
        remote = f"http://127.0.0.1:{listener.getsockname()[1]}/a.png"
        for url, says in ((corrupt, "not a readable image"), (remote, "not fetched")):
            r = ask(c, {"type": "image_url", "image_url": {"url": url}})
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["param"] == "messages[0].content[1]" and says in err["message"]
        assert answer(c, {"type": "text", "text": " Plain text still works."})
        listener.setblocking(False)
        with pytest.raises(BlockingIOError):
            listener.accept()  # nobody connected: the server fetched nothing
