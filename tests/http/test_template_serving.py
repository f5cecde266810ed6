"""A chat template over a real server: ``/tokenize`` with ``messages`` counts its preamble.

Two servers over a thinker worker, one after the other (each checked for
leaks when it stops): one with the default template, one with a template
that adds a preamble.  The preamble's tokens are counted, in ``/tokenize``
and in the chat's ``usage``.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.http.test_omni_serving import THINKER, worker_server
from tests.http_helpers import FRONTS, HANG
from trio_orch.openai.chat_template import ChatInput, ChatTemplate

pytestmark = pytest.mark.processes  # worker processes behind a real server

PREAMBLE = ("You are a careful assistant. Answer in one short sentence.\n"
            "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant:{% endif %}")
MESSAGES = [{"role": "user", "content": "hi"}]


def tokenize(url: str, **body: Any) -> dict[str, Any]:
    with httpx.Client(base_url=url, timeout=HANG) as c:
        r = c.post("/tokenize", json={"messages": MESSAGES, **body})
        assert r.status_code == 200, r.text
        return r.json()  # type: ignore[no-any-return]


@pytest.mark.parametrize("front", FRONTS)
def test_tokenize_counts_the_template_s_preamble(front: str) -> None:
    for plain in worker_server(front, THINKER):
        default = tokenize(plain.url)
    assert default["tokens"] == list(b"user: hi\nassistant:")
    for pre in worker_server(front, THINKER, chat_input=ChatInput(ChatTemplate(PREAMBLE, "preamble"))):
        preamble = tokenize(pre.url, return_token_strs=True)
        opened = tokenize(pre.url, add_generation_prompt=False)
        with httpx.Client(base_url=pre.url, timeout=HANG) as c:
            r = c.post("/v1/chat/completions", json={"model": "omni", "messages": MESSAGES, "max_tokens": 4})
        assert r.status_code == 200, r.text
        usage = r.json()["usage"]
    assert preamble["count"] > default["count"]
    assert "".join(preamble["token_strs"]).startswith("You are a careful assistant.")
    assert opened["count"] == preamble["count"] - len(b"assistant:")
    assert usage["prompt_tokens"] == preamble["count"]
