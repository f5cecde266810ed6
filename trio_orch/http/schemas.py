"""OpenAI request schemas, declared once as ``msgspec.Struct`` types, and what every route does with them.

A route decodes its body with :func:`parse_json_body` (the JSON itself:
invalid UTF-8, NaN/Infinity, integers too long to convert, nesting deeper
than a bound and lone surrogates anywhere are client errors, never a
traceback), then :func:`decode` converts it to its schema, as vLLM's
``protocol.py`` does with pydantic:

- a wrong type, a value out of range or a missing field is a 400
  (:class:`BadRequest`) naming the parameter by its path
  (``messages[0].role``), the message built from the schema itself;
- a field the schema does not know is accepted, ignored and logged once per
  request (vLLM's behaviour: clients that always send their own extras work);
- a field the schema knows but this server cannot honour (:data:`UNSUPPORTED`:
  ``tools``, ``n`` > 1, ``logprobs``, ...) is a 400 naming every such field.

:class:`OpenAIRequest` holds the fields every generation route shares (the
model, streaming, the sampling fields of :mod:`trio_orch.http.openai_sampling`);
:class:`ChatCompletionRequest` adds the chat route's.  :class:`ServedModels`
is the server's list of model names: a request naming another is a 404
``model_not_found`` (OpenAI's and vLLM's answer).
"""

from __future__ import annotations

import functools
import json
import logging
import re
import time
from collections.abc import Callable, Sequence
from typing import Annotated, Any, ClassVar, Literal, TypeVar

import msgspec
from msgspec import Meta, Struct
from msgspec import inspect as mi

__all__ = ["MAX_TOKENS", "UNSUPPORTED", "AudioOptions", "BadRequest", "ChatCompletionRequest", "ContentPart",
           "Message", "OpenAIRequest", "Scheduled", "ServedModels", "StreamOptions", "decode", "error_body",
           "parse_json_body", "type_name"]

log = logging.getLogger("trio_orch.serve.command")

#: the largest token budget a request may ask for (a 32-bit count: the stages' own caps apply below it)
MAX_TOKENS = 2**31 - 1

S = TypeVar("S", bound=Struct)


class BadRequest(ValueError):
    """A request that does not fit the schema; ``param`` names the offending field."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None
                 ) -> None:
        super().__init__(message)
        self.param = param
        self.status = status
        self.code = code


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    """OpenAI's error object: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


# ---------------------------------------------------------------- the JSON body
def _no_constant(name: str) -> Any:
    raise BadRequest(f"{name} is not a JSON number: send a finite number")


def parse_json_body(raw: bytes, max_depth: int = 32) -> Any:
    """Decode a request body; every way it can be malformed is a :class:`BadRequest`."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BadRequest(f"the request body is not valid UTF-8: {exc}", code="invalid_json") from None
    try:
        body = json.loads(text, parse_constant=_no_constant)
    except BadRequest:
        raise
    except json.JSONDecodeError as exc:
        raise BadRequest(f"malformed JSON in the request body: {exc}", code="invalid_json") from None
    except RecursionError:
        raise BadRequest(f"the request body nests deeper than {max_depth} levels",
                         code="invalid_json") from None
    except ValueError as exc:  # e.g. an integer literal too long to convert
        raise BadRequest(f"malformed JSON in the request body: {exc}", code="invalid_json") from None
    _check_tree(body, max_depth)
    return body


def _check_tree(body: Any, max_depth: int) -> None:
    """Depth bound, and no string (key or value) that is not valid Unicode text (a lone surrogate).

    A too-deep value is reported by its top-level field; a bad string by its full path.
    """
    stack: list[tuple[Any, str, str, int]] = [(body, "", "", 0)]
    while stack:
        value, path, top, depth = stack.pop()
        if isinstance(value, (dict, list)) and depth >= max_depth:
            raise BadRequest(f"the request body nests deeper than {max_depth} levels", top or None)
        if isinstance(value, dict):
            for k, v in value.items():
                sub = f"{path}.{k}" if path else str(k)
                _check_text(k, sub)
                stack.append((v, sub, top or sub, depth + 1))
        elif isinstance(value, list):
            stack.extend((v, f"{path}[{i}]", top, depth + 1) for i, v in enumerate(value))
        elif isinstance(value, str):
            _check_text(value, path)


def _check_text(value: str, param: str) -> None:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        shown = param.encode("utf-8", "backslashreplace").decode()
        raise BadRequest(f"'{shown}' is not valid Unicode text (it holds a lone surrogate such as \\ud800)",
                         shown) from None


def type_name(v: Any) -> str:
    """A decoded JSON value's type, as JSON calls it."""
    return {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}.get(
        type(v), "number" if isinstance(v, (int, float)) else type(v).__name__)


# ---------------------------------------------------------------- the schemas
TokenBudget = Annotated[int, Meta(ge=1, le=MAX_TOKENS)]
Seed = Annotated[int, Meta(ge=-(2**63), le=2**63 - 1, description="an integer that fits in a signed 64-bit "
                                                                  "integer")]
