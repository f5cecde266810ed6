"""Tiny Hugging Face checkpoints with random weights, built on the spot (nothing is downloaded).

:func:`tiny_checkpoint` writes a complete local checkpoint directory -- the
shape a model on the Hub ships in -- so tests and examples can serve a "real"
model without a network: ``config.json`` (a 2-layer Qwen2 or Llama),
``model.safetensors``, ``generation_config.json``, and a byte-level BPE
tokenizer trained here with the ``tokenizers`` library on a small corpus
(``tokenizer.json`` + ``tokenizer_config.json`` with its special tokens and a
chat template).  Needs the ``hf`` extra (``transformers``), imported only
when a checkpoint is built.

The weights are random (seeded), drawn wider than a trained model's so the
greedy answers vary from prompt to prompt instead of repeating one token.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["CHATML_TEMPLATE", "CORPUS", "LLAMA_TEMPLATE", "TinyCheckpoint", "tiny_checkpoint"]

#: the ChatML template Qwen2 checkpoints ship (without the tool-calling branches)
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

#: a Llama-2-style template: the BOS token in the text, [INST] blocks, EOS after each answer
LLAMA_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' ' + message['content'] + eos_token }}"
    "{% else %}{{ '<<SYS>>\n' + message['content'] + '\n<</SYS>>\n\n' }}{% endif %}"
    "{% endfor %}"
)

#: what the tokenizer is trained on: English words and some multi-byte characters (so some
#: characters take several tokens, and an incremental detokenizer must not split them)
CORPUS = (
    "the quick brown fox jumps over the lazy dog. hello world, how are you today? "
    "a stage worker serves a model from a local checkpoint directory. "
    "tokens stream back one at a time while the batch keeps running. "
    "café naïve über straße 東京 日本語 こんにちは 🙂 emoji and accents: é è ê ë. "
    "one two three four five six seven eight nine ten. the answer is forty two. "
)

#: Qwen2's pre-tokenizer split (words, single digits, punctuation runs, newlines, spaces)
_QWEN2_SPLIT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
                r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")

_SPECIAL = {
    "qwen2": {"eos": "<|im_end|>", "pad": "<|endoftext|>", "bos": None,
              "extra": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]},
    "llama": {"eos": "</s>", "pad": None, "bos": "<s>", "extra": ["<s>", "</s>", "<unk>"]},
}


@dataclass(frozen=True)
class TinyCheckpoint:
    """What :func:`tiny_checkpoint` built: its directory and the facts a test compares against."""

    path: Path
    architecture: str
    vocab_size: int
    max_position_embeddings: int
    eos_token_id: list[int]
    chat_template: str
    special: dict[str, Any] = field(default_factory=dict)

    def __fspath__(self) -> str:
        return str(self.path)


def _train_tokenizer(arch: str, vocab_size: int) -> Any:
    from tokenizers import (
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
        trainers,
    )

    spec = _SPECIAL[arch]
    tok = Tokenizer(models.BPE())
    if arch == "qwen2":  # what transformers' Qwen2Tokenizer rebuilds: NFC, Qwen's split, then bytes
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_QWEN2_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(spec["extra"]),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([CORPUS] * 4, trainer)
    if spec["bos"] is not None:  # Llama's tokenizer puts BOS before every encoded text
        bos = spec["bos"]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tok.token_to_id(bos))])
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def tiny_checkpoint(path: str | Path, *, arch: str = "qwen2", seed: int = 0, vocab_size: int = 400,
                    hidden_size: int = 64, layers: int = 2, heads: int = 4, kv_heads: int = 2,
                    max_position_embeddings: int = 256, init_range: float = 0.25,
                    chat_template: str | None = None,
                    generation: dict[str, Any] | None = None) -> TinyCheckpoint:
    """Write a tiny random ``arch`` ("qwen2" or "llama") checkpoint into ``path`` (created); return it.

    ``vocab_size``: the BPE's target size (the tokenizer may have a few less);
    ``generation``: extra ``generation_config.json`` fields (e.g. ``{"temperature": 0.7}``).
    """
    import torch
    from transformers import GenerationConfig, PreTrainedTokenizerFast

    if arch not in _SPECIAL:
        raise ValueError(f"arch must be one of {', '.join(_SPECIAL)}, got {arch!r}")
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    spec = _SPECIAL[arch]
    template = chat_template if chat_template is not None else (
        CHATML_TEMPLATE if arch == "qwen2" else LLAMA_TEMPLATE)
    raw = _train_tokenizer(arch, vocab_size)
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=raw, eos_token=spec["eos"], bos_token=spec["bos"],
                                     pad_token=spec["pad"], unk_token="<unk>" if arch == "llama" else None,
                                     model_max_length=max_position_embeddings,
                                     add_bos_token=spec["bos"] is not None)
    hf_tok.chat_template = template
    hf_tok.save_pretrained(out)
    n_vocab = len(hf_tok)
    eos_ids = [hf_tok.convert_tokens_to_ids(spec["eos"])]
    if arch == "qwen2":
        eos_ids.append(hf_tok.convert_tokens_to_ids("<|endoftext|>"))
    bos_id = hf_tok.convert_tokens_to_ids(spec["bos"]) if spec["bos"] is not None else None
    common = dict(vocab_size=n_vocab, hidden_size=hidden_size, intermediate_size=hidden_size * 2,
                  num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                  max_position_embeddings=max_position_embeddings, initializer_range=init_range,
                  eos_token_id=eos_ids[0], bos_token_id=bos_id, tie_word_embeddings=False)
    if arch == "qwen2":
        from transformers import Qwen2Config, Qwen2ForCausalLM

        config: Any = Qwen2Config(**common)
        model_cls: Any = Qwen2ForCausalLM
    else:
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(**common)
        model_cls = LlamaForCausalLM
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    model.generation_config = GenerationConfig(eos_token_id=eos_ids if len(eos_ids) > 1 else eos_ids[0],
                                               bos_token_id=bos_id, **(generation or {}))
    model.save_pretrained(out)
    return TinyCheckpoint(out, model_cls.__name__, n_vocab, max_position_embeddings, eos_ids, template,
                          {"eos_token": spec["eos"], "bos_token": spec["bos"]})
