"""Pipelines that fit: what each stage emits to the next must be what the next one reads.

A stage kind may declare its sizes (``StageSpec.sizes``: options -> :class:`Sizes`):
the vocabulary its token ids come from, the codebooks of its codes, the width
of its hidden states -- what it ``emits`` to the next stage and what it
``reads`` from the one before.  :func:`check_fit` compares every pair of
consecutive stages before any worker starts, so a mismatch is a config error
naming both stages and both sizes, never an index error in the middle of a
request.  Each size has one rule (:data:`RULES`): ids must come from a
vocabulary no larger than the reader's; widths must be equal.

The size functions of the built-in kinds are here too, beside the rules: they
read the stage's options (the constructor's defaults filled in) and, for a
tokenizer or a checkpoint, the files the options name -- never torch.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["RULES", "Sizes", "causal_lm_sizes", "check_fit", "code2wav_sizes", "talker_sizes",
           "thinker_sizes"]


@dataclass(frozen=True)
class Sizes:
    """What a stage emits to the next stage and reads from the one before, by size name.

    ``options``: for a size it reads, the model option that sets it (the fix a
    mismatch's message suggests).
    """

    emits: Mapping[str, int] = field(default_factory=dict)
    reads: Mapping[str, int] = field(default_factory=dict)
    options: Mapping[str, str] = field(default_factory=dict)


#: size name -> (how the emitted size must compare with the read one, what it measures)
RULES: dict[str, tuple[str, str]] = {
    "vocabulary": ("<=", "token ids from a vocabulary of"),
    "codebook_size": ("<=", "codes from codebooks of size"),
    "codebooks": ("==", "frames of codebooks:"),
    "hidden_size": ("==", "hidden states of width"),
}


def check_fit(labels: Sequence[str], sizes: Sequence[Sizes | None]) -> None:
    """ValueError naming both stages and both sizes when stage k+1 cannot read what stage k emits."""
    for k in range(len(sizes) - 1):
        out, into = sizes[k], sizes[k + 1]
        if out is None or into is None:
            continue
        for name, emitted in out.emits.items():
            read = into.reads.get(name)
            if read is None or name not in RULES:
                continue
            rule, what = RULES[name]
            if (emitted <= read) if rule == "<=" else (emitted == read):
                continue
            option = into.options.get(name)
            fix = (f"; set stage {k + 1}'s {option} to {'at least ' if rule == '<=' else ''}{emitted} "
                   "([stages.model])" if option else "")
            raise ValueError(f"pipeline config: stage {k} ({labels[k]}) emits {what} {emitted}, but stage "
                             f"{k + 1} ({labels[k + 1]}) reads {what} {read}{fix}")


def thinker_sizes(options: Mapping[str, Any]) -> Sizes:
    """The toy thinker emits ids of its tokenizer's vocabulary (byte-level: 257)."""
    from stages.tokenizer import load_tokenizer

    return Sizes(emits={"vocabulary": load_tokenizer(options.get("tokenizer", "")).vocab_size})


def talker_sizes(options: Mapping[str, Any]) -> Sizes:
    """The toy talker reads ids below its ``vocab_size`` and emits frames of codes."""
    return Sizes(emits={"codebooks": options["codebooks"], "codebook_size": options["codebook_size"]},
                 reads={"vocabulary": options["vocab_size"]}, options={"vocabulary": "vocab_size"})


def code2wav_sizes(options: Mapping[str, Any]) -> Sizes:
    """The toy vocoder reads frames of ``codebooks`` codes below ``codebook_size``."""
    return Sizes(reads={"codebooks": options["codebooks"], "codebook_size": options["codebook_size"]},
                 options={"codebooks": "codebooks", "codebook_size": "codebook_size"})


def causal_lm_sizes(options: Mapping[str, Any]) -> Sizes:
    """A checkpoint's causal LM emits ids of its ``config.json`` vocabulary (and, asked for hidden
    states, rows of its hidden size)."""
    from stages.hf.checkpoint import load_checkpoint

    ckpt = load_checkpoint(options["checkpoint"])
    emits = {"vocabulary": ckpt.vocab_size}
    if options.get("hidden_states") and ckpt.hidden_size is not None:
        emits["hidden_size"] = ckpt.hidden_size
    return Sizes(emits=emits)


#: a kind's size function: its options (defaults filled in) -> what it emits and reads
SizeFn = Callable[[Mapping[str, Any]], Sizes]
