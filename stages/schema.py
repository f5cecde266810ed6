"""The pipeline config as a typed schema: every table, key, type and range, checked by msgspec.

A config file is checked against :class:`ConfigFile` before anything is built:
a wrong type (``max_new_tokens = "48"``), a value out of range
(``max_batch = 0``), an unknown key or a misspelt table (``[pipline]``) is a
:class:`ConfigError` whose message names the key's path
(``stages[0].max_batch``) -- instead of a worker's traceback seconds later.

The schema holds no defaults: a key left out is :data:`msgspec.UNSET` here
and takes its default from the config's dataclasses (:mod:`stages.config`),
so every default is written once.

A model's own options (``[stages.model]``) are checked against its
constructor's annotations (:func:`check_option`); the aliases below
(:data:`PositiveInt`, ...) let a model say a range there, in the signature,
where a plug-in author writes it anyway.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Sequence
from typing import Annotated, Any, Literal

import msgspec
from msgspec import UNSET, Meta, Struct, UnsetType

from stages.placement import DEVICE_PATTERN
from stages.validation import Invalid, convert

__all__ = ["ANNOTATION_NAMES", "ConfigError", "ConfigFile", "NonNegativeFloat", "NonNegativeInt",
           "PipelineTable", "PositiveFloat", "PositiveInt", "StageTable", "check_file", "check_option",
           "set_fields"]

#: a count that must be at least 1 (tokens, frames, layers)
PositiveInt = Annotated[int, Meta(ge=1)]
#: a count that may be 0
NonNegativeInt = Annotated[int, Meta(ge=0)]
#: a quantity that must be above 0 (seconds, hertz)
PositiveFloat = Annotated[float, Meta(gt=0)]
#: a quantity that may be 0
NonNegativeFloat = Annotated[float, Meta(ge=0)]
#: a torch device: cpu, cuda or cuda:N (stages/placement.py)
Device = Annotated[str, Meta(pattern=DEVICE_PATTERN)]


class ConfigError(ValueError):
    """A config that does not fit the schema; the message names the key's path."""


class PipelineTable(Struct, forbid_unknown_fields=True, omit_defaults=True):
    """``[pipeline]``: settings of the whole pipeline."""

    final_stages: Annotated[list[NonNegativeInt], Meta(min_length=1)] | UnsetType = UNSET
    #: the same, by the name of the config's field (older files use it)
    final_stage_ids: Annotated[list[NonNegativeInt], Meta(min_length=1)] | UnsetType = UNSET
    async_chunk: bool | UnsetType = UNSET
    device: Device | UnsetType = UNSET
    seed: int | UnsetType = UNSET
    heartbeat_interval: NonNegativeFloat | UnsetType = UNSET
    heartbeat_timeout: PositiveFloat | UnsetType = UNSET
    startup_timeout: PositiveFloat | UnsetType = UNSET
    stop_grace: NonNegativeFloat | UnsetType = UNSET
    max_retries: NonNegativeInt | UnsetType = UNSET
    #: --worker-backend ray: Ray's placement strategy for the replicas' bundles, and whether one
    #: placement group holds the whole pipeline or each stage gets its own
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] | UnsetType = UNSET
    placement_scope: Literal["pipeline", "stage"] | UnsetType = UNSET


class StageTable(Struct, forbid_unknown_fields=True, omit_defaults=True):
    """One ``[[stages]]`` entry."""

    kind: Annotated[str, Meta(min_length=1)]
    replicas: NonNegativeInt | UnsetType = UNSET
    model: dict[str, Any] | UnsetType = UNSET
    max_batch: PositiveInt | UnsetType = UNSET
    max_inflight: NonNegativeInt | UnsetType | None = UNSET
    threads: PositiveInt | UnsetType = UNSET
    worker_args: list[str] | UnsetType = UNSET
    replica_args: dict[Annotated[str, Meta(pattern=r"^\d+$")], list[str]] | UnsetType = UNSET
    name: str | UnsetType = UNSET
    role: str | UnsetType = UNSET  # which roles a kind has: the registry says (naming them)
    resources: dict[str, NonNegativeFloat] | UnsetType = UNSET
    label_selector: dict[str, str] | UnsetType = UNSET  # Ray node labels (--worker-backend ray)
    #: this stage's device, or one per replica (None, or left out: the pipeline's)
    device: Device | Annotated[list[Device], Meta(min_length=1)] | UnsetType | None = UNSET


