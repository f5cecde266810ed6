"""Sampling in the torch models, in-process: per-request seeds (alone or batched), greedy, top-k/top-p,
penalties, stop strings and tokens, limits, voices."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from stages.base import ReqState, StageModel  # noqa: E402
from stages.registry import build_model as build  # noqa: E402
from stages.sampling import RequestSampler, StopText, sample  # noqa: E402

SMALL = {"d_model": 32, "layers": 2, "heads": 2}


def req(rid: str, payload: Any, **sampling: Any) -> ReqState:
    r = ReqState(rid, payload)
    r.sampling = sampling
    return r


def run(model: StageModel, reqs: list[ReqState]) -> dict[str, list[Any]]:
    """Drive a model like the worker does: admit all, step the runnable ones until all finished."""
    for r in reqs:
        model.admit(r)
    outs: dict[str, list[Any]] = {r.request_id: [] for r in reqs}
    active = list(reqs)
    while active:
        batch = [r for r in active if model.runnable(r)]
        for r, res in zip(batch, model.step(batch), strict=True):
            if res.data is not None:
                outs[r.request_id].append(res.data)
            if res.finished:
                active.remove(r)
                model.release(r)
    return outs


def text(outs: list[dict[str, Any]]) -> str:
    return "".join(o["text"] for o in outs)


@pytest.fixture(scope="module")
def thinker() -> StageModel:
    """One model for the module: a request's tokens depend on its own state and seed only."""
    return build("thinker", {**SMALL, "max_new_tokens": 24}, seed=0)


# ---------------------------------------------------------------- the sampler
def sampler(seed: int, **params: Any) -> RequestSampler:
    return RequestSampler({"temperature": 1.0, "seed": seed, **params}, 50,
                          seed_source=torch.Generator().manual_seed(0))


def test_a_request_s_draws_depend_on_its_seed_only_not_on_its_batch() -> None:
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(3))
    alone, batched, other = sampler(7), sampler(7), sampler(8)
    mates = [sampler(1), sampler(2, top_k=5), sampler(4, top_p=0.3)]
    draws = [int(sample([alone], logits[2:3])) for _ in range(20)]
    in_batch = [int(sample([mates[0], mates[1], batched, mates[2]], logits)[2]) for _ in range(20)]
    assert in_batch == draws and len(set(draws)) > 1  # the same seed, the same draws; and they are draws
    assert [int(sample([other], logits[2:3])) for _ in range(20)] != draws


def test_greedy_top_k_1_and_a_tiny_top_p_all_take_the_argmax() -> None:
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(5))
    best = logits.argmax(-1)
    assert torch.equal(sample([sampler(1, temperature=0.0) for _ in range(3)], logits), best)
    for _ in range(10):
        assert torch.equal(sample([sampler(s, top_k=1) for s in range(3)], logits), best)
        assert torch.equal(sample([sampler(s, top_p=1e-6) for s in range(3)], logits), best)


def test_top_k_keeps_the_k_most_likely_tokens() -> None:
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(6))
    top3 = set(logits[0].topk(3).indices.tolist())
    s = sampler(11, top_k=3, temperature=2.0)
    picks = {int(sample([s], logits)) for _ in range(200)}
    assert picks <= top3 and len(picks) > 1


def test_penalties_follow_their_definitions() -> None:
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5]])
    rep = RequestSampler({"temperature": 0.0, "repetition_penalty": 2.0}, 4,
                         seed_source=torch.Generator(), prompt=[0])
    rep.observe(torch.tensor([1]))
    assert torch.allclose(rep.penalise(logits), torch.tensor([[1.0, -4.0, 1.0, 0.5]]))
    freq = RequestSampler({"temperature": 0.0, "frequency_penalty": 0.5, "presence_penalty": 1.0}, 4,
                          seed_source=torch.Generator(), prompt=[0])
    freq.observe(torch.tensor([2]))
    freq.observe(torch.tensor([2]))
    assert torch.allclose(freq.penalise(logits), torch.tensor([[2.0, -2.0, -1.0, 0.5]]))
    assert int(sample([freq], logits)) == 0 and int(sample([rep], logits)) in (0, 2)


def test_stop_text_holds_back_what_may_begin_a_stop_string() -> None:
    st = StopText(["xyz", "q"])
    assert [st.push(c) for c in "abx"] == [("a", False), ("b", False), ("", False)]
    assert st.push("y") == ("", False)
    assert st.push("w") == ("xyw", False)  # no longer a prefix: released
    assert st.push("xy") == ("", False)
    assert st.push("z") == ("", True)
    st = StopText(["xyz"])
    assert st.push("axy") == ("a", False) and st.flush() == "xy"
    assert StopText(["bc", "c"]).push("abc") == ("a", True)  # the earliest stop string wins


