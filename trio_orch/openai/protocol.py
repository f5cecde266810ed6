"""The OpenAI request schemas, declared once as ``msgspec.Struct`` types, and the served model names.

Every route's body is one of these, read by the one validator
(:func:`trio_orch.openai.validation.decode`): a value that does not fit is a
400 naming its path, an unknown field is ignored and logged, a known one this
server cannot honour (the schema's ``UNSUPPORTED`` table) is a 400 naming it.

:class:`OpenAIRequest` holds the fields every generation route shares (the
model, streaming, the sampling fields of :mod:`trio_orch.openai.sampling`);
:class:`ChatCompletionRequest`, :class:`CompletionRequest`,
:class:`SpeechRequest`, :class:`ImageGenerationRequest`,
:class:`TokenizeRequest` and :class:`DetokenizeRequest` are the routes' own.
:class:`ServedModels` is the server's list of model names: a request naming
another is a 404 ``model_not_found`` (OpenAI's and vLLM's answer).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from typing import Annotated, Any, ClassVar, Literal

from msgspec import Meta, Struct

from trio_orch.openai.audio_out import ChatAudioFormat, SpeechFormat, check_audio_format
from trio_orch.openai.validation import BadRequest, Unsupported

__all__ = ["MAX_SPEECH_INPUT", "MAX_TOKENS", "UNSUPPORTED", "AudioOptions", "ChatCompletionRequest",
           "CompletionRequest", "ContentPart", "Count", "DetokenizeRequest", "ImageGenerationRequest",
           "Int64", "Message", "OpenAIRequest", "Scheduled", "Seed", "ServedModels", "SpeechRequest",
           "StreamOptions", "TokenizeRequest", "Voice"]

#: the largest token budget a request may ask for (a 32-bit count: the stages' own caps apply below it)
MAX_TOKENS = 2**31 - 1


_NO_TOOLS = "is not supported: this server has no tool calling"
#: fields the generation schemas declare that this server cannot honour: name -> (is the value one it
#: can, why not); each schema's ``UNSUPPORTED`` (a schema whose fields mean something else -- the images
#: route's ``response_format`` -- has its own table)
UNSUPPORTED: Unsupported = {
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


# ---------------------------------------------------------------- the schemas
# Every integer field has a range, so that no value reaches a stage that the wire cannot carry or the
# stage cannot mean (a priority of 10**20 once came back as a 503 from the encoder): a 400 naming it.
TokenBudget = Annotated[int, Meta(ge=1, le=MAX_TOKENS)]
#: any integer the wire carries (msgpack's signed 64 bits)
Int64 = Annotated[int, Meta(ge=-(2**63), le=2**63 - 1, description="an integer that fits in a signed 64-bit "
                                                                   "integer")]
Seed = Int64
#: how many of something a request asks for (choices, denoising steps): 1 up to a 32-bit count
Count = Annotated[int, Meta(ge=1, le=MAX_TOKENS)]
#: a number of tokens that may be 0
TokenCount = Annotated[int, Meta(ge=0, le=MAX_TOKENS)]
#: log-probabilities per token (OpenAI's bound)
LogprobCount = Annotated[int, Meta(ge=0, le=20)]
#: a float that is a number (JSON's 1e400 is inf to Python)
Finite = Annotated[float, Meta(ge=-sys.float_info.max, le=sys.float_info.max, description="a finite number")]
Role = Literal["system", "developer", "user", "assistant"]
#: a speaker's name: which names a pipeline takes is its stages' (``voice``), checked against them
Voice = Annotated[str, Meta(min_length=1, max_length=64)]


class StreamOptions(Struct, kw_only=True):
    include_usage: bool = False


class Scheduled(Struct, kw_only=True):
    """What every generation route takes: ``priority``, an int, lower values served first (vLLM's
    convention; default 0).  Anything else (``"high"``, 1.5, true) is a 400 naming it."""

    priority: Int64 = 0


class OpenAIRequest(Scheduled, kw_only=True):
    """What every generation route takes: the model, streaming, ``user``, the sampling fields.

    The sampling fields (:meth:`sampling_fields`) are range-checked here only
    where OpenAI fixes the range; each stage checks its own parameters
    (:mod:`trio_orch.openai.sampling`).
    """

    model: Annotated[str, Meta(max_length=256)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    n: Count | None = None
    max_tokens: TokenBudget | None = None
    temperature: Annotated[float, Meta(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Meta(ge=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Meta(ge=-1, le=MAX_TOKENS)] | None = None  # -1 or 0: all (vLLM's)
    min_tokens: TokenCount | None = None
    stop: str | list[str] | None = None
    frequency_penalty: Finite | None = None
    presence_penalty: Finite | None = None
    repetition_penalty: Finite | None = None
    seed: Seed | None = None
    #: the extension: stage (kind or index) -> that stage's parameters, checked per stage
    stage_sampling: dict[str, Any] | None = None
    logit_bias: dict[str, Any] | None = None

    UNSUPPORTED: ClassVar[Unsupported] = UNSUPPORTED
    #: the fields :mod:`trio_orch.openai.sampling` maps to stages
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
    #: (decoded by :mod:`trio_orch.openai.media`)
    image_url: dict[str, Any] | None = None
    input_audio: dict[str, Any] | None = None


class Message(Struct, kw_only=True):
    role: Role
    content: Annotated[str | list[ContentPart] | None,
                       Meta(description="a string or an array of text parts")] = None
    name: str | None = None


class AudioOptions(Struct, kw_only=True):
    voice: Voice | None = None
    format: ChatAudioFormat | None = None


class ChatCompletionRequest(OpenAIRequest, kw_only=True):
    """``POST /v1/chat/completions``."""

    messages: Annotated[list[Message], Meta(min_length=1)]
    modalities: list[str] | None = None
    audio: AudioOptions | None = None
    max_completion_tokens: TokenBudget | None = None
    logprobs: bool | None = None
    top_logprobs: LogprobCount | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    functions: list[Any] | None = None
    function_call: str | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    prediction: dict[str, Any] | None = None

    SAMPLING: ClassVar[tuple[str, ...]] = (*OpenAIRequest.SAMPLING, "max_completion_tokens")


class CompletionRequest(OpenAIRequest, kw_only=True):
    """``POST /v1/completions``: the shared fields, and the completion's own."""

    prompt: str | list[str]
    echo: bool = False
    best_of: Count | None = None
    logprobs: LogprobCount | None = None
    suffix: str | None = None

    def text(self, max_chars: int | None) -> str:
        """The one prompt; BadRequest for what cannot be one."""
        if self.best_of not in (None, 1):
            raise BadRequest("only 'best_of': 1 is supported", "best_of", code="unsupported_parameter")
        if self.suffix:
            raise BadRequest("'suffix' (insertion) is not supported", "suffix", code="unsupported_parameter")
        prompt = self.prompt
        if isinstance(prompt, list):
            if len(prompt) != 1:
                raise BadRequest(f"one prompt per request: a text or a list of one text, got {len(prompt)}",
                                 "prompt")
            prompt = prompt[0]
        if not prompt:
            raise BadRequest("'prompt' must not be empty", "prompt")
        if max_chars is not None and len(prompt) > max_chars:
            raise BadRequest(f"the prompt has {len(prompt)} characters, over the limit of {max_chars}",
                             "prompt", code="context_length_exceeded")
        return prompt


