"""Stage kinds: one table from a kind name to everything that is kind-specific.

A *kind* names a stage model.  The built-in kinds are the rows of :data:`KINDS`;
any other kind is a plug-in named by import path, ``"package.module:Class"``,
whose class declares its own row (a ``stage_spec`` class attribute).  Whatever
differs between kinds is read from here, and nowhere else:

- config validation: is the kind known, do its ``[stages.model]`` options fit
  the model's constructor, does it have the stage's role (:func:`check_stage`,
  before any worker starts);
- the worker: ``--kind`` and building the model (:func:`build_model`);
- the orchestrator: ``forward_fn`` and ``prewarm_fn`` (:func:`forward_fn`,
  :func:`prewarm_fn`), from each row's ``next_input`` (with the request's
  companions where the kind conditions on them) and ``prewarm_input``;
- ``generate`` and ``serve``: how a stage's outputs are shown (``output``,
  :func:`as_text`, :func:`as_audio`, :func:`text_stage`), the media a chat
  may carry to it (:func:`input_media`), whether it reads tokens and can be
  told what to say (:func:`reads_tokens`, :func:`says`);
- per-request sampling parameters: what each kind takes, checked when a request
  is accepted and again in the worker (``sampling``, :func:`stage_params`,
  :func:`check_sampling`; the parameters themselves are in :mod:`stages.sampling_params`).

A kind may also be split into *roles* (:data:`ROLES`): the thinker into a
``prefill`` and a ``decode`` stage (prefill/decode disaggregation).  A role
has its own row (model class, output, forward) and takes its kind's options.

This module imports neither torch nor trio: a model class is imported when it
is built (in the worker) or, for a plug-in, when it is checked.  A built-in
kind's options are checked against its constructor by reading the model's
source (``ast``), so checking a config never imports torch.
"""

from __future__ import annotations

import ast
import difflib
import importlib
import importlib.util
import inspect
import json
import os
import re
import sys
import typing
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import cache
from typing import Any

import numpy as np

from stages.base import StageModel
from stages.fit import SizeFn, Sizes, causal_lm_sizes, code2wav_sizes, talker_sizes, thinker_sizes
from stages.forwarding import (
    codes_input,
    encoding_input,
    kv_handoff_input,
    last_output,
    placeholder_input,
    tokens_input,
)
from stages.hf.omni.forwarding import talker_input
from stages.hf.omni.params import schema_for, talker_params, thinker_params, token2wav_params
from stages.media import audio_features_input, image_features_input
from stages.sampling_params import (
    CODE2WAV_PARAMS,
    HF_PARAMS,
    NO_PARAMS,
    TALKER_PARAMS,
    THINKER_PARAMS,
    Param,
    SamplingSchema,
    StageParams,
    checker,
)
from stages.schema import ConfigError, check_option

__all__ = ["KINDS", "MODALITIES", "ROLES", "KindError", "StageSpec", "as_audio", "as_text", "build_model",
           "check_kind_name", "check_sampling", "check_stage", "forward_fn", "full_options", "image_of",
           "input_media", "model_class", "outputs_of", "pcm_of", "prewarm_fn", "reads_tokens",
           "sampling_schema", "says", "source_root", "spec_for", "stage_params", "stage_sizes",
           "takes_companions", "text_of", "text_stage"]

#: What a stage's output ``data`` is, and so how ``generate`` and ``serve`` show it.
MODALITIES: dict[str, str] = {
    "text": "{'text': str, ...} or a str: streamed to the user as text",
    "audio": "{'pcm': float32[samples], 'sample_rate': int}: written to the WAV, sent as audio",
    "codes": "intermediate codes or tokens for the next stage: never shown to the user",
    "embedding": "conditioning vectors for the next stage (a text encoder's): never shown to the user",
    "image": "{'png': bytes, 'width': int, 'height': int, ...} when finished, {'progress': {'step': int, "
             "'steps': int}} before: written as a PNG, progress shown",
    "data": "not declared: shown by its shape (text if it looks like text, audio if like audio)",
}

