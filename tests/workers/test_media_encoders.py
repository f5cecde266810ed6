"""The image and audio encoder kinds and the thinker's features, in process (no worker started).

The chain is driven the way the orchestrator drives it: each encoder's
outputs go through its kind's forward function (the registry's) to the next
stage, with the request's stage-0 prompt.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from stages.base import ReqState, StageModel  # noqa: E402
from stages.config import PipelineConfig, StageConfig, builtin_config  # noqa: E402
from stages.registry import build_model, forward_fn, input_media, spec_for  # noqa: E402
from stages.wire import InboundMsg, Submit, WireCodec  # noqa: E402

SMALL = {"d_model": 32, "layers": 1, "heads": 2}
KINDS = ["image-encoder", "audio-encoder", "thinker"]


def solid(rgb: tuple[int, int, int], size: int = 64) -> np.ndarray:
    img = np.zeros((size, size, 3), np.uint8)
    img[...] = rgb
    return img


def tone(freq: float, rate: int = 16000, seconds: float = 0.5) -> dict[str, Any]:
    t = np.arange(int(rate * seconds)) / rate
    return {"pcm": (0.5 * np.sin(2 * np.pi * freq * t)).astype(np.float32), "sample_rate": rate}


def one(model: StageModel, payload: Any, rid: str = "r", **sampling: Any) -> list[Any]:
    """Every output of one request, driven like the worker (admit, step until finished)."""
    req = ReqState(rid, payload, sampling=dict(sampling))
    model.admit(req)
    outs = []
    while True:
        [res] = model.step([req])
        if res.data is not None:
            outs.append(res.data)
        if res.finished:
            model.release(req)
            return outs


class Omni:
    """The omni-in pipeline's three models with their seeds, and its forward function."""

    def __init__(self, seed: int = 0) -> None:
        cfg = builtin_config("omni-in")
        self.models = [build_model(s.kind, {**s.model, **(SMALL if s.kind == "thinker" else {})},
                                   seed=cfg.model_seed(k)) for k, s in enumerate(cfg.stages)]
        self.forward = forward_fn(cfg.kinds())

    def answer(self, prompt: Any, seed: int = 7) -> str:
        payload = prompt
        for k, model in enumerate(self.models[:-1]):
            payload = self.forward(k, prompt, one(model, payload))
        return "".join(o["text"] for o in one(self.models[-1], payload, seed=seed, max_tokens=24))


@pytest.fixture(scope="module")
def omni() -> Omni:
    return Omni()


def test_the_encoder_kinds_are_registered_with_their_media() -> None:
    assert [spec_for(k).output for k in KINDS] == ["embedding", "embedding", "text"]
    assert input_media(KINDS) == {"image", "audio"} and input_media(["thinker", "not a kind"]) == set()
    assert builtin_config("omni-in").kinds() == KINDS


def test_an_image_becomes_patch_rows_and_a_sound_frame_rows() -> None:
    img = build_model("image-encoder", {"image_size": 32, "patch": 8, "dim": 16})
    [out] = one(img, {"text": "x", "images": [solid((255, 0, 0)), solid((0, 0, 255), 20)]})
    assert out["features"].shape == (32, 16) and out["features"].dtype == np.float32
    assert out["encoded"] == ["image"]
    aud = build_model("audio-encoder", {"max_frames": 8, "dim": 16})
    [out] = one(aud, {"text": "x", "audios": [tone(440)], "features": np.ones((3, 16), np.float32),
                      "encoded": ["image"]})
    assert out["features"].shape == (3 + 8, 16) and (out["features"][:3] == 1).all()  # the given rows first
    assert out["encoded"] == ["audio", "image"]
    [passed] = one(aud, "just text")
    assert passed["features"].shape == (0, 16)


def test_the_same_seed_gives_the_same_weights_and_features() -> None:
    a, b = (build_model("image-encoder", {}, seed=5) for _ in range(2))
    c = build_model("image-encoder", {}, seed=6)
    f = [one(m, {"images": [solid((10, 200, 30))]})[0]["features"] for m in (a, b, c)]
    assert np.array_equal(f[0], f[1]) and not np.allclose(f[0], f[2])


def test_encoders_refuse_what_is_not_their_medium() -> None:
    img = build_model("image-encoder", {})
    with pytest.raises(ValueError, match="uint8"):
        img.admit(ReqState("r", {"images": [np.zeros((4, 4), np.float32)]}))
    with pytest.raises(ValueError, match="rows of 128"):
        img.admit(ReqState("r", {"images": [], "features": np.zeros((2, 7), np.float32)}))
    with pytest.raises(ValueError, match="sample_rate"):
        build_model("audio-encoder", {}).admit(ReqState("r", {"audios": [{"pcm": [0.1], "sample_rate": 0}]}))
    with pytest.raises(ValueError, match="multiple of patch"):
        build_model("image-encoder", {"image_size": 30, "patch": 8})


