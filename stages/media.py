"""The media payload of a chat with images or audio, and how encoder stages forward it to the thinker.

A request whose chat carried images or audio enters the pipeline as a dict:
``{"text": prompt, "images": [uint8[h, w, 3], ...], "audios": [{"pcm":
float32[n], "sample_rate": int}, ...]}`` (either list may be absent).  Each
encoder stage (``image-encoder``, ``audio-encoder``) turns its own media
into feature rows and hands the rest on: the next stage gets the prompt
without the media encoded so far and with ``"features": float32[rows, dim]``
-- the features it was given, then its own -- and ``"encoded"``, the media
encoded so far (the forward function gets the request's stage-0 prompt, so
it reads there what to leave out).  Only the thinker reads ``features``
(projected into its embedding space and put before the prompt's tokens);
arrays travel as their own wire frames, never copied into the header.

A text-only request (a plain string) passes an encoder unchanged.  Like
:mod:`stages.forwarding`, this runs in the orchestrator: no torch, no trio.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["FEATURE_DIM", "MEDIA_KEYS", "audio_features_input", "features_of", "image_features_input",
           "media_of"]

#: the default width of a feature row: the built-in encoders' ``dim``, the thinker's ``feature_dim``
FEATURE_DIM = 128

#: payload key -> the encoder kind's medium that reads it
MEDIA_KEYS = {"image": "images", "audio": "audios"}


def media_of(payload: Any, medium: str) -> list[Any]:
    """The items of ``medium`` ("image" or "audio") a stage-0 payload carries."""
    if not isinstance(payload, dict):
        return []
    items = payload.get(MEDIA_KEYS[medium])
    return list(items) if isinstance(items, list | tuple) else []


def features_of(payload: Any) -> np.ndarray | None:
    """The feature rows a payload carries (None: none)."""
    if isinstance(payload, dict) and payload.get("features") is not None:
        return np.asarray(payload["features"], dtype=np.float32)
    return None


def _forward(prompt: Any, outputs: list[Any], medium: str) -> Any:
    if not isinstance(prompt, dict):
        return prompt  # text only: nothing was encoded
    last = outputs[-1] if outputs else None
    if not isinstance(last, dict) or "features" not in last:
        raise ValueError(f"the {medium} encoder's output has no 'features'")
    done = {m for m in last.get("encoded", ()) if m in MEDIA_KEYS} | {medium}
    drop = {MEDIA_KEYS[m] for m in done} | {"features", "encoded"}
    nxt = {k: v for k, v in prompt.items() if k not in drop}
    nxt["encoded"] = sorted(done)
    if len(last["features"]):
        nxt["features"] = last["features"]
    return nxt


def image_features_input(prompt: Any, outputs: list[Any]) -> Any:
    """image-encoder -> next stage: the prompt without its images, with the features so far."""
    return _forward(prompt, outputs, "image")


def audio_features_input(prompt: Any, outputs: list[Any]) -> Any:
    """audio-encoder -> next stage: the prompt without its audio, with the features so far."""
    return _forward(prompt, outputs, "audio")
