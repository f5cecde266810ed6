"""Qwen2.5-Omni split in three parts, in this process: chained, they are ``generate()``.

A tiny random checkpoint is built here (nothing is downloaded).  Each part is
loaded alone from it; the thinker's rows go through the forward function to
the talker stage model, its codes to the token2wav stage model -- and the
text ids, the codec ids and the waveform are ``generate()``'s, for a text, an
image and an audio input.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from stages.base import ReqState, StageModel  # noqa: E402
from stages.forwarding import codes_input  # noqa: E402
from stages.hf.omni.checkpoint import OmniConfig, read_omni_config, speakers  # noqa: E402
from stages.hf.omni.compute import ThinkerRunner  # noqa: E402
from stages.hf.omni.forwarding import talker_input  # noqa: E402
from stages.hf.omni.parts import load_part, load_processor, quiet_transformers  # noqa: E402
from stages.hf.omni.talker import OmniTalker  # noqa: E402
from stages.hf.omni.token2wav import OmniToken2Wav  # noqa: E402

pytestmark = pytest.mark.slow

THINKER_MAX, TALKER_MAX = 8, 24


@pytest.fixture(scope="module")
def ckpt(tiny_omni: Path) -> Iterator[Path]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: one thread is faster on a busy machine
    try:
        yield tiny_omni
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def full(ckpt: Path) -> Any:
    from transformers import Qwen2_5OmniForConditionalGeneration

    with quiet_transformers():
        return Qwen2_5OmniForConditionalGeneration.from_pretrained(str(ckpt)).eval()


def chat_prompt(ckpt: Path, medium: str) -> tuple[str, dict[str, Any]]:
    """The chat-templated prompt of a chat with one ``medium`` part ("text", "image", "audio"), and the
    media beside it (the processor's keywords)."""
    rng = np.random.default_rng(7)
    part = {"text": {"type": "text", "text": "hello there"}, "image": {"type": "image"},
            "audio": {"type": "audio"}}[medium]
    conv = [{"role": "user", "content": [part, {"type": "text", "text": "What is this?"}]}]
    text = load_processor(ckpt).apply_chat_template(conv, add_generation_prompt=True, tokenize=False)
    media: dict[str, Any] = {}
    if medium == "image":
        media["images"] = [(rng.random((60, 80, 3)) * 255).astype(np.uint8)]
    if medium == "audio":
        media["audio"] = [(rng.standard_normal(16000) * 0.1).astype(np.float32)]
    return text, media


def media_inputs(ckpt: Path, medium: str) -> dict[str, Any]:
    """The processor's inputs for :func:`chat_prompt`'s chat."""
    text, media = chat_prompt(ckpt, medium)
    return dict(load_processor(ckpt)(text=text, return_tensors="pt", **media))


def generate(full: Any, inputs: dict[str, Any], cfg: OmniConfig, voice: str) -> tuple[list[int], list[int],
                                                                                       np.ndarray]:
    """``generate()`` greedy: its reply ids, the codes it handed token2wav, its waveform."""
    seen: list[Any] = []
    original = full.token2wav.forward

    def spy(code: Any, *args: Any, **kwargs: Any) -> Any:
        seen.append(code[0].tolist())
        return original(code, *args, **kwargs)

    full.token2wav.forward = spy
    try:
        torch.manual_seed(0)
        seq, wav = full.generate(**inputs, speaker=voice, thinker_do_sample=False, talker_do_sample=False,
                                 thinker_max_new_tokens=THINKER_MAX, talker_max_new_tokens=TALKER_MAX,
                                 talker_eos_token_id=cfg.codec_stop)
    finally:
        del full.token2wav.forward
    return seq[0, inputs["input_ids"].shape[1]:].tolist(), seen[0], wav.reshape(-1).numpy()


def thinker_outputs(runner: ThinkerRunner, inputs: dict[str, Any], cfg: OmniConfig, bos: int) -> list[dict]:
    """Greedy thinker outputs shaped as the thinker stage sends them when asked to speak."""
    ids = inputs["input_ids"][0].tolist()
    seq = runner.start(inputs)
    logits, rows = runner.forward(seq, ids, rows=True)
    head = {"prompt_ids": np.array(ids), "speaker_id": bos,
            "frame": runner.embed([bos, cfg.tts_text["end"], cfg.tts_text["pad"]])}
    if "image_grid_thw" in inputs:
        head["image_grid_thw"] = inputs["image_grid_thw"].numpy()
    if "feature_attention_mask" in inputs:
        head["audio_feature_lengths"] = inputs["feature_attention_mask"].sum(1).numpy()
    toks = [int(logits.argmax())]
    outs = [{"tokens": np.array(toks), "rows": rows, "talker": head}]
    while toks[-1] not in cfg.eos_token_ids and len(toks) < THINKER_MAX:
        logits, rows = runner.forward(seq, [toks[-1]], rows=True)
        toks.append(int(logits.argmax()))
        outs.append({"tokens": np.array(toks[-1:]), "rows": rows})
    return outs


def drive(model: StageModel, req: ReqState) -> list[dict]:
    model.admit(req)
    outs = []
    while True:
        res = model.step([req])[0]
        if res.data is not None:
            outs.append(res.data)
        if res.finished:
            model.release(req)
            return outs


@pytest.mark.parametrize("medium", ["text", "image", "audio"])
def test_the_parts_chained_are_generate(ckpt: Path, full: Any, medium: str) -> None:
    cfg = read_omni_config(ckpt)
    inputs = media_inputs(ckpt, medium)
    voice = "Ethan"  # not generate()'s default: the voice reaches every part
    ref_text, ref_codes, ref_wav = generate(full, inputs, cfg, voice)

    thinker = ThinkerRunner(load_part(ckpt, "thinker"), cfg)
    outs = thinker_outputs(thinker, inputs, cfg, speakers(ckpt)[voice]["bos_token"])
    assert np.concatenate([o["tokens"] for o in outs]).tolist() == ref_text

    talked = drive(OmniTalker(str(ckpt)), ReqState("r", talker_input(None, outs),
                                                   sampling={"temperature": 0.0, "max_tokens": TALKER_MAX}))
    codes = codes_input(None, talked)["codes"]
    assert codes.tolist() == ref_codes and len(codes) > 10

    waves = drive(OmniToken2Wav(str(ckpt), chunk_frames=7), ReqState("w", {"codes": codes},
                                                                      sampling={"voice": voice}))
    assert len(waves) > 2  # it came in pieces
    wav = np.concatenate([w["pcm"] for w in waves])
    assert wav.shape == ref_wav.shape and np.abs(ref_wav).max() > 0.05  # sound, not silence
    np.testing.assert_allclose(wav, ref_wav, atol=1e-6)
    assert {w["sample_rate"] for w in waves} == {24000}


def test_each_part_loads_only_its_own_weights(ckpt: Path, full: Any) -> None:
    """token2wav's weights are under ``token2wav.``: a plain from_pretrained leaves them random."""
    from transformers import Qwen2_5OmniConfig, Qwen2_5OmniToken2WavModel

    reference = full.state_dict()
    for part in ("thinker", "talker", "token2wav"):
        own = load_part(ckpt, part).state_dict()
        assert set(own) == {k.removeprefix(f"{part}.") for k in reference if k.startswith(f"{part}.")}
        assert all(torch.equal(v, reference[f"{part}.{k}"]) for k, v in own.items()), part
    with quiet_transformers():
        naive = Qwen2_5OmniToken2WavModel.from_pretrained(
            str(ckpt), config=Qwen2_5OmniConfig.from_pretrained(str(ckpt)).token2wav_config).state_dict()
    assert not all(torch.equal(v, reference[f"token2wav.{k}"]) for k, v in naive.items())


def test_vocoder_pieces_join_into_the_whole_waveform(ckpt: Path) -> None:
    """Each piece is vocoded from its frames and the context on each side: together, the whole waveform."""
    runner = OmniToken2Wav(str(ckpt)).runner
    frames = 4 * runner.context  # long enough that no piece sees all of it
    mel = torch.randn(1, 80, frames, generator=torch.Generator().manual_seed(3))
    whole = runner.waveform(mel)
    moved = mel.clone()
    moved[..., frames // 2] += 1  # the receptive field, measured: within the context
    changed = np.nonzero(runner.waveform(moved) != whole)[0] // runner.hop
    assert frames // 2 - runner.context <= changed.min() and changed.max() <= frames // 2 + runner.context
    for size in (5, 2 * runner.context):
        pieces = list(runner.waveform_chunks(mel, size))
        assert len(pieces) == -(-frames // size)
        np.testing.assert_allclose(np.concatenate(pieces), whole, atol=1e-6)


def test_the_talker_stops_at_the_configs_end_code(ckpt: Path) -> None:
    """The tiny checkpoint's end code is not generate()'s hard-coded 8294: the config's is the one."""
    cfg = read_omni_config(ckpt)
    end = cfg.codec["end"]
    assert end not in (8292, 8294)
    talker = OmniTalker(str(ckpt))
    calls = []

    def rig(module: Any, args: Any, out: Any) -> Any:  # from the 4th code on, the end code wins
        calls.append(1)
        if len(calls) >= 4:
            out = out.clone()
            out[..., end] = out.max() + 10
        return out

    talker.runner.model.codec_head.register_forward_hook(rig)
    thinker = ThinkerRunner(load_part(ckpt, "thinker"), cfg)
    outs = thinker_outputs(thinker, media_inputs(ckpt, "text"), cfg, speakers(ckpt)["Chelsie"]["bos_token"])
    greedy = {"temperature": 0.0, "max_tokens": TALKER_MAX}
    codes = codes_input(None, drive(talker, ReqState("r", talker_input(None, outs), sampling=greedy)))
    assert len(calls) == 4 and len(codes["codes"]) == 3 and end not in codes["codes"]


def test_the_processor_needs_no_torchvision(ckpt: Path) -> None:
    proc = load_processor(ckpt)
    assert type(proc.image_processor).__name__ == "Qwen2VLImageProcessorPil"
    with pytest.raises(ValueError, match="video input is not served"):
        proc.video_processor([np.zeros((2, 28, 28, 3), np.uint8)])


def test_the_talker_streamed_row_by_row_makes_the_same_codes(ckpt: Path) -> None:
    """Async-chunk mode: the thinker's outputs arrive one at a time between steps; the talker waits for
    each row it needs, so its codes are those it makes from the whole answer."""
    cfg = read_omni_config(ckpt)
    thinker = ThinkerRunner(load_part(ckpt, "thinker"), cfg)
    outs = thinker_outputs(thinker, media_inputs(ckpt, "image"), cfg, speakers(ckpt)["Chelsie"]["bos_token"])
    greedy = {"temperature": 0.0, "max_tokens": TALKER_MAX}
    talker = OmniTalker(str(ckpt), chunk_codes=1)
    whole = codes_input(None, drive(talker, ReqState("whole", talker_input(None, outs), sampling=greedy)))

    req = ReqState("streamed", None, upstream=True, input_done=False, sampling=greedy)
    talker.admit(req)
    codes: list[int] = []
    pending, waited = list(outs), 0
    while True:
        if not talker.runnable(req):
            waited += 1
            out = pending.pop(0)  # the next output arrives
            talker.feed(req, out, end=not pending)
            continue
        res = talker.step([req])[0]
        if res.data is not None:
            codes += res.data["codes"].tolist()
        if res.finished:
            break
    assert waited == len(outs) and codes == whole["codes"].tolist()


def test_token2wav_solves_a_window_as_sample_solves_the_whole(ckpt: Path) -> None:
    """The solver, an interval at a time, with the noise given: over every code, sample()'s mel."""
    t2w = OmniToken2Wav(str(ckpt))
    spk = speakers(ckpt)["Chelsie"]
    codes = np.random.default_rng(0).integers(0, 300, 30)
    y0 = torch.randn(1, 30 * t2w.rep, 80, generator=t2w.runner.noise(5))
    window = t2w.runner.start(codes, spk["cond"], spk["ref_mel"], y0=y0)
    steps = 0
    while not t2w.runner.advance(window):
        steps += 1
    assert steps + 1 == 9 and torch.equal(window.mel, t2w.runner.mel(codes, spk["cond"], spk["ref_mel"], 5))


def test_token2wav_streams_audio_once_a_chunk_and_its_look_ahead_are_in(ckpt: Path) -> None:
    t2w = OmniToken2Wav(str(ckpt))
    codes = np.random.default_rng(1).integers(0, 300, 37)
    req = ReqState("s", None, upstream=True, input_done=False, sampling={"voice": "Ethan"})
    t2w.admit(req)
    fed, heard = 0, []  # (codes in when a piece came, its samples)
    while True:
        if not t2w.runnable(req):
            t2w.feed(req, {"codes": codes[fed:fed + 3]}, end=fed + 3 >= len(codes))
            fed += 3
            continue
        res = t2w.step([req])[0]
        heard.append((fed, len(res.data["pcm"])))
        if res.finished:
            break
    samples = t2w.rep * t2w.runner.hop
    assert heard[0] == (-(-(t2w.stream + t2w.future) // 3) * 3, t2w.stream * samples)  # before the rest came
    assert sum(n for _, n in heard) == len(codes) * samples


def test_the_thinker_stage_batches_requests_as_if_each_were_alone(ckpt: Path) -> None:
    """The omni-thinker stage (the checkpoint decoder loop): requests of different media in one batch
    send the tokens and rows the runner computes for each alone, the talker's header first."""
    from stages.hf.omni.thinker import OmniThinker

    cfg = read_omni_config(ckpt)
    runner = ThinkerRunner(load_part(ckpt, "thinker"), cfg)
    stage = OmniThinker(str(ckpt))
    payloads, alone = {}, {}
    for medium in ("text", "image", "audio"):
        prompt, media = chat_prompt(ckpt, medium)
        clips = [{"pcm": a, "sample_rate": 16000} for a in media.get("audio", [])]
        payloads[medium] = {"text": prompt, "images": media.get("images", []), "audios": clips}
        alone[medium] = thinker_outputs(runner, media_inputs(ckpt, medium), cfg,
                                        speakers(ckpt)["Chelsie"]["bos_token"])
    greedy = {"temperature": 0.0, "max_tokens": THINKER_MAX}
    reqs = [ReqState(m, p, sampling=greedy) for m, p in payloads.items()]
    for r in reqs:
        stage.admit(r)
    got: dict[str, list[dict]] = {r.request_id: [] for r in reqs}
    active = list(reqs)
    while active:
        for r, res in zip(list(active), stage.step(active), strict=True):
            got[r.request_id].append(res.data)
            if res.finished:
                active.remove(r)
                stage.release(r)
    for medium, outs in got.items():
        ref = alone[medium]
        assert np.concatenate([o["tokens"] for o in outs]).tolist() == \
            np.concatenate([o["tokens"] for o in ref]).tolist()
        np.testing.assert_array_equal(np.concatenate([o["rows"] for o in outs]),
                                      np.concatenate([o["rows"] for o in ref]))
        head, ref_head = outs[0]["talker"], ref[0]["talker"]
        assert head["prompt_ids"].tolist() == ref_head["prompt_ids"].tolist()
        np.testing.assert_array_equal(head["frame"], ref_head["frame"])
