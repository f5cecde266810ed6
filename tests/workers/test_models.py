"""The torch stage models in-process: batching must not change results, shapes and formats hold."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from stages.base import ReqState, StageModel  # noqa: E402
from stages.registry import build_model as build  # noqa: E402

SMALL = {"d_model": 32, "layers": 2, "heads": 2}


def run(model: StageModel, reqs: list[ReqState]) -> dict[str, list]:
    """Drive a model like the worker does: admit all, step the runnable ones until all finished."""
    for r in reqs:
        model.admit(r)
    outs: dict[str, list] = {r.request_id: [] for r in reqs}
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


def test_thinker_batched_greedy_decoding_matches_one_at_a_time() -> None:
    """The KV cache slots and length masks keep batched requests independent."""
    opts = {**SMALL, "temperature": 0.0, "max_new_tokens": 10, "min_new_tokens": 10}
    prompts = {"a": "Hello", "b": "A much longer prompt, to get a different length"}
    alone = {rid: run(build("thinker", opts, seed=1), [ReqState(rid, p)])[rid] for rid, p in prompts.items()}
    together = run(build("thinker", opts, seed=1), [ReqState(rid, p) for rid, p in prompts.items()])
    text = {rid: "".join(o["text"] for o in outs) for rid, outs in together.items()}
    assert text == {rid: "".join(o["text"] for o in outs) for rid, outs in alone.items()}
    assert all(len(t) == 10 and t.isprintable() for t in text.values())
    assert all(o["tokens"].dtype == np.int32 for o in together["a"])


def test_decoder_batched_step_equals_separate_steps_for_different_lengths() -> None:
    """Slots of different lengths in one batch: masking keeps each request's attention its own."""
    from stages.toy.torch_blocks import TinyDecoder

    def fresh() -> TinyDecoder:
        torch.manual_seed(0)
        return TinyDecoder(32, 2, 2, max_len=64, slots=4).eval()

    g = torch.Generator().manual_seed(1)
    prompts = [torch.randn(3, 32, generator=g), torch.randn(9, 32, generator=g)]
    nxt = torch.randn(2, 32, generator=g)
    with torch.inference_mode():
        dec = fresh()
        for slot, p in enumerate(prompts):
            dec.prefill(p, slot)
        both = dec.step(nxt, torch.tensor([0, 1]), torch.tensor([3, 9]))
        alone = []
        for slot, p in enumerate(prompts):
            d = fresh()
            d.prefill(p, 2)  # another slot, alone in its batch
            alone.append(d.step(nxt[slot:slot + 1], torch.tensor([2]), torch.tensor([len(p)]))[0])
    torch.testing.assert_close(both, torch.stack(alone), rtol=1e-4, atol=1e-5)


def test_the_kv_cache_grows_as_sequences_need_it_up_to_the_context() -> None:
    """A long context costs memory only once a request is that long."""
    from stages.toy.torch_blocks import TinyDecoder

    torch.manual_seed(0)
    dec = TinyDecoder(32, 2, 2, max_len=1000, slots=2).eval()
    assert dec.k_cache.shape[3] == TinyDecoder.FIRST_CACHE
    x = torch.randn(300, 32)
    with torch.inference_mode():
        whole = dec.prefill(x, 1)
        assert dec.k_cache.shape[3] == 2 * TinyDecoder.FIRST_CACHE
        dec.prefill(x[:299], 0)  # the same sequence, its last position through a decode step
        last = dec.step(x[299:], torch.tensor([0]), torch.tensor([299]))[0]
    torch.testing.assert_close(last, whole, rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="1001 positions do not fit a context of 1000"):
        dec.reserve(1001)


def test_a_longer_context_keeps_every_weight_and_answer_of_the_thinker() -> None:
    """The position rows past the first ones come from a stream of their own: nothing else moves."""
    opts = {**SMALL, "temperature": 0.0, "max_new_tokens": 12, "min_new_tokens": 12}
    short = build("thinker", {**opts, "max_model_len": 204}, seed=5)  # 192 + 12: the rows first drawn
    long = build("thinker", opts, seed=5)  # the default context, 32768
    assert long.dec.max_len == 32768 and long.dec.pos.weight.shape[0] == 32768
    torch.testing.assert_close(long.dec.pos.weight[:204], short.dec.pos.weight, rtol=0, atol=0)
    torch.testing.assert_close(long.head.weight, short.head.weight, rtol=0, atol=0)
    first, second = ("".join(o["text"] for o in run(m, [ReqState("r", "Hello there")])["r"])
                     for m in (short, long))
    assert len(first) == 12 and first == second


def test_talker_turns_tokens_into_code_chunks() -> None:
    model = build("talker", {**SMALL, "codebooks": 3, "frames_per_token": 2, "chunk_frames": 4})
    outs = run(model, [ReqState("r", {"tokens": np.arange(97, 107, dtype=np.int32)})])["r"]
    codes = np.concatenate([o["codes"] for o in outs])
    assert codes.shape == (20, 3) and codes.dtype == np.int32
    assert [len(o["codes"]) for o in outs[:-1]] == [4] * (len(outs) - 1)  # streamed in chunks


def test_talker_streamed_input_gives_the_same_codes_as_whole_input() -> None:
    toks = np.arange(97, 109, dtype=np.int32)
    whole = run(build("talker", SMALL, seed=2), [ReqState("r", {"tokens": toks})])["r"]
    model = build("talker", SMALL, seed=2)
    req = ReqState("r", {"prewarm": 1}, upstream=True, input_done=False)
    model.admit(req)
    streamed = []
    for i, t in enumerate(toks):
        model.feed(req, np.array([t]), end=i == len(toks) - 1)
        while model.runnable(req):  # consume what arrived; idle until the next chunk
            (res,) = model.step([req])
            if res.data is not None:
                streamed.append(res.data)
            if res.finished:
                break
    assert np.array_equal(np.concatenate([o["codes"] for o in whole]),
                          np.concatenate([o["codes"] for o in streamed]))


def test_code2wav_makes_float32_pcm_at_24khz_in_chunks() -> None:
    model = build("code2wav", {"dim": 16, "chunk_frames": 4})
    codes = np.random.default_rng(0).integers(0, 256, size=(10, 4), dtype=np.int32)
    outs = run(model, [ReqState("r", {"codes": codes})])["r"]
    pcm = np.concatenate([o["pcm"] for o in outs])
    assert all(o["sample_rate"] == 24000 for o in outs)
    assert pcm.dtype == np.float32 and len(pcm) == 10 * 480
    assert 0.05 < np.abs(pcm).max() <= 1.0  # audible, never clipping
    assert len(outs) == 3  # 4 + 4 + 2 frames


@pytest.mark.parametrize("kind, payload", [("thinker", ""), ("thinker", 3), ("talker", "text"),
                                           ("code2wav", {"tokens": [1]})])
def test_bad_payloads_are_refused_with_a_reason(kind: str, payload: object) -> None:
    with pytest.raises(ValueError, match=kind):
        build(kind, {}).admit(ReqState("r", payload))


def test_unknown_model_options_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown model option 'hidden' for thinker"):
        build("thinker", {"hidden": 3})
