"""The talker's codec ids through the server are ``generate()``'s, for text, image and audio input.

tests/serve/test_serve_omni.py compares what a client hears with
``generate()``'s waveform; the codes between the talker and token2wav never
reach a client.  Here the same checkpoint pipeline -- its three real worker
processes, the real HTTP server and the official ``openai`` SDK -- is served
in this process, so what crosses from stage 1 to stage 2 can be read where
the orchestrator forwards it: the talker's outputs as the pipeline's own
forward function receives them (read, then passed on unchanged).  With the
thinker and the talker greedy, those codes are the ids ``generate(...,
talker_do_sample=False)`` hands its token2wav, and the answer's text and
waveform are ``generate()``'s.  No worker, socket or ipc file is left after.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")
openai = pytest.importorskip("openai")

from stages.config import checkpoint_config  # noqa: E402
from stages.forwarding import codes_input  # noqa: E402
from stages.hf.omni.checkpoint import read_omni_config  # noqa: E402
from stages.hf.omni.parts import load_processor  # noqa: E402
from tests.http_helpers import HANG, worker_server  # noqa: E402
from tests.serve.test_serve_omni import (  # noqa: E402
    GREEDY_TALKER,
    MODEL,
    THINKER_MAX,
    media_part,
    messages,
    wav_samples,
)
from tests.workers import test_omni_parts as parts  # noqa: E402
from trio_orch.openai.chat_template import ChatInput  # noqa: E402
from trio_orch.serve.checkpoint import checkpoint_template  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tapped(tiny_omni: Path) -> Iterator[tuple[Any, list[list[int]]]]:
    """The checkpoint's pipeline behind the Trio front, and the codes of each request that went from the
    talker (stage 1) to token2wav, in order."""
    cfg = checkpoint_config(str(tiny_omni))
    codes: list[list[int]] = []

    def tap(pipe: Any) -> None:
        forward = pipe.forward_fn

        def reading(k: int, prompt: Any, outputs: list[Any], **kw: Any) -> Any:
            if k == 1:
                codes.append(codes_input(prompt, outputs)["codes"].tolist())
            return forward(k, prompt, outputs, **kw)

        pipe.forward_fn = reading

    chat = ChatInput(checkpoint_template(str(tiny_omni)))
    served = worker_server("trio", cfg, prepare=tap, model_name=MODEL, chat_input=chat,
                           stage_names=[s.label for s in cfg.stages])
    yield next(served), codes
    next(served, None)  # stops it; checks that nothing is left


@pytest.mark.parametrize("medium", ["text", "image", "audio"])
def test_the_talkers_codes_through_the_server_are_generate_s(tapped: tuple[Any, list[list[int]]], full: Any,
                                                              tiny_omni: Path, medium: str) -> None:
    served, codes = tapped
    # generate() as the one-process test runs it, with the budgets the request asks for
    talker_max = GREEDY_TALKER["stage_sampling"]["omni-talker"]["max_tokens"]
    assert (parts.THINKER_MAX, parts.TALKER_MAX) == (THINKER_MAX, talker_max)
    part, media = media_part(medium)
    proc = load_processor(tiny_omni)
    shown = {"text": part, "image": {"type": "image"}, "audio": {"type": "audio"}}[medium]
    text = proc.apply_chat_template(messages(shown), add_generation_prompt=True, tokenize=False)
    inputs = dict(proc(text=text, return_tensors="pt", **media))
    ref_ids, ref_codes, ref_wav = parts.generate(full, inputs, read_omni_config(tiny_omni), "Ethan")
    assert len(ref_codes) > 10

    before = len(codes)
    client = openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0, timeout=HANG * 2)
    with client:
        answer = client.chat.completions.create(
            model=MODEL, messages=messages(part), temperature=0, max_tokens=THINKER_MAX,
            modalities=["text", "audio"], audio={"voice": "Ethan", "format": "wav"}, extra_body=GREEDY_TALKER)
    assert len(codes) == before + 1  # this request's talker answer, forwarded once
    assert codes[-1] == ref_codes  # the codec ids
    said = proc.decode(ref_ids, skip_special_tokens=True).rstrip("\ufffd")
    assert answer.choices[0].message.content == said
    pcm = (np.clip(ref_wav, -1, 1) * 32767).astype(np.int16)
    got = wav_samples(answer.choices[0].message.audio.data)
    assert got.shape == pcm.shape and np.abs(got.astype(np.int32) - pcm).max() <= 1
