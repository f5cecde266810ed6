"""The audio this server sends: 16-bit PCM, and the files OpenAI's clients ask for, from one encoder.

``/v1/audio/speech``'s ``response_format``, a chat answer's
``audio.format`` and ``trio-orch generate``'s WAV file all come from
:func:`encode_audio`, and each format is one row of :data:`AUDIO_OUT`; a
Realtime response's deltas from :class:`AudioStream`, in a format of
:data:`REALTIME_OUT` (24 kHz PCM, G.711 at 8 kHz: headerless, so piece by
piece):

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
at another rate is resampled to the lowest such rate at or above its own --
22.05 kHz becomes 24 kHz for Opus -- so nothing of its band is lost; the
file says the rate it holds.  One :class:`Resampler` does every change of
rate, whole or piece by piece.

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
import math
import wave
from dataclasses import dataclass
from typing import Literal, get_args

import numpy as np

from trio_orch.openai.validation import BadRequest

__all__ = ["AUDIO_OUT", "FILE_SUFFIXES", "OPENAI_AUDIO_FORMATS", "REALTIME_OUT", "AudioFormat", "AudioStream",
           "ChatAudioFormat", "Resampler", "SpeechFormat", "check_audio_format", "encode_audio", "pcm16",
           "writable", "writable_formats"]

#: the audio formats OpenAI's APIs name: ``/v1/audio/speech``'s ``response_format`` ...
SpeechFormat = Literal["mp3", "opus", "aac", "flac", "wav", "pcm"]
#: ... and a chat request's ``audio.format``: the same ones, ``pcm`` spelt ``pcm16``
ChatAudioFormat = Literal["wav", "aac", "mp3", "flac", "opus", "pcm16"]
OPENAI_AUDIO_FORMATS: tuple[str, ...] = get_args(SpeechFormat)
OPUS_RATES = (8000, 12000, 16000, 24000, 48000)
MP3_RATES = (8000, 11025, 12000, 16000, 22050, 24000, 32000, 44100, 48000)  # MPEG-1/2/2.5: MP3's and AAC's
#: who writes a format: no one (``raw``: the 16-bit samples as they are), the standard library
#: (``wave``), libsndfile (through soundfile, a dependency) or FFmpeg (through PyAV, the ``audio`` extra)
Writer = Literal["raw", "wave", "sndfile", "av"]
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
    "pcm": AudioFormat("audio/pcm", "raw"),
    "flac": AudioFormat("audio/flac", "sndfile", ("FLAC", "PCM_16")),
    "opus": AudioFormat("audio/ogg", "sndfile", ("OGG", "OPUS"), OPUS_RATES),
    "mp3": AudioFormat("audio/mpeg", "sndfile", ("MP3", "MPEG_LAYER_III"), MP3_RATES),
    "aac": AudioFormat("audio/aac", "av", ("adts", "aac"), MP3_RATES),
}
#: a file's suffix -> the format of :data:`AUDIO_OUT` it is written in (``trio-orch generate --out``)
FILE_SUFFIXES = {".wav": "wav", ".flac": "flac", ".opus": "opus", ".ogg": "opus", ".mp3": "mp3",
                 ".aac": "aac", ".pcm": "pcm", ".raw": "pcm"}
#: the Realtime API's output formats (a session's ``audio.output.format.type``), each streamed as
#: headerless runs of samples, one per ``response.output_audio.delta``: 16-bit PCM at 24 kHz, G.711
#: mu-law and A-law at 8 kHz (libsndfile's, as RAW); :class:`AudioStream` writes them
REALTIME_OUT: dict[str, AudioFormat] = {
    "audio/pcm": AudioFormat("audio/pcm", "raw", rates=(24000,)),
    "audio/pcmu": AudioFormat("audio/pcmu", "sndfile", ("RAW", "ULAW"), (8000,)),
    "audio/pcma": AudioFormat("audio/pcma", "sndfile", ("RAW", "ALAW"), (8000,)),
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


def _lowpass(ratio: float) -> np.ndarray:
    """A windowed-sinc low-pass filter (FIR taps) keeping what a rate ``ratio`` times the input's holds."""
    half = math.ceil(8 / ratio)
    n = np.arange(-half, half + 1)
    cutoff = 0.45 * ratio  # cycles per input sample: 90 % of the new rate's Nyquist frequency
    taps = 2 * cutoff * np.sinc(2 * cutoff * n) * np.hamming(len(n))
    return (taps / taps.sum()).astype(np.float32)


