"""The diffusion stage and the thinker-as-encoder, in process: CFG arithmetic, progress, PNG, batching."""

from __future__ import annotations

import io
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from stages.base import ReqState
from stages.forwarding import encoding_input
from stages.toy.diffusion import Diffusion, guided_eps
from stages.toy.encoder import ThinkerEncoder


@pytest.fixture(scope="module")
def encoder() -> ThinkerEncoder:
    return ThinkerEncoder(d_model=32, layers=1, heads=2)


@pytest.fixture(scope="module")
def model() -> Diffusion:
    m = Diffusion(d_model=32, heads=2, layers=1, cond_dim=32, vae_dim=8, default_size=32, default_steps=4)
    m.warmup()
    return m


def encode(encoder: ThinkerEncoder, text: str) -> np.ndarray:
    req = ReqState("e", {"text": text, "width": 99})  # options for the next stage are ignored here
    encoder.admit(req)
    [res] = encoder.step([req])
    assert res.finished
    return res.data["embedding"]


def run(model: Diffusion, *payloads: dict[str, Any]) -> list[list[dict[str, Any]]]:
    """Step these requests together until each finished; every output of each."""
    reqs = [ReqState(f"r{i}", p) for i, p in enumerate(payloads)]
    for r in reqs:
        model.admit(r)
    outs: list[list[dict[str, Any]]] = [[] for _ in reqs]
    live = list(range(len(reqs)))
    while live:
        results = model.step([reqs[i] for i in live])
        for i, res in zip(list(live), results, strict=True):
            outs[i].append(res.data)
            if res.finished:
                live.remove(i)
    return outs


def pixels(out: dict[str, Any]) -> np.ndarray:
    img = Image.open(io.BytesIO(out["png"]))
    assert img.format == "PNG" and img.mode == "RGB"
    return np.asarray(img).astype(np.int16)


def test_guidance_moves_from_the_unconditional_towards_the_conditional_prediction() -> None:
    cond, uncond = torch.tensor([1.0, 2.0]), torch.tensor([0.5, -1.0])
    assert torch.equal(guided_eps(cond, uncond, 1.0), cond)
    assert torch.equal(guided_eps(cond, uncond, 0.0), uncond)
    assert guided_eps(cond, uncond, 3.0).tolist() == [0.5 + 3 * 0.5, -1.0 + 3 * 3.0]


def test_the_encoder_gives_one_vector_per_byte_and_encodes_the_empty_prompt(encoder: ThinkerEncoder) -> None:
    assert encode(encoder, "a cat").shape == (6, 32)
    empty = encode(encoder, "")
    assert empty.shape == (1, 32) and empty.dtype == np.float32 and np.isfinite(empty).all()
    with pytest.raises(ValueError, match="encoder payload"):
        encoder.admit(ReqState("e", {"prompt": "x"}))


def test_progress_every_step_then_a_png_of_the_requested_size(model: Diffusion,
                                                              encoder: ThinkerEncoder) -> None:
    [outs] = run(model, {"cond": encode(encoder, "a red square"), "width": 48, "height": 32, "steps": 5})
    assert [o["progress"] for o in outs] == [{"step": i, "steps": 5} for i in range(1, 6)]
    assert all("png" not in o for o in outs[:-1])
    final = outs[-1]
    assert pixels(final).shape == (32, 48, 3) and (final["width"], final["height"]) == (48, 32)
    assert final["guided_by"] is None and final["steps"] == 5


