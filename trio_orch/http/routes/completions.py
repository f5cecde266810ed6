"""``POST /v1/completions``: OpenAI's (legacy) text completions, served by the pipeline's text stage.

Request (:class:`~trio_orch.openai.protocol.CompletionRequest`): ``prompt``
(text, or a list holding one text), ``model`` (optional; if given, a served
name, else 404 ``model_not_found``), ``max_tokens``, ``temperature``,
``top_p``, ``seed``, ``stop``, ``stream`` (SSE) with
``stream_options.include_usage``, ``echo``, ``user``; vLLM's ``top_k``,
``min_tokens``, ``repetition_penalty`` and the penalties, and the
``stage_sampling`` extension, each mapped onto the text stage as the chat
route maps them (:mod:`trio_orch.openai.sampling`).  ``n``, ``best_of``,
``logprobs``, ``suffix`` and ``logit_bias`` beyond their defaults are 400s
naming them; fields the schema does not know are ignored (and logged).
Without ``max_tokens`` the text stage's own cap applies (vLLM's default),
not OpenAI's 16.

The request stops at the text stage (a speech pipeline makes no audio for
it).  Answer: ``{"object": "text_completion", "choices": [{"text",
"finish_reason"}], "usage"}``; streamed, one ``text_completion`` chunk per
text piece, the last with ``finish_reason``, the usage chunk if asked, then
``data: [DONE]``.  Token counts are the text stage's
(:class:`~trio_orch.openai.completions.TextCompletion`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from functools import partial
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from stages.registry import text_stage
from trio_orch.engine.api import AcceptedRequest, EngineClient
from trio_orch.http.generation import OpenAIRoute
from trio_orch.http.limits import HTTPLimits
from trio_orch.http.metrics import FrontMetrics
from trio_orch.http.streaming import sse
from trio_orch.http.vllm_metrics import RequestTimer
from trio_orch.openai import sampling as openai_sampling
from trio_orch.openai.completions import TextCompletion
from trio_orch.openai.protocol import CompletionRequest, ServedModels
from trio_orch.openai.tokenizer import check_context, prompt_token_count
from trio_orch.openai.validation import BadRequest, error_body
from trio_orch.types import OrchOutput

__all__ = ["COMPLETIONS", "completions_route"]

COMPLETIONS = "/v1/completions"
DONE = b"data: [DONE]\n\n"


def completions_route(engine: EngineClient, *, models: ServedModels, outputs: Sequence[str] | None,
                      limits: HTTPLimits, front: FrontMetrics, token_limit: int | None) -> Route:
    """``POST /v1/completions`` over ``engine`` (``models``: the names it answers to)."""
    route = OpenAIRoute(engine, COMPLETIONS, front, limits)

    def count_tokens(tc: TextCompletion) -> None:
        front.count_tokens(tc.usage()["prompt_tokens"], {tc.stage: tc.tokens})

    def failure(code: str, message: str) -> bytes:
        return sse(error_body(message, "server_error", code=code))

    def finished(tc: TextCompletion, handle: AcceptedRequest, timer: RequestTimer) -> None:
        """The request ended with a finish reason: the reason, and its vLLM histograms."""
        front.count_finished(tc.finish_reason())
        timer.finish(prompt_tokens=tc.usage()["prompt_tokens"], max_tokens=tc.max_tokens,
                     token_limit=tc.token_limit, timings=handle.timings)

    def stream(req: CompletionRequest, tc: TextCompletion, handle: AcceptedRequest) -> AsyncIterator[bytes]:
        timer = front.timer(handle.t_open)

        def render(m: OrchOutput) -> bytes:
            text = tc.add(m)
            timer.saw(tc.tokens)
            out = sse(tc.chunk(text)) if text else b""
            if m.finished:
                finished(tc, handle, timer)
                out += sse(tc.chunk("", tc.finish_reason()))
                if req.include_usage:
                    out += sse(tc.usage_chunk())
            return out

        return route.body(handle, render, failure, first=sse(tc.chunk(tc.prompt)) if req.echo else b"",
                          last=DONE, on_end=partial(count_tokens, tc))

    async def collect(req: CompletionRequest, tc: TextCompletion, handle: AcceptedRequest) -> Any:
        timer = front.timer(handle.t_open)

        def absorb(m: OrchOutput) -> None:
            tc.add(m)
            timer.saw(tc.tokens)

        try:
            err = await route.collect(handle, absorb)
        finally:
            count_tokens(tc)
        if err is not None:
            return err
        finished(tc, handle, timer)
        return JSONResponse(tc.completion(req.echo))

    def read(raw: bytes) -> tuple[CompletionRequest, str, str, int, dict[int, dict[str, Any]], int | None]:
        """The one check of a completion request: (request, model, prompt, text stage, sampling, prompt
        tokens); the prompt and ``max_tokens`` checked against the model's context."""
        req = route.parse(raw, CompletionRequest)
        model = models.resolve(req.model)
        prompt = req.text(limits.max_prompt_chars)
        k = text_stage(engine.final_stage_ids, outputs)
        if k is None:
            raise BadRequest(f"model {model!r} gives no text: this pipeline has no text stage", "model")
        try:
            sampling = openai_sampling.map_sampling(req.sampling_fields(), engine.stage_params,
                                                    text_stage=k, last_stage=k)
        except openai_sampling.SamplingError as exc:
            raise BadRequest(str(exc), exc.param) from None
        prompt_tokens = prompt_token_count(engine, outputs, prompt)
        check_context(engine, outputs, prompt_tokens, req.max_tokens, "prompt")
        return req, model, prompt, k, sampling, prompt_tokens

    async def handle(request: Request) -> Response:
        try:
            req, model, prompt, k, sampling, prompt_tokens = read(await request.body())
        except BadRequest as exc:
            return route.bad(exc)
        admitted = await route.admit(prompt, final_stage_id=k, sampling=sampling, want_timings=True,
                                     priority=req.priority)
        if isinstance(admitted, Response):
            return admitted
        tc = TextCompletion(model, prompt, k, req.max_tokens, token_limit, outputs,
                            prompt_tokens=prompt_tokens)
        if req.stream:
            return route.stream(stream(req, tc, admitted))
        answer = await route.wait(partial(collect, req, tc, admitted), request)
        return answer if answer.status_code != 200 else route.ok(answer)

    return Route(COMPLETIONS, handle, methods=["POST"])
