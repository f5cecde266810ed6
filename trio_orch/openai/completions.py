"""OpenAI's (legacy) text completion: one request's text pieces -> streamed chunks, or the whole answer.

No web framework here: the route (:mod:`trio_orch.http.routes.completions`)
reads the request (:class:`~trio_orch.openai.protocol.CompletionRequest`) and
streams or returns what :class:`TextCompletion` builds.  Token counts are the
text stage's (its tokenizer for the prompt, one per text output generated).
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from stages.registry import as_text
from trio_orch.types import OrchOutput

__all__ = ["TextCompletion"]


@dataclass
class TextCompletion:
    """One request's text pieces -> streamed chunks, or the whole completion."""

    model: str
    prompt: str
    stage: int  # the text stage
    max_tokens: int | None
    token_limit: int | None  # the text stage's own cap (its workers' max_new_tokens)
    outputs: Sequence[str] | None
    id: str = field(default_factory=lambda: "cmpl-" + secrets.token_hex(12))
    created: int = field(default_factory=lambda: int(time.time()))
    pieces: list[str] = field(default_factory=list)
    tokens: int = 0
    reason: str | None = None  # what the text stage reported
    #: the prompt's length in the text stage's tokens (None: its UTF-8 bytes, the byte tokenizer's)
    prompt_tokens: int | None = None

    def add(self, m: OrchOutput) -> str:
        """Absorb one output; its text ("" if it carries none)."""
        modality = self.outputs[m.stage_id] if self.outputs is not None else "data"
        text = as_text(modality, m.data)
        if text is None:
            return ""
        data = m.data if isinstance(m.data, dict) else {}
        if isinstance(data.get("finish_reason"), str):
            self.reason = data["finish_reason"]
        toks = data.get("tokens")
        self.tokens += len(toks) if toks is not None else int(bool(text))
        if text:
            self.pieces.append(text)
        return text

    def finish_reason(self) -> str:
        if self.reason is not None:
            return self.reason
        caps = [n for n in (self.max_tokens, self.token_limit) if n is not None]
        return "length" if caps and len(self.pieces) >= min(caps) else "stop"

    def usage(self) -> dict[str, int]:
        prompt = self.prompt_tokens if self.prompt_tokens is not None else len(self.prompt.encode())
        return {"prompt_tokens": prompt, "completion_tokens": self.tokens,
                "total_tokens": prompt + self.tokens}

    def chunk(self, text: str, finish: str | None = None) -> dict[str, Any]:
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}]}

    def completion(self, echo: bool) -> dict[str, Any]:
        body = self.chunk((self.prompt if echo else "") + "".join(self.pieces), self.finish_reason())
        return {**body, "usage": self.usage()}

    def usage_chunk(self) -> dict[str, Any]:
        return {**self.chunk(""), "choices": [], "usage": self.usage()}
