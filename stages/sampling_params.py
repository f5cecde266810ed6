"""Per-request sampling parameters: what each stage kind takes, their defaults and ranges.

A request may carry parameters for every stage (``add_request(...,
sampling=...)``).  Each stage kind declares the parameters it takes as a
*schema*: a mapping ``name -> Param`` (the ``sampling`` column of its
:class:`stages.registry.StageSpec`).  The orchestrator checks a request's
parameters against the schema of each stage when it accepts the request, so
a typo or an out-of-range value is a ``ValueError`` before anything is
submitted; the worker checks them again (a message from any other client
gets the same answer) and hands the model the normalised parameters in
``ReqState.sampling``: only the keys the client gave, values normalised (an
int for a float becomes a float, a single stop string becomes a list).  The
model fills in its defaults with :func:`with_defaults`.

This module imports neither torch nor trio: the orchestrator, the HTTP front
and ``generate`` read it.  The sampling itself (torch) is :mod:`stages.sampling`.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

__all__ = ["CODE2WAV_PARAMS", "HF_PARAMS", "NO_PARAMS", "TALKER_PARAMS", "THINKER_PARAMS", "VOICES", "Param",
           "SamplingSchema", "StageParams", "check_params", "checker", "describe", "voice_index",
           "with_defaults"]

#: The speakers of the talker and vocoder (OpenAI's voice names); a voice is a row of a
#: speaker-embedding table, so the same text in another voice gives other codes and audio.
VOICES: tuple[str, ...] = ("alloy", "ash", "ballad", "coral", "echo", "fable", "nova", "onyx", "sage",
                           "shimmer", "verse")

SEED_MAX = 2**63 - 1
#: the integers the wire carries (msgpack's signed 64 bits): any int parameter is one of them
WIRE_INTS = range(-(2**63), 2**63)


@dataclass(frozen=True)
class Param:
    """One sampling parameter.

    ``type``: ``"float"``, ``"int"``, ``"choice"`` (a string of ``choices``),
    ``"strings"`` (one string or a list of them, each ``1..hi`` characters) or
    ``"ints"`` (a list of ints in ``lo..hi``).  ``lo``/``hi`` bound a number
    (``lo_open``: ``lo`` itself is excluded); ``max_items`` bounds a list.
    ``default`` is what the stage uses when the request does not say; None
    with ``doc`` saying where it comes from (a model option, "no seed").
    """

    type: str
    default: Any
    doc: str
    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    choices: tuple[str, ...] = ()
    max_items: int = 0

    def check(self, name: str, value: Any) -> Any:
        """The normalised value, or ValueError naming ``name``."""
        t = self.type
        if t in ("float", "int"):
            wanted = (int,) if t == "int" else (int, float)
            if isinstance(value, bool) or not isinstance(value, wanted):
                raise ValueError(f"{name!r} must be {'an integer' if t == 'int' else 'a number'}, "
                                 f"got {_what(value)}")
            if t == "float" and not math.isfinite(value):
                raise ValueError(f"{name!r} must be a finite number, got {value!r}")
            if t == "int" and value not in WIRE_INTS:
                raise ValueError(f"{name!r} must fit in a signed 64-bit integer, got {value!r}")
            if not self._in_range(value):
                raise ValueError(f"{name!r} must be {self.range_text()}, got {value!r}")
            return float(value) if t == "float" else int(value)
        if t == "choice":
            if value not in self.choices:
                raise ValueError(f"{name!r} must be one of {', '.join(self.choices)}, got {value!r}")
            return value
        if t == "strings":
            items = [value] if isinstance(value, str) else value
            if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
                raise ValueError(f"{name!r} must be a string or a list of strings, got {_what(value)}")
            bad = next((s for s in items if not s or (self.hi is not None and len(s) > self.hi)), None)
            if bad is not None:
                raise ValueError(f"{name!r}: each string must have 1 to {_num(self.hi)} characters, "
                                 f"got {bad!r}")
        elif t == "ints":
            items = value
            if not isinstance(items, list) or not all(isinstance(v, int) and not isinstance(v, bool)
                                                      for v in items):
                raise ValueError(f"{name!r} must be a list of integers, got {_what(value)}")
            bad = next((v for v in items if not self._in_range(v) or v not in WIRE_INTS), None)
            if bad is not None:
                raise ValueError(f"{name!r}: each entry must be {self.range_text()} (and a signed 64-bit "
                                 f"integer), got {bad!r}")
        else:
            raise ValueError(f"{name!r} has an unknown parameter type {t!r}")
        if self.max_items and len(items) > self.max_items:
            raise ValueError(f"{name!r} takes at most {self.max_items} entries, got {len(items)}")
        return list(items)

    def _in_range(self, v: float) -> bool:
        lo, hi = self.lo, self.hi
        if lo is not None and (v <= lo if self.lo_open else v < lo):
            return False
        return hi is None or v <= hi

    def range_text(self) -> str:
        """The allowed values, for error messages and the documentation."""
        lo, hi = _num(self.lo), _num(self.hi)
        if lo is None and hi is None:
            return "any value"
        if hi is None:
            return f"{'>' if self.lo_open else '>='} {lo}"
        if lo is None:
            return f"<= {hi}"
        return f"in {'(' if self.lo_open else '['}{lo}, {hi}]"


SamplingSchema = Mapping[str, Param]

#: The schema of a stage that takes no sampling parameters.
NO_PARAMS: SamplingSchema = MappingProxyType({})


def _freeze(params: dict[str, Param]) -> SamplingSchema:
    return MappingProxyType(params)


_SEED = Param("int", None, "per-request RNG seed: the same seed and parameters give the same "
              "output, alone or batched with other requests (default: drawn from the worker's seed)",
              lo=0, hi=SEED_MAX)
_TEMPERATURE = "0: greedy (argmax); higher: flatter"
_VOICE = Param("choice", "alloy", "speaker: selects a row of the speaker-embedding table", choices=VOICES)

#: The thinker (text LM; a token is one byte, its text one printable ASCII character).
THINKER_PARAMS = _freeze({
    "temperature": Param("float", 0.9, f"{_TEMPERATURE} (default: the model option `temperature`, 0.9)",
                         lo=0.0, hi=2.0),
    "top_p": Param("float", 1.0, "nucleus sampling: keep the most likely tokens up to this mass",
                   lo=0.0, hi=1.0, lo_open=True),
    "top_k": Param("int", 0, "keep the k most likely tokens (0: all)", lo=0),
    "repetition_penalty": Param("float", 1.0, "divide the logit of every token already in the prompt or "
                                "the output by this (multiply if negative); 1: off", lo=0.0, hi=10.0,
                                lo_open=True),
    "frequency_penalty": Param("float", 0.0, "subtract this times the token's count in the output",
                               lo=-2.0, hi=2.0),
    "presence_penalty": Param("float", 0.0, "subtract this from every token already in the output",
                              lo=-2.0, hi=2.0),
    "seed": _SEED,
    "max_tokens": Param("int", None, "most tokens generated (default and cap: the model option "
                        "`max_new_tokens`, 48)", lo=1),
    "min_tokens": Param("int", None, "no end-of-text before this many tokens (default: the model option "
                        "`min_new_tokens`, 8)", lo=0),
    "stop": Param("strings", [], "stop strings: the text ends before the first one generated "
                  "(it is not emitted)", hi=64, max_items=16),
    "stop_token_ids": Param("ints", [], "token ids that end the text like end-of-text (not emitted); "
                            "0-255 are bytes, 256 end-of-text", lo=0, hi=256, max_items=16),
})

#: A checkpoint's text model (``hf-causal-lm``): vLLM's parameters and defaults -- a default not
#: given here is the checkpoint's ``generation_config.json`` value, as vLLM's ``--generation-config auto``
HF_PARAMS = _freeze({
    "temperature": Param("float", None, f"{_TEMPERATURE} (default: generation_config.json's, else 1.0)",
                         lo=0.0, hi=2.0),
    "top_p": Param("float", None, "nucleus sampling: keep the most likely tokens up to this mass "
                   "(default: generation_config.json's, else 1.0)", lo=0.0, hi=1.0, lo_open=True),
    "top_k": Param("int", None, "keep the k most likely tokens (0 or -1: all; default: "
                   "generation_config.json's, else all)", lo=-1),
    "repetition_penalty": Param("float", None, "divide the logit of every token already in the prompt or the "
                                "output by this (multiply if negative); 1: off (default: "
                                "generation_config.json's, else 1)", lo=0.0, hi=10.0, lo_open=True),
    "frequency_penalty": THINKER_PARAMS["frequency_penalty"],
    "presence_penalty": THINKER_PARAMS["presence_penalty"],
    "seed": _SEED,
    "max_tokens": Param("int", None, "most tokens generated (default: generation_config.json's "
                        "max_new_tokens, else as many as the context holds after the prompt)", lo=1),
    "min_tokens": Param("int", 0, "no end-of-text or stop token before this many tokens", lo=0),
    "stop": THINKER_PARAMS["stop"],
    "stop_token_ids": Param("ints", [], "token ids that end the text like end-of-text (not emitted); "
                            "each must be in the model's vocabulary", lo=0, hi=2**31 - 1, max_items=64),
})

#: The talker (speech codes; one token of its input -> frames of codes).
TALKER_PARAMS = _freeze({
    "temperature": Param("float", 0.0, f"{_TEMPERATURE}; the default keeps the codes a function of the "
                         "text and voice", lo=0.0, hi=2.0),
    "top_p": THINKER_PARAMS["top_p"],
    "top_k": Param("int", 0, "keep the k most likely codes (0: all)", lo=0),
    "repetition_penalty": Param("float", 1.0, "penalise codes already produced in the same codebook; 1: off",
                                lo=0.0, hi=10.0, lo_open=True),
    "seed": _SEED,
    "max_tokens": Param("int", None, "most code frames generated; the rest of the input is skipped "
                        "(default: no limit but the model's context)", lo=1),
    "voice": _VOICE,
})

#: The vocoder.
CODE2WAV_PARAMS = _freeze({
    "voice": Param("choice", "alloy", "speaker: conditions the vocoder and sets the pitch", choices=VOICES),
})


@dataclass(frozen=True)
class StageParams:
    """One stage of a pipeline as requests see it: its name (the kind) and what it takes."""

    name: str
    schema: SamplingSchema


def check_params(name: str, schema: SamplingSchema, params: Any) -> dict[str, Any]:
    """``params`` checked against ``schema``: the normalised dict, or ValueError naming the key.

    ``name`` is the stage's name (its kind) for the message.  Keys set to None are
    dropped (the stage's default applies).
    """
    if not isinstance(params, Mapping):
        raise ValueError(f"{name}: sampling parameters must be a mapping of name -> value, "
                         f"got {_what(params)}")
    out: dict[str, Any] = {}
    for key, value in params.items():
        if key not in schema:
            accepted = sorted(schema)
            close = difflib.get_close_matches(str(key), accepted, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            what = f"its parameters: {', '.join(accepted)}" if accepted else "it takes none"
            raise ValueError(f"{name} takes no sampling parameter {key!r} ({what}){hint}")
        if value is None:
            continue
        try:
            out[key] = schema[key].check(key, value)
        except ValueError as exc:
            raise ValueError(f"{name}: {exc}") from None
    return out


def checker(stages: Sequence[StageParams]) -> Callable[[int, Any], dict[str, Any]]:
    """The orchestrator's ``check_sampling(stage_id, params)`` hook for a pipeline of these stages."""
    table = list(stages)

    def check_sampling(stage_id: int, params: Any) -> dict[str, Any]:
        st = table[stage_id]
        return check_params(st.name, st.schema, params)

    return check_sampling


def with_defaults(schema: SamplingSchema, params: Mapping[str, Any] | None,
                  **model_defaults: Any) -> dict[str, Any]:
    """Every parameter of ``schema``: the request's value, else the model's default, else the schema's."""
    out = {k: p.default for k, p in schema.items()}
    out.update(model_defaults)
    out.update(params or {})
    return out


def voice_index(voice: str) -> int:
    """The row of ``voice`` in the speaker tables (ValueError for an unknown voice)."""
    try:
        return VOICES.index(voice)
    except ValueError:
        raise ValueError(f"unknown voice {voice!r} (voices: {', '.join(VOICES)})") from None


def describe(schema: SamplingSchema) -> list[tuple[str, str, str, str]]:
    """``(name, allowed values, default, meaning)`` rows, for help texts and documentation."""
    rows = []
    for name, p in schema.items():
        allowed = {"choice": ", ".join(p.choices) or "set by the model it loads",
                   "strings": f"string or list of <= {p.max_items} strings",
                   "ints": f"list of <= {p.max_items} ints {p.range_text()}"}.get(p.type, p.range_text())
        rows.append((name, allowed, "-" if p.default is None else repr(p.default), p.doc))
    return rows


def _num(v: float | None) -> str | None:
    """A bound as written: integers in full (a seed's bound is 2**63 - 1), others shortest."""
    if v is None:
        return None
    return str(int(v)) if float(v).is_integer() and abs(v) < 2**64 else f"{v:g}"


def _what(v: Any) -> str:
    return f"{type(v).__name__} {v!r}" if not isinstance(v, (list, dict)) else type(v).__name__
