"""Chat templates: the messages of a chat made into the one prompt the text stage reads.

A template is Jinja, rendered as Hugging Face's ``apply_chat_template`` does:
a sandboxed environment with ``trim_blocks`` and ``lstrip_blocks``, the
variables ``messages`` (each ``{"role": str, "content": str | list of
parts}``), ``add_generation_prompt``, ``bos_token`` and ``eos_token`` (empty:
the byte-level thinker has no such tokens in its text), and the function
``raise_exception(message)`` (a refusal: 400 naming ``messages``).  A content
list holds ``{"type": "text", "text": ...}``, ``{"type": "image"}`` and
``{"type": "audio"}`` parts: the media themselves travel beside the prompt
as features for the thinker, so a template only marks where they were.

:data:`DEFAULT_TEMPLATE` is what ``serve`` uses without ``--chat-template``:
``role: content`` lines, image and audio parts as ``<image>`` and
``<audio>``, and ``assistant:`` to end a prompt that asks for an answer --
the prompt the chat route always built, so the dummy thinker sees what it
always did.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, NoReturn

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from stages.registry import input_media
from trio_orch.openai.media import MediaPolicy
from trio_orch.openai.validation import BadRequest

__all__ = ["DEFAULT_TEMPLATE", "ChatInput", "ChatTemplate"]

DEFAULT_TEMPLATE = """\
{%- for message in messages %}
{%- if message.content is not none %}
{{- message.role }}: {% if message.content is string %}{{ message.content }}{% else %}
{%- for part in message.content %}
{%- if part.type == 'text' %}{{ part.text }}
{%- elif part.type == 'image' %}<image>
{%- elif part.type == 'audio' %}<audio>
{%- endif %}
{%- endfor %}
{%- endif %}
{{ '\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}assistant:{% endif %}"""


class _TemplateRefused(Exception):
    """``raise_exception`` was called by the template."""


def _raise_exception(message: str) -> NoReturn:
    raise _TemplateRefused(message)


def _environment() -> jinja2.Environment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.globals["raise_exception"] = _raise_exception
    return env


@dataclass(frozen=True)
class ChatTemplate:
    """A compiled chat template; ``name`` says where it came from (a file, or "default")."""

    source: str = DEFAULT_TEMPLATE
    name: str = "default"
    bos_token: str = ""
    eos_token: str = ""
    _compiled: jinja2.Template = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        try:
            compiled = _environment().from_string(self.source)
        except jinja2.TemplateSyntaxError as exc:
            raise ValueError(f"chat template {self.name}: line {exc.lineno}: {exc.message}") from None
        object.__setattr__(self, "_compiled", compiled)

    @classmethod
    def from_file(cls, path: str | Path) -> ChatTemplate:
        """A template read from ``path`` (ValueError naming the file when unreadable or not Jinja)."""
        p = Path(path)
        try:
            text = p.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"cannot read chat template {p}: {exc}") from None
        return cls(text, str(p))

    @classmethod
    def from_arg(cls, value: str) -> ChatTemplate:
        """``--chat-template``'s value, as vLLM reads it: a file, or the template itself when it is
        no file and holds Jinja (``{{`` or ``{%``)."""
        if not Path(value).is_file() and ("{{" in value or "{%" in value):
            return cls(value, "given on the command line")
        return cls.from_file(value)

    def render(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True) -> str:
        """The prompt for ``messages``; BadRequest (naming ``messages``) when the template refuses them."""
        try:
            return self._compiled.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         bos_token=self.bos_token, eos_token=self.eos_token)
        except _TemplateRefused as exc:
            raise BadRequest(f"the chat template refused the messages: {exc}", "messages") from None
        except jinja2.TemplateError as exc:
            raise BadRequest(f"the chat template ({self.name}) failed on these messages: "
                             f"{type(exc).__name__}: {exc}", "messages") from None


@dataclass(frozen=True)
class ChatInput:
    """How the chat routes make a stage-0 payload: the template, the media policy, the media taken.

    ``accepts``: the media ("image", "audio") the pipeline's stages encode
    (:func:`for_kinds`); a part of another medium is a 400 naming it and
    saying which pipeline takes it.
    """

    template: ChatTemplate = field(default_factory=ChatTemplate)
    media: MediaPolicy = field(default_factory=MediaPolicy)
    accepts: frozenset[str] = frozenset()

    def for_kinds(self, kinds: Iterable[str] | None) -> ChatInput:
        """This, taking the media a pipeline of ``kinds`` encodes (None: an in-process one, none)."""
        return replace(self, accepts=input_media(kinds) if kinds is not None else frozenset())
