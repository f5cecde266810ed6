"""The context-length rule: a prompt and its completion must fit the model's context, said in vLLM's words.

One rule, one function (:func:`context_error`), asked on both sides: by the
HTTP front before a request is admitted (a 400 naming both numbers) and by
every text model when it admits a request (whatever sent it: ``generate``,
a plug-in's client, a forwarded stage input), so nothing is ever truncated
to fit.  This module imports neither torch nor trio.
"""

from __future__ import annotations

__all__ = ["check_context", "context_error"]


def context_error(max_model_len: int, prompt_tokens: int, max_tokens: int | None) -> str | None:
    """Why ``prompt_tokens`` plus ``max_tokens`` do not fit ``max_model_len`` (None: they fit).

    ``max_tokens`` None means "as many as fit" (vLLM's default): then the prompt
    must leave room for at least one generated token.  The messages are vLLM's.
    """
    if max_tokens is None:
        if prompt_tokens >= max_model_len:
            return (f"This model's maximum context length is {max_model_len} tokens. However, you "
                    f"requested {prompt_tokens} tokens in the messages. Please reduce the length of the "
                    "messages.")
        return None
    if prompt_tokens + max_tokens > max_model_len:
        return (f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in the messages, {max_tokens} in "
                "the completion). Please reduce the length of the messages or completion.")
    return None


def check_context(max_model_len: int, prompt_tokens: int, max_tokens: int | None) -> None:
    """:func:`context_error` as a ValueError (how a stage model refuses a request)."""
    error = context_error(max_model_len, prompt_tokens, max_tokens)
    if error is not None:
        raise ValueError(error)
