"""Limits that say so: a prompt and its completion over the model's context are a 400 in vLLM's words.

A thinker worker with a small context (``max_model_len``) behind a real
server: chat and completions refuse, before admission, a prompt that alone
fills the context and one whose ``max_tokens`` would overflow it -- the
message names both numbers -- and serve one that fits; ``/v1/models`` and
``/tokenize`` report the context.  The stage itself refuses the same (no
server in between) and truncates nothing.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from stages.base import ReqState
from stages.config import PipelineConfig, StageConfig
from stages.limits import context_error
from stages.toy.models import Thinker
from tests.http_helpers import HANG, Served, TrioServed, worker_server

openai = pytest.importorskip("openai")

CONTEXT = 64
THINKER = PipelineConfig([StageConfig("thinker", model={"d_model": 32, "layers": 1, "heads": 2,
                                                        "max_model_len": CONTEXT})],
                         final_stage_ids=[0]).validate()


@pytest.fixture(scope="module")
def small() -> Iterator[Served | TrioServed]:
    yield from worker_server("trio", THINKER)


def user(n_bytes: int) -> list[dict[str, Any]]:
    """A chat whose prompt (the default template: ``user: ...\\nassistant:``) is ``n_bytes`` tokens."""
    return [{"role": "user", "content": "x" * (n_bytes - len(b"user: \nassistant:"))}]


def test_the_rule_in_vllm_s_words() -> None:
    assert context_error(64, 63, None) is None and context_error(64, 60, 4) is None
    assert context_error(64, 64, None) == ("This model's maximum context length is 64 tokens. However, you "
                                           "requested 64 tokens in the messages. Please reduce the length "
                                           "of the messages.")
    assert context_error(64, 60, 5) == ("This model's maximum context length is 64 tokens. However, you "
                                        "requested 65 tokens (60 in the messages, 5 in the completion). "
                                        "Please reduce the length of the messages or completion.")


def test_the_thinker_refuses_what_does_not_fit_and_answers_up_to_its_context() -> None:
    m = Thinker(d_model=16, layers=1, heads=2, max_model_len=20, max_new_tokens=48, min_new_tokens=48,
                slots=1)
    with pytest.raises(ValueError, match=r"maximum context length is 20 tokens.*requested 20 tokens"):
        m.admit(ReqState("r", "x" * 20))
    with pytest.raises(ValueError, match=r"requested 21 tokens \(15 in the messages, 6 in the completion\)"):
        m.admit(ReqState("r", "x" * 15, sampling={"max_tokens": 6}))
    req = ReqState("r", "x" * 15)  # no max_tokens: as many as fit, and the prompt is all there
    m.admit(req)
    assert req.model["prompt"] == list(b"x" * 15)
    tokens = []
    while True:
        [res] = m.step([req])
        tokens += list(res.data["tokens"]) if res.data else []
        if res.finished:
            break
    assert len(tokens) == 5 and res.data["finish_reason"] == "length"  # 15 + 5 = the whole context


@pytest.mark.processes
def test_chat_and_completions_refuse_past_the_context_naming_both_numbers(small: Served) -> None:
    with httpx.Client(base_url=small.url, timeout=HANG) as c:
        card = c.get("/v1/models").json()["data"][0]
        assert card["max_model_len"] == CONTEXT
        counted = c.post("/tokenize", json={"messages": user(CONTEXT)}).json()
        assert (counted["count"], counted["max_model_len"]) == (CONTEXT, CONTEXT)
    with openai.OpenAI(base_url=small.url + "/v1", api_key="unused", max_retries=0, timeout=HANG) as client:
        with pytest.raises(openai.BadRequestError) as whole:  # the prompt alone fills the context
            client.chat.completions.create(model="tiny", messages=user(CONTEXT))
        body = whole.value.body
        assert "maximum context length is 64 tokens" in body["message"]
        assert "requested 64 tokens in the messages" in body["message"]
        assert (body["code"], body["param"]) == ("context_length_exceeded", "messages")
        with pytest.raises(openai.BadRequestError) as over:  # streamed: refused before the stream opens
            client.chat.completions.create(model="tiny", messages=user(40), max_tokens=30, stream=True)
        assert "requested 70 tokens (40 in the messages, 30 in the completion)" in over.value.body["message"]
        with pytest.raises(openai.BadRequestError) as comp:
            client.completions.create(model="tiny", prompt="y" * 50, max_tokens=20)
        assert "requested 70 tokens (50 in the messages, 20 in the completion)" in comp.value.body["message"]
        assert comp.value.body["param"] == "prompt"
        fits = client.chat.completions.create(model="tiny", messages=user(40), max_tokens=24, temperature=0)
        assert fits.usage.prompt_tokens == 40 and 1 <= fits.usage.completion_tokens <= 24
        full = client.completions.create(model="tiny", prompt="y" * 60, temperature=0,
                                         extra_body={"min_tokens": 4})
        assert full.usage.completion_tokens == 4 and full.choices[0].finish_reason == "length"  # context full