def test_the_forward_hands_on_the_features_and_drops_the_encoded_media(omni: Omni) -> None:
    prompt = {"text": "user: hi\nassistant:", "images": [solid((255, 0, 0))], "audios": [tone(330)]}
    to_audio = omni.forward(0, prompt, one(omni.models[0], prompt))
    assert sorted(to_audio) == ["audios", "encoded", "features", "text"]
    to_thinker = omni.forward(1, prompt, one(omni.models[1], to_audio))
    assert sorted(to_thinker) == ["encoded", "features", "text"] and to_thinker["text"] == prompt["text"]
    assert to_thinker["features"].shape == (16 + 16, 128)
    assert omni.forward(0, "plain text", one(omni.models[0], "plain text")) == "plain text"


def test_the_thinker_s_answer_depends_on_the_image_and_on_the_sound(omni: Omni) -> None:
    text = "user: what is this?<image>\nassistant:"
    red = omni.answer({"text": text, "images": [solid((255, 0, 0))]})
    blue = omni.answer({"text": text, "images": [solid((0, 0, 255))]})
    assert red and blue and red != blue
    assert omni.answer({"text": text, "images": [solid((255, 0, 0))]}) == red  # seeded: reproducible
    low = omni.answer({"text": text, "audios": [tone(220)]})
    high = omni.answer({"text": text, "audios": [tone(1760)]})
    assert low and high and low != high


def test_the_thinker_refuses_features_of_the_wrong_width_or_more_than_its_context() -> None:
    thinker = build_model("thinker", {**SMALL, "feature_dim": 8, "max_model_len": 20})
    with pytest.raises(ValueError, match="feature_dim"):
        thinker.admit(ReqState("r", {"text": "hi", "features": np.zeros((2, 4), np.float32)}))
    with pytest.raises(ValueError, match=r"maximum context length is 20 tokens.*you requested 20 tokens"):
        thinker.admit(ReqState("r", {"text": "hi", "features": np.zeros((18, 8), np.float32)}))
    feats = np.zeros((15, 8), np.float32)
    too_long = ReqState("r", {"text": "hi", "features": feats}, sampling={"max_tokens": 4})
    with pytest.raises(ValueError, match=r"requested 21 tokens \(17 in the messages, 4 in the completion\)"):
        thinker.admit(too_long)
    assert one(thinker, {"text": "hi", "features": np.zeros((15, 8), np.float32)}, max_tokens=3)


def test_the_media_payload_crosses_the_wire_as_frames_and_encodes_the_same(omni: Omni) -> None:
    prompt = {"text": "user: <image><audio>\nassistant:", "images": [solid((0, 200, 100))],
              "audios": [tone(500)]}
    codec = WireCodec(InboundMsg)
    frames = codec.encode(Submit("r", prompt, 0))
    assert len(frames) == 3  # the header, the image's pixels, the clip's samples: never in the header
    got = codec.decode([bytes(f) for f in frames])
    assert isinstance(got, Submit)
    sent = one(omni.models[0], got.payload)[0]["features"]
    assert np.array_equal(sent, one(omni.models[0], prompt)[0]["features"])


def test_the_config_refuses_an_encoder_the_thinker_cannot_read() -> None:
    with pytest.raises(ValueError, match="dim 64, but stage 1 \\(thinker\\) reads feature_dim 128"):
        PipelineConfig([StageConfig("image-encoder", model={"dim": 64}), StageConfig("thinker")],
                       final_stage_ids=[1]).validate()
    with pytest.raises(ValueError, match="feeds no thinker"):
        PipelineConfig([StageConfig("thinker"), StageConfig("audio-encoder")], final_stage_ids=[0]).validate()
    with pytest.raises(ValueError, match="not async_chunk"):
        builtin_config("omni-in").with_overrides(async_chunk=True)
    with pytest.raises(ValueError, match="split thinker"):
        PipelineConfig([StageConfig("image-encoder"), StageConfig("thinker", role="prefill"),
                        StageConfig("thinker", role="decode")], final_stage_ids=[2]).validate()
    narrow = [StageConfig("audio-encoder", model={"dim": 8}),
              StageConfig("thinker", model={"feature_dim": 8})]
    assert PipelineConfig(narrow, final_stage_ids=[1]).validate().kinds() == ["audio-encoder", "thinker"]
