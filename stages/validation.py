"""The one translator of msgspec's validation errors: where the bad value is, and what is wrong with it.

msgspec says what it refused in one line (``Expected `int` >= 1 - at
`$.stages[0].max_batch```).  :func:`convert` checks data against a schema
(a ``msgspec.Struct``, or any type msgspec converts to) and raises
:class:`Invalid`, which says it three ways, read from that line and from the
schema itself (``msgspec.inspect``):

- ``param``: the path in the data's own spelling (``stages[0].max_batch``,
  ``messages[0].role``; a dict key msgspec does not show is ``[...]``);
- ``detail``: msgspec's own words without the path (``expected `int` >= 1``):
  what the pipeline config's errors say (:mod:`stages.schema`);
- ``words``: the same said from the schema, for an API client
  (``'max_tokens' must be between 1 and 2147483647``, ``'messages[0].role'
  must be one of [...], got 'robot'``, ``'messages' is required``): what the
  OpenAI request handling answers.

``unknown`` names a field a schema that forbids unknown fields refused.
:func:`unknown_fields` lists, anywhere in the data, the fields a schema does
not declare (the OpenAI routes ignore them and log them).

This module imports only msgspec: the worker side's config schema and the
head's request handling share it, so a msgspec message is taken apart in one
place.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence
from typing import Any, TypeVar

import msgspec
from msgspec import inspect as mi

__all__ = ["Invalid", "convert", "type_name", "unknown_fields"]

T = TypeVar("T")

Step = str | int | None  #: a field name, a list index, or a dict key msgspec does not show


class Invalid(ValueError):
    """Data that does not fit its schema; see the module docstring.  ``str()`` is ``words``."""

    def __init__(self, words: str, param: str | None, detail: str, unknown: str | None = None) -> None:
        super().__init__(words)
        self.words = words
        self.param = param
        self.detail = detail
        self.unknown = unknown


def type_name(v: Any) -> str:
    """A decoded JSON (or TOML) value's type, as JSON calls it."""
    return {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}.get(
        type(v), "number" if isinstance(v, (int, float)) else type(v).__name__)


def convert(data: Any, schema: type[T] | Any, *, strict: bool = True, str_keys: bool = False) -> T:
    """``data`` as ``schema`` (``msgspec.convert``; ``str_keys``: its dict keys are strings, as TOML's
    are, converted to the declared key type); :class:`Invalid` when it does not fit."""
    try:
        return msgspec.convert(data, schema, strict=strict, str_keys=str_keys)
    except msgspec.ValidationError as exc:
        raise _explain(str(exc), data, _info(schema)) from None


def _info(schema: Any) -> mi.Type:
    try:
        return _cached_info(schema)
    except TypeError:  # an unhashable annotation: read it each time
        return mi.type_info(schema)


@functools.cache
def _cached_info(schema: Any) -> mi.Type:
    return mi.type_info(schema)


def _fields(info: mi.StructType) -> dict[str, mi.Field]:
    return {f.encode_name: f for f in info.fields}


def _members(t: mi.Type) -> tuple[list[mi.Type], str | None]:
    """A type's alternatives (unions and metadata unwrapped) and its description, if it has one."""
    description = None
    while isinstance(t, mi.Metadata):
        description = (t.extra_json_schema or {}).get("description", description)
        t = t.type
    if isinstance(t, mi.UnionType):
        out: list[mi.Type] = []
        for member in t.types:
            inner, desc = _members(member)
            out += inner
            description = description or desc
        return out, description
    return [t], description


_STEP = re.compile(r"\.([^.\[]+)|\[(\d+)\]|\[\.\.\.\]")


def _steps(path: str) -> list[Step]:
    """``$.messages[0].role`` -> ``["messages", 0, "role"]`` (a dict key msgspec does not show: None)."""
    return [m.group(1) if m.group(1) is not None else int(m.group(2)) if m.group(2) is not None else None
            for m in _STEP.finditer(path.removeprefix("$"))]


def _param(steps: Sequence[Step]) -> str | None:
    out = ""
    for s in steps:
        out += f"[{s}]" if isinstance(s, int) else "[...]" if s is None else (f".{s}" if out else s)
    return out or None


