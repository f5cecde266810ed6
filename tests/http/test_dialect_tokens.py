"""Usage and the token counters speak the text stage's tokens on every route, not the prompt's bytes.

A speech pipeline of worker processes (thinker -> talker -> code2wav) whose
thinker reads a word-level ``tokenizer.json`` (``[stages.model] tokenizer``),
behind a real server on both fronts, driven with the official ``openai`` SDK:
``/v1/completions`` usage, ``/v1/audio/speech``'s ``input_tokens`` and its
length limit, and ``trio_orch_prompt_tokens_total`` all count what
``/tokenize`` counts -- one token per word here, where bytes would be several.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from stages.config import PipelineConfig, StageConfig
from tests.http_helpers import FRONTS, HANG, Served, TrioServed, metrics, sse_events
from tests.tokenizer_helpers import word_tokenizer

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.processes  # worker processes behind a real server

WORDS = ["</s>", "[UNK]", "user", ":", "assistant", "the", "cat", "sat", "on", "a", "mat", "."]
SMALL = {"d_model": 32, "layers": 1, "heads": 2}


@pytest.fixture(scope="module", params=FRONTS)
def served(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[Served | TrioServed]:
    from tests.http.test_omni_serving import worker_server

    path = str(word_tokenizer(tmp_path_factory.mktemp("tok") / "tokenizer.json", WORDS))
    # a context small enough that the speech route's own 4,096-character bound never comes first
    config = PipelineConfig([StageConfig("thinker", model={**SMALL, "tokenizer": path, "max_model_len": 256}),
                             StageConfig("talker", model=SMALL), StageConfig("code2wav", model={"dim": 16})],
                            final_stage_ids=[0, 2]).validate()
    yield from worker_server(request.param, config)


def test_completions_and_speech_count_the_text_stage_s_tokens(served: Served) -> None:
    with openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0, timeout=HANG) as c, \
            httpx.Client(base_url=served.url, timeout=HANG) as h:  # closed: the leak probe counts sockets
        assert h.post("/tokenize", json={"prompt": "the cat sat"}).json()["count"] == 3
        before = metrics(h)["trio_orch_prompt_tokens_total"]
        done = c.completions.create(model="omni", prompt="the cat sat", max_tokens=2, seed=1)
        streamed = list(c.completions.create(model="omni", prompt="the cat sat", max_tokens=2, seed=1,
                                             stream=True, stream_options={"include_usage": True}))
        with h.stream("POST", "/v1/audio/speech", json={
                "model": "omni", "voice": "echo", "input": "the cat sat", "response_format": "pcm",
                "stream_format": "sse"}) as r:
            assert r.status_code == 200
            events = sse_events(r.iter_lines())
        after = metrics(h)["trio_orch_prompt_tokens_total"]
    assert done.usage is not None and done.usage.prompt_tokens == 3  # 11 bytes, 3 words
    assert streamed[-1].usage is not None and streamed[-1].usage.prompt_tokens == 3
    assert events[-1]["type"] == "speech.audio.done", events[-1]
    assert events[-1]["usage"]["input_tokens"] == 3
    assert after - before == 3 + 3 + 3


def test_the_speech_limit_is_the_thinker_s_tokens_not_the_input_s_bytes(served: Served) -> None:
    limit = served.engine.stage_info(0)["max_say"]
    fits = " ".join(["cat"] * (limit // 2))  # twice as many bytes as the limit, half as many tokens
    assert len(fits.encode()) > limit
    with openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0, timeout=HANG) as c:
        wav = c.audio.speech.create(model="omni", voice="echo", input=fits, response_format="wav").content
        assert wav[:4] == b"RIFF" and len(wav) > 44
        with pytest.raises(openai.BadRequestError) as long:
            c.audio.speech.create(model="omni", voice="echo", input=" ".join(["cat"] * (limit + 1)))
    error: dict[str, Any] = json.loads(long.value.response.text)["error"]
    assert (error["param"], error["code"]) == ("input", "context_length_exceeded")
    assert f"{limit + 1} tokens" in error["message"]
