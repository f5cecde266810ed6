"""``input_audio`` in FLAC, Ogg (Vorbis, Opus) and MP3, decoded with libsndfile (``soundfile``).

Each file is made in the test with soundfile itself from a known tone: FLAC
gives back the very samples a 16-bit WAV of them gives, the lossy formats a
clip at the right rate and length whose loudest frequency is the tone's.  A
corrupt file, data of another format than the one named, a clip over the
length limit (as its header says) or over the byte limit is a 400 naming the part.
"""

from __future__ import annotations

import base64
import io
import wave
from typing import Any

import numpy as np
import pytest
import soundfile

from trio_orch.openai.chat import parse_chat_request
from trio_orch.openai.chat_template import ChatInput
from trio_orch.openai.media import AUDIO_FORMATS, MediaPolicy, audio_clip
from trio_orch.openai.protocol import ServedModels
from trio_orch.openai.validation import BadRequest

MODELS = ServedModels("m")
OMNI = ChatInput().for_kinds(["image-encoder", "audio-encoder", "thinker"])
#: input_audio.format -> (libsndfile format, subtype, sample rate); Opus is encoded at 48 kHz only
KINDS = {"flac": ("FLAC", "PCM_16", 16000), "ogg": ("OGG", "VORBIS", 16000), "opus": ("OGG", "OPUS", 48000),
         "mp3": ("MP3", "MPEG_LAYER_III", 16000)}


def tone(freq: float, rate: int, seconds: float = 0.5, channels: int = 1) -> np.ndarray:
    t = np.arange(int(rate * seconds)) / rate
    x = (0.5 * np.sin(2 * np.pi * freq * t)).astype(np.float32)
    return np.repeat(x[:, None], channels, axis=1)


def encode(samples: np.ndarray, kind: str) -> bytes:
    fmt, subtype, rate = KINDS[kind]
    buf = io.BytesIO()
    soundfile.write(buf, samples, rate, format=fmt, subtype=subtype)
    return buf.getvalue()


def part(data: bytes, fmt: str) -> dict[str, Any]:
    return {"type": "input_audio", "input_audio": {"data": base64.b64encode(data).decode(), "format": fmt}}


def refusal(data: bytes, fmt: str, media: MediaPolicy | None = None) -> BadRequest:
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hear"}, part(data, fmt)]}]}
    chat = OMNI if media is None else ChatInput(media=media).for_kinds(["audio-encoder", "thinker"])
    with pytest.raises(BadRequest) as err:
        parse_chat_request(body, MODELS, chat=chat)
    assert err.value.param == "messages[0].content[1]"
    return err.value


def loudest(pcm: np.ndarray, rate: int) -> float:
    spectrum = np.abs(np.fft.rfft(pcm))
    return float(np.fft.rfftfreq(len(pcm), 1 / rate)[int(np.argmax(spectrum))])


def test_flac_gives_back_the_samples_a_wav_of_them_gives() -> None:
    x = tone(440, 16000, channels=2)
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(2)
        w.setsampwidth(2)
        w.setframerate(16000)
        w.writeframes((x * 32767).astype("<i2").tobytes())
    from_wav = audio_clip(buf.getvalue(), "wav", MediaPolicy(), "p")
    from_flac = audio_clip(encode(x, "flac"), "flac", MediaPolicy(), "p")
    assert from_flac.sample_rate == 16000 and from_flac.pcm.dtype == np.float32
    assert from_flac.pcm.shape == from_wav.pcm.shape == (8000,)
    np.testing.assert_allclose(from_flac.pcm, from_wav.pcm, atol=1 / 32768)


@pytest.mark.parametrize("kind", ["ogg", "opus", "mp3"])
def test_a_lossy_clip_keeps_its_rate_length_and_tone(kind: str) -> None:
    rate = KINDS[kind][2]
    fmt = "ogg" if kind == "opus" else kind
    content = [part(encode(tone(440, rate), kind), fmt), part(encode(tone(1760, rate), kind), fmt)]
    req = parse_chat_request({"messages": [{"role": "user", "content": content}]}, MODELS, chat=OMNI)
    low, high = req.audios
    assert low.sample_rate == high.sample_rate == rate
    assert abs(len(low.pcm) - rate // 2) <= rate // 20  # an encoder's padding, at most
    assert abs(loudest(low.pcm, rate) - 440) < 20 and abs(loudest(high.pcm, rate) - 1760) < 20


def test_the_formats_taken_are_named_when_another_is_asked_for() -> None:
    assert AUDIO_FORMATS == ("wav", "flac", "ogg", "mp3")
    err = refusal(encode(tone(440, 16000), "flac"), "aac")
    assert "'aac' is not supported" in str(err) and "wav, flac, ogg, mp3" in str(err)


def test_corrupt_or_mislabelled_audio_is_a_400_naming_the_part() -> None:
    flac = encode(tone(440, 16000), "flac")
    assert "not a readable FLAC" in str(refusal(flac[:4] + b"\0" * 64, "flac"))
    assert "not a readable MP3" in str(refusal(b"\xff\xfb" + b"\x00" * 64, "mp3"))
    assert "the audio is FLAC, not OGG" in str(refusal(flac, "ogg"))
    assert "object at 0x" not in str(refusal(b"junk" * 20, "ogg"))  # libsndfile's words, not a repr


def test_a_clip_over_the_length_or_byte_limit_is_refused() -> None:
    long = encode(tone(440, 16000, seconds=3.0), "flac")
    err = refusal(long, "flac", MediaPolicy(max_audio_seconds=1.0))
    assert "3.0 s long, over the limit of 1 s" in str(err)
    assert "over the limit of 100 bytes" in str(refusal(long, "flac", MediaPolicy(max_audio_bytes=100)))
    with pytest.raises(BadRequest, match="over the limit of 100 bytes"):  # the bytes, from a file too
        audio_clip(long, "flac", MediaPolicy(max_audio_bytes=100), "--audio a.flac")
