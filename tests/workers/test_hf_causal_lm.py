"""The ``hf-causal-lm`` stage on tiny random checkpoints built here: it is ``generate()``, batched.

In-process (the worker's loop is the model's ``admit``/``step``/``release``,
driven here as the worker drives it): the checkpoint is read and refused by
name; its tokenizer counts what ``transformers`` counts; greedy tokens equal
``model.generate()``'s for a request alone and for four of different lengths
joining a running batch; text streams in whole characters and spells the
tokens; stop strings, stop tokens, ``min_tokens``/``max_tokens``, seeds,
hidden states, the context and resumable segments behave as documented.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

from stages.base import ReqState, StageModel  # noqa: E402
from stages.config import PipelineConfig, StageConfig, checkpoint_config  # noqa: E402
from stages.hf.checkpoint import CheckpointError, load_checkpoint  # noqa: E402
from stages.hf.tokenizer import checkpoint_tokenizer  # noqa: E402
from stages.registry import build_model, stage_sizes  # noqa: E402

PROMPTS = ["hi", "hello world, how are you today?", "café 東京 " * 6,
           "one two three four five six seven eight nine"]


def chat_ids(ckpt: Any, content: str) -> list[int]:
    tok = transformers.AutoTokenizer.from_pretrained(str(ckpt.path))
    ids = tok.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                  tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def chat_text(ckpt: Any, content: str) -> str:
    tok = transformers.AutoTokenizer.from_pretrained(str(ckpt.path))
    return str(tok.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                       tokenize=False))


def generated(ckpt: Any, ids: list[int], n: int) -> list[int]:
    """``model.generate()``'s greedy tokens, the end-of-text one left out (the stage never emits it)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(str(ckpt.path)).eval()
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False)[0, len(ids):].tolist()
    return out[:-1] if out and out[-1] in ckpt.eos_token_id else out


def drive(model: StageModel, arrivals: list[tuple[int, ReqState]]) -> dict[str, list[dict[str, Any]]]:
    """Step ``model`` as the worker does; request i is admitted before step ``arrivals[i][0]``."""
    pending = sorted(arrivals, key=lambda a: a[0])
    outs: dict[str, list[dict[str, Any]]] = {}
    active: list[ReqState] = []
    step = 0
    while pending or active:
        while pending and pending[0][0] <= step:
            req = pending.pop(0)[1]
            model.admit(req)
            active.append(req)
            outs[req.request_id] = []
        if active:
            for req, res in zip(list(active), model.step(active), strict=True):
                if res.data is not None:
                    outs[req.request_id].append(res.data)
                if res.finished:
                    active.remove(req)
                    model.release(req)
        step += 1
    return outs


def tokens(outs: list[dict[str, Any]]) -> list[int]:
    return [int(t) for o in outs for t in o["tokens"]]


@pytest.fixture(scope="module")
def qwen(tiny_qwen2: Any) -> StageModel:
    return build_model("hf-causal-lm", {"checkpoint": str(tiny_qwen2.path)})


# ---------------------------------------------------------------- the checkpoint and its tokenizer
def test_a_checkpoint_directory_is_read_for_what_the_head_needs(tiny_qwen2: Any, tiny_llama: Any) -> None:
    q = load_checkpoint(tiny_qwen2.path)
    assert (q.architecture, q.vocab_size, q.max_model_len) == ("Qwen2ForCausalLM", 400, 256)
    assert q.dtype == "float32"
    assert q.chat_template == tiny_qwen2.chat_template and q.eos_token == "<|im_end|>" and q.bos_token is None
    assert q.eos_token_ids() == tiny_qwen2.eos_token_id
    lm = load_checkpoint(tiny_llama.path)
    assert (lm.bos_token, lm.eos_token, lm.architecture) == ("<s>", "</s>", "LlamaForCausalLM")
    cfg = checkpoint_config(str(tiny_qwen2.path), max_model_len=100)
    assert [(s.kind, s.name, s.model["max_model_len"]) for s in cfg.stages] == [
        ("hf-causal-lm", "Qwen2ForCausalLM", 100)]
    assert cfg.outputs() == ["text"] and cfg.final_stage_ids == [0]


