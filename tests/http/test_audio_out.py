"""The one audio encoder (``trio_orch/openai/audio_out.py``): every format the server sends, read back.

Each file is decoded by ``soundfile`` (libsndfile), PyAV (FFmpeg) for AAC,
the standard library's :mod:`wave` for WAV: FLAC holds the very 16-bit
samples, Opus, MP3 and AAC a clip as long as the input at a rate their codec
takes (22.05 kHz resampled to 24 kHz for Opus) whose loudest frequency is
the tone's.  A format OpenAI names that cannot be written here (its library
missing, as without the ``audio`` extra) is a 400 naming the field and the
format.  The resampler gives the same samples fed whole or in pieces (the
Realtime API's deltas), and going down to G.711's 8 kHz filters out what
8 kHz cannot hold.
"""

from __future__ import annotations

import functools
import io
import wave

import numpy as np
import pytest
import soundfile

from tests.http_helpers import aac_samples, without_pyav
from trio_orch.openai import audio_out
from trio_orch.openai.audio_out import (
    AUDIO_OUT,
    OPENAI_AUDIO_FORMATS,
    REALTIME_OUT,
    AudioStream,
    Resampler,
    check_audio_format,
    encode_audio,
    pcm16,
    writable_formats,
)
from trio_orch.openai.chat import parse_chat_request
from trio_orch.openai.protocol import ServedModels, SpeechRequest
from trio_orch.openai.validation import BadRequest, decode


def tone(freq: float, rate: int, seconds: float = 0.5) -> bytes:
    t = np.arange(int(rate * seconds)) / rate
    return pcm16(0.5 * np.sin(2 * np.pi * freq * t))


def loudest(samples: np.ndarray, rate: int) -> float:
    spectrum = np.abs(np.fft.rfft(samples))
    return float(np.fft.rfftfreq(len(samples), 1 / rate)[int(np.argmax(spectrum))])


def test_wav_and_pcm_carry_the_samples_as_they_are() -> None:
    pcm = tone(440, 24000)
    assert encode_audio(pcm, 24000, "pcm") == pcm
    with wave.open(io.BytesIO(encode_audio(pcm, 24000, "wav"))) as w:
        assert (w.getnchannels(), w.getsampwidth(), w.getframerate()) == (1, 2, 24000)
        assert w.readframes(w.getnframes()) == pcm


@pytest.mark.parametrize("rate", [24000, 22050, 44100])
def test_flac_holds_the_very_16_bit_samples_at_their_rate(rate: int) -> None:
    pcm = tone(440, rate)
    data = encode_audio(pcm, rate, "flac")
    assert data[:4] == b"fLaC"
    samples, got = soundfile.read(io.BytesIO(data), dtype="int16")
    assert got == rate and samples.tobytes() == pcm


@pytest.mark.parametrize(("fmt", "rate", "written"), [("opus", 24000, 24000), ("opus", 22050, 24000),
                                                      ("opus", 44100, 48000), ("opus", 8000, 8000),
                                                      ("mp3", 24000, 24000), ("mp3", 22050, 22050),
                                                      ("mp3", 20000, 22050)])
def test_opus_and_mp3_are_as_long_as_the_audio_at_a_rate_their_codec_takes(fmt: str, rate: int,
                                                                           written: int) -> None:
    data = encode_audio(tone(440, rate), rate, fmt)
    with soundfile.SoundFile(io.BytesIO(data)) as f:
        assert (f.format, f.samplerate, f.channels) == (AUDIO_OUT[fmt].codec[0], written, 1)
        samples = f.read(dtype="float32")
    assert abs(len(samples) / written - 0.5) < 0.002  # the input's half second, give or take a few samples
    assert abs(loudest(samples, written) - 440) <= 4  # the tone, not noise


@pytest.mark.parametrize(("rate", "written"), [(24000, 24000), (22050, 22050), (20000, 22050)])
def test_aac_is_an_adts_stream_of_the_audio_at_a_rate_aac_takes(rate: int, written: int) -> None:
    pcm = tone(440, rate)
    data = encode_audio(pcm, rate, "aac")
    assert data[0] == 0xFF and data[1] & 0xF6 == 0xF0  # an ADTS sync word, layer 0
    samples = aac_samples(data, written)
    assert 0 <= len(samples) - len(pcm) // 2 * written // rate < 1024  # as long, the last frame padded
    assert abs(loudest(samples, written) - 440) <= 4


def test_every_format_openai_names_is_written_here() -> None:
    assert set(OPENAI_AUDIO_FORMATS) == set(AUDIO_OUT)
    pytest.importorskip("av")
    assert set(writable_formats()) == set(AUDIO_OUT)  # soundfile's libsndfile: FLAC, Opus, MP3; PyAV: AAC


def test_aac_without_pyav_is_a_400_naming_the_field_the_format_and_the_extra(
        monkeypatch: pytest.MonkeyPatch) -> None:
    without_pyav(monkeypatch)
    assert audio_out.writable_formats() == ("wav", "pcm", "flac", "opus", "mp3")
    with pytest.raises(BadRequest) as aac:
        check_audio_format("aac", "response_format")
    assert aac.value.param == "response_format" and aac.value.code == "unsupported_value"
    assert "'aac'" in str(aac.value) and "pip install 'trio-orch[audio]'" in str(aac.value)
    assert "wav, pcm, flac, opus, mp3" in str(aac.value)
    with pytest.raises(BadRequest) as chat:
        check_audio_format("aac", "audio.format", pcm="pcm16")
    assert chat.value.param == "audio.format" and "wav, pcm16, flac" in str(chat.value)  # chat's spelling
    assert check_audio_format("pcm16", "audio.format", pcm="pcm16") == "pcm"
    assert check_audio_format("flac", "response_format") == "flac"


