"""The per-request parameters of the Omni talker and token2wav, with ``generate()``'s defaults.

``generate()`` samples the talker with ``top_k=40, top_p=0.8, temperature=0.9,
repetition_penalty=1.05`` and at most 4096 codes; these are the talker's
defaults here, and a request can change each (``temperature: 0`` makes it
greedy; the repetition penalty stays, as in ``generate(talker_do_sample=False)``).
``voice`` names one of the checkpoint's speakers (``spk_dict.pt``), so the
schema is built per checkpoint (:func:`schema_for`, the registry's
``sampling_for``): an unknown voice is refused with the list of the
checkpoint's.  Every part takes ``voice``: the thinker frames its reply with
the speaker's start embedding, the talker speaks from that, token2wav
conditions on the speaker.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import Any

from stages.hf.omni.checkpoint import speaker_ids
from stages.sampling_params import HF_PARAMS, SEED_MAX, Param, SamplingSchema

__all__ = ["DEFAULT_SPEAKER", "SCHEMAS", "default_voice", "schema_for", "talker_params", "thinker_params",
           "token2wav_params", "voice_param"]

#: ``generate()``'s default speaker
DEFAULT_SPEAKER = "Chelsie"

_SEED = Param("int", None, "per-request seed: the talker's sampling, or token2wav's noise (default: 0 for "
              "token2wav, as after torch.manual_seed(0); drawn from the worker's seed for the talker)",
              lo=0, hi=SEED_MAX)


def default_voice(voices: Sequence[str]) -> str | None:
    """``generate()``'s default speaker when the checkpoint has it, else its first (None: no speakers)."""
    return DEFAULT_SPEAKER if DEFAULT_SPEAKER in voices else (voices[0] if voices else None)


def voice_param(voices: Sequence[str]) -> Param:
    """``voice``: one of the checkpoint's speakers."""
    return Param("choice", default_voice(voices), "the speaker: one of the checkpoint's (spk_dict.pt); "
                 "default Chelsie, generate()'s, else its first", choices=tuple(voices))


def thinker_params(voices: Sequence[str]) -> SamplingSchema:
    """The thinker's: a checkpoint text model's (``HF_PARAMS``), and the voice its reply is framed for."""
    return MappingProxyType({**HF_PARAMS, "voice": voice_param(voices)})


def talker_params(voices: Sequence[str]) -> SamplingSchema:
    """The talker's parameters (``voice`` only so it can be given to every stage alike)."""
    return MappingProxyType({
        "temperature": Param("float", 0.9, "0: greedy (argmax); generate()'s default 0.9", lo=0.0, hi=2.0),
        "top_k": Param("int", 40, "keep the k most likely codes (0: all)", lo=0),
        "top_p": Param("float", 0.8, "nucleus sampling over codes", lo=0.0, hi=1.0, lo_open=True),
        "repetition_penalty": Param("float", 1.05, "divide the logit of every code already in the talker's "
                                    "input or answer by this (1: off)", lo=0.0, hi=10.0, lo_open=True),
        "max_tokens": Param("int", 4096, "most codes generated (about 50 a second of speech)", lo=1),
        "seed": _SEED,
        "voice": voice_param(voices),
    })


def token2wav_params(voices: Sequence[str]) -> SamplingSchema:
    """token2wav's parameters: the speaker it conditions on and the seed of its noise."""
    return MappingProxyType({"voice": voice_param(voices), "seed": _SEED})


#: part -> its schema for a checkpoint's speakers
SCHEMAS: dict[str, Callable[[Sequence[str]], SamplingSchema]] = {
    "thinker": thinker_params, "talker": talker_params, "token2wav": token2wav_params}


def schema_for(part: str) -> Callable[[Mapping[str, Any]], SamplingSchema]:
    """The registry's ``sampling_for`` of ``part``: its schema for the checkpoint its options name."""
    def schema(options: Mapping[str, Any]) -> SamplingSchema:
        return SCHEMAS[part](list(speaker_ids(options["checkpoint"])))

    return schema