def test_same_seed_same_image_and_guidance_changes_it(model: Diffusion, encoder: ThinkerEncoder) -> None:
    cond, neg = encode(encoder, "a cat"), encode(encoder, "blurry")
    base = {"cond": cond, "seed": 5, "steps": 3}
    plain = run(model, base)[0][-1]
    assert run(model, base)[0][-1]["png"] == plain["png"]
    assert run(model, {**base, "seed": 6})[0][-1]["png"] != plain["png"]
    guided = run(model, {**base, "uncond": neg, "companion": "r:neg", "guidance_scale": 7.5})[0][-1]
    assert guided["guided_by"] == "r:neg" and guided["guidance_scale"] == 7.5
    assert np.abs(pixels(guided) - pixels(plain)).mean() > 5
    # guidance 0 is the negative prompt's prediction alone: as if it had been the prompt
    zero = run(model, {**base, "uncond": neg, "companion": "r:neg", "guidance_scale": 0.0})[0][-1]
    negative_only = run(model, {**base, "cond": neg})[0][-1]
    assert np.abs(pixels(zero) - pixels(negative_only)).max() <= 2


def test_concurrent_requests_share_forward_passes_per_image_size(model: Diffusion,
                                                                 encoder: ThinkerEncoder) -> None:
    cond, neg = encode(encoder, "a cat"), encode(encoder, "a much longer negative prompt")
    a = {"cond": cond, "seed": 1, "steps": 4}
    b = {"cond": cond, "uncond": neg, "companion": "b:neg", "seed": 2, "steps": 2, "guidance_scale": 3.0}
    c = {"cond": cond, "seed": 3, "steps": 4, "width": 48}
    alone = [run(model, p)[0][-1] for p in (a, b, c)]
    before, model.max_rows = model.forwards, 0
    together = run(model, a, b, c)
    # 4 steps: two sizes each step (a+b share while b runs: a's row, b's two rows)
    assert model.forwards - before == 8 and model.max_rows == 3
    assert [len(o) for o in together] == [4, 2, 4]
    for solo, batched in zip(alone, together, strict=True):
        assert np.abs(pixels(solo) - pixels(batched[-1])).max() <= 2  # padding and batching change nothing


@pytest.mark.parametrize("payload, message", [
    ({"cond": np.zeros((2, 16), np.float32)}, r"cond must be a float array \[tokens, 32\]"),
    ({"cond": np.zeros((2, 32), np.int32)}, "cond must be a float array"),
    ({"cond": np.zeros((2, 32), np.float32), "uncond": np.zeros(3, np.float32)}, "uncond must be"),
    ({"cond": np.zeros((2, 32), np.float32), "width": 40}, "width must be a multiple of 16"),
    ({"cond": np.zeros((2, 32), np.float32), "height": 1024}, "height must be a multiple of 16 from 16 to"),
    ({"cond": np.zeros((2, 32), np.float32), "steps": 0}, "steps must be an integer from 1 to 100"),
    ({"cond": np.zeros((2, 32), np.float32), "guidance_scale": float("nan")}, "guidance_scale must be"),
    ({"cond": np.zeros((2, 32), np.float32), "seed": -1}, "seed must be a non-negative integer"),
    ("a cat", "must be a dict"),
])
def test_bad_payloads_are_refused_at_admission(model: Diffusion, payload: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        model.admit(ReqState("r", payload))
    with pytest.raises(ValueError, match="not streamed chunks"):
        model.admit(ReqState("r", {"cond": np.zeros((2, 32), np.float32)}, upstream=True))


def test_the_encoders_forward_pairs_the_prompt_with_its_negative_companion() -> None:
    emb = {"embedding": np.ones((3, 4), np.float32)}
    neg = {"embedding": np.zeros((1, 4), np.float32)}
    prompt = {"text": "a cat", "width": 64, "steps": 3, "other": "ignored"}
    plain = encoding_input(prompt, [emb])
    assert set(plain) == {"cond", "width", "steps"} and plain["cond"] is emb["embedding"]
    guided = encoding_input(prompt, [emb], companions={"r:neg": [neg]})
    assert guided["uncond"] is neg["embedding"] and guided["companion"] == "r:neg"
    with pytest.raises(ValueError, match="one companion"):
        encoding_input(prompt, [emb], companions={"a": [neg], "b": [neg]})
    with pytest.raises(ValueError, match="companion 'a' has no encoding"):
        encoding_input(prompt, [emb], companions={"a": ["text"]})
