"""``POST /v1/images/generations`` against a real server on loopback (validation on both fronts).

The image tests serve a small text-to-image pipeline of real worker
processes (encoder -> diffusion); the last one serves the in-process toy
speech pipeline, whose server makes no images.
"""

from __future__ import annotations

import base64
import io
import logging
import os
import re
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from PIL import Image

from stages.config import PipelineConfig, StageConfig
from tests.http_helpers import FRONTS, serve
from trio_orch.cluster.launcher import open_pipeline
from trio_orch.testing import LeakProbe
from trio_orch.testing.toy_pipeline import toy_pipeline

HANG = 60.0
ROOT = Path(__file__).resolve().parents[2]
SMALL = {"d_model": 32, "layers": 1, "heads": 2}
CONFIG = PipelineConfig([StageConfig("encoder", model=SMALL),
                         StageConfig("diffusion", model={**SMALL, "cond_dim": 32, "vae_dim": 8})],
                        final_stage_ids=[1]).validate()


@pytest.fixture(scope="module")
def images() -> Iterator[httpx.Client]:
    probe = LeakProbe()

    @asynccontextmanager
    async def factory() -> AsyncIterator[Any]:
        async with open_pipeline(CONFIG) as pipe:
            probe.saw(pipe.pids)
            probe.saw_dir(pipe.tmpdir)
            yield pipe

    served = serve("asyncio", factory, engine_options={"startup_timeout": HANG}, model_name="tiny-image",
                   outputs=CONFIG.outputs())
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


@pytest.fixture(scope="module", params=FRONTS)
def validating(request: pytest.FixtureRequest) -> Iterator[httpx.Client]:
    """A server that says its final stage gives images but never gets that far: the front refuses first."""
    served = serve(request.param, toy_pipeline(), model_name="tiny-image", outputs=["text", "codes", "image"])
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
    ({"prompt": "x", "negative_prompt": ["a"]}, "negative_prompt"),
    ({"prompt": "x", "guidance_scale": "high"}, "guidance_scale"),
    ({"prompt": "x", "guidance_scale": 1000}, "guidance_scale"),
    ({"prompt": "x", "num_inference_steps": 0}, "num_inference_steps"),
    ({"prompt": "x", "num_inference_steps": 8.5}, "num_inference_steps"),
    ({"prompt": "x", "seed": -1}, "seed"),
])
def test_bad_input_is_a_400_naming_the_field(validating: httpx.Client, body: Any, param: str) -> None:
    r = validating.post("/v1/images/generations", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error" and param in err["message"]


def test_a_model_not_served_is_a_404_and_a_body_not_an_object_a_400(validating: httpx.Client) -> None:
    r = validating.post("/v1/images/generations", json={"prompt": "x", "model": "dall-e-3"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found", r.text
    assert "dall-e-3" in r.json()["error"]["message"]
    r = validating.post("/v1/images/generations", json=[1, 2])
    assert r.status_code == 400 and "JSON object" in r.json()["error"]["message"], r.text


@pytest.mark.slow
def test_an_unknown_field_is_ignored_and_logged(images: httpx.Client,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        r = images.post("/v1/images/generations", json={
            "prompt": "a cat", "size": "32x32", "guidance_scale": 1, "num_inference_steps": 2,
            "quality": "hd"})
    assert png_of(r).size == (32, 32)
    assert any("'quality'" in rec.getMessage() for rec in caplog.records)


def test_malformed_json_is_a_400(validating: httpx.Client) -> None:
    r = validating.post("/v1/images/generations", content=b"{not json",
                        headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"


@pytest.mark.parametrize("front", FRONTS)
def test_a_server_whose_pipeline_makes_no_images_says_so(serving: Callable[..., Any], front: str) -> None:
    served = serving(front, toy_pipeline(), model_name="tiny-image")
    with httpx.Client(base_url=served.url, timeout=HANG) as c:
        r = c.post("/v1/images/generations", json={"prompt": "a cat"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "model"
        assert "--pipeline text2image" in r.json()["error"]["message"]
        assert c.get("/health").status_code == 200  # the rest of the server is fine


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
        assert proc.wait(30) == 0  # a clean drain after the signal (the documented exit code)
        assert list(tmp_path.iterdir()) == []  # no ipc socket or log left behind
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
