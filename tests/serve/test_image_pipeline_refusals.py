"""A pipeline that answers with images refuses chat and realtime clearly, not sending the client in a circle.

The app over an in-process pipeline whose final stages are declared to give
an image (what ``serve --pipeline text2image`` declares), driven through
Starlette's test client: chat with either modalities, and a ``/v1/realtime``
handshake.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from starlette.testclient import TestClient, WebSocketDenialResponse

from trio_orch.engine import ThreadEngine
from trio_orch.http.app import create_app
from trio_orch.testing.toy_pipeline import toy_pipeline

#: the toy pipeline's stages 0 and 2 are final: declared to give images, no final stage gives text or audio
IMAGE_OUTPUTS = ["image", "codes", "image"]


@pytest.fixture(scope="module")
def client() -> Iterator[TestClient]:
    with ThreadEngine(toy_pipeline(token_delay=0.001, audio_delay=0.001)) as engine:
        app = create_app(engine, outputs=IMAGE_OUTPUTS, model_name="toy")
        with TestClient(app) as c:
            yield c


@pytest.mark.parametrize("modalities", [["text"], ["text", "audio"]])
def test_a_chat_on_an_image_pipeline_says_what_it_serves_whatever_the_modalities(
        client: TestClient, modalities: list[str]) -> None:
    r = client.post("/v1/chat/completions", json={"model": "toy", "modalities": modalities,
                                                  "messages": [{"role": "user", "content": "a cat"}]})
    assert r.status_code == 400
    message = r.json()["error"]["message"]
    assert "this pipeline answers with image (POST /v1/images/generations), not chat" in message
    assert "ask for modalities" not in message  # no hint that the other modalities would do


def test_a_realtime_session_on_an_image_pipeline_is_refused_at_the_handshake(client: TestClient) -> None:
    with pytest.raises(WebSocketDenialResponse) as refused:
        with client.websocket_connect("/v1/realtime?model=toy"):
            pass
    assert refused.value.status_code == 400
    error = refused.value.json()["error"]
    assert "answers with image, not text or audio" in error["message"] and error["param"] == "model"
