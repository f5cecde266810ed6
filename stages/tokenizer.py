"""The text stages' tokenizer: Hugging Face's ``tokenizers`` library, a ``tokenizer.json`` or a built-in one.

A checkpoint directory's tokenizer is loaded as ``transformers`` loads it
(:mod:`stages.hf.tokenizer`), into the same :class:`TextTokenizer`.  A thinker
names its tokenizer in the pipeline config
(``[stages.model] tokenizer = "path/to/tokenizer.json"``, a file the
``tokenizers`` library reads, as a model on the Hub ships it).  Without one
it uses :func:`byte_level`: a byte-level BPE with no merges, built with the
library at first use (nothing is downloaded), whose ids are the bytes of the
UTF-8 text and 256 end-of-text -- the built-in thinker's vocabulary, so its
seeded weights and answers do not depend on which of the two encoded them.

Decoding is incremental (:class:`IncrementalDecoder`), as vLLM's detokenizer
is: a token's text is released only once it ends in a whole character, so a
streamed answer never splits one (a multi-byte character whose bytes are
several tokens comes out with its last one).  This module imports neither
torch nor trio.
"""

from __future__ import annotations

import functools
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

__all__ = ["EOS_NAMES", "IncrementalDecoder", "TextTokenizer", "byte_level", "load_tokenizer"]

#: the special tokens taken as end-of-text, in this order, when a ``tokenizer.json`` has one of them
EOS_NAMES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eot_id|>", "<|im_end|>")


class TextTokenizer:
    """A ``tokenizers.Tokenizer`` and its end-of-text id; ``source``: the file, or "byte-level".

    ``eos``: the end-of-text id (default: the first of :data:`EOS_NAMES` the
    vocabulary has).  A checkpoint's tokenizer (:mod:`stages.hf.tokenizer`)
    also has ``bos`` and ``checkpoint=True``: its encoding adds the special
    tokens the checkpoint's tokenizer adds (its BOS) -- once, when the text
    already begins with one (a chat template that writes ``bos_token``), as
    vLLM's chat (no special tokens added) and completions (added) come out --
    and its decoding leaves every special token out.
    """

    def __init__(self, tok: Tokenizer, source: str, *, eos: int | None = None, bos: int | None = None,
                 checkpoint: bool = False, vocab_size: int | None = None) -> None:
        self.tok = tok
        self.source = source
        vocab = tok.get_vocab(with_added_tokens=True)
        if eos is None:
            eos = next((vocab[n] for n in EOS_NAMES if n in vocab), None)
        if eos is None:
            raise ValueError(f"tokenizer {source}: no end-of-text token (one of {', '.join(EOS_NAMES)})")
        self.eos = eos
        self.bos = bos
        self.checkpoint = checkpoint
        self.vocab_size = max(tok.get_vocab_size(with_added_tokens=True), eos + 1, vocab_size or 0)

    def encode(self, text: str) -> list[int]:
        """The ids of ``text``: no special tokens added, or a checkpoint's (see the class)."""
        if not self.checkpoint:
            return list(self.tok.encode(text, add_special_tokens=False).ids)
        ids = list(self.tok.encode(text, add_special_tokens=True).ids)
        if self.bos is not None and ids[:2] == [self.bos, self.bos]:
            del ids[0]  # the text began with BOS (a chat template's): it is not added again
        return ids

    def decode(self, tokens: list[int]) -> str:
        """The text of ``tokens``; end-of-text is not text (a checkpoint's: no special token is), and a cut
        character shows as U+FFFD."""
        if self.checkpoint:
            return self.tok.decode(list(tokens), skip_special_tokens=True)
        return self.tok.decode([t for t in tokens if t != self.eos], skip_special_tokens=False)

    def token_str(self, token: int) -> str:
        """One token as text (its piece, for a token that is part of a character)."""
        if token == self.eos:
            return "<eos>"
        text = self.decode([token])
        return text if "\ufffd" not in text else (self.tok.id_to_token(token) or text)

    def decoder(self) -> IncrementalDecoder:
        return IncrementalDecoder(self)


class IncrementalDecoder:
    """Tokens in, whole characters out: each :meth:`push` returns the text that became complete."""

    def __init__(self, tok: TextTokenizer) -> None:
        self.tok = tok
        self.ids: list[int] = []
        self.prefix = 0  # ids[prefix:read] decode to text already released
        self.read = 0

    def push(self, token: int) -> str:
        if token == self.tok.eos:
            return ""
        self.ids.append(token)
        before = self.tok.decode(self.ids[self.prefix:self.read])
        after = self.tok.decode(self.ids[self.prefix:])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""  # the last tokens end inside a character (or add nothing yet)
        self.prefix, self.read = self.read, len(self.ids)
        return after[len(before):]

    def flush(self) -> str:
        """At the end of the text: what is still held back, less a last character the tokens left
        unfinished (never shown: it would only be U+FFFD)."""
        before = self.tok.decode(self.ids[self.prefix:self.read])
        after = self.tok.decode(self.ids[self.prefix:]).rstrip("\ufffd")
        self.prefix = self.read = len(self.ids)
        return after[len(before):] if len(after) > len(before) else ""


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table, the alphabet of byte-level BPE."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = list(keep)
    n = 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(keep, chars, strict=True)}


@functools.cache
def byte_level() -> TextTokenizer:
    """The default tokenizer: one token per UTF-8 byte (its id is the byte), 256 end-of-text."""
    table = _bytes_to_unicode()
    tok = Tokenizer(models.BPE(vocab={table[b]: b for b in range(256)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>"])
    tok.encode_special_tokens = True  # "<|endoftext|>" typed in a prompt is 13 bytes, not the end of it
    return TextTokenizer(tok, "byte-level")


@functools.cache
def load_tokenizer(path: str = "") -> TextTokenizer:
    """A ``tokenizer.json``'s tokenizer, or :func:`byte_level` for "" (ValueError naming the file).

    A checkpoint directory's is :func:`stages.hf.tokenizer.checkpoint_tokenizer`'s."""
    if not path:
        return byte_level()
    p = Path(path)
    try:
        tok = Tokenizer.from_file(str(p))
    except Exception as exc:  # the library raises its own exception types for unreadable or bad files
        raise ValueError(f"tokenizer {p}: cannot load it: {exc}") from None
    return TextTokenizer(tok, str(p))
