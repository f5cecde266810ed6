"""``/v1/completions``, ``/v1/audio/speech``, ``/tokenize`` and ``/detokenize`` as their clients use them.

The official ``openai`` SDK (httpx for vLLM's tokenizer routes, which the SDK
does not have) against real servers on loopback, on both fronts: the
in-process toy pipeline for the shapes, the audio formats and the refusals; a small speech pipeline
of worker processes (thinker -> talker -> code2wav) for what depends on the
real models -- a seed reproduces text streamed or not, the WAV carries the
vocoder's rate, the tokenizer is the thinker's; and a talker-first pipeline
(talker -> code2wav) for speech that speaks its input word for word.
"""

from __future__ import annotations

import base64
import io
import json
import wave
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import numpy as np
import pytest
import soundfile

from stages.base import ReqState
from stages.config import PipelineConfig, StageConfig
from tests.http_helpers import (
    FRONTS,
    HANG,
    Served,
    TrioServed,
    aac_samples,
    sse_events,
    without_pyav,
    worker_server,
)
from trio_orch.engine import static_pipeline
from trio_orch.openai.speech import Speed
from trio_orch.openai.tokenizer import ByteTokenizer
from trio_orch.testing import ScriptedStage
from trio_orch.testing.toy_pipeline import SAMPLE_RATE, toy_pipeline

openai = pytest.importorskip("openai")

SERVES = pytest.mark.processes  # a real server on loopback (and, for some, worker processes)
SMALL = {"d_model": 32, "layers": 1, "heads": 2}
SPEECH = PipelineConfig([StageConfig("thinker", model=SMALL), StageConfig("talker", model=SMALL),
                         StageConfig("code2wav", model={"dim": 16})], final_stage_ids=[0, 2]).validate()
TTS = PipelineConfig([StageConfig("talker", model=SMALL), StageConfig("code2wav", model={"dim": 16})],
                     final_stage_ids=[1]).validate()


def sdk(url: str) -> Any:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=HANG)


def param_of(err: Any) -> str | None:
    """The ``param`` of an SDK error's OpenAI-shaped body."""
    return json.loads(err.response.text)["error"]["param"]  # type: ignore[no-any-return]


def wav_frames(data: bytes, rate: int) -> bytes:
    """The frames of a mono 16-bit WAV at ``rate`` (asserting that is what it is)."""
    assert data[:4] == b"RIFF" and data[8:12] == b"WAVE"
    with wave.open(io.BytesIO(data)) as w:
        assert (w.getnchannels(), w.getsampwidth(), w.getframerate()) == (1, 2, rate)
        frames = w.readframes(w.getnframes())
        assert len(frames) == 2 * w.getnframes()
    return frames


@pytest.fixture(params=FRONTS)
def toy(request: pytest.FixtureRequest, serving: Callable[..., Any]) -> Served | TrioServed:
    return serving(request.param, toy_pipeline(token_delay=0.001, audio_delay=0.001))  # type: ignore[no-any-return]


@pytest.fixture(scope="module", params=FRONTS)
def speech(request: pytest.FixtureRequest) -> Iterator[Served | TrioServed]:
    yield from worker_server(request.param, SPEECH)


@pytest.fixture(scope="module")
def tts() -> Iterator[Served | TrioServed]:
    yield from worker_server("asyncio", TTS)


# ---------------------------------------------------------------- the toy pipeline, both fronts
@SERVES
def test_completions_streamed_and_not_give_the_same_text(toy: Served) -> None:
    with sdk(toy.url) as c:
        resp = c.completions.create(model="toy", prompt="one two three", max_tokens=3)
        assert resp.object == "text_completion" and resp.model == "toy" and resp.id.startswith("cmpl-")
        assert resp.choices[0].text == "You said: one " and resp.choices[0].finish_reason == "length"
        assert (resp.usage.prompt_tokens, resp.usage.completion_tokens) == (len(b"one two three"), 3)
        chunks = list(c.completions.create(model="toy", prompt=["one two three"], max_tokens=3, stream=True,
                                           stream_options={"include_usage": True}))
        assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == resp.choices[0].text
        assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 3
        whole = c.completions.create(model="toy", prompt="hi", echo=True)
        assert whole.choices[0].text == "hiYou said: hi" and whole.choices[0].finish_reason == "stop"


