"""A checkpoint's tokenizer, as ``transformers`` builds it, wrapped as the project's :class:`TextTokenizer`.

``AutoTokenizer`` is the reference (it is what ``model.generate()`` users and
vLLM tokenize with): some tokenizer classes rebuild the ``tokenizers``
pipeline from the vocabulary rather than read ``tokenizer.json`` as it is
(Qwen2's does), so the checkpoint's tokenizer is the library tokenizer
``AutoTokenizer`` ends up running (its ``backend_tokenizer``).  The worker and
the head (``/tokenize``, prompt counts, the context check) load it the same
way, so they count the same tokens.  Needs the ``hf`` extra; a tokenizer with
no fast (``tokenizers``) form is refused by name.
"""

from __future__ import annotations

import functools

from stages.hf.checkpoint import load_checkpoint
from stages.tokenizer import TextTokenizer

__all__ = ["HF_EXTRA", "checkpoint_tokenizer", "require_transformers"]

#: how to install what the checkpoint kinds need
HF_EXTRA = "pip install 'trio-orch[hf]' (the hf extra: transformers)"


def require_transformers() -> None:
    """ImportError naming the ``hf`` extra when ``transformers`` is not installed."""
    try:
        import transformers  # noqa: F401
    except ImportError as exc:
        raise ImportError(f"serving a Hugging Face checkpoint needs transformers: {HF_EXTRA}") from exc


@functools.cache
def checkpoint_tokenizer(path: str) -> TextTokenizer:
    """The tokenizer of the checkpoint in directory ``path`` (ValueError naming it when it cannot load)."""
    ckpt = load_checkpoint(path)
    require_transformers()
    from transformers import AutoTokenizer

    try:
        hf = AutoTokenizer.from_pretrained(str(ckpt.path), local_files_only=True)
    except Exception as exc:  # transformers raises many kinds for a broken tokenizer
        raise ValueError(f"{path}: cannot load its tokenizer: {type(exc).__name__}: {exc}") from None
    backend = getattr(hf, "backend_tokenizer", None)
    if backend is None:
        raise ValueError(f"{path}: its tokenizer ({type(hf).__name__}) has no tokenizers-library form "
                         "(tokenizer.json): it is not served")
    eos = hf.eos_token_id
    if eos is None:
        ids = ckpt.eos_token_ids()
        eos = ids[0] if ids else None
    if eos is None:
        raise ValueError(f"{path}: neither its tokenizer nor generation_config.json names an end-of-text "
                         "token")
    return TextTokenizer(backend, str(ckpt.path), eos=int(eos), bos=hf.bos_token_id, checkpoint=True,
                         vocab_size=ckpt.vocab_size)
