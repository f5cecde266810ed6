"""The server's tokenizer is the text stage's: the ``tokenizers`` library's, a named ``tokenizer.json``.

Without processes: which tokenizer the routes pick from what a stage's
workers report (the built-in byte-level one for a thinker that names none, a
plug-in kind's own file, nothing for a kind that reports none).  Over a real
server and a thinker worker configured with ``[stages.model] tokenizer``:
``/tokenize``, ``/detokenize`` and chat ``usage`` speak that file's ids, and
a streamed answer is the same text as the whole one.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from stages.config import PipelineConfig, StageConfig
from stages.tokenizer import byte_level, load_tokenizer
from tests.http_helpers import FRONTS, HANG, sse_events
from tests.tokenizer_helpers import word_tokenizer
from trio_orch.openai.tokenizer import pipeline_tokenizer

WORDS = ["</s>", "[UNK]", "user", ":", "assistant", "the", "cat", "sat", "on", "a", "mat", "."]



def engine(kinds: list[str], infos: list[dict[str, Any]], final: int = -1) -> Any:
    """The parts of an engine the tokenizer routes read: kinds, final stages, workers' ready info."""
    return SimpleNamespace(stage_kinds=list(kinds), stage_info=lambda k: infos[k],
                           final_stage_ids=[len(kinds) - 1 if final < 0 else final])


def test_the_routes_take_the_tokenizer_a_stage_reports_or_the_library_s_byte_level_one(
        tmp_path: Path) -> None:
    path = str(word_tokenizer(tmp_path / "tokenizer.json", WORDS))
    # a thinker naming none: the library-built byte-level tokenizer, not a second implementation
    assert pipeline_tokenizer(engine(["thinker"], [{}]), ["text"]) == (0, byte_level())
    assert pipeline_tokenizer(engine(["thinker"], [{"tokenizer": ""}]), ["text"]) == (0, byte_level())
    found = pipeline_tokenizer(engine(["thinker"], [{"tokenizer": path}]), ["text"])
    assert found is not None and found[1] is load_tokenizer(path) and found[1].encode("the cat") == [5, 6]
    # a plug-in text kind brings its own by reporting it; one that reports none has no known tokenizer
    plugin = engine(["image-encoder", "my-llm"], [{}, {"tokenizer": path}])
    found = pipeline_tokenizer(plugin, ["data", "text"])
    assert found is not None and found[0] == 1 and found[1].encode("a mat .") == [9, 10, 11]
    assert pipeline_tokenizer(engine(["my-llm"], [{"tokenizer": ""}]), ["text"]) == (0, byte_level())
    assert pipeline_tokenizer(engine(["my-llm"], [{"d_model": 8}]), ["text"]) is None
    # a file this process cannot read: unknown (a 400 naming model), not a wrong count
    gone = engine(["my-llm"], [{"tokenizer": str(tmp_path / "gone.json")}])
    assert pipeline_tokenizer(gone, ["text"]) is None


@pytest.mark.processes
@pytest.mark.parametrize("front", FRONTS)
def test_a_configured_tokenizer_json_is_what_the_server_counts_and_decodes(
        front: str, tmp_path: Path) -> None:
    from tests.http.test_omni_serving import SMALL, worker_server

    path = str(word_tokenizer(tmp_path / "tokenizer.json", WORDS))
    config = PipelineConfig([StageConfig("thinker", model={**SMALL, "tokenizer": path,
                                                           "min_new_tokens": 6})]).validate()
    messages = [{"role": "user", "content": "the cat sat"}]
    chat = {"model": "omni", "messages": messages, "max_tokens": 6, "seed": 4}
    for served in worker_server(front, config):
        with httpx.Client(base_url=served.url, timeout=HANG) as c:
            tok = c.post("/tokenize", json={"prompt": "the cat sat on a mat",
                                            "return_token_strs": True}).json()
            templated = c.post("/tokenize", json={"messages": messages}).json()
            detok = c.post("/detokenize", json={"tokens": [5, 6, 7]}).json()
            bad = c.post("/detokenize", json={"tokens": [5, len(WORDS)]})
            whole = c.post("/v1/chat/completions", json=chat)
            with c.stream("POST", "/v1/chat/completions", json={**chat, "stream": True}) as r:
                events = sse_events(r.iter_lines())
    assert tok["tokens"] == [5, 6, 7, 8, 9, 10] and tok["token_strs"] == "the cat sat on a mat".split()
    assert templated["tokens"] == [2, 3, 5, 6, 7, 4, 3]  # user: the cat sat \n assistant:
    assert detok == {"prompt": "the cat sat"}
    assert bad.status_code == 400 and json.loads(bad.text)["error"]["param"] == "tokens[1]"
    assert whole.status_code == 200, whole.text
    body = whole.json()
    assert body["usage"]["prompt_tokens"] == templated["count"]
    text = body["choices"][0]["message"]["content"]
    assert text and all(w in WORDS for w in re.findall(r"\[UNK\]|\w+|[^\w\s]", text))  # the file's words
    assert body["usage"]["completion_tokens"] == 6 and "</s>" not in text
    streamed = "".join(e["choices"][0]["delta"].get("content") or "" for e in events[:-1] if e["choices"])
    assert streamed == text
