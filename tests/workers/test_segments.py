"""Resumable requests inside a worker, in process: the segment tracker and the models' ``extend``."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from stages.base import EchoModel, ReqState, StageModel, StepResult
from stages.segments import SegmentTracker
from stages.toy.models import Code2Wav, Talker, Thinker
from stages.toy.torch_blocks import TinyDecoder

TINY_THINKER = {"d_model": 32, "layers": 2, "heads": 2, "max_model_len": 70, "max_new_tokens": 6,
                "min_new_tokens": 6, "temperature": 0.0, "slots": 4}


def run_segment(model: StageModel, req: ReqState, limit: int = 200) -> list[StepResult]:
    """Step ``req`` alone until it reports a finished segment."""
    out = []
    for _ in range(limit):
        (res,) = model.step([req])
        out.append(res)
        if res.finished:
            return out
    raise AssertionError("the segment never finished")


def thinker_tokens(results: list[StepResult]) -> list[int]:
    return [int(t) for r in results for t in r.data["tokens"]]


# ---------------------------------------------------------------------------- the decoder
def test_extending_a_cached_prefix_matches_encoding_the_whole_sequence_at_once() -> None:
    torch.manual_seed(0)
    dec = TinyDecoder(32, 2, 2, 64, 2).eval()
    x = torch.randn(20, 32)
    with torch.inference_mode():
        whole = dec.prefill(x, 0)
        dec.prefill(x[:12], 1)
        dec.extend(x[12:19], 1, 12)  # all but the last; the last goes through a decode step
        last = dec.step(x[19:20], torch.tensor([1]), torch.tensor([19]))[0]
        assert torch.allclose(dec.k_cache[:, 1, :, :19], dec.k_cache[:, 0, :, :19], atol=1e-5)
    assert torch.allclose(last, whole, atol=1e-5)


def test_extend_refuses_positions_past_the_cache() -> None:
    dec = TinyDecoder(32, 1, 2, 16, 1).eval()
    with torch.inference_mode(), pytest.raises(ValueError, match="do not fit"):
        dec.extend(torch.zeros(5, 32), 0, 12)


# ---------------------------------------------------------------------------- the models
def test_thinker_continues_from_its_cache_like_a_model_that_saw_the_whole_conversation() -> None:
    a = Thinker(**TINY_THINKER)
    req = ReqState("r", "Hello there")
    a.admit(req)
    first = thinker_tokens(run_segment(a, req))
    slot, pos = req.model["slot"], req.model["pos"]
    a.extend(req, {"text": " and more", "max_new_tokens": 4})
    assert req.model["slot"] == slot and req.model["pos"] > pos  # same cache, grown: no restart
    second = thinker_tokens(run_segment(a, req))
    assert len(first) == 6 and len(second) == 4
    # A fresh model (same weights) given the whole conversation as its prompt answers the same.
    b = Thinker(**TINY_THINKER)
    whole = list(b"Hello there") + first + list(b" and more")
    ref = ReqState("ref", bytes(whole).decode("latin-1"))
    b.admit(ref)
    ref.model["prompt"] = whole  # bytes >= 128 would not survive str round trips
    assert thinker_tokens(run_segment(b, ref))[:4] == second


def test_thinker_refuses_a_segment_past_its_context_and_never_drops_the_conversation() -> None:
    m = Thinker(**{**TINY_THINKER, "max_model_len": 40})
    req = ReqState("r", "start")  # 5 tokens, 6 answered: 11 positions
    m.admit(req)
    run_segment(m, req)
    m.extend(req, "segment one")  # + 11: 22 positions, and room for an answer
    assert len(thinker_tokens(run_segment(m, req))) == 6
    pos = req.model["pos"]
    with pytest.raises(ValueError, match="maximum context length is 40 tokens"):
        m.extend(req, "one segment too many")  # 28 + 1 + 20 positions: over 40
    assert req.model["pos"] == pos  # nothing was cut to make room
    m.release(req)
    assert len(m.free) == 4  # the one slot came back


def test_thinker_refuses_an_empty_segment() -> None:
    m = Thinker(**TINY_THINKER)
    req = ReqState("r", "hi")
    m.admit(req)
    run_segment(m, req)
    with pytest.raises(ValueError, match="non-empty"):
        m.extend(req, {"text": ""})


def test_talker_and_vocoder_take_the_next_segment_on_their_state() -> None:
    talker = Talker(d_model=32, layers=1, heads=2, chunk_frames=4, slots=2)
    req = ReqState("r", {"tokens": np.arange(3, dtype=np.int32) + 97})
    talker.admit(req)
    codes1 = np.concatenate([r.data["codes"] for r in run_segment(talker, req) if r.data is not None])
    talker.extend(req, {"tokens": np.arange(5, dtype=np.int32) + 97})
    codes2 = np.concatenate([r.data["codes"] for r in run_segment(talker, req) if r.data is not None])
    assert len(codes1) == 3 * 2 and len(codes2) == 5 * 2  # frames_per_token each
    assert req.model["pos"] == 8  # the speech context went on
    with pytest.raises(ValueError, match="tokens"):
        talker.extend(req, "words")

    voc = Code2Wav(dim=16, upsample=[4, 3], chunk_frames=4, slots=2)
    v = ReqState("v", {"codes": codes1})
    voc.admit(v)
    pcm1 = np.concatenate([r.data["pcm"] for r in run_segment(voc, v) if r.data is not None])
    voc.extend(v, {"codes": codes2})
    pcm2 = np.concatenate([r.data["pcm"] for r in run_segment(voc, v) if r.data is not None])
    assert len(pcm1) == 6 * 12 and len(pcm2) == 10 * 12


def test_upstream_models_reopen_their_input_for_the_next_segment() -> None:
    for model in (EchoModel(), Talker(d_model=32, layers=1, heads=2, slots=1), Code2Wav(dim=16, slots=1)):
        req = ReqState("r", {"prewarm": 1}, upstream=True, input_done=False)
        model.admit(req)
        model.feed(req, None, True)
        assert model.runnable(req)
        run_segment(model, req)
        model.extend(req, {"prewarm": 1})
        assert not req.input_done and not model.runnable(req)


def test_a_model_without_extend_refuses_more_input() -> None:
    class Once(StageModel):
        kind = "once"

        def step(self, reqs: list[ReqState]) -> list[StepResult]:
            return [StepResult("x", True) for _ in reqs]

    with pytest.raises(ValueError, match="once model takes no more input"):
        Once().extend(ReqState("r", "p"), "more")


# ---------------------------------------------------------------------------- the tracker
class Recorder(EchoModel):
    """An echo model that records what it was given."""

    def __init__(self) -> None:
        super().__init__(outputs=1)
        self.log: list[tuple[str, Any]] = []

    def extend(self, req: ReqState, payload: Any) -> None:
        self.log.append(("extend", payload))
        super().extend(req, payload)

    def feed(self, req: ReqState, data: Any, end: bool) -> None:
        self.log.append(("feed", data))
        super().feed(req, data, end)


def test_a_finished_segment_parks_the_request_until_its_update() -> None:
    model = Recorder()
    t = SegmentTracker(model)
    req = ReqState("r", "a")
    t.open(req)
    assert not t.segment_finished(req)
    assert t.parked("r") and t.segment("r") == 0
    t.update(req, "b", final=True)
    assert not t.parked("r") and t.segment("r") == 1 and model.log == [("extend", "b")]
    assert t.segment_finished(req)  # the final segment: retire
    with pytest.raises(ValueError, match="after the final"):
        t.update(req, "c", final=False)
    t.forget("r")
    assert not t.resumable("r")


def test_an_update_that_comes_early_waits_for_the_running_segment() -> None:
    model = Recorder()
    t = SegmentTracker(model)
    req = ReqState("r", "a")
    t.open(req)
    t.update(req, "b", final=False)
    t.update(req, "c", final=True)
    assert model.log == [] and t.segment("r") == 0  # segment 0 still runs
    assert not t.segment_finished(req) and model.log == [("extend", "b")]
    assert not t.segment_finished(req) and model.log[-1] == ("extend", "c")
    assert t.segment_finished(req)


def test_chunks_of_a_later_segment_are_held_and_fed_in_order_when_it_starts() -> None:
    model = Recorder()
    t = SegmentTracker(model)
    req = ReqState("r", {"prewarm": 1}, upstream=True, input_done=False)
    t.open(req)
    assert t.route_chunk(req, "a0", False, 0)
    assert not t.route_chunk(req, "b0", False, 1)
    assert not t.route_chunk(req, "b1", True, 1)
    assert not t.route_chunk(req, "c0", True, 2)
    assert not t.segment_finished(req)  # segment 0 done; segment 1's update has not come
    assert not t.route_chunk(req, "a-late", False, 0)  # a chunk of a finished segment
    assert t.late_chunks == 1
    t.update(req, {"prewarm": 1}, final=False)
    assert model.log == [("extend", {"prewarm": 1}), ("feed", "b0"), ("feed", "b1")]
    assert req.input_done  # b1 ended segment 1's input


def test_a_none_segment_is_empty_and_never_reaches_the_model() -> None:
    model = Recorder()
    t = SegmentTracker(model)
    req = ReqState("r", "a")
    t.open(req)
    t.update(req, None, final=True)
    assert not t.empty("r")  # segment 0 still runs
    assert not t.segment_finished(req)
    assert t.empty("r") and model.log == []  # closed by the worker without a model step
    assert t.segment_finished(req) and not t.empty("r")
    up = ReqState("u", {"prewarm": 1}, upstream=True, input_done=False)
    t.open(up)
    t.segment_finished(up)
    t.update(up, None, final=True)  # downstream in async-chunk mode: its input still streams in
    assert not t.empty("u") and model.log == [("extend", None)]