@SERVES
def test_completions_refuse_what_they_cannot_do_in_openai_s_error_shape(toy: Served) -> None:
    with sdk(toy.url) as c:
        before = len(toy.engine.stages[0].submissions)  # type: ignore[attr-defined]
        with pytest.raises(openai.NotFoundError) as missing:
            c.completions.create(model="gpt-4o", prompt="hi")
        assert missing.value.body["code"] == "model_not_found"
        for kwargs, param in [({"n": 2}, "n"), ({"prompt": ["a", "b"]}, "prompt"), ({"prompt": ""}, "prompt"),
                              ({"temperature": 0.5}, "temperature"), ({"best_of": 3}, "best_of"),
                              ({"max_tokens": "many"}, "max_tokens")]:
            with pytest.raises(openai.BadRequestError) as bad:
                c.completions.create(**{"model": "toy", "prompt": "hi", **kwargs})
            assert bad.value.body["param"] == param, (kwargs, bad.value.body)
        assert len(toy.engine.stages[0].submissions) == before  # type: ignore[attr-defined]  # nothing submitted
        extra = c.completions.create(model="toy", prompt="hi", extra_body={"my_client_extra": {"x": 1}})
        assert extra.choices[0].text == "You said: hi"


@SERVES
def test_speech_is_a_wav_or_pcm_of_the_same_audio_streamed_as_it_is_made(toy: Served) -> None:
    with sdk(toy.url) as c:
        wav = c.audio.speech.create(model="toy", voice="onyx", input="hello there", response_format="wav")
        assert wav.response.headers["content-type"] == "audio/wav"
        frames = wav_frames(wav.content, SAMPLE_RATE)
        assert frames and any(frames)
        pcm = c.audio.speech.create(model="toy", voice="onyx", input="hello there", response_format="pcm")
        assert pcm.content == frames
        with c.audio.speech.with_streaming_response.create(model="toy", voice="onyx", input="hello there",
                                                           response_format="pcm") as streamed:
            assert streamed.headers["content-type"] == "audio/pcm"
            pieces = list(streamed.iter_bytes())
        assert b"".join(pieces) == frames
        other = c.audio.speech.create(model="toy", voice="alloy", input="hello there", response_format="pcm")
        assert len(other.content) == len(frames) and other.content != frames  # another voice, another pitch
        fast = c.audio.speech.create(model="toy", voice="onyx", input="hello there", response_format="pcm",
                                     speed=2.0)
        assert abs(len(fast.content) // 2 - len(frames) // 4) <= 1  # half the samples


@SERVES
def test_speech_as_flac_opus_mp3_and_aac_through_the_sdk(toy: Served) -> None:
    """FLAC holds the WAV answer's very samples; Opus, MP3 and AAC decode to as long a clip."""
    with sdk(toy.url) as c:
        frames = wav_frames(c.audio.speech.create(model="toy", voice="onyx", input="hello there").content,
                            SAMPLE_RATE)
        flac = c.audio.speech.create(model="toy", voice="onyx", input="hello there", response_format="flac")
        assert flac.response.headers["content-type"] == "audio/flac"
        samples, rate = soundfile.read(io.BytesIO(flac.content), dtype="int16")
        assert rate == SAMPLE_RATE and samples.tobytes() == frames  # lossless: the 16-bit samples exactly
        seconds = len(frames) / 2 / SAMPLE_RATE
        for fmt, kind, content_type in (("opus", "OGG", "audio/ogg"), ("mp3", "MP3", "audio/mpeg")):
            lossy = c.audio.speech.create(model="toy", voice="onyx", input="hello there", response_format=fmt)
            assert lossy.response.headers["content-type"] == content_type
            with soundfile.SoundFile(io.BytesIO(lossy.content)) as f:
                assert (f.format, f.samplerate, f.channels) == (kind, SAMPLE_RATE, 1)  # 24 kHz: Opus takes it
                decoded = f.read(dtype="float32")
            assert abs(len(decoded) / SAMPLE_RATE - seconds) < 0.002, fmt
            assert np.abs(decoded).max() > 0.05  # sound, not silence
        aac = c.audio.speech.create(model="toy", voice="onyx", input="hello there", response_format="aac")
        assert aac.response.headers["content-type"] == "audio/aac"
        decoded = aac_samples(aac.content, SAMPLE_RATE)
        assert 0 <= len(decoded) - len(frames) // 2 < 1024  # the last AAC frame padded
        assert np.abs(decoded).max() > 0.05


@SERVES
def test_aac_without_the_audio_extra_is_a_400_naming_the_format_and_the_extra(
        toy: Served, monkeypatch: pytest.MonkeyPatch) -> None:
    without_pyav(monkeypatch)
    with sdk(toy.url) as c:
        before = len(toy.engine.stages[0].submissions)  # type: ignore[attr-defined]
        with pytest.raises(openai.BadRequestError) as speech:
            c.audio.speech.create(model="toy", voice="onyx", input="hi", response_format="aac")
        with pytest.raises(openai.BadRequestError) as chat:
            c.chat.completions.create(model="toy", messages=[{"role": "user", "content": "hi"}],
                                      modalities=["text", "audio"], audio={"voice": "onyx", "format": "aac"})
        assert len(toy.engine.stages[0].submissions) == before  # type: ignore[attr-defined]  # refused first
        flac = c.audio.speech.create(model="toy", voice="onyx", input="hi", response_format="flac")
    assert flac.content[:4] == b"fLaC"  # the other formats still served
    for err, param in ((speech.value, "response_format"), (chat.value, "audio.format")):
        assert err.status_code == 400 and param_of(err) == param
        assert "'aac'" in err.message and "pip install 'trio-orch[audio]'" in err.message
        assert "flac, opus, mp3" in err.message  # what it can write


@SERVES
def test_chat_audio_comes_in_the_format_asked_through_the_sdk(toy: Served) -> None:
    """A chat answer's ``audio.format``: the same encoder as speech's, the samples the WAV answer holds."""
    messages = [{"role": "user", "content": "wave at me"}]

    def audio(c: Any, fmt: str) -> bytes:
        resp = c.chat.completions.create(model="toy", messages=messages, modalities=["text", "audio"],
                                         audio={"voice": "onyx", "format": fmt})
        assert resp.choices[0].message.audio.transcript == resp.choices[0].message.content
        return base64.b64decode(resp.choices[0].message.audio.data)

    with sdk(toy.url) as c:
        frames = wav_frames(audio(c, "wav"), SAMPLE_RATE)
        assert audio(c, "pcm16") == frames
        samples, rate = soundfile.read(io.BytesIO(audio(c, "flac")), dtype="int16")
        assert rate == SAMPLE_RATE and samples.tobytes() == frames
        for fmt, kind in (("opus", "OGG"), ("mp3", "MP3")):
            with soundfile.SoundFile(io.BytesIO(audio(c, fmt))) as f:
                assert (f.format, f.samplerate) == (kind, SAMPLE_RATE)
                assert abs(f.frames - len(frames) // 2) <= 2, fmt  # as long as the WAV
        assert 0 <= len(aac_samples(audio(c, "aac"), SAMPLE_RATE)) - len(frames) // 2 < 1024


@SERVES
def test_speech_events_carry_the_same_pcm(toy: Served) -> None:
    body = {"model": "toy", "voice": "onyx", "input": "hello there", "response_format": "pcm"}
    with httpx.Client(base_url=toy.url, timeout=HANG) as c:
        whole = c.post("/v1/audio/speech", json=body).content
        r = c.post("/v1/audio/speech", json={**body, "stream_format": "sse"})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.iter_lines())
    assert [e["type"] for e in events][-1] == "speech.audio.done"
    assert events[-1]["usage"]["input_tokens"] == len(b"hello there")
    deltas = [base64.b64decode(e["audio"]) for e in events if e["type"] == "speech.audio.delta"]
    assert len(deltas) > 1 and b"".join(deltas) == whole


@SERVES
def test_speech_refusals_name_the_field(toy: Served) -> None:
    with sdk(toy.url) as c:
        cases = [({"response_format": "ogg"}, "response_format"), ({"speed": 9.0}, "speed"),
                 ({"voice": "nobody"}, "voice"), ({"input": ""}, "input"),
                 ({"instructions": "whisper"}, "instructions"),
                 ({"response_format": "wav", "stream_format": "sse"}, "response_format")]
        for kwargs, param in cases:
            with pytest.raises(openai.BadRequestError) as bad:
                c.audio.speech.create(**{"model": "toy", "voice": "onyx", "input": "hi", **kwargs})
            assert bad.value.status_code == 400 and param_of(bad.value) == param
            if kwargs.get("response_format") == "ogg":
                assert repr(kwargs["response_format"]) in bad.value.message  # names the format
        with pytest.raises(openai.NotFoundError):
            c.audio.speech.create(model="tts-1", voice="onyx", input="hi")


@SERVES
def test_tokenize_on_a_pipeline_without_a_known_tokenizer_is_a_400(toy: Served) -> None:
    with httpx.Client(base_url=toy.url, timeout=HANG) as c:
        for path, body in (("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [104]})):
            r = c.post(path, json=body)
            assert r.status_code == 400 and r.json()["error"]["param"] == "model", r.text


@SERVES
@pytest.mark.parametrize("front", FRONTS)
def test_a_pipeline_without_audio_or_text_says_so(serving: Callable[..., Any], front: str) -> None:
    stage = ScriptedStage(0)
    s = serving(front, static_pipeline([stage], {0}), outputs=["image"])
    with sdk(s.url) as c:
        with pytest.raises(openai.BadRequestError) as speech:
            c.audio.speech.create(model="toy", voice="onyx", input="hi")
        with pytest.raises(openai.BadRequestError) as text:
            c.completions.create(model="toy", prompt="hi")
        for err in (speech, text):
            assert err.value.status_code == 400 and param_of(err.value) == "model"
        assert "makes no audio" in speech.value.message and "no text stage" in text.value.message
        assert stage.submissions == []


# ---------------------------------------------------------------- worker processes
@SERVES
@pytest.mark.slow
def test_a_seed_gives_the_same_completion_streamed_and_not(speech: Served) -> None:
    with sdk(speech.url) as c:
        ask = {"model": "tiny", "prompt": "once upon a time", "max_tokens": 12, "temperature": 1.0, "seed": 7}
        whole = c.completions.create(**ask)
        text = whole.choices[0].text
        assert text and whole.usage.completion_tokens == len(text.encode())
        assert whole.usage.prompt_tokens == len(b"once upon a time")
        streamed = list(c.completions.create(**ask, stream=True))
        assert "".join(ch.choices[0].text for ch in streamed if ch.choices) == text
        assert streamed[-1].choices[0].finish_reason == whole.choices[0].finish_reason
        stopped = c.completions.create(**{**ask, "stop": [text[3:5]]})
        assert stopped.choices[0].text == text[:text.index(text[3:5])]
        assert c.completions.create(**ask).choices[0].text == text


@SERVES
@pytest.mark.slow
def test_speech_from_the_speech_pipeline_is_a_wav_at_the_vocoder_s_rate(speech: Served) -> None:
    rate = speech.engine.stage_info(2)["sample_rate"]
    with sdk(speech.url) as c:
        wav = c.audio.speech.create(model="tiny", voice="nova", input="good morning", response_format="wav")
    frames = wav_frames(wav.content, rate)
    assert frames and any(frames)


@SERVES
@pytest.mark.slow
def test_the_speech_pipeline_speaks_its_input_word_for_word(speech: Served) -> None:
    talker = speech.engine.stage_info(1)
    vocoder = speech.engine.stage_info(2)
    limit = speech.engine.stage_info(0)["max_say"]
    with sdk(speech.url) as c:
        def say(text: str) -> bytes:
            return wav_frames(c.audio.speech.create(model="tiny", voice="echo", input=text,
                                                    response_format="wav").content, vocoder["sample_rate"])

        hello = say("hello there")
        # every byte of the input, and nothing else, went through the talker
        assert len(hello) == 2 * len(b"hello there") * talker["frames_per_token"] * vocoder["hop"]
        assert say("hello there") == hello and say("hello thera") != hello
        with pytest.raises(openai.BadRequestError) as long:
            c.audio.speech.create(model="tiny", voice="echo", input="x" * (limit + 1))
    assert long.value.status_code == 400 and param_of(long.value) == "input"


@SERVES
@pytest.mark.slow
def test_tokenize_and_detokenize_round_trip_with_the_thinker_s_tokens(speech: Served) -> None:
    text = "héllo, wörld"
    with httpx.Client(base_url=speech.url, timeout=HANG) as c:
        r = c.post("/tokenize", json={"model": "tiny", "prompt": text, "return_token_strs": True})
        assert r.status_code == 200, r.text
        got = r.json()
        assert got["tokens"] == list(text.encode()) and got["count"] == len(text.encode())
        info = speech.engine.stage_info(0)
        assert got["max_model_len"] == info["max_model_len"]
        assert len(got["token_strs"]) == got["count"]
        back = c.post("/detokenize", json={"model": "tiny", "tokens": got["tokens"]})
        assert back.status_code == 200 and back.json() == {"prompt": text}
        chat = c.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
        assert chat["tokens"] == list(b"user: hi\nassistant:")
        bad = c.post("/detokenize", json={"tokens": [104, 999]})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens[1]"
    with sdk(speech.url) as client:
        usage = client.completions.create(model="tiny", prompt=text, max_tokens=2).usage
    assert usage.prompt_tokens == got["count"]


@SERVES
@pytest.mark.slow
def test_a_talker_first_pipeline_speaks_its_input_word_for_word(tts: Served) -> None:
    with sdk(tts.url) as c:
        info = tts.engine.stage_info(0)
        hop = tts.engine.stage_info(1)["hop"]
        rate = tts.engine.stage_info(1)["sample_rate"]

        def say(text: str) -> bytes:
            return wav_frames(c.audio.speech.create(model="tiny", voice="echo", input=text,
                                                    response_format="wav").content, rate)

        hello = say("hello there")
        assert len(hello) == 2 * len(b"hello there") * info["frames_per_token"] * hop  # every token spoken
        assert say("hello there") == hello and say("hello thera") != hello
        with httpx.Client(base_url=tts.url, timeout=HANG) as h:
            tokens = h.post("/tokenize", json={"prompt": "hello there"}).json()["tokens"]
        assert tokens == list(b"hello there")  # what the talker was given


# ---------------------------------------------------------------- no server
def test_the_byte_tokenizer_is_the_thinker_s() -> None:
    from stages.toy.models import EOS, Thinker

    tok = ByteTokenizer()
    assert tok.eos == EOS
    thinker = Thinker(d_model=16, layers=1, heads=2, max_model_len=68, max_new_tokens=4, slots=1)
    for text in ("hello", "héllo wörld", "日本"):
        req = ReqState("r", text)
        thinker.admit(req)
        assert req.model["prompt"] == tok.encode(text)
        assert tok.decode([*tok.encode(text), EOS]) == text


def test_a_thinker_told_what_to_say_says_it_and_ends() -> None:
    from stages.toy.models import Thinker

    thinker = Thinker(d_model=16, layers=1, heads=2, max_model_len=20, max_new_tokens=4, slots=2)
    req = ReqState("r", {"text": " ", "say": "more than four"})
    thinker.admit(req)
    text, done = "", False
    while not done:
        [res] = thinker.step([req])
        text += res.data["text"] if res.data else ""
        done = res.finished
    assert text == "more than four" and res.data["finish_reason"] == "stop"
    with pytest.raises(ValueError, match="'say' is 20 tokens"):
        thinker.admit(ReqState("long", {"text": " ", "say": "x" * 20}))


def test_speed_resamples_across_chunks_as_it_would_the_whole() -> None:
    pcm = np.sin(np.arange(4000) / 7.0).astype(np.float32)
    for factor in (0.5, 1.0, 1.5, 2.0, 4.0):
        speed = Speed(factor)
        whole = np.concatenate([speed(pcm), speed.flush()])
        speed = Speed(factor)
        pieces = np.concatenate([*(speed(pcm[i:i + 333]) for i in range(0, len(pcm), 333)), speed.flush()])
        assert len(whole) == round(len(pcm) / factor)
        assert np.array_equal(pieces, whole)