def _walk(data: Any, info: mi.Type, steps: Sequence[Step]) -> tuple[Any, mi.Type | None]:
    """The value and the declared type at ``steps`` (None where the schema says nothing)."""
    value: Any = data
    t: mi.Type | None = info
    for step in steps:
        members = _members(t)[0] if t is not None else []
        t = None
        if isinstance(step, str):
            value = value.get(step) if isinstance(value, dict) else None
            for m in members:
                if isinstance(m, mi.StructType) and step in _fields(m):
                    t = _fields(m)[step].type
                elif isinstance(m, mi.DictType):
                    t = m.value_type
        else:
            value = value[step] if isinstance(value, list) and isinstance(step, int) else None
            t = next((m.item_type for m in members if isinstance(m, mi.ListType)), None)
    return value, t


def _what(t: mi.Type | None) -> str:
    """What a value of type ``t`` must be, in words."""
    if t is None:
        return "a valid value"
    members, description = _members(t)
    if description:
        return description
    words: list[str] = []
    for m in members:
        word = {mi.IntType: "an integer", mi.FloatType: "a number", mi.BoolType: "a boolean",
                mi.StrType: "a string", mi.ListType: "an array", mi.DictType: "an object",
                mi.StructType: "an object"}.get(type(m))
        if isinstance(m, mi.LiteralType):
            word = f"one of {sorted(m.values, key=str)}"
        if word is not None and word not in words:
            words.append(word)
    return " or ".join(words) or "null"


def _limit(t: mi.Type | None, value: Any) -> str:
    """Why ``value`` (of the right type) is out of ``t``'s range, in words."""
    members, description = _members(t) if t is not None else ([], None)
    if description:
        return f"must be {description}"
    for m in members:
        if isinstance(m, (mi.IntType, mi.FloatType)) and isinstance(value, (int, float)):
            lo = m.ge if m.ge is not None else m.gt
            hi = m.le if m.le is not None else m.lt
            if lo is not None and hi is not None:
                return f"must be between {lo} and {hi}"
            return f"must be >= {lo}" if lo is not None else f"must be <= {hi}"
        if isinstance(m, (mi.StrType, mi.ListType)) and isinstance(value, (str, list)):
            unit = "characters" if isinstance(value, str) else "items"
            if m.max_length is not None and len(value) > m.max_length:
                return f"is longer than {m.max_length} {unit}"
            if m.min_length == 1:
                return "must not be empty"
            return f"is shorter than {m.min_length} {unit}"
    return "is out of range"


def _explain(text: str, data: Any, info: mi.Type) -> Invalid:
    """msgspec's validation message as an :class:`Invalid`."""
    msg, _, where = text.partition(" - at `")
    steps = _steps(where.rstrip("`") if where else "$")
    detail = msg[:1].lower() + msg[1:]
    missing = re.fullmatch(r"Object missing required field `(.+)`", msg)
    if missing:
        param = _param([*steps, missing.group(1)])
        return Invalid(f"'{param}' is required", param, detail)
    unknown = re.fullmatch(r"Object contains unknown field `(.+)`", msg)
    if unknown:
        name = unknown.group(1)
        return Invalid(f"'{_param([*steps, name])}' is not a known field", _param(steps), detail, name)
    param = _param(steps)
    value, t = _walk(data, info, steps)
    if msg.startswith("Invalid enum value") or ", got `" in msg:
        got = repr(value) if msg.startswith("Invalid enum value") else type_name(value)
        return Invalid(f"'{param}' must be {_what(t)}, got {got}", param, detail)
    if msg.startswith("Expected `"):
        return Invalid(f"'{param}' {_limit(t, value)}", param, detail)
    return Invalid(f"'{param}': {detail}" if param else detail, param, detail)


def unknown_fields(data: Any, schema: Any) -> list[str]:
    """The paths of every field in ``data`` that ``schema`` does not declare, in the data's order."""
    return _unknown(data, _info(schema), "")


def _unknown(value: Any, t: mi.Type, path: str) -> list[str]:
    out: list[str] = []
    for m in _members(t)[0]:
        if isinstance(m, mi.StructType) and isinstance(value, dict):
            fields = _fields(m)
            for k, v in value.items():
                sub = f"{path}.{k}" if path else k
                out += _unknown(v, fields[k].type, sub) if k in fields else [sub]
            return out
        if isinstance(m, mi.ListType) and isinstance(value, list):
            for i, v in enumerate(value):
                out += _unknown(v, m.item_type, f"{path}[{i}]")
            return out
    return out
