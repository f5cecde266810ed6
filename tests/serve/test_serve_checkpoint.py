"""``trio-orch serve MODEL_DIR`` as a vLLM user runs it, on a tiny random checkpoint built here.

The real command in a process of its own, its worker a real ``hf-causal-lm``
stage, the official ``openai`` SDK as the client: the streamed greedy chat
answer is ``transformers``' ``generate()`` on the same chat-templated prompt,
token for token; four concurrent requests of different lengths give what
each gives alone; ``/tokenize`` counts what the tokenizer's own chat template
gives; a prompt past ``--max-model-len`` is a 400 naming both numbers;
``serve --model DIR`` is ``serve DIR``; a path that is no checkpoint exits 2
naming it before any worker starts.  Every worker is gone after each server.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.serve_process import ROOT, Server
from tests.waiting import HANG

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")
openai = pytest.importorskip("openai")

CONTEXT = 128
MODEL = "tiny"  # --served-model-name of the module's server
QUESTIONS = ["hi", "hello world, how are you today?", "café 東京 " * 4,
             "one two three four five six seven eight"]


@pytest.fixture(scope="module")
def served(tiny_qwen2: Any) -> Iterator[Server]:
    s = Server(str(tiny_qwen2.path), "--max-model-len", str(CONTEXT), "--served-model-name", MODEL)
    try:
        yield s
    finally:
        s.stop()


def chat(content: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": content}]


def reference(ckpt: Any, content: str, n: int) -> tuple[list[int], str]:
    """``generate()``'s greedy tokens on the chat-templated prompt (end-of-text left out) and their text."""
    tok = transformers.AutoTokenizer.from_pretrained(str(ckpt.path))
    ids = tok.apply_chat_template(chat(content), add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(ckpt.path)).eval()
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False)[0, len(ids):].tolist()
    if out and out[-1] in ckpt.eos_token_id:
        out = out[:-1]
    return out, tok.decode(out, skip_special_tokens=True).rstrip("\ufffd")


def streamed(client: Any, content: str, n: int) -> tuple[str, int, str]:
    """A streamed greedy chat answer: its text, completion tokens and finish reason."""
    chunks = list(client.chat.completions.create(model=MODEL, messages=chat(content), max_tokens=n,
                                                 temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason][-1]
    return text, chunks[-1].usage.completion_tokens, finish


def test_the_streamed_greedy_answer_is_generate_s_token_for_token(served: Server, tiny_qwen2: Any) -> None:
    with served.sdk() as client:
        cards = client.models.list().data
        assert [c.id for c in cards] == [MODEL] and cards[0].model_extra["max_model_len"] == CONTEXT
        for content in QUESTIONS[:2]:
            tokens, text = reference(tiny_qwen2, content, 16)
            got, count, finish = streamed(client, content, 16)
            assert (got, count) == (text, len(tokens))
            assert finish == ("length" if len(tokens) == 16 else "stop")


def test_four_concurrent_requests_give_what_each_gives_alone(served: Server, tiny_qwen2: Any) -> None:
    with served.sdk() as client:
        alone = [streamed(client, q, 24) for q in QUESTIONS]
        with ThreadPoolExecutor(4) as pool:  # together: each joins while the others are running
            together = list(pool.map(lambda q: streamed(client, q, 24), QUESTIONS))
    assert together == alone
    assert [a[:2] for a in alone] == [(text, len(toks)) for toks, text in
                                      (reference(tiny_qwen2, q, 24) for q in QUESTIONS)]


def test_tokenize_counts_what_the_checkpoint_s_chat_template_gives(served: Server, tiny_qwen2: Any) -> None:
    tok = transformers.AutoTokenizer.from_pretrained(str(tiny_qwen2.path))
    with httpx.Client(base_url=served.url, timeout=HANG) as c:
        for content in QUESTIONS:
            ids = tok.apply_chat_template(chat(content), add_generation_prompt=True, tokenize=True)
            ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
            got = c.post("/tokenize", json={"messages": chat(content)}).json()
            assert (got["tokens"], got["count"], got["max_model_len"]) == (ids, len(ids), CONTEXT)
        plain = c.post("/tokenize", json={"prompt": "hello world"}).json()
        assert plain["tokens"] == tok("hello world").input_ids


def test_a_prompt_past_the_context_is_a_400_naming_both_numbers(served: Server, tiny_qwen2: Any) -> None:
    tok = transformers.AutoTokenizer.from_pretrained(str(tiny_qwen2.path))
    long = "one two three " * 30
    n = len(tok.apply_chat_template(chat(long), add_generation_prompt=True, tokenize=True)["input_ids"])
    assert n > CONTEXT
    with served.sdk() as client:
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=MODEL, messages=chat(long), stream=True)
        assert f"maximum context length is {CONTEXT} tokens" in info.value.body["message"]
        assert f"requested {n} tokens" in info.value.body["message"]
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model=MODEL, prompt="hello", max_tokens=CONTEXT)
        assert f"({len(tok('hello').input_ids)} in the messages, {CONTEXT} in the completion)" in \
            info.value.body["message"]


def test_serve_dash_dash_model_is_serve_model_dir_named_as_given(served: Server, tiny_qwen2: Any) -> None:
    given = os.path.relpath(tiny_qwen2.path, ROOT)  # the path as typed: the default served name (vLLM's)
    other = Server("--model", given, "--max-model-len", str(CONTEXT), "--loop", "trio")
    try:
        with other.sdk() as a, served.sdk() as b:
            cards = a.models.list().data
            assert [(m.id, m.model_extra["max_model_len"]) for m in cards] == [(given, CONTEXT)]
            answer = a.chat.completions.create(model=given, messages=chat(QUESTIONS[1]), max_tokens=12,
                                               temperature=0)
            assert (answer.choices[0].message.content, answer.usage.completion_tokens) == \
                streamed(b, QUESTIONS[1], 12)[:2]
    finally:
        other.stop()


def test_a_path_that_is_no_checkpoint_exits_2_naming_it_before_any_worker(tmp_path: Path) -> None:
    for path in ("/no/such/dir", str(tmp_path)):
        proc = subprocess.run([sys.executable, "-m", "trio_orch.cli", "serve", path, "--port", "0"], cwd=ROOT,
                              capture_output=True, text=True, timeout=HANG * 2, env=dict(os.environ))
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr.startswith(f"error: {path}") and "Traceback" not in proc.stderr
        assert "starting" not in proc.stdout, proc.stdout  # no worker was started


def test_generate_dash_dash_model_prints_generate_s_answer(tiny_qwen2: Any, tmp_path: Path) -> None:
    _, text = reference(tiny_qwen2, "hello world, how are you today?", 10)
    proc = subprocess.run([sys.executable, "-m", "trio_orch.cli", "generate", "--model", str(tiny_qwen2.path),
                           "--max-tokens", "10", "--temperature", "0", "hello world, how are you today?"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=HANG * 4)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"text: {text}\n")
    assert not (tmp_path / "out.wav").exists()  # text only: no audio stage
