"""The pipeline config's checks: the ranges a setting may declare, and its errors in words.

A config file is checked against its layout (:mod:`stages.config`, whose
``StageConfig`` and ``PipelineConfig`` declare each setting once, with its
type, range and default) before anything is built: a wrong type
(``max_new_tokens = "48"``), a value out of range (``max_batch = 0``), an
unknown key or a misspelt table (``[pipline]``) is a :class:`ConfigError`
whose message names the key's path (``stages[0].max_batch``) -- instead of a
worker's traceback seconds later.  msgspec's own error is taken apart by
:mod:`stages.validation` (the one translator the OpenAI request handling
uses too); :func:`explain` says it the config's way.

A model's own options (``[stages.model]``) are checked against its
constructor's annotations (:func:`check_option`); the aliases below
(:data:`PositiveInt`, ...) let a model say a range there, in the signature,
where a plug-in author writes it anyway.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import re
import sys
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import Annotated, Any, Literal

from msgspec import Meta, Struct

from stages.placement import DEVICE_PATTERN
from stages.validation import Invalid, convert

__all__ = ["ANNOTATION_NAMES", "MAX_SECONDS", "ConfigError", "Device", "NonNegativeFloat", "NonNegativeInt",
           "PositiveFloat", "PositiveInt", "PositiveSeconds", "Seconds", "check_fields", "check_option",
           "explain", "positive_seconds_arg", "seconds_arg"]

#: a count that must be at least 1 (tokens, frames, layers)
PositiveInt = Annotated[int, Meta(ge=1)]
#: a count that may be 0
NonNegativeInt = Annotated[int, Meta(ge=0)]
#: a quantity that must be above 0 (hertz, a resource amount); finite: nan and inf are refused
PositiveFloat = Annotated[float, Meta(gt=0, le=sys.float_info.max)]
#: a quantity that may be 0; finite
NonNegativeFloat = Annotated[float, Meta(ge=0, le=sys.float_info.max)]
#: the longest time a setting may give (about 31 years): any longer is a mistake, and ``inf`` (or
#: ``nan``, which no comparison stops) would make a timer that never fires or a deadline that crashes
MAX_SECONDS = 1e9
#: a time in seconds, 0 included (0 often means "none" or "at once"): finite, never negative
Seconds = Annotated[float, Meta(ge=0, le=MAX_SECONDS)]
#: a time in seconds that must be above 0 (a timeout, an interval that divides)
PositiveSeconds = Annotated[float, Meta(gt=0, le=MAX_SECONDS)]
#: a torch device: cpu, cuda or cuda:N (stages/placement.py)
Device = Annotated[str, Meta(pattern=DEVICE_PATTERN)]


class ConfigError(ValueError):
    """A config that does not fit the schema; the message names the key's path."""


def _time_arg(schema: Any, rule: str) -> Callable[[str], float]:
    def parse(text: str) -> float:
        try:
            return convert(float(text), schema)
        except (ValueError, Invalid):
            raise argparse.ArgumentTypeError(f"must be a finite number of seconds {rule} (at most "
                                             f"{MAX_SECONDS:g}), got {text!r}") from None

    return parse


#: a command-line time (``type=seconds_arg``): a :data:`Seconds`, else a usage error (exit 2) at once
seconds_arg = _time_arg(Seconds, ">= 0")
#: a command-line time that must be above 0 (:data:`PositiveSeconds`)
positive_seconds_arg = _time_arg(PositiveSeconds, "> 0")


def check_fields(obj: Any) -> None:
    """Each field of the dataclass ``obj`` fits its annotation (the ranges above): ValueError naming
    the first that does not.  For settings kept in a dataclass rather than a ``msgspec`` Struct, whose
    ranges msgspec checks only when it converts."""
    hints = typing.get_type_hints(type(obj), include_extras=True)
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        try:
            convert(value, hints[f.name])
        except Invalid as exc:
            raise ValueError(f"{f.name}: {exc.detail}, got {value!r}") from None


def explain(exc: Invalid, tables: Mapping[str, type[Struct]] | None = None,
            root: type[Struct] | None = None) -> str:
    """An error of a config's schema, its path first, in the config's own spelling.

    ``tables``: the table types by the key they sit under, and ``root`` the
    file's own, for the keys an unknown key is said next to (did you mean...).
    """
    where = exc.param or ""
    if exc.unknown is not None:
        what = "table" if not where else "key"
        allowed = _fields_at(where, tables or {}, root)
        close = difflib.get_close_matches(exc.unknown, allowed, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        at = f" in {where}" if where else ""
        return f"unknown {what} {exc.unknown!r}{at} (allowed: {', '.join(allowed)}){hint}"
    return f"{where}: {exc.detail}" if where else exc.detail


def _fields_at(path: str, tables: Mapping[str, type[Struct]], root: type[Struct] | None) -> list[str]:
    """The keys the schema allows at ``path``."""
    target = root
    for part in re.sub(r"\[\d+\]", "", path).split("."):
        if part:
            target = tables.get(part, target)
    return list(target.__struct_fields__) if target is not None else []


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
        raise ConfigError(f"model option {name!r} of {kind}: {explain(exc)}") from None
    except TypeError:  # an annotation msgspec cannot check (a class of the model's own)
        return