@pytest.fixture()
def libsndfile_without_lame(monkeypatch: pytest.MonkeyPatch) -> None:
    """A libsndfile built without an MP3 encoder (as some systems' are), the format check asked anew."""
    writes = soundfile.check_format
    monkeypatch.setattr(soundfile, "check_format", lambda fmt, *a: fmt != "MP3" and writes(fmt, *a))
    monkeypatch.setattr(audio_out, "writable", functools.cache(audio_out.writable.__wrapped__))


@pytest.mark.usefixtures("libsndfile_without_lame")
def test_a_format_this_libsndfile_cannot_write_is_a_400_too() -> None:
    assert "mp3" not in writable_formats()
    with pytest.raises(BadRequest) as mp3:
        check_audio_format("mp3", "response_format")
    assert "'mp3'" in str(mp3.value) and "cannot write it" in str(mp3.value)
    assert mp3.value.param == "response_format"


def test_the_requests_take_openai_s_format_names_and_refuse_what_cannot_be_written(
        monkeypatch: pytest.MonkeyPatch) -> None:
    without_pyav(monkeypatch)
    for fmt in ("flac", "opus", "mp3", "wav", "pcm"):
        req = decode({"input": "hi", "response_format": fmt}, SpeechRequest, what="speech")
        req.check(None)
    req = decode({"input": "hi", "response_format": "aac"}, SpeechRequest, what="speech")
    with pytest.raises(BadRequest) as aac:
        req.check(None)
    assert aac.value.param == "response_format" and "'aac'" in str(aac.value)  # no PyAV here
    with pytest.raises(BadRequest) as ogg:  # not a name OpenAI has: the schema's refusal
        decode({"input": "hi", "response_format": "ogg"}, SpeechRequest, what="speech")
    assert ogg.value.param == "response_format"
    models = ServedModels("m")
    audio = {"messages": [{"role": "user", "content": "hi"}], "modalities": ["text", "audio"]}
    for fmt, name in (("flac", "flac"), ("opus", "opus"), ("mp3", "mp3"), ("pcm16", "pcm"), ("wav", "wav")):
        assert parse_chat_request({**audio, "audio": {"format": fmt}}, models).audio_format == name
    with pytest.raises(BadRequest) as chat_aac:
        parse_chat_request({**audio, "audio": {"format": "aac"}}, models)
    assert chat_aac.value.param == "audio.format" and "'aac'" in str(chat_aac.value)
    with pytest.raises(BadRequest) as streamed:  # a streamed answer is pcm16, as before
        parse_chat_request({**audio, "stream": True, "audio": {"format": "flac"}}, models)
    assert streamed.value.param == "audio.format"


@pytest.mark.parametrize(("src", "dst"), [(24000, 8000), (22050, 24000), (44100, 48000), (96000, 48000),
                                          (22050, 8000)])
def test_the_resampler_fed_in_pieces_gives_what_it_gives_fed_whole(src: int, dst: int) -> None:
    rng = np.random.default_rng(src + dst)
    x = (0.1 * rng.standard_normal(5003)).astype(np.float32)
    whole = Resampler(src, dst)
    at_once = np.concatenate([whole.feed(x), whole.flush()])
    assert len(at_once) == round(len(x) * dst / src)
    pieces = Resampler(src, dst)
    cuts = np.sort(rng.choice(np.arange(1, len(x)), 30, replace=False))
    fed = [pieces.feed(p) for p in [x[:0], *np.split(x, cuts), x[:0]]]  # empty pieces and one-sample ones
    assert np.array_equal(np.concatenate([*fed, pieces.flush()]), at_once)


@pytest.mark.parametrize(("freq", "kept"), [(440, True), (3000, True), (6000, False), (9000, False)])
def test_down_to_8_khz_keeps_what_8_khz_holds_in_phase_and_filters_the_rest(freq: int, kept: bool) -> None:
    r = Resampler(24000, 8000)
    x = np.sin(2 * np.pi * freq * np.arange(24000) / 24000).astype(np.float32)
    y = np.concatenate([r.feed(x), r.flush()])[100:-100]
    if kept:  # in phase: the filter's delay is taken back
        ref = np.sin(2 * np.pi * freq * np.arange(100, 7900) / 8000)
        assert np.abs(y - ref).max() < 0.05
    else:  # above 4 kHz: it would fold back below it
        assert np.sqrt(np.mean(y**2)) < 0.01


def test_a_stream_writes_only_headerless_formats() -> None:
    with pytest.raises(ValueError, match="header"):
        AudioStream(AUDIO_OUT["flac"], 24000)
    stream = AudioStream(REALTIME_OUT["audio/pcm"], 24000)
    assert stream.resampler is None and stream.encode(np.array([0.5, -0.5])) == pcm16(np.array([0.5, -0.5]))
