"""The audio this server sends: 16-bit PCM, and the files OpenAI's clients ask for, from one encoder.

``/v1/audio/speech``'s ``response_format``, a chat answer's
``audio.format`` and ``trio-orch generate``'s WAV file all come from
:func:`encode_audio`, and each format is one row of :data:`AUDIO_OUT`:

- ``pcm``: the samples as they are, 16-bit little-endian mono at the
  pipeline's rate (chat calls it ``pcm16``);
- ``wav``: those samples in a WAV header, by the standard library's
  :mod:`wave` (the default format needs no native library);
- ``flac``, ``opus`` (Ogg/Opus) and ``mp3``: libsndfile's encoders, through
  ``soundfile`` -- where the libsndfile it loads writes them (the one its
  wheels bundle, 1.1 or newer, writes all three).  FLAC holds the 16-bit
  samples exactly.  Opus takes 8, 12, 16, 24 or 48 kHz and MP3 the MPEG
  rates only: audio at another rate is resampled (linear interpolation) to
  the lowest such rate at or above its own -- 22.05 kHz becomes 24 kHz for
  Opus -- so nothing of its band is lost; the file says the rate it holds.

A format OpenAI names that this server cannot write (``aac``: libsndfile
has no AAC encoder; ``mp3`` on a libsndfile built without LAME) is refused
before the request is admitted, by :func:`check_audio_format`: a 400 naming
the field and the format, and the formats it could have.  Encoding a long
clip takes a while (an Opus or MP3 encoder), so the routes encode off the
event loop.  Audio without a sample gives an empty FLAC or MP3 body
(libsndfile writes their header with the first samples).
"""

from __future__ import annotations

import functools
import io
import wave
from dataclasses import dataclass
from typing import Literal, get_args

import numpy as np

from trio_orch.openai.validation import BadRequest

__all__ = ["AUDIO_OUT", "OPENAI_AUDIO_FORMATS", "AudioFormat", "ChatAudioFormat", "SpeechFormat",
           "check_audio_format", "encode_audio", "pcm16", "writable_formats"]

#: the audio formats OpenAI's APIs name: ``/v1/audio/speech``'s ``response_format`` ...
SpeechFormat = Literal["mp3", "opus", "aac", "flac", "wav", "pcm"]
#: ... and a chat request's ``audio.format``: the same ones, ``pcm`` spelt ``pcm16``
ChatAudioFormat = Literal["wav", "aac", "mp3", "flac", "opus", "pcm16"]
OPENAI_AUDIO_FORMATS: tuple[str, ...] = get_args(SpeechFormat)
OPUS_RATES = (8000, 12000, 16000, 24000, 48000)
MP3_RATES = (8000, 11025, 12000, 16000, 22050, 24000, 32000, 44100, 48000)


@dataclass(frozen=True)
class AudioFormat:
    """How one format is written."""

    content_type: str
    #: libsndfile's (major format, subtype), for the formats it writes; None: written here (pcm, wav)
    sndfile: tuple[str, str] | None = None
    #: the sample rates it takes (empty: any)
    rates: tuple[int, ...] = ()

    def rate_for(self, sample_rate: int) -> int:
        """The rate audio at ``sample_rate`` is written at: its own, or the lowest one taken above it."""
        if not self.rates or sample_rate in self.rates:
            return sample_rate
        return min((r for r in self.rates if r >= sample_rate), default=max(self.rates))


#: every format this server may write (one that libsndfile cannot write here is refused: see
#: :func:`writable_formats`); the others of OPENAI_AUDIO_FORMATS it never writes
AUDIO_OUT: dict[str, AudioFormat] = {
    "wav": AudioFormat("audio/wav"),
    "pcm": AudioFormat("audio/pcm"),
    "flac": AudioFormat("audio/flac", ("FLAC", "PCM_16")),
    "opus": AudioFormat("audio/ogg", ("OGG", "OPUS"), OPUS_RATES),
    "mp3": AudioFormat("audio/mpeg", ("MP3", "MPEG_LAYER_III"), MP3_RATES),
}


@functools.cache
def writable_formats() -> tuple[str, ...]:
    """The formats of :data:`AUDIO_OUT` this process can write (libsndfile's asked once)."""
    import soundfile

    return tuple(name for name, f in AUDIO_OUT.items()
                 if f.sndfile is None or soundfile.check_format(*f.sndfile))


def check_audio_format(fmt: str, param: str, *, pcm: str = "pcm") -> str:
    """``fmt``'s name in :data:`AUDIO_OUT`; BadRequest naming ``param`` if it cannot be written here.
    ``pcm``: the route's name for raw PCM (chat's ``pcm16``)."""
    name = "pcm" if fmt == pcm else fmt
    if name in writable_formats():
        return name
    why = ("libsndfile, which this server encodes with, has no AAC encoder" if name == "aac"
           else "the libsndfile this server loaded cannot write it" if name in AUDIO_OUT
           else "it is not an audio format OpenAI names")
    names = ", ".join(pcm if n == "pcm" else n for n in writable_formats())
    raise BadRequest(f"'{param}': {fmt!r} cannot be encoded here ({why}); ask for one of {names}", param,
                     code="unsupported_value")


def pcm16(pcm: np.ndarray) -> bytes:
    """Float samples in [-1, 1] -> 16-bit little-endian PCM (clipped)."""
    return (np.clip(pcm, -1.0, 1.0) * 32767).astype("<i2").tobytes()


def _resample(samples: np.ndarray, src: int, dst: int) -> np.ndarray:
    """``samples`` at ``src`` Hz -> at ``dst`` Hz (linear interpolation), as float32 in [-1, 1]."""
    x = samples.astype(np.float32) / 32768.0
    n = round(len(x) * dst / src)
    return np.interp(np.arange(n) * (src / dst), np.arange(len(x)), x).astype(np.float32)


def encode_audio(pcm: bytes, sample_rate: int, fmt: str) -> bytes:
    """16-bit little-endian mono ``pcm`` at ``sample_rate`` -> a file in ``fmt`` (a format that
    :func:`check_audio_format` let through; KeyError for a name not in :data:`AUDIO_OUT`)."""
    spec = AUDIO_OUT[fmt]
    if fmt == "pcm":
        return pcm
    buf = io.BytesIO()
    if spec.sndfile is None:
        with wave.open(buf, "wb") as w:
            w.setnchannels(1)
            w.setsampwidth(2)
            w.setframerate(sample_rate)
            w.writeframes(pcm)
        return buf.getvalue()
    import soundfile

    samples = np.frombuffer(pcm, dtype="<i2")
    rate = spec.rate_for(sample_rate)
    data = samples if rate == sample_rate else _resample(samples, sample_rate, rate)
    kind, subtype = spec.sndfile
    soundfile.write(buf, data, rate, format=kind, subtype=subtype)
    return buf.getvalue()
