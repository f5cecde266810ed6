"""The one validator of OpenAI requests: the JSON body, then its schema, every refusal a :class:`BadRequest`.

A route decodes its body with :func:`parse_json_body` (the JSON itself:
invalid UTF-8, NaN/Infinity, integers too long to convert, nesting deeper
than a bound and lone surrogates anywhere are client errors, never a
traceback), then :func:`decode` converts it to its schema
(:mod:`trio_orch.openai.protocol`), as vLLM's ``protocol.py`` does with
pydantic:

- a wrong type, a value out of range or a missing field is a 400
  (:class:`BadRequest`) naming the parameter by its path
  (``messages[0].role``), the message built from the schema itself
  (msgspec's error taken apart by :mod:`stages.validation`, the one
  translator the pipeline config's errors use too);
- a field the schema does not know is accepted, ignored and logged once per
  request (vLLM's behaviour: clients that always send their own extras work)
  -- unless the schema forbids unknown fields (the admin routes'): then it
  is a 400 naming it;
- a field the schema knows but this server cannot honour (the schema's
  ``UNSUPPORTED`` table: ``tools``, ``n`` > 1, ``logprobs``, ...) is a 400
  naming every such field.

No web framework here: the HTTP routes and the command line use it alike.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any, TypeVar

from msgspec import Struct

from stages.validation import Invalid, convert, type_name, unknown_fields

__all__ = ["BadRequest", "Unsupported", "decode", "error_body", "parse_json_body"]

log = logging.getLogger("trio_orch.openai")

S = TypeVar("S", bound=Struct)

#: a schema's table of fields it declares but this server cannot honour: name -> (is the value one it
#: can, why not); a schema's ``UNSUPPORTED`` class variable
Unsupported = dict[str, tuple[Callable[[Any], bool], str]]


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


def decode(body: Any, schema: type[S], *, what: str) -> S:
    """``body`` (decoded JSON) as ``schema``; see the module docstring.

    ``what`` names the request in the log line of its unknown fields.
    """
    if not isinstance(body, dict):
        raise BadRequest(f"the request body must be a JSON object, got {type_name(body)}")
    try:
        req = convert(body, schema)
    except Invalid as exc:
        raise BadRequest(str(exc), exc.param) from None
    ignored = unknown_fields(body, schema)
    if ignored:
        log.warning("ignored unknown field%s in %s: %s", "s" if len(ignored) > 1 else "", what,
                    ", ".join(repr(f) for f in ignored))
    table: Unsupported = getattr(schema, "UNSUPPORTED", {})
    refused = [(name, why) for name, (ok, why) in table.items()
               if name in schema.__struct_fields__ and not ok(getattr(req, name))]
    if refused:
        raise BadRequest("; ".join(why for _, why in refused), refused[0][0], code="unsupported_parameter")
    return req
