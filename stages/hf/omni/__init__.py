"""Qwen2.5-Omni as a pipeline of three stages: thinker -> talker -> token2wav.

``Qwen2_5OmniForConditionalGeneration`` holds three models and ``generate()``
runs them one after the other in one process.  Here each is a stage of its own,
loaded alone from the same local checkpoint, and what ``generate()`` passes
between them crosses the wire instead:

- :mod:`~stages.hf.omni.checkpoint` reads the checkpoint's ids and speakers
  (no ``transformers``);
- :mod:`~stages.hf.omni.parts` loads one part (only its weights) and the
  checkpoint's processor;
- :mod:`~stages.hf.omni.compute` runs each part one sequence at a time the
  way ``generate()`` runs it, so the chained parts give ``generate()``'s text
  ids, codec ids and waveform;
- :mod:`~stages.hf.omni.forwarding` turns the thinker's outputs into the
  talker's input and the talker's into token2wav's (numpy only: it runs in the
  orchestrator).
"""
