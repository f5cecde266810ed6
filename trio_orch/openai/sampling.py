"""OpenAI request fields -> per-stage sampling parameters of the pipeline that serves them.

Each field goes to the stages it concerns (:data:`TEXT_FIELDS`: the stage
that gives the text; :data:`EVERY_STAGE_FIELDS`: every stage of the request
that takes the parameter), checked against what each stage declares
(:class:`stages.sampling_params.StageParams`).  A field no stage of the request
can honour is an error, never silently dropped.  The extension field
``stage_sampling`` sets any stage's parameters explicitly, naming the stage by
its kind (``"talker"``) or its index (``"1"``); it wins over the mapped fields.

Used by ``trio-orch serve`` (:func:`chat_sampling`, through
:mod:`trio_orch.openai.chat`) and ``trio-orch generate`` (:func:`map_sampling`).
Over HTTP each field's type (and OpenAI's range, where it fixes one) is the
request schema's (:mod:`trio_orch.openai.protocol`); what is checked here is what
only the pipeline knows: which stage takes the parameter, and its own range.
docs/sampling.md has the table (Over HTTP).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from stages.registry import text_stage
from stages.sampling_params import StageParams, check_params

__all__ = ["EVERY_STAGE_FIELDS", "EXTENSION", "FIELDS", "TEXT_FIELDS", "SamplingError", "chat_sampling",
           "map_sampling"]

#: Field -> parameter of the stage that gives the text.  ``top_k``, ``min_tokens`` and
#: ``repetition_penalty`` are not OpenAI's (vLLM's server takes them too).
TEXT_FIELDS: dict[str, str] = {
    "temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
    "max_completion_tokens": "max_tokens", "max_tokens": "max_tokens", "min_tokens": "min_tokens",
    "stop": "stop", "frequency_penalty": "frequency_penalty", "presence_penalty": "presence_penalty",
    "repetition_penalty": "repetition_penalty",
}
#: Field -> parameter of every stage of the request that takes it (``voice``: ``audio.voice``,
#: mapped for audio requests only).
EVERY_STAGE_FIELDS: dict[str, str] = {"seed": "seed", "voice": "voice"}
#: The extension field: ``{"stage_sampling": {"talker": {"temperature": 0.7}, "2": {...}}}``.
EXTENSION = "stage_sampling"
#: The request-body fields this module reads (``voice`` comes inside ``audio``).
FIELDS = frozenset(TEXT_FIELDS) | {"seed", EXTENSION}


class SamplingError(ValueError):
    """A field that cannot be honoured or does not fit; ``param`` names it (OpenAI's error ``param``)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def map_sampling(fields: Mapping[str, Any], stages: Sequence[StageParams] | None, *,
                 text_stage: int | None, last_stage: int,
                 voice_field: str = "audio.voice") -> dict[int, dict[str, Any]]:
    """``{stage: parameters}`` for the fields given (OpenAI names, ``voice``, ``stage_sampling``).

    ``stages``: what each stage takes (None: the pipeline declares nothing, so
    any field is refused); ``text_stage``: the stage that gives the text;
    ``last_stage``: the last stage the request runs (later stages get nothing);
    ``voice_field``: what the request calls ``voice`` (chat: ``audio.voice``).
    Raises :class:`SamplingError`.
    """
    given = {k: v for k, v in fields.items() if v is not None}
    if "max_completion_tokens" in given:  # the newer name wins, as at OpenAI
        given.pop("max_tokens", None)
    out: dict[int, dict[str, Any]] = {}
    for field, value in given.items():
        if field == EXTENSION:
            continue
        param = TEXT_FIELDS.get(field) or EVERY_STAGE_FIELDS.get(field)
        if param is None:
            raise SamplingError(f"{field!r} is not a sampling field", field)
        shown = voice_field if field == "voice" else field
        if stages is None:
            raise SamplingError(f"{shown!r} cannot be honoured: this pipeline declares no sampling "
                                "parameters", shown)
        if field in TEXT_FIELDS:
            if text_stage is None or param not in stages[text_stage].schema:
                where = (f"its text stage (stage {text_stage}, {stages[text_stage].name}) takes no {param!r}"
                         if text_stage is not None else "it has no text stage")
                raise SamplingError(f"{shown!r} cannot be honoured by this pipeline: {where}", shown)
            targets = [text_stage]
        else:
            targets = [k for k in range(last_stage + 1) if param in stages[k].schema]
            if not targets:
                raise SamplingError(f"{shown!r} cannot be honoured: no stage this request runs takes "
                                    f"{param!r}", shown)
        for k in targets:
            try:
                out.setdefault(k, {})[param] = stages[k].schema[param].check(shown, value)
            except ValueError as exc:
                raise SamplingError(str(exc), shown) from None
    for k, params in _explicit(given.get(EXTENSION), stages).items():
        out.setdefault(k, {}).update(params)
    return {k: v for k, v in out.items() if v}


def _explicit(value: Any, stages: Sequence[StageParams] | None) -> dict[int, dict[str, Any]]:
    """``stage_sampling``: stage (kind or index) -> parameters, each checked against its stage's."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise SamplingError(f"{EXTENSION!r} must be an object: stage (kind or index) -> parameters",
                            EXTENSION)
    if stages is None:
        raise SamplingError(f"{EXTENSION!r} cannot be honoured: this pipeline declares no sampling "
                            "parameters", EXTENSION)
    out: dict[int, dict[str, Any]] = {}
    for key, params in value.items():
        k = _stage_index(key, stages)
        try:
            out[k] = check_params(stages[k].name, stages[k].schema, params)
        except ValueError as exc:
            raise SamplingError(f"{EXTENSION}.{key}: {exc}", f"{EXTENSION}.{key}") from None
    return out


def _stage_index(key: Any, stages: Sequence[StageParams]) -> int:
    names = [s.name for s in stages]
    if (isinstance(key, int) and not isinstance(key, bool)) or (isinstance(key, str) and key.isdigit()):
        k = int(key)
        if 0 <= k < len(stages):
            return k
    elif key in names:
        if names.count(key) == 1:
            return names.index(key)
        raise SamplingError(f"{EXTENSION}: {key!r} names {names.count(key)} stages: use a stage index",
                            f"{EXTENSION}.{key}")
    listing = ", ".join(f"{i} ({n})" for i, n in enumerate(names))
    raise SamplingError(f"{EXTENSION}: no stage {key!r} (stages: {listing})", f"{EXTENSION}.{key}")


def chat_sampling(body: Mapping[str, Any], *, audio: bool, stages: Sequence[StageParams] | None,
                  final_stage_ids: Iterable[int], outputs: Sequence[str] | None,
                  final_stage_id: int | None) -> dict[int, dict[str, Any]]:
    """The per-stage parameters of a chat request's sampling fields (their types already checked by
    the schema; ``audio.voice`` under ``audio``).

    ``final_stage_id``: where the request stops (None: every final stage);
    ``audio``: audio was asked for (only then does ``audio.voice`` reach a stage).
    """
    finals = sorted(final_stage_ids)
    fields = {f: body[f] for f in FIELDS if f in body}
    voice = body.get("audio", {}).get("voice") if isinstance(body.get("audio"), Mapping) else None
    if audio and voice is not None:
        fields["voice"] = voice
    last = final_stage_id if final_stage_id is not None else (finals[-1] if finals else 0)
    return map_sampling(fields, stages, text_stage=text_stage(finals, outputs), last_stage=last)
