"""Images and audio a client sends in a chat: decoded, bounded, turned into arrays for the encoder stages.

An ``image_url`` part's URL is a ``data:image/...;base64,`` URL, or -- only
when the server allows a directory (``serve --allowed-local-media-path``, as
vLLM's) -- a ``file://`` URL of a file inside it.  Remote ``http(s)`` URLs
are refused with a 400: the server fetches nothing on a client's behalf.
Images are decoded with Pillow (:data:`IMAGE_FORMATS` only), bounded in encoded bytes and pixels
(Pillow's decompression-bomb guard is not the limit here; ours is checked
before the pixels are decoded), converted to RGB and shrunk to at most
:attr:`MediaPolicy.max_side` on their longer side: a ``uint8[height, width,
3]`` array.

An ``input_audio`` part is ``{"data": base64, "format": "wav"}``: a PCM WAV
(8, 16, 24 or 32-bit integer samples, any channel count and rate) read with
the standard library's :mod:`wave`, mixed to mono float32 and bounded in
bytes and seconds.  Other formats are refused naming them.

Every refusal is a :class:`~trio_orch.http.schemas.BadRequest` whose
``param`` names the part (``messages[0].content[1]``).
"""

from __future__ import annotations

import base64
import binascii
import io
import wave
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

import numpy as np
from PIL import Image, UnidentifiedImageError

from trio_orch.http.schemas import BadRequest

__all__ = ["IMAGE_FORMATS", "AudioClip", "MediaPolicy", "decode_audio", "decode_image", "read_image_file",
           "wav_clip"]


#: the image formats decoded (Pillow's names): common raster formats only -- never one whose
#: plug-in runs an outside program (EPS runs Ghostscript)
IMAGE_FORMATS = ("PNG", "JPEG", "GIF", "WEBP", "BMP", "TIFF")


@dataclass(frozen=True)
class MediaPolicy:
    """What media a chat may carry: where local files may come from, and how large each part may be."""

    #: the directory ``file://`` image URLs must be inside (None: local files are refused)
    allowed_local_media_path: Path | None = None
    max_image_bytes: int = 8 << 20
    max_image_pixels: int = 4096 * 4096
    #: images are shrunk to at most this many pixels on their longer side before they travel
    max_side: int = 512
    max_audio_bytes: int = 16 << 20
    max_audio_seconds: float = 60.0
    max_parts: int = 8  # image and audio parts per request

    def __post_init__(self) -> None:
        for name in ("max_image_bytes", "max_image_pixels", "max_side", "max_audio_bytes", "max_parts"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)!r}")
        if not self.max_audio_seconds > 0:
            raise ValueError(f"max_audio_seconds must be > 0, got {self.max_audio_seconds!r}")
        if self.allowed_local_media_path is not None:
            root = Path(self.allowed_local_media_path).resolve()
            if not root.is_dir():
                raise ValueError(f"allowed local media path {root} is not a directory")
            object.__setattr__(self, "allowed_local_media_path", root)


@dataclass(frozen=True)
class AudioClip:
    """Mono float32 samples in [-1, 1] at ``sample_rate``."""

    pcm: np.ndarray
    sample_rate: int

    def payload(self) -> dict[str, Any]:
        """What an audio encoder stage takes for one clip."""
        return {"pcm": self.pcm, "sample_rate": self.sample_rate}


def _too_big(param: str, what: str, limit: int) -> BadRequest:
    return BadRequest(f"'{param}': the {what} is over the limit of {limit} bytes", param)


def _b64(data: str, param: str, what: str) -> bytes:
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise BadRequest(f"'{param}': the {what} is not valid base64", param) from None


def decode_image(url: Any, policy: MediaPolicy, param: str) -> np.ndarray:
    """An ``image_url.url`` -> ``uint8[height, width, 3]`` (BadRequest naming ``param`` otherwise)."""
    if not isinstance(url, str) or not url:
        raise BadRequest(f"'{param}': image_url.url must be a non-empty string", param)
    if url.startswith("data:"):
        head, sep, body = url[5:].partition(",")
        if not sep or not head.endswith(";base64") or not head.startswith("image/"):
            raise BadRequest(f"'{param}': a data URL must be 'data:image/<type>;base64,<data>'", param)
        if len(body) * 3 // 4 > policy.max_image_bytes:
            raise _too_big(param, "image", policy.max_image_bytes)
        return _pixels(_b64(body, param, "image data"), policy, param)
    scheme = urlparse(url).scheme.lower()
    if scheme == "file":
        return read_image_file(Path(unquote(urlparse(url).path)), policy, param)
    if scheme in ("http", "https"):
        raise BadRequest(f"'{param}': remote image URLs are not fetched by this server: send the image "
                         "inline as a data: URL (data:image/png;base64,...)", param)
    raise BadRequest(f"'{param}': unsupported image URL scheme {scheme or url[:16]!r} (use a data: URL"
                     + (", or file:// inside the allowed local media path)" if policy.allowed_local_media_path
                        else ")"), param)


