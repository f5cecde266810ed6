"""``POST /v1/images/generations`` against a real uvicorn server on loopback, with httpx.

The image tests serve a small text-to-image pipeline of real worker
processes (encoder -> diffusion); the last one serves the in-process toy
speech pipeline, whose server makes no images.
"""

from __future__ import annotations

import base64
import io
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from PIL import Image

from stages.config import PipelineConfig, StageConfig
from trio_orch.cluster.launcher import open_pipeline
from trio_orch.engine import Engine
from trio_orch.http.app import create_app
from trio_orch.http.openai_images import add_image_routes
from trio_orch.testing import LeakProbe
from trio_orch.testing.toy_pipeline import toy_pipeline

HANG = 60.0
ROOT = Path(__file__).resolve().parents[2]
SMALL = {"d_model": 32, "layers": 1, "heads": 2}
CONFIG = PipelineConfig([StageConfig("encoder", model=SMALL),
                         StageConfig("diffusion", model={**SMALL, "cond_dim": 32, "vae_dim": 8})],
                        final_stage_ids=[1]).validate()


class Served:
    """An Engine + uvicorn in a background thread, on an ephemeral loopback port."""

    def __init__(self, engine: Engine, outputs: list[str] | None) -> None:
        self.engine = engine
        app = create_app(engine, model_name="tiny-image", outputs=outputs)
        add_image_routes(app, engine, model_name="tiny-image", outputs=outputs)
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning",
                                                    lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        end = time.monotonic() + HANG
        while not self.server.started:
            assert time.monotonic() < end, "uvicorn did not start"
            time.sleep(0.01)
        self.url = f"http://127.0.0.1:{self.server.servers[0].sockets[0].getsockname()[1]}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(HANG)
        self.engine.close()
        assert not self.thread.is_alive()


@pytest.fixture(scope="module")
def images() -> Iterator[httpx.Client]:
    probe = LeakProbe()

    @asynccontextmanager
    async def factory() -> AsyncIterator[Any]:
        async with open_pipeline(CONFIG) as pipe:
            probe.saw(pipe.pids)
            probe.saw_dir(pipe.tmpdir)
            yield pipe

    served = Served(Engine(factory, startup_timeout=HANG).start(), CONFIG.outputs())
    try:
        with httpx.Client(base_url=served.url, timeout=HANG) as c:
            yield c
    finally:
        served.stop()
    assert probe.leaks() == {"processes": 0, "fds": 0, "ipc_files": 0}


def png_of(response: httpx.Response) -> Image.Image:
    assert response.status_code == 200, response.text
    [item] = response.json()["data"]
    img = Image.open(io.BytesIO(base64.b64decode(item["b64_json"])))
    assert img.format == "PNG"
    return img


@pytest.mark.slow
def test_a_generation_returns_a_png_of_the_requested_size_with_guidance(images: httpx.Client) -> None:
    r = images.post("/v1/images/generations", json={
        "prompt": "a cat", "negative_prompt": "blurry", "size": "48x32", "n": 1,
        "response_format": "b64_json", "num_inference_steps": 3, "guidance_scale": 7, "model": "tiny-image",
        "seed": 3})
    assert png_of(r).size == (48, 32)
    made = r.json()["trio_orch"]
    assert made["guided_by"].endswith(":negative") and made["guidance_scale"] == 7.0 and made["steps"] == 3
    plain = images.post("/v1/images/generations", json={
        "prompt": "a cat", "size": "48x32", "guidance_scale": 1, "num_inference_steps": 3, "seed": 3})
    assert png_of(plain).size == (48, 32) and plain.json()["trio_orch"]["guided_by"] is None
    assert plain.json()["data"] != r.json()["data"]


@pytest.fixture(scope="module")
def validating() -> Iterator[httpx.Client]:
    """A server that says its final stage gives images but never gets that far: the front refuses first."""
    engine = Engine(toy_pipeline()).start()
    served = Served(engine, ["text", "codes", "image"])
    try:
        with httpx.Client(base_url=served.url, timeout=HANG) as c:
            yield c
    finally:
        served.stop()


@pytest.mark.parametrize("body, param", [
    ({}, "prompt"),
    ({"prompt": 3}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": "x", "n": 2}, "n"),
    ({"prompt": "x", "n": True}, "n"),
    ({"prompt": "x", "size": "1024x1024"}, "size"),
    ({"prompt": "x", "size": "big"}, "size"),
    ({"prompt": "x", "response_format": "url"}, "response_format"),
    ({"prompt": "x", "model": "dall-e-3"}, "model"),
    ({"prompt": "x", "negative_prompt": ["a"]}, "negative_prompt"),
    ({"prompt": "x", "guidance_scale": "high"}, "guidance_scale"),
    ({"prompt": "x", "guidance_scale": 1000}, "guidance_scale"),
    ({"prompt": "x", "num_inference_steps": 0}, "num_inference_steps"),
    ({"prompt": "x", "num_inference_steps": 8.5}, "num_inference_steps"),
    ({"prompt": "x", "seed": -1}, "seed"),
    ({"prompt": "x", "quality": "hd"}, "quality"),
    ([1, 2], "body"),
])
def test_bad_input_is_a_400_naming_the_field(validating: httpx.Client, body: Any, param: str) -> None:
    r = validating.post("/v1/images/generations", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error" and param in err["message"]


def test_malformed_json_is_a_400(validating: httpx.Client) -> None:
    r = validating.post("/v1/images/generations", content=b"{not json",
                        headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"


def test_a_server_whose_pipeline_makes_no_images_says_so() -> None:
    served = Served(Engine(toy_pipeline()).start(), None)
    try:
        with httpx.Client(base_url=served.url, timeout=HANG) as c:
            r = c.post("/v1/images/generations", json={"prompt": "a cat"})
            assert r.status_code == 400 and r.json()["error"]["param"] == "model"
            assert "--pipeline text2image" in r.json()["error"]["message"]
            assert c.get("/health").status_code == 200  # the rest of the server is fine
    finally:
        served.stop()


@pytest.mark.slow
@pytest.mark.processes
def test_trio_orch_serve_text2image_answers_with_a_decodable_png(tmp_path: Path) -> None:
    env = {**os.environ, "TMPDIR": str(tmp_path)}  # the launcher's ipc sockets and logs go here
    proc = subprocess.Popen([sys.executable, "-m", "trio_orch.cli", "serve", "--pipeline", "text2image",
                             "--port", "0"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=env)
    try:
        assert proc.stdout is not None
        url = None
        while url is None:
            line = proc.stdout.readline()
            assert line, "serve exited before it served"
            m = re.search(r"serving on (http://\S+)", line)
            url = m.group(1) if m else None
        with httpx.Client(base_url=url, timeout=HANG) as c:
            r = c.post("/v1/images/generations", json={"prompt": "a red square", "size": "64x32",
                                                       "negative_prompt": "blurry", "num_inference_steps": 2})
            assert png_of(r).size == (64, 32) and r.json()["trio_orch"]["guided_by"]
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 130  # stopped by a signal, cleanly (the documented exit code)
        assert list(tmp_path.iterdir()) == []  # no ipc socket or log left behind
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
