"""Images and audio a client sends in a chat: decoded, bounded, turned into arrays for the encoder stages.

An ``image_url`` part's URL is a ``data:image/...;base64,`` URL; or -- only
when the server allows a directory (``serve --allowed-local-media-path``, as
vLLM's) -- a ``file://`` URL of a file inside it; or -- only when the server
allows its host (``serve --allowed-media-domains HOST ...``, as vLLM's flag,
but none by default where vLLM allows all) -- an ``http(s)`` URL, fetched
by :func:`fetch_remote_images` without blocking the event loop: within
:attr:`MediaPolicy.fetch_timeout`, the image byte limit checked while the
body streams in, redirects followed only to allowed hosts.  Any other
remote URL is refused with a 400.
Images are decoded with Pillow (:data:`IMAGE_FORMATS` only), bounded in encoded bytes and pixels
(Pillow's decompression-bomb guard is not the limit here; ours is checked
before the pixels are decoded), converted to RGB and shrunk to at most
:attr:`MediaPolicy.max_side` on their longer side: a ``uint8[height, width,
3]`` array.

An ``input_audio`` part is ``{"data": base64, "format": ...}``, the format
one of :data:`AUDIO_FORMATS`: a PCM WAV (8, 16, 24 or 32-bit integer
samples, any channel count and rate) is read with the standard library's
:mod:`wave`; FLAC, Ogg (Vorbis or Opus) and MP3 with ``soundfile``
(libsndfile).  Either way the clip is mixed to mono float32 and bounded in
bytes and seconds (a compressed file's length is checked before it is
decoded, and it is decoded block by block, so a small file that claims
hours is refused without decoding it).

Every refusal is a :class:`~trio_orch.openai.validation.BadRequest` whose
``param`` names the part (``messages[0].content[1]``).
"""

from __future__ import annotations

import base64
import binascii
import io
import ipaddress
import wave
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

import numpy as np
from PIL import Image, UnidentifiedImageError

from trio_orch.openai.validation import BadRequest

__all__ = ["AUDIO_FORMATS", "IMAGE_FORMATS", "AudioClip", "MediaPolicy", "audio_clip", "check_remote_url",
           "decode_audio", "decode_image", "fetch_remote_images", "image_pixels", "is_remote",
           "read_image_file", "wav_clip"]


#: the image formats decoded (Pillow's names): common raster formats only -- never one whose
#: plug-in runs an outside program (EPS runs Ghostscript)
IMAGE_FORMATS = ("PNG", "JPEG", "GIF", "WEBP", "BMP", "TIFF")

#: the ``input_audio.format`` values decoded: ``wav`` by :mod:`wave`, the others by libsndfile
AUDIO_FORMATS = ("wav", "flac", "ogg", "mp3")
#: input_audio.format -> libsndfile's major format name (``soundfile.SoundFile.format``)
_SNDFILE_FORMATS = {"flac": "FLAC", "ogg": "OGG", "mp3": "MP3"}
#: a compressed clip's bounds besides its length: what libsndfile says it holds is checked before decoding
MAX_AUDIO_RATE = 192_000
MAX_AUDIO_CHANNELS = 64
_BLOCK_FRAMES = 1 << 16  # decoded and mixed to mono a block at a time


@dataclass(frozen=True)
class MediaPolicy:
    """What media a chat may carry: where local files may come from, and how large each part may be."""

    #: the directory ``file://`` image URLs must be inside (None: local files are refused)
    allowed_local_media_path: Path | None = None
    #: the hosts ``http(s)`` image URLs may name, exactly (lower case; empty: remote URLs are refused)
    allowed_media_domains: frozenset[str] = frozenset()
    #: seconds one remote image may take, redirects included, connecting to the last byte
    fetch_timeout: float = 10.0
    max_redirects: int = 5
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
        if not self.fetch_timeout > 0:
            raise ValueError(f"fetch_timeout must be > 0, got {self.fetch_timeout!r}")
        if self.max_redirects < 0:
            raise ValueError(f"max_redirects must be >= 0, got {self.max_redirects!r}")
        if isinstance(self.allowed_media_domains, str):
            raise ValueError("allowed_media_domains is a collection of host names, not one string")
        object.__setattr__(self, "allowed_media_domains",
                           frozenset(_host_name(h) for h in self.allowed_media_domains))
        if self.allowed_local_media_path is not None:
            root = Path(self.allowed_local_media_path).resolve()
            if not root.is_dir():
                raise ValueError(f"allowed local media path {root} is not a directory")
            object.__setattr__(self, "allowed_local_media_path", root)


def _host_name(given: str) -> str:
    """An allowed media domain as URLs' host names compare to it (ValueError for a URL or host:port)."""
    host = given.strip().lower().rstrip(".")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    try:
        ipaddress.ip_address(host)
        return host
    except ValueError:
        pass
    if not host or any(c in host for c in "/:@?#[] "):
        raise ValueError(f"allowed media domain {given!r}: give a host name or IP address, not a URL or "
                         "host:port")
    return host


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