# ---------------------------------------------------------------- the thinker
@pytest.mark.slow
def test_thinker_same_seed_same_text_alone_or_batched_with_others(thinker: StageModel) -> None:
    alone = run(thinker, [req("a", "Hello there", seed=7, temperature=1.0)])["a"]
    batched = run(thinker, [req("x", "another prompt", temperature=1.3, top_k=20),
                              req("a", "Hello there", seed=7, temperature=1.0),
                              req("y", "zz", seed=3, repetition_penalty=1.3)])
    assert text(batched["a"]) == text(alone) and len(text(alone)) > 0
    other = run(thinker, [req("a", "Hello there", seed=8, temperature=1.0)])["a"]
    assert text(other) != text(alone)
    g1 = run(thinker, [req("g", "Hello there", seed=1, temperature=0.0)])["g"]
    g2 = run(thinker, [req("g", "Hello there", seed=2, temperature=0.0)])["g"]
    assert text(g1) == text(g2)  # greedy: the seed does not matter


@pytest.mark.slow
def test_thinker_stop_strings_tokens_and_limits(thinker: StageModel) -> None:
    full = text(run(thinker, [req("a", "Hello there", seed=7, temperature=1.0, min_tokens=24)])["a"])
    assert len(full) == 24
    stop = full[5:7]
    first = full.index(stop)
    outs = run(thinker, [req("a", "Hello there", seed=7, temperature=1.0, min_tokens=24, stop=[stop])])["a"]
    assert text(outs) == full[:first] and outs[-1]["finish_reason"] == "stop"
    assert sum(len(o["tokens"]) for o in outs) == first  # the tokens sent on match the text
    assert bytes(np.concatenate([o["tokens"] for o in outs]).astype(np.uint8)).decode() == full[:first]
    outs = run(thinker, [req("a", "Hello there", seed=7, temperature=1.0, min_tokens=24,
                             stop_token_ids=[ord(full[3])])])
    assert text(outs["a"]) == full[: full.index(full[3])] and outs["a"][-1]["finish_reason"] == "stop"
    short = run(thinker, [req("a", "Hello there", seed=7, temperature=1.0, max_tokens=4)])["a"]
    assert text(short) == full[:4] and short[-1]["finish_reason"] == "length"
    capped = run(thinker, [req("a", "Hello there", seed=7, temperature=1.0, max_tokens=500, min_tokens=24)])
    assert len(text(capped["a"])) == 24  # the model's max_new_tokens caps max_tokens


# ---------------------------------------------------------------- talker and vocoder
def talker_codes(*reqs: ReqState) -> dict[str, np.ndarray]:
    outs = run(build("talker", {**SMALL, "codebooks": 2, "codebook_size": 64}, seed=0), list(reqs))
    return {rid: np.concatenate([o["codes"] for o in v]) for rid, v in outs.items()}


TOKENS = {"tokens": np.frombuffer(b"hello world", np.uint8).astype(np.int32)}


@pytest.mark.slow
def test_talker_voice_sampling_seed_and_frame_limit() -> None:
    c = talker_codes(req("alloy", TOKENS), req("nova", TOKENS, voice="nova"),
                     req("hot", TOKENS, temperature=1.0, seed=5), req("short", TOKENS, max_tokens=5))
    assert c["alloy"].shape == c["nova"].shape == (22, 2) and c["short"].shape == (5, 2)
    assert not np.array_equal(c["alloy"], c["nova"])  # another speaker, other codes
    assert not np.array_equal(c["alloy"], c["hot"])  # sampled, not greedy
    assert np.array_equal(c["short"], c["alloy"][:5])
    again = talker_codes(req("hot", TOKENS, temperature=1.0, seed=5))
    assert np.array_equal(again["hot"], c["hot"])  # alone or batched with three others
    assert np.array_equal(talker_codes(req("alloy", TOKENS))["alloy"], c["alloy"])


def test_code2wav_voices_give_different_audio_for_the_same_codes() -> None:
    codes = {"codes": np.arange(40, dtype=np.int32).reshape(20, 2) % 64}
    model = build("code2wav", {"codebooks": 2, "codebook_size": 64, "dim": 16}, seed=0)
    outs = run(model, [req("a", codes), req("b", codes, voice="onyx"), req("a2", codes, voice="alloy")])
    pcm = {rid: np.concatenate([o["pcm"] for o in v]) for rid, v in outs.items()}
    assert pcm["a"].shape == pcm["b"].shape and len(pcm["a"]) > 0
    assert np.abs(pcm["a"] - pcm["b"]).max() > 0.1 and np.array_equal(pcm["a"], pcm["a2"])