class Resampler:
    """Mono float audio at ``src`` Hz -> at ``dst`` Hz, fed piece by piece: the pieces out, joined, are
    what the whole fed at once gives, as many samples as the input's length at ``dst``.  (Only the
    ratio counts: speech's ``speed`` is ``Resampler(speed, 1)``.)

    Linear interpolation, after a low-pass filter when the rate goes down (what the lower rate cannot
    hold would fold back as noise: 24 kHz speech to G.711's 8 kHz).  The filter's delay is taken back,
    so the audio is not shifted; :meth:`flush` gives the last samples, which it held back.
    """

    def __init__(self, src: float, dst: float) -> None:
        self.src, self.dst, self.step = src, dst, src / dst
        self.taps = _lowpass(dst / src) if dst < src else None
        self.delay = 0 if self.taps is None else (len(self.taps) - 1) // 2
        self.history = np.zeros(0 if self.taps is None else len(self.taps) - 1, np.float32)  # filter state
        self.kept = np.zeros(0, np.float32)  # the last (filtered) sample: the next output may need it
        self.base = 0  # kept's index among the samples fed
        self.fed = 0
        self.made = 0

    def feed(self, x: np.ndarray) -> np.ndarray:
        """The output samples ``x`` (the next input samples) completes."""
        x = np.asarray(x, np.float32)
        if not len(x):
            return x
        self.fed += len(x)
        if self.taps is not None:
            padded = np.concatenate([self.history, x])
            self.history = padded[len(x):]
            x = np.convolve(padded, self.taps, mode="valid").astype(np.float32)
        buf = np.concatenate([self.kept, x])
        end = self.base + len(buf) - 1  # buf's last sample's index among those fed
        last = math.floor((end - self.delay) / self.step + 1e-9) if end >= self.delay else -1
        k = np.arange(self.made, last + 1)
        out = np.interp(self.delay + k * self.step - self.base, np.arange(len(buf)), buf)
        self.made = max(self.made, last + 1)
        self.kept, self.base = buf[-1:], end
        return out.astype(np.float32)

    def flush(self) -> np.ndarray:
        """The rest, once the input has ended (the signal after it silence)."""
        total, fed = round(self.fed * self.dst / self.src), self.fed
        made = self.made
        tail = self.feed(np.zeros(self.delay + math.ceil(self.step) + 1, np.float32))
        self.fed, self.made = fed, total
        return tail[:max(0, total - made)]


def _resample(samples: np.ndarray, src: int, dst: int) -> np.ndarray:
    """16-bit ``samples`` at ``src`` Hz -> float32 in [-1, 1] at ``dst`` Hz (:class:`Resampler`)."""
    r = Resampler(src, dst)
    return np.concatenate([r.feed(samples.astype(np.float32) / 32768.0), r.flush()])


class AudioStream:
    """One answer's audio, encoded piece by piece as it is made (a Realtime response's deltas), in a
    headerless format of :data:`REALTIME_OUT` at that format's rate: the pieces out, joined, are the
    whole encoded at once."""

    def __init__(self, fmt: AudioFormat, sample_rate: int) -> None:
        if fmt.writer not in ("raw", "sndfile") or fmt.codec[0] not in ("", "RAW"):
            raise ValueError(f"{fmt.content_type} has a header: it is written whole, by encode_audio")
        self.fmt = fmt
        self.rate = fmt.rate_for(sample_rate)
        self.resampler = Resampler(sample_rate, self.rate) if self.rate != sample_rate else None

    def encode(self, pcm: np.ndarray) -> bytes:
        """Float samples in [-1, 1] at the answer's rate -> the bytes they complete (maybe none yet)."""
        return self._write(pcm if self.resampler is None else self.resampler.feed(pcm))

    def flush(self) -> bytes:
        """The last bytes, once the answer's audio has ended."""
        return b"" if self.resampler is None else self._write(self.resampler.flush())

    def _write(self, samples: np.ndarray) -> bytes:
        if self.fmt.writer == "raw" or not len(samples):
            return pcm16(samples)
        import soundfile

        buf = io.BytesIO()
        soundfile.write(buf, np.clip(samples, -1.0, 1.0), self.rate, format=self.fmt.codec[0],
                        subtype=self.fmt.codec[1])
        return buf.getvalue()


def encode_audio(pcm: bytes, sample_rate: int, fmt: str) -> bytes:
    """16-bit little-endian mono ``pcm`` at ``sample_rate`` -> a file in ``fmt`` (a format that
    :func:`check_audio_format` let through; KeyError for a name not in :data:`AUDIO_OUT`)."""
    spec = AUDIO_OUT[fmt]
    if spec.writer == "raw":
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