class ConfigFile(Struct, forbid_unknown_fields=True, omit_defaults=True):
    """A whole config file: a ``[pipeline]`` table (optional) and at least one ``[[stages]]``."""

    stages: Annotated[list[StageTable], Meta(min_length=1)]
    pipeline: PipelineTable = msgspec.field(default_factory=PipelineTable)


def _fields_at(path: str) -> list[str]:
    """The keys the schema allows at ``path`` (for a did-you-mean hint)."""
    target: type[Struct] = ConfigFile
    for part in re.sub(r"\[\d+\]", "", path).split("."):
        if not part:
            continue
        target = {"pipeline": PipelineTable, "stages": StageTable}.get(part, target)
    return list(target.__struct_fields__)


def _explain(exc: Invalid) -> str:
    """An error of the config's schema, its path first, in the config's own spelling."""
    where = exc.param or ""
    if exc.unknown is not None:
        what = "table" if not where else "key"
        close = difflib.get_close_matches(exc.unknown, _fields_at(where), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        at = f" in {where}" if where else ""
        return f"unknown {what} {exc.unknown!r}{at} (allowed: {', '.join(_fields_at(where))}){hint}"
    return f"{where}: {exc.detail}" if where else exc.detail


def check_file(data: Any) -> ConfigFile:
    """The parsed TOML layout, checked (ConfigError naming the key's path)."""
    if not isinstance(data, dict) or "stages" not in data:
        raise ConfigError("pipeline config: a [[stages]] table array with at least one stage is needed")
    try:
        checked = convert(data, ConfigFile)
    except Invalid as exc:
        raise ConfigError(f"pipeline config: {_explain(exc)}") from None
    pipe = checked.pipeline
    if pipe.final_stages is not UNSET and pipe.final_stage_ids is not UNSET:
        raise ConfigError("pipeline config: pipeline: final_stages and final_stage_ids are one setting; "
                          "give one")
    return checked


def set_fields(table: Struct) -> dict[str, Any]:
    """The keys a table sets (UNSET ones left out: they take the dataclass's default)."""
    return {f: v for f in table.__struct_fields__ if (v := getattr(table, f)) is not UNSET}


#: names a model constructor's annotations may use and still be checked without importing the model
ANNOTATION_NAMES: dict[str, Any] = {
    "int": int, "float": float, "str": str, "bool": bool, "list": list, "dict": dict, "tuple": tuple,
    "None": None, "Any": Any, "Literal": Literal, "Annotated": Annotated, "Meta": Meta,
    "Sequence": Sequence, "PositiveInt": PositiveInt, "NonNegativeInt": NonNegativeInt,
    "PositiveFloat": PositiveFloat, "NonNegativeFloat": NonNegativeFloat,
}


def check_option(kind: str, name: str, value: Any, annotation: Any) -> None:
    """``value`` fits the constructor's annotation of ``name`` (ConfigError naming the option).

    ``annotation`` is a type or the annotation's source text; text naming
    anything outside :data:`ANNOTATION_NAMES` (a torch type, say) is not
    checked here: the model judges it when it is built.
    """
    if isinstance(annotation, str):
        try:
            annotation = eval(annotation, {"__builtins__": {}}, dict(ANNOTATION_NAMES))  # names above only
        except Exception:
            return
    if annotation is Any or annotation is None:
        return
    try:
        convert(value, annotation)
    except Invalid as exc:
        raise ConfigError(f"model option {name!r} of {kind}: {_explain(exc)}") from None
    except TypeError:  # an annotation msgspec cannot check (a class of the model's own)
        return