#: OpenAI's bound on a speech request's ``input``
MAX_SPEECH_INPUT = 4096


class SpeechRequest(Scheduled, kw_only=True):
    """``POST /v1/audio/speech`` (the fields this server reads)."""

    input: Annotated[str, Meta(min_length=1, max_length=MAX_SPEECH_INPUT)]
    model: Annotated[str, Meta(max_length=256)] | None = None
    voice: Voice | None = None
    speed: Annotated[float, Meta(ge=0.25, le=4.0)] = 1.0
    stream_format: Literal["audio", "sse"] = "audio"
    instructions: str | None = None
    seed: Seed | None = None
    stage_sampling: dict[str, Any] | None = None
    response_format: SpeechFormat = "wav"

    def check(self, max_chars: int | None) -> None:
        """BadRequest naming the first field this server cannot honour."""
        if not self.input.strip():
            raise BadRequest("'input' must hold some text", "input")
        if max_chars is not None and len(self.input) > max_chars:
            raise BadRequest(f"'input' has {len(self.input)} characters, over the limit of {max_chars}",
                             "input", code="context_length_exceeded")
        check_audio_format(self.response_format, "response_format")
        if self.stream_format == "sse" and self.response_format != "pcm":
            raise BadRequest("streamed events carry pcm: use \"response_format\": \"pcm\" with "
                             "\"stream_format\": \"sse\"", "response_format")
        if self.instructions:
            raise BadRequest("'instructions' are not supported: the voice is set by 'voice'", "instructions",
                             code="unsupported_parameter")


class ImageGenerationRequest(Scheduled, kw_only=True):
    """``POST /v1/images/generations`` (OpenAI's fields, then the diffusion extensions)."""

    prompt: str
    model: str | None = None
    n: Count | None = None
    size: str = "256x256"
    response_format: str | None = None
    user: str | None = None
    negative_prompt: str | None = None
    guidance_scale: Finite = 4.0
    num_inference_steps: Count = 8
    seed: Seed = 0

    #: this route's own table: ``response_format`` means an image encoding here, not chat's text format
    UNSUPPORTED: ClassVar[Unsupported] = {
        "n": UNSUPPORTED["n"],
        "response_format": (lambda v: v in (None, "b64_json"),
                            "'response_format' must be 'b64_json' (no image URLs are served)"),
    }


class TokenizeRequest(Struct, kw_only=True):
    """vLLM's ``POST /tokenize``: a ``prompt`` or chat ``messages``."""

    model: str | None = None
    prompt: str | None = None
    messages: list[Any] | None = None
    add_special_tokens: bool = True  # the byte tokenizer adds none either way
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(Struct, kw_only=True):
    """vLLM's ``POST /detokenize``."""

    tokens: list[int]
    model: str | None = None


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
