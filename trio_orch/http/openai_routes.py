"""The routes a vLLM or OpenAI client expects beside chat: completions, speech, tokenize, detokenize.

One function for :func:`~trio_orch.http.app.create_app`'s route list, so
both fronts serve them.  Each route lives in its own module:
:mod:`~trio_orch.http.openai_completions`, :mod:`~trio_orch.http.openai_speech`,
:mod:`~trio_orch.http.tokenizer`.
"""

from __future__ import annotations

from collections.abc import Sequence

from starlette.routing import BaseRoute

from trio_orch.engine.api import EngineClient
from trio_orch.http.chat_template import ChatInput
from trio_orch.http.limits import HTTPLimits
from trio_orch.http.metrics import FrontMetrics
from trio_orch.http.openai_completions import COMPLETIONS, completions_route
from trio_orch.http.openai_speech import SPEECH, speech_route
from trio_orch.http.schemas import ServedModels
from trio_orch.http.tokenizer import tokenizer_routes

__all__ = ["GENERATION", "openai_routes"]

#: the POST routes among them that start work in the engine (for the front's shedding)
GENERATION = frozenset({COMPLETIONS, SPEECH})


def openai_routes(engine: EngineClient, models: ServedModels, *, outputs: Sequence[str] | None,
                  limits: HTTPLimits, front: FrontMetrics, token_limit: int | None = None,
                  chat: ChatInput | None = None) -> list[BaseRoute]:
    """``/v1/completions``, ``/v1/audio/speech``, ``/tokenize`` and ``/detokenize`` over ``engine``.

    ``models``: the names the server answers to; ``outputs``, ``limits``,
    ``front`` and ``token_limit`` as for :func:`~trio_orch.http.app.create_app`; ``chat``: the
    chat template and media (for ``/tokenize`` with ``messages``).
    """
    return [
        completions_route(engine, models=models, outputs=outputs, limits=limits, front=front,
                          token_limit=token_limit),
        speech_route(engine, models=models, outputs=outputs, limits=limits, front=front),
        *tokenizer_routes(engine, models=models, outputs=outputs, limits=limits, front=front, chat=chat),
    ]