def test_what_is_not_a_servable_checkpoint_is_refused_by_path(tmp_path: Path, tiny_qwen2: Any) -> None:
    def refused(path: Path | str) -> str:
        with pytest.raises(CheckpointError) as info:
            load_checkpoint(path)
        return str(info.value)

    assert refused("/no/such/dir") == "/no/such/dir: no such checkpoint directory"
    (tmp_path / "file").write_text("x")
    assert "not a directory" in refused(tmp_path / "file")
    assert "no config.json" in refused(tmp_path)
    copy = tmp_path / "ck"
    shutil.copytree(tiny_qwen2.path, copy)
    config = json.loads((copy / "config.json").read_text())
    omni = ["Qwen3OmniMoeForConditionalGeneration"]
    bert = ["BertModel"]
    for archs, says in ((bert, "architecture BertModel is not served"), ([], "names no architectures"),
                        (omni, "not served yet")):
        (copy / "config.json").write_text(json.dumps({**config, "architectures": archs}))
        assert says in refused(copy) and str(copy) in refused(copy)
    (copy / "config.json").write_text(json.dumps(config))
    (copy / "model.safetensors").unlink()
    assert "no weights" in refused(copy)
    with pytest.raises(ValueError, match="between 1 and the model's context, 256"):
        checkpoint_config(str(tiny_qwen2.path), max_model_len=257)


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_the_tokenizer_counts_what_transformers_counts(arch: str, request: pytest.FixtureRequest) -> None:
    ckpt = request.getfixturevalue(f"tiny_{arch}")
    tok = checkpoint_tokenizer(str(ckpt.path))
    ref = transformers.AutoTokenizer.from_pretrained(str(ckpt.path))
    for text in PROMPTS:
        assert tok.encode(chat_text(ckpt, text)) == chat_ids(ckpt, text)  # a chat: BOS once
        assert tok.encode(text) == ref(text).input_ids  # a completion: BOS added as its tokenizer adds it
        assert tok.decode(chat_ids(ckpt, text)) == ref.decode(chat_ids(ckpt, text), skip_special_tokens=True)


# ---------------------------------------------------------------- batching changes nothing
@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_greedy_tokens_equal_generate_alone_and_joining_a_running_batch(
        arch: str, request: pytest.FixtureRequest) -> None:
    ckpt = request.getfixturevalue(f"tiny_{arch}")
    model = build_model("hf-causal-lm", {"checkpoint": str(ckpt.path)})
    n = 12
    reqs = {f"r{i}": chat_text(ckpt, p) for i, p in enumerate(PROMPTS)}
    greedy = {"temperature": 0.0, "max_tokens": n}
    alone = {rid: tokens(drive(model, [(0, ReqState(rid, p, sampling=greedy))])[rid])
             for rid, p in reqs.items()}
    # four of different lengths, each joining the batch while the earlier ones are running
    together = drive(model, [(3 * i, ReqState(rid, p, sampling=greedy))
                             for i, (rid, p) in enumerate(reqs.items())])
    for rid, content in zip(reqs, PROMPTS, strict=True):
        ref = generated(ckpt, chat_ids(ckpt, content), n)
        assert alone[rid] == ref, rid
        assert tokens(together[rid]) == ref, rid
    assert len({len(chat_ids(ckpt, p)) for p in PROMPTS}) == len(PROMPTS)  # really different lengths
    assert model.adapter.vocab_size == ckpt.vocab_size


# ---------------------------------------------------------------- text, stops, limits, seeds
def test_streamed_text_is_whole_characters_that_spell_the_tokens(qwen: StageModel, tiny_qwen2: Any) -> None:
    tok = checkpoint_tokenizer(str(tiny_qwen2.path))
    for seed in range(6):
        outs = drive(qwen, [(0, ReqState("r", "café 東京 🙂", sampling={"seed": seed, "max_tokens": 24,
                                                                       "temperature": 1.0}))])["r"]
        pieces = [o["text"] for o in outs]
        whole = tok.decode(tokens(outs))  # a character the answer left unfinished shows as U+FFFD here
        assert "".join(pieces) == whole.rstrip("\ufffd")  # and is never streamed
        assert all(np.asarray(o["tokens"]).dtype == np.int32 for o in outs)
        for piece in pieces[:-1]:  # a piece never ends inside a character (a cut one shows as U+FFFD)
            assert not piece.endswith("\ufffd")
        assert outs[-1]["finish_reason"] in ("stop", "length")


def test_stop_strings_stop_tokens_and_token_limits(qwen: StageModel) -> None:
    greedy = {"temperature": 0.0, "max_tokens": 12}
    free = drive(qwen, [(0, ReqState("r", "hello", sampling=greedy))])["r"]
    text, toks = "".join(o["text"] for o in free), tokens(free)
    assert len(toks) == 12 and free[-1]["finish_reason"] == "length"
    stop = text[3:5]
    cut = drive(qwen, [(0, ReqState("r", "hello", sampling={**greedy, "stop": [stop]}))])["r"]
    assert "".join(o["text"] for o in cut) == text[:text.index(stop)] and cut[-1]["finish_reason"] == "stop"
    by_id = drive(qwen, [(0, ReqState("r", "hello", sampling={**greedy, "stop_token_ids": [toks[4]]}))])["r"]
    assert tokens(by_id) == toks[:toks.index(toks[4])] and by_id[-1]["finish_reason"] == "stop"
    eos = sorted(qwen.eos_ids)
    early = drive(qwen, [(0, ReqState("r", "hello", sampling={**greedy, "stop_token_ids": [toks[0]],
                                                                  "min_tokens": 3}))])["r"]
    assert len(tokens(early)) >= 3 and not set(tokens(early)[:3]) & {toks[0], *eos}
    with pytest.raises(ValueError, match="not in the model's vocabulary of 400"):
        qwen.admit(ReqState("r", "hello", sampling={"stop_token_ids": [400]}))


