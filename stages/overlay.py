"""A stage config: per-stage settings laid over a pipeline something else built (``--stage-config FILE``).

``serve MODEL_DIR`` builds its pipeline from the checkpoint (which stages,
their kinds, their model options); ``--pipeline`` and ``--config`` name one.
A stage config changes the *settings* of that pipeline's stages -- where each
runs, its replicas, its batch, a model option -- without restating the
pipeline, as vLLM-Omni's per-model stage configs do::

    [pipeline]                  # optional: settings of the whole pipeline
    heartbeat_timeout = 60

    [stages.thinker]            # a stage by name, kind ([stages.omni-talker]) or index ([stages.2])
    device = "cuda:0"

    [stages.talker]
    device = "cuda:1"
    replicas = 2
    [stages.talker.model]       # model options, merged over the pipeline's own
    max_tokens = 2048

Every key of a ``[[stages]]`` table of a pipeline config may be set but
``kind``, ``role`` and ``name`` (they say which stages the pipeline is made
of), every key of its ``[pipeline]`` table but ``final_stages`` (which stages
answer).  The result is checked as a whole pipeline config is
(:func:`stages.config.from_dict`): a stage the pipeline does not have, a key
that is no stage setting, a wrong type or range is a ``ValueError`` naming
the table and the key, before any worker starts.  Pure: reads no checkpoint,
counts no device (the command's device check comes after).
"""

from __future__ import annotations

import difflib
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from stages.config import PipelineConfig, PipelineTable, StageConfig, from_dict, to_dict

__all__ = ["FIXED_PIPELINE", "FIXED_STAGE", "apply_overlay", "load_overlay", "stage_index"]

#: stage keys a stage config may not set: which stages the pipeline is made of
FIXED_STAGE = ("kind", "role", "name")
#: pipeline keys it may not set: which stages answer the user
FIXED_PIPELINE = ("final_stages", "final_stage_ids")


def load_overlay(path: str | Path) -> dict[str, Any]:
    """The parsed TOML of a stage config (ValueError naming the file when it cannot be read)."""
    p = Path(path)
    try:
        return tomllib.loads(p.read_text())
    except OSError as exc:
        raise ValueError(f"cannot read stage config {p}: {exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"stage config {p} is not valid TOML: {exc}") from None


def _stages(cfg: PipelineConfig) -> str:
    return ", ".join(f"{k} {st.label} ({st.kind})" for k, st in enumerate(cfg.stages))


def stage_index(cfg: PipelineConfig, key: str) -> int:
    """The stage ``[stages.KEY]`` names: an index, else a stage's name, else its kind (ValueError if none
    or several)."""
    if key.isdigit():
        if int(key) < len(cfg.stages):
            return int(key)
        n = len(cfg.stages)
        raise ValueError(f"[stages.{key}]: the pipeline has {n} stage(s), 0..{n - 1} ({_stages(cfg)})")
    for attr in ("label", "kind"):
        hits = [k for k, st in enumerate(cfg.stages) if getattr(st, attr) == key]
        if len(hits) == 1:
            return hits[0]
        if hits:
            raise ValueError(f"[stages.{key}]: stages {', '.join(map(str, hits))} are all {key!r}: name one "
                             f"by its index ([stages.{hits[0]}])")
    names = [n for st in cfg.stages for n in (st.label, st.kind)]
    close = difflib.get_close_matches(key, names, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    raise ValueError(f"[stages.{key}]: the pipeline has no such stage (its stages: {_stages(cfg)}; name "
                     f"one by its index, name or kind){hint}")


def _check_key(where: str, key: str, allowed: tuple[str, ...], fixed: tuple[str, ...], why: str) -> None:
    """``key`` is one of the ``allowed`` keys (the declared fields of its table) and not a ``fixed`` one."""
    if key in fixed:
        raise ValueError(f"{where}: {key!r} is not set by a stage config: {why}")
    if key not in allowed:
        keys = [k for k in allowed if k not in fixed]
        close = difflib.get_close_matches(key, keys, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"{where}: {key!r} is not a{'' if where == '[pipeline]' else ' stage'} setting "
                         f"(settings: {', '.join(keys)}){hint}")


def _table(where: str, value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ValueError(f"{where} must be a table of settings, got {type(value).__name__}")
    return value


def apply_overlay(cfg: PipelineConfig, data: Mapping[str, Any]) -> PipelineConfig:
    """``cfg`` with the stage config ``data`` (its parsed TOML) laid over it, validated; ``cfg`` is not
    changed.  ValueError naming the table and key of anything that does not fit (see the module
    docstring)."""
    unknown = sorted(set(data) - {"pipeline", "stages"})
    if unknown:
        raise ValueError(f"unknown table {unknown[0]!r}: a stage config has a [pipeline] table and "
                         "[stages.NAME] tables")
    layout = to_dict(cfg)
    for key, value in _table("[pipeline]", data.get("pipeline", {})).items():
        _check_key("[pipeline]", key, PipelineTable.__struct_fields__, FIXED_PIPELINE,
                   "which stages answer is the pipeline's own")
        layout["pipeline"][key] = value
    stages = data.get("stages", {})
    if isinstance(stages, list):
        raise ValueError("[[stages]] is a pipeline config's list of stages (give such a file with --config); "
                         "a stage config names each stage it changes: [stages.0], [stages.talker]")
    named: dict[int, str] = {}
    for key, table in _table("[stages]", stages).items():
        k = stage_index(cfg, key)
        if k in named:
            raise ValueError(f"[stages.{named[k]}] and [stages.{key}] are both stage {k} "
                             f"({cfg.stages[k].label}): give its settings once")
        named[k] = key
        where, target = f"[stages.{key}]", layout["stages"][k]
        for name, value in _table(where, table).items():
            _check_key(where, name, StageConfig.__struct_fields__, FIXED_STAGE, "it says which stages the "
                       "pipeline is made of (a pipeline config, --config, chooses them)")
            if name == "model":
                target["model"] = {**target.get("model", {}), **_table(f"{where} model", value)}
            else:
                target[name] = value
    try:
        return from_dict(layout)
    except (TypeError, ValueError) as exc:
        msg = str(exc).removeprefix("pipeline config: ")
        for k, key in named.items():  # the config's stages[k] is the table the user wrote
            msg = re.sub(rf"\bstages\[{k}\]\.?", f"[stages.{key}] ", msg)
        raise ValueError(msg) from None
