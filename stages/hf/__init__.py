"""Stage kinds that serve real checkpoints: Hugging Face models loaded from a local directory.

``transformers`` is the optional extra ``hf`` and is imported only by these kinds.
:mod:`stages.hf.omni` is Qwen2.5-Omni as three stages (thinker, talker, token2wav).
"""