def is_remote(url: Any) -> bool:
    """Whether an ``image_url.url`` is an ``http(s)`` URL (fetched, if its host is allowed)."""
    return isinstance(url, str) and urlparse(url).scheme.lower() in ("http", "https")


def check_remote_url(url: str, policy: MediaPolicy, param: str, *, via: str | None = None) -> None:
    """BadRequest naming ``param`` unless ``url`` is http(s) on a host the policy allows.

    The URL is parsed as httpx parses it, so the host checked is the host that
    would be contacted.  ``via``: the URL that redirected here (the refusal says so).
    """
    import httpx

    where = f" (redirected from {via[:200]})" if via is not None else ""
    try:
        parts = httpx.URL(url)
        scheme, host = parts.scheme.lower(), parts.host.lower().rstrip(".")
    except (httpx.InvalidURL, ValueError, TypeError):
        raise BadRequest(f"'{param}': {url[:200]!r}{where} is not a valid URL", param) from None
    if scheme not in ("http", "https"):
        raise BadRequest(f"'{param}': {url[:200]!r}{where} is not an http(s) URL", param)
    if not policy.allowed_media_domains:
        raise BadRequest(f"'{param}': remote image URLs are not fetched by this server: send the image "
                         "inline as a data: URL (data:image/png;base64,...), or start it with "
                         "--allowed-media-domains HOST", param)
    if host not in policy.allowed_media_domains:
        raise BadRequest(f"'{param}': the image URL's host {host!r}{where} is not one of the allowed "
                         f"media domains ({', '.join(sorted(policy.allowed_media_domains))})", param)


def decode_image(url: Any, policy: MediaPolicy, param: str) -> np.ndarray:
    """An ``image_url.url`` -> ``uint8[height, width, 3]`` (BadRequest naming ``param`` otherwise).

    A remote URL is never fetched here (this is synchronous): it is refused,
    naming why -- the chat route checks it with :func:`check_remote_url` and
    fetches it with :func:`fetch_remote_images` instead.
    """
    if not isinstance(url, str) or not url:
        raise BadRequest(f"'{param}': image_url.url must be a non-empty string", param)
    if url.startswith("data:"):
        head, sep, body = url[5:].partition(",")
        if not sep or not head.endswith(";base64") or not head.startswith("image/"):
            raise BadRequest(f"'{param}': a data URL must be 'data:image/<type>;base64,<data>'", param)
        if len(body) * 3 // 4 > policy.max_image_bytes:
            raise _too_big(param, "image", policy.max_image_bytes)
        return image_pixels(_b64(body, param, "image data"), policy, param)
    scheme = urlparse(url).scheme.lower()
    if scheme == "file":
        return read_image_file(Path(unquote(urlparse(url).path)), policy, param)
    if scheme in ("http", "https"):
        check_remote_url(url, policy, param)
        raise BadRequest(f"'{param}': remote image URLs are fetched for chat completions only", param)
    raise BadRequest(f"'{param}': unsupported image URL scheme {scheme or url[:16]!r} (use a data: URL"
                     + (", or file:// inside the allowed local media path)" if policy.allowed_local_media_path
                        else ")"), param)


async def fetch_remote_images(urls: Sequence[tuple[str, str]], policy: MediaPolicy) -> list[bytes]:
    """Fetch ``(url, param)`` images, one after another, each within the policy's bounds.

    Async (httpx over anyio: the same code under the trio and the asyncio
    front), so the event loop keeps serving while a remote host answers.  Each
    URL (and each redirect's target) must pass :func:`check_remote_url`; a
    redirect is followed by hand so that one to another host is refused.  A
    body over ``max_image_bytes`` is refused as soon as its ``Content-Length``
    says so, or once that many bytes have streamed in: no more is read.
    Compressed transfer encodings are not asked for, and refused.  Proxy
    settings in the environment are not used.  BadRequest naming the part for
    a refused host, a failed fetch, a non-200 answer, a timeout or a body over
    the limit.
    """
    import anyio
    import httpx

    out: list[bytes] = []
    if not urls:
        return out
    async with httpx.AsyncClient(follow_redirects=False, trust_env=False, timeout=policy.fetch_timeout,
                                 headers={"accept-encoding": "identity", "accept": "image/*"}) as client:
        for url, param in urls:
            check_remote_url(url, policy, param)
            try:
                with anyio.fail_after(policy.fetch_timeout):
                    out.append(await _fetch(client, url, policy, param))
            except (TimeoutError, httpx.TimeoutException):
                raise BadRequest(f"'{param}': fetching {url[:200]} timed out after "
                                 f"{policy.fetch_timeout:g} s", param) from None
            except (httpx.HTTPError, httpx.InvalidURL) as exc:
                raise BadRequest(f"'{param}': fetching {url[:200]} failed ({type(exc).__name__}: "
                                 f"{exc or 'no detail'})", param) from None
    return out


