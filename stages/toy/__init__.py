"""The random-weight toy stage models: seeded dummy weights, nothing loaded (checkpoints: stages.hf)."""