Role = Literal["system", "developer", "user", "assistant"]
#: a speaker's name: which names a pipeline takes is its stages' (``voice``), checked against them
Voice = Annotated[str, Meta(min_length=1, max_length=64)]


class StreamOptions(Struct, kw_only=True):
    include_usage: bool = False


class Scheduled(Struct, kw_only=True):
    """What every generation route takes: ``priority``, an int, lower values served first (vLLM's
    convention; default 0).  Anything else (``"high"``, 1.5, true) is a 400 naming it."""

    priority: int = 0


class OpenAIRequest(Scheduled, kw_only=True):
    """What every generation route takes: the model, streaming, ``user``, the sampling fields.

    The sampling fields (:meth:`sampling_fields`) are range-checked here only
    where OpenAI fixes the range; each stage checks its own parameters
    (:mod:`trio_orch.http.openai_sampling`).
    """

    model: Annotated[str, Meta(max_length=256)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    n: int | None = None
    max_tokens: TokenBudget | None = None
    temperature: Annotated[float, Meta(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Meta(ge=0.0, le=1.0)] | None = None
    top_k: int | None = None
    min_tokens: int | None = None
    stop: str | list[str] | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: Seed | None = None
    #: the extension: stage (kind or index) -> that stage's parameters, checked per stage
    stage_sampling: dict[str, Any] | None = None
    logit_bias: dict[str, Any] | None = None

    #: the fields :mod:`trio_orch.http.openai_sampling` maps to stages
    SAMPLING: ClassVar[tuple[str, ...]] = (
        "max_tokens", "temperature", "top_p", "top_k", "min_tokens", "stop", "frequency_penalty",
        "presence_penalty", "repetition_penalty", "seed", "stage_sampling")

    def sampling_fields(self) -> dict[str, Any]:
        """The sampling fields the client gave (None: not given)."""
        return {f: getattr(self, f) for f in type(self).SAMPLING if getattr(self, f) is not None}

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class ContentPart(Struct, kw_only=True):
    type: str
    text: str | None = None
    #: ``{"url": ...}`` of an ``image_url`` part, ``{"data", "format"}`` of an ``input_audio`` one
    #: (decoded by :mod:`trio_orch.http.media`)
    image_url: dict[str, Any] | None = None
    input_audio: dict[str, Any] | None = None


class Message(Struct, kw_only=True):
    role: Role
    content: Annotated[str | list[ContentPart] | None,
                       Meta(description="a string or an array of text parts")] = None
    name: str | None = None


class AudioOptions(Struct, kw_only=True):
    voice: Voice | None = None
    format: Literal["wav", "pcm16"] | None = None


class ChatCompletionRequest(OpenAIRequest, kw_only=True):
    """``POST /v1/chat/completions``."""

    messages: Annotated[list[Message], Meta(min_length=1)]
    modalities: list[str] | None = None
    audio: AudioOptions | None = None
    max_completion_tokens: TokenBudget | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    functions: list[Any] | None = None
    function_call: str | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    prediction: dict[str, Any] | None = None

    SAMPLING: ClassVar[tuple[str, ...]] = (*OpenAIRequest.SAMPLING, "max_completion_tokens")


_NO_TOOLS = "is not supported: this server has no tool calling"
#: fields a schema declares that this server cannot honour: name -> (is the value one it can, why not).
#: A route's schema may declare more of them (``echo``, ``best_of``, ...): add them here.  A schema whose
#: fields mean something else (the images route's ``response_format``) declares its own table as a
#: ``UNSUPPORTED`` class variable.
UNSUPPORTED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "n": (lambda v: v is None or v == 1, "only 'n': 1 is supported (one choice per request)"),
    "logprobs": (lambda v: not v, "'logprobs' is not supported: the stages report no log-probabilities"),
    "top_logprobs": (lambda v: not v, "'top_logprobs' is not supported: the stages report no "
                                      "log-probabilities"),
    "logit_bias": (lambda v: not v, "'logit_bias' is not supported"),
    "tools": (lambda v: not v, f"'tools' {_NO_TOOLS}"),
    "tool_choice": (lambda v: v in (None, "none", "auto"), f"'tool_choice' {_NO_TOOLS}"),
    "functions": (lambda v: not v, f"'functions' {_NO_TOOLS}"),
    "function_call": (lambda v: v in (None, "none", "auto"), f"'function_call' {_NO_TOOLS}"),
    "response_format": (lambda v: v is None or v == {"type": "text"},
                        "'response_format' is not supported other than {\"type\": \"text\"}"),
    "prediction": (lambda v: v is None, "'prediction' is not supported"),
}


# ---------------------------------------------------------------- decoding
def decode(body: Any, schema: type[S], *, what: str) -> S:
    """``body`` (decoded JSON) as ``schema``; unknown fields logged once and ignored.

    Raises :class:`BadRequest` for a value that does not fit (naming its path)
    and for fields of :data:`UNSUPPORTED` (or the schema's own table) set to
    what this server cannot do.
    """
    if not isinstance(body, dict):
        raise BadRequest(f"the request body must be a JSON object, got {type_name(body)}")
    info = _info(schema)
    try:
        req = msgspec.convert(body, schema, strict=True)
    except msgspec.ValidationError as exc:
        raise _explain(str(exc), body, info) from None
    ignored = _unknown(body, info, "")
    if ignored:
        log.warning("ignored unknown field%s in %s: %s", "s" if len(ignored) > 1 else "", what,
                    ", ".join(repr(f) for f in ignored))
    table: dict[str, tuple[Callable[[Any], bool], str]] = getattr(schema, "UNSUPPORTED", UNSUPPORTED)
    refused = [(name, why) for name, (ok, why) in table.items()
               if name in info_fields(info) and not ok(getattr(req, name))]
    if refused:
        raise BadRequest("; ".join(why for _, why in refused), refused[0][0], code="unsupported_parameter")
    return req


@functools.cache
def _info(schema: type[Struct]) -> mi.StructType:
    info = mi.type_info(schema)
    assert isinstance(info, mi.StructType)
    return info


def info_fields(info: mi.StructType) -> dict[str, mi.Field]:
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


def _steps(path: str) -> list[str | int | None]:
    """``$.messages[0].role`` -> ``["messages", 0, "role"]`` (a dict key msgspec does not show: None)."""
    return [m.group(1) if m.group(1) is not None else int(m.group(2)) if m.group(2) is not None else None
            for m in _STEP.finditer(path.removeprefix("$"))]


def _param(steps: Sequence[str | int | None]) -> str | None:
    out = ""
    for s in steps:
        out += f"[{s}]" if isinstance(s, int) else "[...]" if s is None else (f".{s}" if out else s)
    return out or None


def _walk(body: Any, info: mi.Type, steps: Sequence[str | int | None]) -> tuple[Any, mi.Type | None]:
    """The value and the declared type at ``steps`` (None where the schema says nothing)."""
    value: Any = body
    t: mi.Type | None = info
    for step in steps:
        members = _members(t)[0] if t is not None else []
        t = None
        if isinstance(step, str):
            value = value.get(step) if isinstance(value, dict) else None
            for m in members:
                if isinstance(m, mi.StructType) and step in info_fields(m):
                    t = info_fields(m)[step].type
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


def _explain(text: str, body: Any, info: mi.StructType) -> BadRequest:
    """msgspec's validation error as a :class:`BadRequest` in words from the schema."""
    msg, _, where = text.partition(" - at `")
    steps = _steps(where.rstrip("`") if where else "$")
    missing = re.fullmatch(r"Object missing required field `(.+)`", msg)
    if missing:
        param = _param([*steps, missing.group(1)])
        return BadRequest(f"'{param}' is required", param)
    param = _param(steps)
    value, t = _walk(body, info, steps)
    if msg.startswith("Invalid enum value") or ", got `" in msg:
        got = repr(value) if msg.startswith("Invalid enum value") else type_name(value)
        return BadRequest(f"'{param}' must be {_what(t)}, got {got}", param)
    if msg.startswith("Expected `"):
        return BadRequest(f"'{param}' {_limit(t, value)}", param)
    return BadRequest(f"'{param}': {msg}" if param else msg, param)


def _unknown(value: Any, t: mi.Type, path: str) -> list[str]:
    """The paths of every field in ``value`` its schema does not declare (ignored, logged)."""
    out: list[str] = []
    for m in _members(t)[0]:
        if isinstance(m, mi.StructType) and isinstance(value, dict):
            fields = info_fields(m)
            for k, v in value.items():
                sub = f"{path}.{k}" if path else k
                out += _unknown(v, fields[k].type, sub) if k in fields else [sub]
            return out
        if isinstance(m, mi.ListType) and isinstance(value, list):
            for i, v in enumerate(value):
                out += _unknown(v, m.item_type, f"{path}[{i}]")
            return out
    return out


# ---------------------------------------------------------------- the served models
class ServedModels:
    """The model names this server answers to (``--served-model-name``) and when it started.

    Answers carry the first name, whichever the request named (as vLLM's do).
    """

    def __init__(self, names: str | Sequence[str], created: int | None = None,
                 max_model_len: int | None = None) -> None:
        self.names = (names,) if isinstance(names, str) else tuple(names)
        if not self.names or not all(self.names):
            raise ValueError("at least one served model name is needed, none empty")
        self.created = int(time.time()) if created is None else created
        self.max_model_len = max_model_len  #: the model's context, as vLLM's model card shows it

    @property
    def name(self) -> str:
        return self.names[0]

    def resolve(self, requested: str | None) -> str:
        """The name an answer carries; a 404 ``model_not_found`` for a model not served here."""
        if requested is not None and requested not in self.names:
            raise BadRequest(f"The model `{requested}` does not exist (this server serves "
                             f"{', '.join(repr(n) for n in self.names)})", "model", 404, "model_not_found")
        return self.name

    def card(self, name: str) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": self.created, "owned_by": "trio-orch",
                "max_model_len": self.max_model_len}

    def listing(self) -> dict[str, Any]:
        """``GET /v1/models``."""
        return {"object": "list", "data": [self.card(n) for n in self.names]}
