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
  samples exactly;
- ``aac``: FFmpeg's AAC encoder in an ADTS stream (what OpenAI sends),
  through PyAV -- the optional ``audio`` extra (``pip install
  'trio-orch[audio]'``; ``dev`` pulls it in), as libsndfile has no AAC
  encoder.

Opus takes 8, 12, 16, 24 or 48 kHz, MP3 and AAC the MPEG rates only: audio
at another rate is resampled (linear interpolation) to the lowest such rate
at or above its own -- 22.05 kHz becomes 24 kHz for Opus -- so nothing of
its band is lost; the file says the rate it holds.

A format OpenAI names that this server cannot write (``aac`` without PyAV;
``mp3`` on a libsndfile built without LAME) is refused before the request is
admitted, by :func:`check_audio_format`: a 400 naming the field and the
format, why, and the formats it could have.  Encoding a long clip takes a
while (an Opus, MP3 or AAC encoder), so the routes encode off the event
loop.  Audio without a sample gives an empty FLAC, MP3 or AAC body (their
writers put the header with the first samples).
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
           "check_audio_format", "encode_audio", "pcm16", "writable", "writable_formats"]

#: the audio formats OpenAI's APIs name: ``/v1/audio/speech``'s ``response_format`` ...
SpeechFormat = Literal["mp3", "opus", "aac", "flac", "wav", "pcm"]
#: ... and a chat request's ``audio.format``: the same ones, ``pcm`` spelt ``pcm16``
ChatAudioFormat = Literal["wav", "aac", "mp3", "flac", "opus", "pcm16"]
OPENAI_AUDIO_FORMATS: tuple[str, ...] = get_args(SpeechFormat)
OPUS_RATES = (8000, 12000, 16000, 24000, 48000)
MP3_RATES = (8000, 11025, 12000, 16000, 22050, 24000, 32000, 44100, 48000)  # MPEG-1/2/2.5: MP3's and AAC's
#: who writes a format: the standard library (``wave``; pcm is the samples as they are), libsndfile
#: (through soundfile, a dependency) or FFmpeg (through PyAV, the optional ``audio`` extra)
Writer = Literal["wave", "sndfile", "av"]
#: why a writer may be missing here, for the 400 that refuses its formats
_MISSING = {"sndfile": "the libsndfile this server loaded cannot write it",
            "av": "it needs PyAV, which is not installed here: pip install 'trio-orch[audio]'"}


@dataclass(frozen=True)
class AudioFormat:
    """How one format is written."""

    content_type: str
    writer: Writer = "wave"
    #: the writer's names for it: libsndfile's (major format, subtype), FFmpeg's (muxer, encoder)
    codec: tuple[str, str] = ("", "")
    #: the sample rates it takes (empty: any)
    rates: tuple[int, ...] = ()

    def can_write(self) -> bool:
        """Whether this process has the writer and the writer this format (asked of the library)."""
        if self.writer == "sndfile":
            import soundfile

            return bool(soundfile.check_format(*self.codec))
        if self.writer == "av":
            try:
                import av
            except ImportError:
                return False
            return self.codec[0] in av.formats_available and self.codec[1] in av.codecs_available
        return True

    def rate_for(self, sample_rate: int) -> int:
        """The rate audio at ``sample_rate`` is written at: its own, or the lowest one taken above it."""
        if not self.rates or sample_rate in self.rates:
            return sample_rate
        return min((r for r in self.rates if r >= sample_rate), default=max(self.rates))


#: every format OpenAI names, and how it is written (one whose writer is missing here is refused: see
#: :func:`writable_formats`)
AUDIO_OUT: dict[str, AudioFormat] = {
    "wav": AudioFormat("audio/wav"),
    "pcm": AudioFormat("audio/pcm"),
    "flac": AudioFormat("audio/flac", "sndfile", ("FLAC", "PCM_16")),
    "opus": AudioFormat("audio/ogg", "sndfile", ("OGG", "OPUS"), OPUS_RATES),
    "mp3": AudioFormat("audio/mpeg", "sndfile", ("MP3", "MPEG_LAYER_III"), MP3_RATES),
    "aac": AudioFormat("audio/aac", "av", ("adts", "aac"), MP3_RATES),
}


@functools.cache
def writable(name: str) -> bool:
    """Whether this process can write the format ``name`` of :data:`AUDIO_OUT` (its library asked once,
    when the format is first asked for: a WAV answer never loads libsndfile or FFmpeg)."""
    return AUDIO_OUT[name].can_write()


def writable_formats() -> tuple[str, ...]:
    """The formats of :data:`AUDIO_OUT` this process can write."""
    return tuple(name for name in AUDIO_OUT if writable(name))


def check_audio_format(fmt: str, param: str, *, pcm: str = "pcm") -> str:
    """``fmt``'s name in :data:`AUDIO_OUT`; BadRequest naming ``param`` if it cannot be written here.
    ``pcm``: the route's name for raw PCM (chat's ``pcm16``)."""
    name = "pcm" if fmt == pcm else fmt
    if name in AUDIO_OUT and writable(name):
        return name
    why = _MISSING[AUDIO_OUT[name].writer] if name in AUDIO_OUT else "it is not an audio format OpenAI names"
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
    if spec.writer == "wave":
        with wave.open(buf, "wb") as w:
            w.setnchannels(1)
            w.setsampwidth(2)
            w.setframerate(sample_rate)
            w.writeframes(pcm)
        return buf.getvalue()
    samples = np.frombuffer(pcm, dtype="<i2")
    rate = spec.rate_for(sample_rate)
    data = samples if rate == sample_rate else _resample(samples, sample_rate, rate)
    if spec.writer == "av":
        _write_av(buf, data, rate, *spec.codec)
    else:
        import soundfile

        soundfile.write(buf, data, rate, format=spec.codec[0], subtype=spec.codec[1])
    return buf.getvalue()


def _write_av(buf: io.BytesIO, data: np.ndarray, rate: int, muxer: str, codec: str) -> None:
    """Mono ``data`` (int16, or float32 once resampled) -> ``buf`` in FFmpeg's ``muxer``/``codec``.
    The encoder takes the whole clip as one frame: PyAV cuts it into the codec's frame size."""
    import av

    with av.open(buf, "w", format=muxer) as out:
        stream = out.add_stream(codec, rate=rate, layout="mono")
        frames = []
        if len(data):
            frame = av.AudioFrame.from_ndarray(data.reshape(1, -1), layout="mono",
                                               format="s16" if data.dtype == np.int16 else "flt")
            frame.sample_rate = rate
            frames.append(frame)
        for frame in [*frames, None]:  # None: flush the encoder
            for packet in stream.encode(frame):
                out.mux(packet)