def read_image_file(path: Path, policy: MediaPolicy, param: str, *, anywhere: bool = False) -> np.ndarray:
    """A local image file -> pixels; only inside the allowed directory unless ``anywhere`` (the CLI's own)."""
    if not anywhere:
        root = policy.allowed_local_media_path
        if root is None:
            raise BadRequest(f"'{param}': local image files are not allowed on this server (serve "
                             "--allowed-local-media-path DIR allows those inside DIR)", param)
        real = path.resolve()
        if not real.is_relative_to(root):
            raise BadRequest(f"'{param}': {path} is outside the allowed local media path", param)
        path = real
    try:
        size = path.stat().st_size
        if size > policy.max_image_bytes:
            raise _too_big(param, "image", policy.max_image_bytes)
        data = path.read_bytes()
    except OSError as exc:
        raise BadRequest(f"'{param}': cannot read {path}: {exc.strerror or exc}", param) from None
    return _pixels(data, policy, param)


def _pixels(data: bytes, policy: MediaPolicy, param: str) -> np.ndarray:
    if len(data) > policy.max_image_bytes:
        raise _too_big(param, "image", policy.max_image_bytes)
    try:
        with Image.open(io.BytesIO(data), formats=IMAGE_FORMATS) as img:
            w, h = img.size
            if w * h > policy.max_image_pixels:
                raise BadRequest(f"'{param}': the image is {w}x{h}, over the limit of "
                                 f"{policy.max_image_pixels} pixels", param)
            img.load()
            rgb = img.convert("RGB")
    except BadRequest:
        raise
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError, Image.DecompressionBombError) as exc:
        raise BadRequest(f"'{param}': not a readable image ({type(exc).__name__}: {exc})", param) from None
    if max(rgb.size) > policy.max_side:
        rgb.thumbnail((policy.max_side, policy.max_side))
    return np.asarray(rgb, dtype=np.uint8).copy()


def decode_audio(part: Any, policy: MediaPolicy, param: str) -> AudioClip:
    """An ``input_audio`` object ``{"data": base64, "format": "wav"}`` -> a clip (BadRequest otherwise)."""
    if not isinstance(part, dict):
        raise BadRequest(f"'{param}': input_audio must be an object "
                         "{'data': base64, 'format': 'wav'}", param)
    fmt, data = part.get("format"), part.get("data")
    if fmt != "wav":
        raise BadRequest(f"'{param}': audio format {fmt!r} is not supported: send a PCM WAV "
                         "(input_audio.format 'wav')", param)
    if not isinstance(data, str) or not data:
        raise BadRequest(f"'{param}': input_audio.data must be a non-empty base64 string", param)
    if len(data) * 3 // 4 > policy.max_audio_bytes:
        raise _too_big(param, "audio", policy.max_audio_bytes)
    return wav_clip(_b64(data, param, "audio data"), policy, param)


def wav_clip(data: bytes, policy: MediaPolicy, param: str) -> AudioClip:
    """A WAV file's bytes -> a mono clip, within the policy's bounds."""
    try:
        with wave.open(io.BytesIO(data)) as w:
            channels, width, rate, n = w.getnchannels(), w.getsampwidth(), w.getframerate(), w.getnframes()
            if rate < 1:
                raise BadRequest(f"'{param}': the WAV's sample rate is {rate}", param)
            if n / rate > policy.max_audio_seconds:
                raise BadRequest(f"'{param}': the audio is {n / rate:.1f} s long, over the limit of "
                                 f"{policy.max_audio_seconds:g} s", param)
            frames = w.readframes(n)
    except BadRequest:
        raise
    except (wave.Error, EOFError, ValueError) as exc:
        why = str(exc) or type(exc).__name__
        raise BadRequest(f"'{param}': not a readable PCM WAV ({why})", param) from None
    if width not in (1, 2, 3, 4) or channels < 1:
        raise BadRequest(f"'{param}': unsupported WAV sample width {width} bytes", param)
    usable = len(frames) - len(frames) % (width * channels)
    raw = np.frombuffer(frames[:usable], dtype=np.uint8)
    if width == 1:
        samples = (raw.astype(np.float32) - 128.0) / 128.0
    elif width == 3:
        b = raw.reshape(-1, 3).astype(np.int32)
        ints = (b[:, 0] | (b[:, 1] << 8) | (b[:, 2] << 16)) << 8 >> 8  # sign-extend 24-bit
        samples = ints.astype(np.float32) / float(1 << 23)
    else:
        dtype = "<i2" if width == 2 else "<i4"
        samples = np.frombuffer(raw.tobytes(), dtype=dtype).astype(np.float32) / float(1 << (8 * width - 1))
    if not len(samples):
        raise BadRequest(f"'{param}': the WAV holds no samples", param)
    mono = samples.reshape(-1, channels).mean(axis=1).astype(np.float32)
    return AudioClip(mono, rate)