def test_a_seed_gives_the_same_text_on_every_replica(tiny_qwen2: Any, qwen: StageModel) -> None:
    other = build_model("hf-causal-lm", {"checkpoint": str(tiny_qwen2.path)}, seed=99)  # another replica
    params = {"seed": 7, "temperature": 0.9, "top_p": 0.9, "top_k": 50, "max_tokens": 16,
              "repetition_penalty": 1.2, "frequency_penalty": 0.5}
    a = tokens(drive(qwen, [(0, ReqState("a", "hello", sampling=params))])["a"])
    b = tokens(drive(other, [(0, ReqState("b", "hello", sampling=params))])["b"])
    c = tokens(drive(other, [(0, ReqState("c", "hello", sampling={**params, "seed": 8}))])["c"])
    assert a == b and a != c


def test_the_context_is_the_limit_never_a_cut(tiny_qwen2: Any) -> None:
    model = build_model("hf-causal-lm", {"checkpoint": str(tiny_qwen2.path), "max_model_len": 24})
    assert model.info()["max_model_len"] == 24
    with pytest.raises(ValueError, match=r"maximum context length is 24 tokens.*requested 200 tokens in the"):
        model.admit(ReqState("r", "x" * 200))
    n_prompt = len(checkpoint_tokenizer(str(tiny_qwen2.path)).encode("one two three"))
    with pytest.raises(ValueError, match=rf"requested {n_prompt + 20} tokens \({n_prompt} in the messages"):
        model.admit(ReqState("r", "one two three", sampling={"max_tokens": 20}))
    long = {"temperature": 0.0, "min_tokens": 30}
    outs = drive(model, [(0, ReqState("r", "one two three", sampling=long))])
    assert len(tokens(outs["r"])) == 24 - n_prompt and outs["r"][-1]["finish_reason"] == "length"


def test_hidden_states_are_the_rows_each_token_was_sampled_from(tiny_qwen2: Any) -> None:
    model = build_model("hf-causal-lm", {"checkpoint": str(tiny_qwen2.path), "hidden_states": True})
    greedy = {"temperature": 0.0, "max_tokens": 6}
    outs = drive(model, [(0, ReqState("r", "hello there", sampling=greedy))])["r"]
    toks = tokens(outs)
    rows = np.concatenate([o["hidden"] for o in outs])
    assert rows.dtype == np.float32 and rows.shape == (len(toks), 64)
    prompt = checkpoint_tokenizer(str(tiny_qwen2.path)).encode("hello there")
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(tiny_qwen2.path)).eval()
    with torch.inference_mode():
        states = ref(torch.tensor([prompt + toks]), output_hidden_states=True).hidden_states[-1][0]
    want = states[len(prompt) - 1:len(prompt) - 1 + len(toks)].numpy()  # the position before each token
    np.testing.assert_allclose(rows, want, rtol=1e-4, atol=1e-4)
    assert stage_sizes("hf-causal-lm", {"checkpoint": str(tiny_qwen2.path), "hidden_states": True}).emits == {
        "vocabulary": 400, "hidden_size": 64}


def test_a_resumable_request_goes_on_from_its_cache(qwen: StageModel) -> None:
    """The next segment runs on the cache the request has: the answer is the one a fresh request gives
    for the whole conversation as its prompt."""
    greedy = {"temperature": 0.0, "max_tokens": 5}
    for opening in ("hello", "one two three"):
        req = ReqState("r", opening, sampling=greedy)
        first = drive_segment(qwen, req, admit=True)
        qwen.extend(req, " and more")
        second = drive_segment(qwen, req)
        qwen.release(req)
        said = first if len(first) == 5 else [*first, req.model.last]  # an end-of-text goes in too
        ids = [*qwen.tok.encode(opening), *said, *qwen.tok.encode(" and more")]
        fresh = ReqState("f", opening, sampling=greedy)
        qwen.admit(fresh)
        fresh.model.prompt, fresh.model.feed, fresh.model.context = ids, list(ids), len(ids)
        assert drive_segment(qwen, fresh) == second
        qwen.release(fresh)


def drive_segment(model: StageModel, req: ReqState, admit: bool = False) -> list[int]:
    if admit:
        model.admit(req)
    out: list[int] = []
    while True:
        [res] = model.step([req])
        if res.data is not None:
            out += [int(t) for t in res.data["tokens"]]
        if res.finished:
            return out


def test_the_stage_declares_its_vocabulary_and_a_stage_that_cannot_read_it_fails(tiny_qwen2: Any) -> None:
    assert stage_sizes("hf-causal-lm", {"checkpoint": str(tiny_qwen2.path)}).emits == {"vocabulary": 400}
    with pytest.raises(ValueError, match=r"stage 0 \(hf-causal-lm\) emits token ids from a vocabulary "
                                         r"of 400, but stage 1 \(talker\) reads token ids from a vocabulary "
                                         r"of 257"):
        PipelineConfig([StageConfig("hf-causal-lm", model={"checkpoint": str(tiny_qwen2.path)}),
                        StageConfig("talker"), StageConfig("code2wav")], final_stage_ids=[0, 2]).validate()
