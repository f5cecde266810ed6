"""``hf-causal-lm``: a Hugging Face causal language model from a local checkpoint, as a stage worker.

The model is ``transformers``' ``AutoModelForCausalLM`` on the checkpoint
directory (``checkpoint`` option; nothing is downloaded), in the checkpoint's
dtype or the stage's ``dtype`` option, on the worker's device; its tokenizer
is the checkpoint's (:mod:`stages.hf.tokenizer`), its end-of-text ids and
sampling defaults come from ``generation_config.json``, its context from
``config.json`` (or a smaller ``max_model_len``).  The loop is
:class:`~stages.hf.decoder.DecoderStage`; :class:`CausalLMAdapter` runs one
sequence the way ``generate()`` runs it -- the model's own
``prepare_inputs_for_generation`` over its full sequence, a ``DynamicCache``,
an all-ones attention mask, logits of the last position only -- so a greedy
answer is ``generate()``'s, token for token.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch

from stages.hf.checkpoint import DTYPES, load_checkpoint
from stages.hf.decoder import DecoderStage, Forward
from stages.hf.tokenizer import checkpoint_tokenizer, require_transformers
from stages.schema import PositiveInt

__all__ = ["CausalLMAdapter", "HFCausalLM"]

#: ``generation_config.json`` fields that are sampling defaults (vLLM reads the same ones)
_DEFAULTS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
             "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


@dataclass(slots=True)
class _Sequence:
    ids: torch.Tensor  # [1, n]: every token the model has seen, as generate() keeps them
    cache: Any


class CausalLMAdapter:
    """One sequence at a time through a ``transformers`` causal LM (see the module's docstring)."""

    def __init__(self, model: Any, device: torch.device) -> None:
        self.model = model
        self.device = device
        config = model.config.get_text_config()
        self.vocab_size = int(config.vocab_size)
        self.hidden_size = int(config.hidden_size)
        self.keep_one = "logits_to_keep" in inspect.signature(model.forward).parameters

    def start(self) -> _Sequence:
        from transformers import DynamicCache

        return _Sequence(torch.zeros((1, 0), dtype=torch.long, device=self.device),
                         DynamicCache(config=self.model.config))

    def forward(self, state: _Sequence, new_ids: list[int], *, hidden: bool) -> Forward:
        first = state.ids.shape[1] == 0
        state.ids = torch.cat([state.ids, torch.tensor([new_ids], dtype=torch.long, device=self.device)], 1)
        extra: dict[str, Any] = {"logits_to_keep": 1} if self.keep_one else {}
        if hidden:
            extra["output_hidden_states"] = True
        inputs = self.model.prepare_inputs_for_generation(
            state.ids, next_sequence_length=None if first else len(new_ids), past_key_values=state.cache,
            attention_mask=torch.ones_like(state.ids), use_cache=True, is_first_iteration=first, **extra)
        out = self.model(**inputs, return_dict=True)
        state.cache = out.past_key_values
        logits = out.logits[0, -1].to(dtype=torch.float32, device="cpu")
        last = out.hidden_states[-1][0, -1].to(dtype=torch.float32, device="cpu") if hidden else None
        return Forward(logits, last)

    def release(self, state: _Sequence) -> None:
        state.cache = None


class HFCausalLM(DecoderStage):
    """A causal LM checkpoint served with continuous batching (see the module's docstring).

    Options: ``checkpoint`` (the directory), ``max_model_len`` (at most the
    model's context; default: the model's), ``dtype`` (auto: the checkpoint's),
    ``hidden_states`` (outputs carry each token's final hidden state).
    """

    kind = "hf-causal-lm"

    def __init__(self, checkpoint: str, max_model_len: PositiveInt | None = None, dtype: str = "auto",
                 hidden_states: bool = False, device: str = "cpu", seed: int = 0) -> None:
        ckpt = load_checkpoint(checkpoint)
        context = ckpt.context(max_model_len)
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
        require_transformers()
        from transformers import AutoModelForCausalLM

        self.dtype = ckpt.dtype if dtype == "auto" else dtype
        self.device = torch.device(device)
        torch_dtype = getattr(torch, self.dtype, None)
        if not isinstance(torch_dtype, torch.dtype):
            raise ValueError(f"{checkpoint}: dtype {self.dtype!r} is not a torch dtype")
        model = AutoModelForCausalLM.from_pretrained(str(ckpt.path), dtype=torch_dtype, local_files_only=True)
        model = model.to(self.device).eval()
        self.checkpoint = ckpt
        given = {key: v for key, v in ckpt.generation.items() if not isinstance(v, bool)}
        defaults = {name: given[key] for key, name in _DEFAULTS.items()
                    if isinstance(given.get(key), int | float)}
        super().__init__(CausalLMAdapter(model, self.device), checkpoint_tokenizer(str(ckpt.path)),
                         max_model_len=context, eos_ids=ckpt.eos_token_ids(), defaults=defaults, seed=seed,
                         hidden_states=hidden_states)

    def info(self) -> dict[str, Any]:
        return {**super().info(), "tokenizer": str(self.checkpoint.path),
                "architecture": self.checkpoint.architecture, "dtype": self.dtype, "device": str(self.device)}