#: ``next_input(prompt, outputs)``, or ``next_input(prompt, outputs, *, companions)`` for a kind
#: that conditions on companion requests (see :func:`takes_companions`)
ForwardInput = Callable[..., Any]
PrewarmInput = Callable[[int, Any], Any]

_FILLED = ("device", "seed", "slots")  # passed by the worker when the constructor declares them
_RESERVED = ("device", "seed")  # [pipeline] settings, never [stages.model] options
_INTERFACE = ("admit", "feed", "runnable", "step", "warmup", "release", "info")
_PATH = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*")


class KindError(ValueError):
    """A stage kind that cannot be used: unknown, a bad import path, options that do not fit, no such role."""


@dataclass(frozen=True)
class StageSpec:
    """One row: what a stage kind means outside its worker.

    ``output``: a key of :data:`MODALITIES`.  ``next_input(prompt, outputs)``:
    normal mode, this stage's outputs for a request (every ``data``, in order)
    -> the next stage's input; declaring a ``companions`` keyword makes the
    kind condition on companion requests (``{id: [data values]}`` of each, at
    this stage).  ``prewarm_input(stage_id, prompt)``: async-chunk
    mode, what this stage is submitted when it is stage >= 1 (its real input
    streams in as chunks).  Both run in the orchestrator process, never in a
    worker, and must not raise for well-formed outputs.  ``sampling``: the
    per-request sampling parameters the kind takes (name -> :class:`Param`;
    default: none, so any parameter sent to it is refused).  ``model`` is the
    ``"module:Class"`` path, imported only when needed; ``kind`` the name;
    ``role`` the role of a split kind (:data:`ROLES`), else empty.  ``media``:
    the medium a chat part may carry that this kind encodes ("image", "audio",
    or a tuple of both; :mod:`stages.media`), else empty: a pipeline takes the
    media its stages encode.
    ``tokens``: how the kind reads text, for a front that counts or feeds its
    tokens -- ``"text"`` (it tokenizes text itself: with the tokenizer its
    workers report, else the byte-level one of :mod:`stages.tokenizer`),
    ``"ids"`` (it reads the token ids such a stage makes), else empty.
    ``says``: it can be told what to say (a payload's ``say`` is forced as its
    answer: the speech route speaks its input through it).
    ``sizes``: what the kind emits to the next stage and reads from the one
    before (:mod:`stages.fit`), from its options with the constructor's
    defaults filled in; None: nothing declared, nothing checked.
    ``sampling_for``: the kind's sampling parameters for a stage's options,
    where they depend on the model it loads (a checkpoint's speakers are its
    ``voice`` choices); None: ``sampling`` whatever the options.
    """

    output: str = "data"
    next_input: ForwardInput = last_output
    prewarm_input: PrewarmInput = placeholder_input
    sampling: SamplingSchema = field(default_factory=lambda: NO_PARAMS)
    model: str = ""
    kind: str = ""
    role: str = ""
    media: str | tuple[str, ...] = ""
    tokens: str = ""
    says: bool = False
    sizes: SizeFn | None = None
    sampling_for: Callable[[Mapping[str, Any]], SamplingSchema] | None = None


