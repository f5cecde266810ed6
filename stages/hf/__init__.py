"""Stage kinds that serve real checkpoints: Hugging Face models loaded from a local directory.

What is here loads weights someone trained; the random-weight toys are
elsewhere.  :mod:`stages.hf.checkpoint` reads a checkpoint directory without
torch or ``transformers`` (the head checks it before any worker starts);
:mod:`stages.hf.tokenizer` is its tokenizer; :mod:`stages.hf.decoder` the
continuous-batching decoder loop any autoregressive kind reuses, over a model
adapter; :mod:`stages.hf.causal_lm` the ``hf-causal-lm`` kind; :mod:`stages.hf.omni`
Qwen2.5-Omni as three stages (thinker, talker, token2wav).  ``transformers`` is
the optional extra ``hf`` and is imported only by these kinds.
"""