async def _fetch(client: Any, url: str, policy: MediaPolicy, param: str) -> bytes:
    """One image's bytes, following at most ``max_redirects`` redirects to allowed hosts."""
    limit = policy.max_image_bytes
    for _ in range(policy.max_redirects + 1):
        async with client.stream("GET", url) as resp:
            if resp.is_redirect:
                target = str(resp.url.join(resp.headers.get("location", "")))
                check_remote_url(target, policy, param, via=url)
                url = target
                continue
            if resp.status_code != 200:
                raise BadRequest(f"'{param}': fetching {url[:200]}: the server answered {resp.status_code} "
                                 f"{resp.reason_phrase}".rstrip(), param)
            encoding = resp.headers.get("content-encoding", "identity").strip().lower()
            if encoding not in ("", "identity"):
                raise BadRequest(f"'{param}': fetching {url[:200]}: the body is {encoding}-encoded; "
                                 "this server takes images sent unencoded", param)
            declared = resp.headers.get("content-length", "")
            if declared.isdigit() and int(declared) > limit:
                raise _too_big(param, "image", limit)
            data = bytearray()
            async for chunk in resp.aiter_raw():
                data += chunk
                if len(data) > limit:
                    raise _too_big(param, "image", limit)  # leaving the stream closes the connection
            return bytes(data)
    raise BadRequest(f"'{param}': fetching the image took more than {policy.max_redirects} redirects", param)


def read_image_file(path: Path, policy: MediaPolicy, param: str, *, anywhere: bool = False) -> np.ndarray:
    """A local image file -> pixels; only inside the allowed directory unless ``anywhere`` (the CLI's own).

    A path holding a NUL byte names no file (the OS would refuse it): a 400 before it is resolved."""
    if "\0" in str(path):
        raise BadRequest(f"'{param}': a file path may not hold a NUL byte", param)
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
    return image_pixels(data, policy, param)


def image_pixels(data: bytes, policy: MediaPolicy, param: str) -> np.ndarray:
    """An encoded image's bytes (inline, local or fetched) -> pixels, within the policy's bounds."""
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
    if fmt not in AUDIO_FORMATS:
        raise BadRequest(f"'{param}': audio format {fmt!r} is not supported: input_audio.format is one of "
                         f"{', '.join(AUDIO_FORMATS)}", param)
    if not isinstance(data, str) or not data:
        raise BadRequest(f"'{param}': input_audio.data must be a non-empty base64 string", param)
    if len(data) * 3 // 4 > policy.max_audio_bytes:
        raise _too_big(param, "audio", policy.max_audio_bytes)
    return audio_clip(_b64(data, param, "audio data"), fmt, policy, param)


def audio_clip(data: bytes, fmt: str, policy: MediaPolicy, param: str) -> AudioClip:
    """An audio file's bytes in ``fmt`` (one of :data:`AUDIO_FORMATS`) -> a mono clip within the bounds."""
    if len(data) > policy.max_audio_bytes:
        raise _too_big(param, "audio", policy.max_audio_bytes)
    if fmt == "wav":
        return wav_clip(data, policy, param)
    if fmt not in _SNDFILE_FORMATS:
        raise BadRequest(f"'{param}': audio format {fmt!r} is not one of {', '.join(AUDIO_FORMATS)}", param)
    return _sndfile_clip(data, fmt, policy, param)


def _sndfile_clip(data: bytes, fmt: str, policy: MediaPolicy, param: str) -> AudioClip:
    """FLAC, Ogg or MP3 through libsndfile: its header checked first, then decoded a block at a time."""
    import soundfile

    name = fmt.upper()
    blocks: list[np.ndarray] = []
    got = 0
    try:
        with soundfile.SoundFile(io.BytesIO(data)) as f:
            if f.format != _SNDFILE_FORMATS[fmt]:
                raise BadRequest(f"'{param}': the audio is {f.format}, not {name} (set input_audio.format "
                                 "to what the data is)", param)
            rate, channels = f.samplerate, f.channels
            if not 1 <= rate <= MAX_AUDIO_RATE or not 1 <= channels <= MAX_AUDIO_CHANNELS:
                raise BadRequest(f"'{param}': the {name} has {channels} channels at {rate} Hz (at most "
                                 f"{MAX_AUDIO_CHANNELS} channels at {MAX_AUDIO_RATE} Hz)", param)
            limit = int(policy.max_audio_seconds * rate)
            if f.frames > limit:
                raise BadRequest(f"'{param}': the audio is {f.frames / rate:.1f} s long, over the limit of "
                                 f"{policy.max_audio_seconds:g} s", param)
            while got <= limit:
                block = f.read(min(_BLOCK_FRAMES, limit + 1 - got), dtype="float32", always_2d=True)
                if not len(block):
                    break
                got += len(block)
                blocks.append(block.mean(axis=1, dtype=np.float32))
    except BadRequest:
        raise
    except (soundfile.LibsndfileError, RuntimeError, ValueError, TypeError, EOFError) as exc:
        why = getattr(exc, "error_string", None) or str(exc) or type(exc).__name__  # libsndfile's own words
        raise BadRequest(f"'{param}': not a readable {name} ({why})", param) from None
    if got > limit:  # the header understated it
        raise BadRequest(f"'{param}': the audio is over the limit of {policy.max_audio_seconds:g} s", param)
    if not got:
        raise BadRequest(f"'{param}': the {name} holds no samples", param)
    return AudioClip(np.concatenate(blocks).astype(np.float32, copy=False), rate)


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