#: The built-in kinds.  Adding one: a row here, the model class, a test.
KINDS: dict[str, StageSpec] = {kind: replace(spec, kind=kind) for kind, spec in {
    "echo": StageSpec("data", model="stages.base:EchoModel"),
    "thinker": StageSpec("text", tokens_input, sampling=THINKER_PARAMS, model="stages.toy.models:Thinker",
                         sizes=thinker_sizes, tokens="text", says=True),
    "talker": StageSpec("codes", codes_input, sampling=TALKER_PARAMS, model="stages.toy.models:Talker",
                        sizes=talker_sizes, tokens="ids"),
    "code2wav": StageSpec("audio", sampling=CODE2WAV_PARAMS, model="stages.toy.models:Code2Wav",
                          sizes=code2wav_sizes),
    "encoder": StageSpec("embedding", encoding_input, model="stages.toy.encoder:ThinkerEncoder"),
    "diffusion": StageSpec("image", model="stages.toy.diffusion:Diffusion"),
    "image-encoder": StageSpec("embedding", image_features_input,
                               model="stages.toy.media_encoders:ImageEncoder", media="image"),
    "audio-encoder": StageSpec("embedding", audio_features_input,
                               model="stages.toy.media_encoders:AudioEncoder", media="audio"),
    # a Hugging Face causal LM from a local checkpoint directory (the hf extra): real weights
    "hf-causal-lm": StageSpec("text", tokens_input, sampling=HF_PARAMS,
                              model="stages.hf.causal_lm:HFCausalLM", sizes=causal_lm_sizes, tokens="text"),
    # Qwen2.5-Omni from a local checkpoint, one part per stage (stages.hf.omni; the hf extra)
    "omni-thinker": StageSpec("text", talker_input, sampling=thinker_params(()), media=("image", "audio"),
                              model="stages.hf.omni.thinker:OmniThinker", tokens="text", says=True,
                              sampling_for=schema_for("thinker")),
    "omni-talker": StageSpec("codes", codes_input, sampling=talker_params(()),
                             model="stages.hf.omni.talker:OmniTalker", sampling_for=schema_for("talker")),
    "omni-token2wav": StageSpec("audio", sampling=token2wav_params(()),
                                model="stages.hf.omni.token2wav:OmniToken2Wav",
                                sampling_for=schema_for("token2wav")),
}.items()}

#: Kinds split over two stages, (kind, role) -> row.  Prefill/decode disaggregation: the
#: prefill stage computes a request's KV cache and hands it, worker to worker, to the decode
#: replica the pool chose for it; the decode stage generates from it.  A role takes the
#: options and sampling parameters of its kind (the same model, split).
ROLES: dict[tuple[str, str], StageSpec] = {(kind, role): replace(spec, kind=kind, role=role)
                                           for (kind, role), spec in {
    ("thinker", "prefill"): StageSpec("codes", kv_handoff_input, sampling=THINKER_PARAMS,
                                      model="stages.toy.pd:PrefillThinker"),
    ("thinker", "decode"): StageSpec("text", tokens_input, sampling=THINKER_PARAMS,
                                     model="stages.toy.pd:DecodeThinker", sizes=thinker_sizes),
}.items()}


# ---------------------------------------------------------------------------- kinds and plug-ins
def check_kind_name(kind: str) -> str:
    """Return ``kind`` if it is a built-in kind or a well-formed import path (nothing is imported)."""
    if not isinstance(kind, str):
        raise KindError(f"a kind is a string, got {type(kind).__name__}")
    if kind in KINDS:
        return kind
    if ":" not in kind:
        raise KindError(f"unknown kind {kind!r} (expected one of {', '.join(KINDS)}, "
                        "or a plug-in model as 'package.module:Class')")
    if not _PATH.fullmatch(kind):
        raise KindError(f"malformed plug-in model path {kind!r} (expected 'package.module:Class')")
    if kind.startswith("__main__:"):
        raise KindError(f"{kind!r}: a worker process cannot import this process's __main__; "
                        "move the class to a module")
    return kind


def spec_for(kind: str, role: str = "") -> StageSpec:
    """The row of ``kind`` (in ``role``); a plug-in's module is imported and its class checked (KindError)."""
    check_kind_name(kind)
    if role:
        spec = ROLES.get((kind, role))
        if spec is None:
            roles = sorted(r for k, r in ROLES if k == kind)
            raise KindError(f"kind {kind!r} has no role {role!r}"
                            + (f" (its roles: {', '.join(roles)})" if roles else " (it cannot be split)"))
        return spec
    return KINDS[kind] if kind in KINDS else _plugin_spec(kind)


def takes_companions(spec: StageSpec) -> bool:
    """Does this kind's ``next_input`` condition on companion requests (a ``companions`` keyword)?"""
    try:
        return "companions" in inspect.signature(spec.next_input).parameters
    except (TypeError, ValueError):
        return False


