"""A tiny word-level ``tokenizer.json`` for tests, made with the tokenizers library (no download)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

__all__ = ["word_tokenizer"]


def word_tokenizer(path: Path, words: Sequence[str]) -> Path:
    """Write a whitespace-split tokenizer of ``words`` to ``path`` (``</s>`` special, ``[UNK]`` unknown)."""
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece(prefix="##")
    tok.add_special_tokens(["</s>"])
    tok.save(str(path))
    return path
