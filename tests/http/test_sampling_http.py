"""Sampling fields over HTTP, as a new user sends them: the official ``openai`` client on loopback.

Against the in-process toy pipeline (its stages record what they were
given) for the mapping and the refusals; against ``trio-orch serve`` with
its worker processes for the acceptance: a seed reproduces text and audio,
temperature 0 ignores the seed, voices differ, stop strings stop the text.
"""

from __future__ import annotations

import base64
import io
import os
import re
import signal
import subprocess
import sys
import time
import wave
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

openai = pytest.importorskip("openai")

from stages.lockdown import serving_pid  # noqa: E402
from tests.http.test_server import Served, wait_until  # noqa: E402
from trio_orch.engine import ThreadEngine  # noqa: E402
from trio_orch.testing.toy_pipeline import toy_pipeline  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
USER = [{"role": "user", "content": "one two three four"}]


def client(url: str) -> Any:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def toy() -> Iterator[Served]:
    s = Served(ThreadEngine(toy_pipeline(token_delay=0.002, audio_delay=0.001)).start())
    yield s
    s.stop()


def said(resp: Any) -> tuple[str, bytes]:
    """(text, audio bytes) of a non-streamed chat completion."""
    msg = resp.choices[0].message
    return msg.content, base64.b64decode(msg.audio.data) if msg.audio is not None else b""


def test_fields_reach_the_toy_stages_that_take_them(toy: Served) -> None:
    c = client(toy.url)
    stages = toy.engine.stages
    resp = c.chat.completions.create(model="toy", messages=USER, max_tokens=3)
    assert resp.choices[0].message.content == "You said: one " and resp.choices[0].finish_reason == "length"
    assert stages[0].sampling[-1][1] == {"max_tokens": 3}  # type: ignore[attr-defined]
    chunks = list(c.chat.completions.create(model="toy", messages=USER, max_tokens=2, stream=True))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == "You said: "
    assert chunks[-1].choices[0].finish_reason == "length"
    alloy = said(c.chat.completions.create(model="toy", messages=USER, modalities=["text", "audio"],
                                           audio={"voice": "alloy", "format": "wav"}))
    onyx = said(c.chat.completions.create(model="toy", messages=USER, modalities=["text", "audio"],
                                          audio={"voice": "onyx", "format": "wav"}))
    assert alloy[0] == onyx[0] and alloy[1] != onyx[1] and len(alloy[1]) == len(onyx[1])
    assert stages[2].sampling[-1][1] == {"voice": "onyx"}  # type: ignore[attr-defined]
    sage = said(c.chat.completions.create(model="toy", messages=USER, modalities=["text", "audio"],
                                          audio={"voice": "onyx", "format": "wav"},
                                          extra_body={"stage_sampling": {"toy vocoder": {"voice": "sage"}}}))
    assert stages[2].sampling[-1][1] == {"voice": "sage"} and sage[1] not in (alloy[1], onyx[1])  # type: ignore[attr-defined]


@pytest.mark.parametrize(("kwargs", "param", "message"), [
    ({"temperature": 0.5}, "temperature", "its text stage (stage 0, toy thinker) takes no 'temperature'"),
    ({"seed": 7}, "seed", "no stage this request runs takes 'seed'"),
    ({"stop": ["x"]}, "stop", "takes no 'stop'"),
    ({"extra_body": {"stage_sampling": {"toy talker": {"voice": "nova"}}}}, "stage_sampling.toy talker",
     "toy talker takes no sampling parameter 'voice' (it takes none)"),
    ({"max_tokens": 0}, "max_tokens", "'max_tokens' must be between 1 and"),
])
def test_fields_a_stage_cannot_honour_are_400s(toy: Served, kwargs: dict[str, Any], param: str,
                                               message: str) -> None:
    before = len(toy.engine.stages[0].submissions)  # type: ignore[attr-defined]
    with pytest.raises(openai.BadRequestError) as info:
        client(toy.url).chat.completions.create(model="toy", messages=USER, **kwargs)
    assert info.value.status_code == 400
    err = info.value.body
    assert err["param"] == param and message in err["message"], err
    assert len(toy.engine.stages[0].submissions) == before  # type: ignore[attr-defined]  # nothing submitted


# ---------------------------------------------------------------- trio-orch serve, worker processes
def _children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _wav_samples(data: bytes) -> np.ndarray:
    with wave.open(io.BytesIO(data)) as w:
        return np.frombuffer(w.readframes(w.getnframes()), "<i2")


@pytest.mark.slow
@pytest.mark.processes
def test_acceptance_with_the_openai_client_against_trio_orch_serve(tmp_path: Path) -> None:
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    proc = subprocess.Popen([sys.executable, "-m", "trio_orch.cli", "serve", "--port", "0"], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        assert proc.stdout is not None
        url = None
        start = time.monotonic()
        while url is None and time.monotonic() - start < 120:
            line = proc.stdout.readline()
            if not line:
                break
            m = re.search(r"serving on (http://\S+)", line)
            url = m.group(1) if m else None
        assert url, "serve did not report its address"
        workers = _children(serving_pid(proc.pid))
        c = client(url)

        def ask(**kw: Any) -> tuple[str, bytes]:
            kw = {"audio": {"voice": "alloy", "format": "wav"}, **kw}
            return said(c.chat.completions.create(model="trio-orch", messages=USER,
                                                  modalities=["text", "audio"], **kw))

        first, second = ask(seed=7), ask(seed=7)
        assert first == second and first[0] and len(_wav_samples(first[1])) > 0  # text and audio
        assert ask(seed=8)[0] != first[0]
        cold = ask(temperature=0, seed=1)
        assert ask(temperature=0, seed=2) == cold  # greedy: the seed does not matter
        nova = ask(temperature=0, seed=1, audio={"voice": "nova", "format": "wav"})
        assert nova[0] == cold[0] and nova[1] != cold[1]  # the same text in another voice
        # stop strings: the text ends before the first one (here two characters out of the text)
        stop = first[0][6:8]
        resp = c.chat.completions.create(model="trio-orch", messages=USER, seed=7, stop=[stop])
        assert resp.choices[0].message.content == first[0][: first[0].index(stop)]
        assert resp.choices[0].finish_reason == "stop"
        def hot_text(seed: int, **kw: Any) -> str:
            return c.chat.completions.create(model="trio-orch", messages=USER, seed=seed, temperature=2.0,
                                             **kw).choices[0].message.content

        seed_x = next(s for s in range(40) if "x" in hot_text(s))  # a seed whose text has an x
        with_x = hot_text(seed_x)
        assert hot_text(seed_x, stop=["x"]) == with_x[: with_x.index("x")]
        # the talker's own parameters through the extension field: sampled codes, reproducible
        talk = {"stage_sampling": {"talker": {"temperature": 1.0, "seed": 3}}}
        varied = ask(temperature=0, extra_body=talk)
        assert varied[0] == cold[0] and varied[1] != cold[1] and ask(temperature=0, extra_body=talk) == varied
        with pytest.raises(openai.BadRequestError, match="talker takes no sampling parameter 'stop'"):
            ask(extra_body={"stage_sampling": {"talker": {"stop": ["x"]}}})
        with pytest.raises(openai.BadRequestError, match=r"'top_p' must be in \(0, 1\]"):
            ask(top_p=0)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0  # a clean drain after the signal (documented exit code)
        wait_until(lambda: not any(_alive(p) for p in workers), "worker processes gone")
        assert list(tmp_path.iterdir()) == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
