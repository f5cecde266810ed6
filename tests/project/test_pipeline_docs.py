"""The pipeline configs shown in docs/pipelines.md are valid and are the built-in pipelines they name."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from stages.config import PIPELINES, builtin_config, from_dict

DOC = Path(__file__).resolve().parents[2] / "docs" / "pipelines.md"


def test_every_toml_block_is_the_built_in_pipeline_it_names() -> None:
    blocks = re.findall(r"```toml\n# --pipeline (\S+)\n(.*?)```", DOC.read_text(), re.S)
    assert {name for name, _ in blocks} == set(PIPELINES) - {"speech"}
    for name, text in blocks:
        doc, built = from_dict(tomllib.loads(text)), builtin_config(name)
        shape = [(s.kind, s.role, s.replicas) for s in doc.stages]
        assert shape == [(s.kind, s.role, s.replicas) for s in built.stages], name
        assert doc.final_stage_ids == built.final_stage_ids