@cache
def _plugin_spec(path: str) -> StageSpec:
    cls = model_class(path)
    if not issubclass(cls, StageModel):
        raise KindError(f"{path!r} is not a stage model: it must subclass stages.base.StageModel")
    missing = [m for m in _INTERFACE if not callable(getattr(cls, m, None))]
    if cls.step is StageModel.step:
        missing.append("step")
    if missing:
        raise KindError(f"{path!r} does not implement the stage model interface: "
                        f"{', '.join(dict.fromkeys(missing))} missing")
    declared = getattr(cls, "stage_spec", None) or StageSpec()
    if not isinstance(declared, StageSpec):
        raise KindError(f"{path}.stage_spec must be a stages.registry.StageSpec, "
                        f"got {type(declared).__name__}")
    if declared.output not in MODALITIES:
        raise KindError(f"{path}.stage_spec: output {declared.output!r} is not one of "
                        f"{', '.join(MODALITIES)}")
    for name in ("next_input", "prewarm_input"):
        if not callable(getattr(declared, name)):
            raise KindError(f"{path}.stage_spec: {name} must be a function")
    sampling = declared.sampling
    if not isinstance(sampling, Mapping) or not all(
            isinstance(k, str) and isinstance(p, Param) for k, p in sampling.items()):
        raise KindError(f"{path}.stage_spec: sampling must map parameter names to "
                        "stages.sampling_params.Param")
    return replace(declared, model=path, kind=path)


def model_class(path_or_kind: str) -> type:
    """Import a model class (``"module:Class"`` or a kind's); a clean KindError if that fails."""
    path = KINDS[path_or_kind].model if path_or_kind in KINDS else path_or_kind
    modname, _, attr = path.partition(":")
    try:
        module = importlib.import_module(modname)
    except ModuleNotFoundError as exc:
        if exc.name and (modname == exc.name or modname.startswith(exc.name + ".")):
            raise KindError(f"module {modname!r} not found (install it, or put its directory on "
                            "PYTHONPATH)") from None
        raise KindError(f"importing module {modname!r} failed: {_one_line(exc)}") from None
    except Exception as exc:  # a syntax error or a failing import inside the user's module
        raise KindError(f"importing module {modname!r} failed: "
                        f"{type(exc).__name__}: {_one_line(exc)}") from None
    obj = getattr(module, attr, None)
    if obj is None:
        raise KindError(f"module {modname!r} has no attribute {attr!r}")
    if not isinstance(obj, type):
        raise KindError(f"{path!r} is a {type(obj).__name__}, not a class")
    return obj


def source_root(kind: str) -> str | None:
    """The ``sys.path`` directory a plug-in's top-level package was imported from (None: built-in).

    The launcher hands it to the worker (``--python-path``), so a worker imports the
    plug-in from where this process found it, whatever its own ``sys.path``.
    """
    if kind in KINDS:
        return None
    spec_for(kind)
    top = sys.modules[kind.partition(":")[0].split(".")[0]]
    file = getattr(top, "__file__", None)
    if file:
        here = os.path.dirname(os.path.abspath(file))
        return os.path.dirname(here) if hasattr(top, "__path__") else here
    paths = list(getattr(top, "__path__", []))  # a namespace package
    return os.path.dirname(os.path.abspath(paths[0])) if paths else None


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text if len(text) <= 300 else text[:297] + "..."


# ---------------------------------------------------------------------------- model options
@dataclass(frozen=True)
class _Params:
    names: frozenset[str]  # passable by keyword
    required: frozenset[str]  # of those, without a default
    var_kw: bool  # **kwargs: any name is taken
    #: each annotated parameter's type, or its annotation's source text (read without importing)
    annotations: tuple[tuple[str, Any], ...] = ()
    #: the defaults that are plain values (read from source without importing: literals only)
    defaults: tuple[tuple[str, Any], ...] = ()


