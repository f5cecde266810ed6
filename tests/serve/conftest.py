"""Fixtures of the serve tests that more than one module takes."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest


@pytest.fixture(scope="module")
def full(tiny_omni: Path) -> Iterator[Any]:
    """The whole tiny Qwen2.5-Omni in this process (``generate()``'s reference), one torch thread while a
    module uses it (tiny matrices: one thread is faster on a busy machine)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from stages.hf.omni.parts import quiet_transformers

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with quiet_transformers():
            yield transformers.Qwen2_5OmniForConditionalGeneration.from_pretrained(str(tiny_omni)).eval()
    finally:
        torch.set_num_threads(threads)
