"""The text stages' tokenizer (the ``tokenizers`` library), in process: the byte-level default, a
``tokenizer.json`` named in the config, and incremental decoding that never splits a character."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from stages.tokenizer import byte_level, load_tokenizer
from tests.tokenizer_helpers import word_tokenizer
from trio_orch.openai.tokenizer import ByteTokenizer

torch = pytest.importorskip("torch")

from stages.base import ReqState  # noqa: E402
from stages.registry import build_model  # noqa: E402

SMALL = {"d_model": 32, "layers": 1, "heads": 2}
TEXT = "héllo, wörld 🎉 — <|endoftext|> ok"


WORDS = ["</s>", "[UNK]", "the", "cat", "sat", "on", "mat", "a", "é", "ü", ".", ","]



def test_the_byte_level_tokenizer_is_the_server_s_byte_tokenizer() -> None:
    lib, plain = byte_level(), ByteTokenizer()
    assert lib.encode(TEXT) == plain.encode(TEXT) == list(TEXT.encode())  # a typed special token is text
    assert (lib.eos, lib.vocab_size) == (plain.eos, plain.vocab_size) == (256, 257)
    assert lib.decode([*lib.encode(TEXT), lib.eos]) == plain.decode(plain.encode(TEXT)) == TEXT
    assert load_tokenizer("") is lib  # built once, at first use


def test_incremental_decoding_releases_whole_characters_only() -> None:
    tok = byte_level()
    dec = tok.decoder()
    pieces = [dec.push(t) for t in tok.encode(TEXT)]
    assert "".join(pieces) == TEXT and all("\ufffd" not in p for p in pieces)
    first = tok.decoder()
    assert [first.push(t) for t in "🎉".encode()] == ["", "", "", "🎉"]  # four bytes, one character


def test_a_tokenizer_json_gives_its_ids_and_end_of_text(tmp_path: Path) -> None:
    tok = load_tokenizer(str(word_tokenizer(tmp_path / "tokenizer.json", WORDS)))
    assert tok.encode("the cat sat") == [2, 3, 4] and tok.eos == 0 and tok.vocab_size == 12
    assert tok.decode([2, 3, 0]) == "the cat"
    with pytest.raises(ValueError, match="cannot load it"):
        load_tokenizer(str(tmp_path / "missing.json"))
    bad = tmp_path / "no_eos.json"
    data = json.loads((tmp_path / "tokenizer.json").read_text())
    data["added_tokens"] = []
    data["model"]["vocab"].pop("</s>")
    bad.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="no end-of-text token"):
        load_tokenizer(str(bad))


def test_a_thinker_with_a_tokenizer_json_reads_and_writes_its_tokens(tmp_path: Path) -> None:
    path = str(word_tokenizer(tmp_path / "tokenizer.json", WORDS))
    thinker = build_model("thinker", {**SMALL, "tokenizer": path, "min_new_tokens": 4}, seed=3)
    assert thinker.info()["tokenizer"] == path and thinker.info()["vocab_size"] == 12
    req = ReqState("r", "the cat sat on", sampling={"seed": 1, "max_tokens": 6})
    thinker.admit(req)
    assert req.model["prompt"] == [2, 3, 4, 5]
    outs = []
    while True:
        [res] = thinker.step([req])
        if res.data is not None:
            outs.append(res.data)
        if res.finished:
            break
    tokens = [int(t) for o in outs for t in o["tokens"]]
    assert tokens and all(2 <= t < 12 for t in tokens)  # printable words only: no [UNK], no </s> text
    assert "".join(o["text"] for o in outs) == load_tokenizer(path).decode(tokens)


def test_the_default_thinker_streams_a_forced_multibyte_answer_without_splitting_it() -> None:
    thinker = build_model("thinker", SMALL, seed=2)
    assert thinker.info()["tokenizer"] == "" and thinker.info()["eos"] == 256
    req = ReqState("r", {"text": "say it", "say": "naïve 🎉 café"})
    thinker.admit(req)
    pieces = []
    while True:
        [res] = thinker.step([req])
        if res.data is not None:
            pieces.append(res.data["text"])
        if res.finished:
            break
    assert "".join(pieces) == "naïve 🎉 café" and all("\ufffd" not in p for p in pieces)