def _signature_params(cls: type) -> _Params:
    try:
        sig = inspect.signature(cls)
    except (TypeError, ValueError):
        return _Params(frozenset(), frozenset(), True)  # not inspectable: let the worker judge
    ps = sig.parameters.values()
    kw = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    try:  # the annotations evaluated where the class is defined (its own aliases resolve)
        hints: dict[str, Any] = typing.get_type_hints(cls.__init__, include_extras=True)
    except Exception:
        hints = {p.name: p.annotation for p in ps if p.annotation is not inspect.Parameter.empty}
    return _Params(frozenset(p.name for p in ps if p.kind in kw),
                   frozenset(p.name for p in ps if p.kind in kw and p.default is inspect.Parameter.empty),
                   any(p.kind is inspect.Parameter.VAR_KEYWORD for p in ps),
                   tuple((p.name, hints[p.name]) for p in ps if p.kind in kw and p.name in hints),
                   tuple((p.name, p.default) for p in ps
                         if p.kind in kw and p.default is not inspect.Parameter.empty))


def _static_params(modname: str, attr: str) -> _Params | None:
    """The constructor's parameters read from source, without importing it (None: cannot tell)."""
    try:
        found = importlib.util.find_spec(modname)
        if found is None or not (found.origin or "").endswith(".py"):
            return None
        with open(found.origin) as f:  # type: ignore[arg-type]
            tree = ast.parse(f.read())
    except (ImportError, ValueError, OSError, SyntaxError):
        return None
    cls = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == attr), None)
    if cls is None or cls.decorator_list:
        return None
    init = next((n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"), None)
    if init is None:
        return None  # inherited: only an import can tell
    a = init.args
    positional = [*a.posonlyargs, *a.args][1:]  # without self
    defaulted = {p.arg for p in positional[len(positional) - len(a.defaults):]} if a.defaults else set()
    keyword = [p.arg for p in a.args if p in positional] + [p.arg for p in a.kwonlyargs]
    required = {p.arg for p in a.args if p in positional and p.arg not in defaulted}
    required |= {p.arg for p, d in zip(a.kwonlyargs, a.kw_defaults, strict=True) if d is None}
    annotated = tuple((p.arg, ast.unparse(p.annotation)) for p in [*positional, *a.kwonlyargs]
                      if p.annotation is not None and p.arg in keyword)
    pairs = [*zip(positional[len(positional) - len(a.defaults):], a.defaults, strict=True),
             *((p, d) for p, d in zip(a.kwonlyargs, a.kw_defaults, strict=True) if d is not None)]
    return _Params(frozenset(keyword), frozenset(required), a.kwarg is not None, annotated,
                   tuple((p.arg, v) for p, d in pairs if (v := _literal(d)) is not _NOT_LITERAL))


_NOT_LITERAL = object()


def _literal(node: ast.expr) -> Any:
    """A default's value when it is a literal (else :data:`_NOT_LITERAL`: only an import can tell)."""
    try:
        return ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return _NOT_LITERAL


@cache
def _params(path: str) -> _Params:
    modname, _, attr = path.partition(":")
    if modname not in sys.modules:
        static = _static_params(modname, attr)
        if static is not None:
            return static
    return _signature_params(model_class(path))


def check_options(spec: StageSpec, options: Any) -> None:
    """Do ``options`` fit the model's constructor?  KindError naming the problem otherwise."""
    if not isinstance(options, dict):
        raise KindError(f"model options must be a table, got {type(options).__name__}")
    reserved = [o for o in _RESERVED if o in options]
    if reserved:
        raise KindError(f"model option {reserved[0]!r} is set for the whole pipeline "
                        f"([pipeline] {reserved[0]}), not in [stages.model]")
    params = _params(spec.model)
    accepted = sorted(params.names - set(_RESERVED))
    unknown = [] if params.var_kw else sorted(set(options) - params.names)
    if unknown:
        close = difflib.get_close_matches(unknown[0], accepted, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise KindError(f"unknown model option{'s' if len(unknown) > 1 else ''} "
                        f"{', '.join(map(repr, unknown))} for {spec.kind} "
                        f"(accepted: {', '.join(accepted) or 'none'}){hint}")
    missing = sorted(params.required - set(options) - set(_FILLED))
    if missing:
        raise KindError(f"{spec.kind} needs model option{'s' if len(missing) > 1 else ''} "
                        f"{', '.join(map(repr, missing))} in [stages.model]")
    try:
        json.dumps(options)
    except (TypeError, ValueError) as exc:
        raise KindError(f"model options must be numbers, strings, booleans, lists or tables: {exc}") from None
    for name, annotation in params.annotations:
        if name in options:
            try:
                check_option(spec.kind, name, options[name], annotation)
            except ConfigError as exc:
                raise KindError(str(exc)) from None


def full_options(spec: StageSpec, options: dict[str, Any]) -> dict[str, Any]:
    """``options`` with the model constructor's plain-valued defaults filled in (what ``sizes`` reads)."""
    return {**dict(_params(spec.model).defaults), **options}


def stage_sizes(kind: str, options: dict[str, Any], role: str = "") -> Sizes | None:
    """What a stage of ``kind`` emits and reads (:mod:`stages.fit`; None: not declared).

    A size function that fails (a tokenizer or checkpoint its options name cannot
    be read) is a KindError saying so.
    """
    spec = spec_for(kind, role)
    if spec.sizes is None:
        return None
    model = spec_for(kind) if role else spec  # a role takes its kind's options
    try:
        return spec.sizes(full_options(model, options))
    except KindError:
        raise
    except (ValueError, OSError, KeyError) as exc:
        raise KindError(f"{kind}: cannot tell its sizes: {exc}") from None


def check_stage(kind: str, options: Any, role: str = "") -> StageSpec:
    """Everything that can be checked before a worker starts: the kind and role, then its options."""
    spec = spec_for(kind, role)
    check_options(spec_for(kind) if role else spec, options)  # a role takes its kind's options
    return spec


def build_model(kind: str, options: dict[str, Any], *, device: str = "cpu", seed: int = 0,
                slots: int = 32, role: str = "") -> StageModel:
    """Build the model of ``kind`` in ``role`` (imports it: torch for the torch kinds).

    ``device``, ``seed`` and ``slots`` are passed when the constructor declares them
    (``slots`` may also come from the options).  Raises KindError for a bad kind,
    role or options, and whatever the constructor raises for bad values.
    """
    spec = check_stage(kind, options, role)
    cls = model_class(spec.model)
    params = _signature_params(cls)
    kwargs = dict(options)
    for name, value in zip(_FILLED, (device, seed, slots), strict=True):
        if name in params.names:
            kwargs.setdefault(name, value)
    return cls(**kwargs)


# ---------------------------------------------------------------------------- the orchestrator's view
def _specs(kinds: Iterable[str], roles: Sequence[str] | None) -> list[StageSpec]:
    kinds = list(kinds)
    roles = list(roles) if roles is not None else [""] * len(kinds)
    return [spec_for(k, r) for k, r in zip(kinds, roles, strict=True)]


def forward_fn(kinds: Iterable[str], roles: Sequence[str] | None = None) -> Callable[..., Any]:
    """The pipeline's ``forward_fn``: stage k's outputs -> stage k+1's input, by stage k's kind.

    ``forward(k, prompt, outputs, companions=None)``: a request's companions go
    to a kind that conditions on them (:func:`takes_companions`); for any other
    kind they are an error (that request ends ``forward_failed``).
    """
    specs = _specs(kinds, roles)
    conditioned = [takes_companions(s) for s in specs]

    def forward(k: int, prompt: Any, outputs: list[Any],
                companions: Mapping[str, list[Any]] | None = None) -> Any:
        if companions is None:
            return specs[k].next_input(prompt, outputs)
        if not conditioned[k]:
            raise ValueError(f"stage {k} ({specs[k].kind}) takes no companions: its next_input "
                             "does not condition on them")
        return specs[k].next_input(prompt, outputs, companions=companions)

    return forward


def prewarm_fn(kinds: Iterable[str], roles: Sequence[str] | None = None) -> Callable[[int, Any], Any]:
    """The pipeline's ``prewarm_fn``: the async-chunk placeholder input of stage k, by its kind."""
    specs = _specs(kinds, roles)

    def prewarm(k: int, prompt: Any) -> Any:
        return specs[k].prewarm_input(k, prompt)

    return prewarm


def input_media(kinds: Iterable[str]) -> frozenset[str]:
    """The media a chat may carry into a pipeline of ``kinds``: those its stages encode.

    A name that is no kind (an in-process stage's label) encodes none.
    """
    found: set[str] = set()
    for spec in map(_spec_or_none, kinds):
        if spec is not None:
            found.update((spec.media,) if isinstance(spec.media, str) else spec.media)
    return frozenset(found - {""})


def _spec_or_none(kind: str) -> StageSpec | None:
    try:
        return spec_for(kind)
    except KindError:  # a name that is no kind (an in-process stage's label)
        return None


def reads_tokens(kind: str) -> str:
    """How a stage of ``kind`` reads text: ``"text"``, ``"ids"`` or "" (see :class:`StageSpec`)."""
    spec = _spec_or_none(kind)
    return spec.tokens if spec is not None else ""


def says(kind: str) -> bool:
    """Can a stage of ``kind`` be told what to say (a ``say`` payload)?"""
    spec = _spec_or_none(kind)
    return spec is not None and spec.says


def sampling_schema(kind: str, options: Mapping[str, Any] | None = None) -> SamplingSchema:
    """The sampling parameters a stage of ``kind`` takes with these model ``options``
    (``StageSpec.sampling_for`` when the kind's depend on them, and options are given)."""
    spec = spec_for(kind)
    if spec.sampling_for is not None and options:
        return spec.sampling_for(options)
    return spec.sampling


def stage_params(kinds: Iterable[str], options: Sequence[Mapping[str, Any]] | None = None
                 ) -> list[StageParams]:
    """Each stage's name and sampling parameters (what ``serve`` and ``generate`` map requests onto);
    ``options``: each stage's model options, for the kinds whose parameters depend on them."""
    kinds = list(kinds)
    opts = list(options) if options is not None else [{}] * len(kinds)
    return [StageParams(spec_for(kind).kind, sampling_schema(kind, o))
            for kind, o in zip(kinds, opts, strict=True)]


def check_sampling(kinds: Iterable[str], options: Sequence[Mapping[str, Any]] | None = None
                   ) -> Callable[[int, Any], dict[str, Any]]:
    """The pipeline's ``check_sampling(stage_id, params)``: stage k's parameters against its kind's."""
    return checker(stage_params(kinds, options))


def outputs_of(kinds: Iterable[str], roles: Sequence[str] | None = None) -> list[str]:
    """The output modality of each stage."""
    return [s.output for s in _specs(kinds, roles)]


def text_stage(final_stage_ids: Iterable[int], outputs: Sequence[str] | None) -> int | None:
    """The first final stage that gives text (or undeclared data): where a text-only request stops.

    Without declared ``outputs`` (an in-process pipeline) stage 0 is assumed to give text.
    """
    finals = sorted(final_stage_ids)
    if outputs is None:
        return 0 if 0 in finals else None
    return next((k for k in finals if outputs[k] in ("text", "data")), None)


def text_of(data: Any) -> str | None:
    """The text of an output shaped like text: a str, or ``{"text": str}``."""
    if isinstance(data, str):
        return data
    if isinstance(data, dict) and isinstance(data.get("text"), str):
        return data["text"]
    return None


def pcm_of(data: Any) -> tuple[np.ndarray, int] | None:
    """(float32 samples, sample rate) of an output shaped like audio."""
    if isinstance(data, dict) and data.get("pcm") is not None:
        return np.asarray(data["pcm"], dtype=np.float32).reshape(-1), int(data.get("sample_rate", 24000))
    if isinstance(data, np.ndarray):
        return data.astype(np.float32).reshape(-1), 24000
    return None


def as_text(output: str, data: Any) -> str | None:
    """The text to show for ``data`` from a stage whose modality is ``output`` (None: not text)."""
    return text_of(data) if output in ("text", "data") else None


def as_audio(output: str, data: Any) -> tuple[np.ndarray, int] | None:
    """The audio to play for ``data`` from a stage whose modality is ``output`` (None: not audio)."""
    return pcm_of(data) if output in ("audio", "data") else None


def image_of(data: Any) -> bytes | None:
    """The PNG bytes of an output shaped like a finished image."""
    if isinstance(data, dict) and isinstance(data.get("png"), bytes | bytearray | memoryview):
        return bytes(data["png"])
    return None
