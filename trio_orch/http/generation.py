"""What every OpenAI-shaped route shares: the body, refusals, admission, the wait, and the one streaming loop.

The routes (:mod:`trio_orch.http.routes`) answer alike: a refusal is
OpenAI's error body with a status, counted by route in ``/metrics`` and
logged; a request is admitted before any byte of the answer goes out (429
with ``Retry-After`` when the engine sheds it, 503 when it is not running or
a stage of the request's path has no live replica); bodies are read by the
one validator (:mod:`trio_orch.openai.validation`: typed 400s naming the
field).  Every generation route streams through :meth:`OpenAIRoute.body`
(one chunk per dispatcher batch, an error terminal as the route's failure
chunk, the tokens counted however it ends) and answers a non-streamed
request through :meth:`OpenAIRoute.wait`.  A client that leaves before its
answer -- mid-stream, while it waits for a non-streamed one, or with a
realtime response in progress -- has its request aborted (the stream's
handle closed) and is counted and logged in one place,
:meth:`~trio_orch.http.metrics.FrontMetrics.client_left`.  AnyIO throughout: the same code on either front.
"""

from __future__ import annotations

import logging
import math
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import msgspec
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from trio_orch.engine.api import AcceptedRequest, EngineClient, EngineClosed, Overloaded
from trio_orch.http.limits import HTTPLimits
from trio_orch.http.logs import log_refusal
from trio_orch.http.metrics import FrontMetrics
from trio_orch.http.streaming import SSEResponse, until_done_or_gone
from trio_orch.openai.validation import BadRequest, decode, error_body, parse_json_body
from trio_orch.types import OrchError, OrchOutput

__all__ = ["REQUESTS_LOGGER", "CutPrompt", "OpenAIRoute", "orch_error_status"]

log = logging.getLogger("trio_orch.http")
#: one line per admitted request (its id, route, prompt and sampling), as vLLM's request log: off unless
#: ``serve --enable-log-requests`` lets this logger through
REQUESTS_LOGGER = "trio_orch.requests"
request_log = logging.getLogger(REQUESTS_LOGGER)

S = TypeVar("S", bound=msgspec.Struct)


class CutPrompt(logging.Filter):
    """``serve --max-log-len N``: a request-log line's prompt (its third argument) cut to N characters."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit = limit

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and len(args) > 2 and isinstance(args[2], str):
            record.args = (*args[:2], args[2][:self.limit], *args[3:])
        return True

#: an error terminal's kind -> the status of a request that ended in it before anything was sent
_STATUS = {"timeout": 504, "shutdown": 503, "stage_unavailable": 503, "replica_died": 503, "aborted": 499}


def orch_error_status(err: OrchError) -> int:
    """HTTP status for a request that ended in ``err`` before anything was sent."""
    return _STATUS.get(err.kind, 500)


class OpenAIRoute:
    """One route's plumbing over ``engine``: ``path`` labels its counts and log lines.

    A handler reads its body (:meth:`parse`), then ``await admit(...)``, then
    answers with :meth:`wait` (one non-streamed answer) or :meth:`stream` of
    :meth:`body`; each of them gives either its value or the refusal to return.
    """

    def __init__(self, engine: EngineClient, path: str, front: FrontMetrics, limits: HTTPLimits) -> None:
        self.engine = engine
        self.path = path
        self.front = front
        self.limits = limits

    def parse(self, raw: bytes, schema: type[S]) -> S:
        """The body as ``schema`` (BadRequest naming the field that does not fit)."""
        return decode(parse_json_body(raw, self.limits.max_json_depth), schema, what=f"a {self.path} request")

    def error(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
              code: str | None = None, retry_after: float | None = None) -> JSONResponse:
        self.front.count(self.path, status)
        if status < 500:
            log_refusal(self.path, status, message, logging.INFO if status == 429 else logging.WARNING)
        headers = {"retry-after": str(max(1, math.ceil(retry_after)))} if retry_after is not None else None
        return JSONResponse(error_body(message, kind, param, code), status_code=status, headers=headers)

    def bad(self, exc: BadRequest) -> JSONResponse:
        return self.error(exc.status, str(exc), param=exc.param, code=exc.code)

    def failed(self, err: OrchError) -> JSONResponse:
        """The answer to a request that ended in ``err`` before anything was sent."""
        status = orch_error_status(err)
        return self.error(status, f"request failed: {err.kind}: {err.message}", "server_error", code=err.kind,
                          retry_after=1 if status == 503 else None)

    def ok(self, response: Response) -> Response:
        self.front.count(self.path, response.status_code)
        return response

    def not_running(self) -> JSONResponse | None:
        """The 503 while the engine does not run (None: it runs)."""
        if self.engine.running:
            return None
        why = self.engine.closed_reason or "it has not started"
        return self.error(503, f"the engine is not running: {why}", "server_error", code="engine_closed")

    def overloaded(self, exc: Overloaded) -> JSONResponse:
        return self.error(429, str(exc), "rate_limit_error", code="overloaded", retry_after=exc.retry_after)

    async def admit(self, prompt: Any, *, final_stage_id: int | None, sampling: dict[int, dict[str, Any]],
                    want_timings: bool = False, priority: int = 0) -> AcceptedRequest | JSONResponse:
        """The accepted request's handle, or the refusal (429, 503, or a 400 the engine's checks gave)."""
        refused = self.not_running()
        if refused is not None:
            return refused
        try:
            handle = await self.engine.add_request_async(prompt, final_stage_id=final_stage_id,
                                                         sampling=sampling, want_timings=want_timings,
                                                         priority=priority)
        except Overloaded as exc:
            return self.overloaded(exc)
        except EngineClosed as exc:
            return self.error(503, str(exc), "server_error", code="engine_closed")
        except ValueError as exc:
            return self.error(400, str(exc))
        if handle.rejection is not None:
            return self.failed(handle.rejection)
        if request_log.isEnabledFor(logging.INFO):
            text = prompt.get("text") if isinstance(prompt, dict) else prompt  # a chat's media stay out
            request_log.info("received request %s (%s): prompt: %r, sampling: %s, priority: %d",
                             handle.request_id, self.path, text, sampling, priority)
        return handle

    def client_left(self) -> None:
        """A client left before its answer; its request was aborted (:meth:`FrontMetrics.client_left`)."""
        self.front.client_left(self.path)

    async def wait(self, fn: Callable[[], Awaitable[Any]], request: Request) -> Any:
        """``await fn()`` unless the client leaves first (then its request is aborted: 499)."""
        result, exc, left = await until_done_or_gone(fn, request.receive)
        if left:
            self.client_left()
            self.front.count(self.path, 499)
            return Response(status_code=499)
        if isinstance(exc, EngineClosed):
            return self.error(503, str(exc), "server_error", code="engine_closed")
        if exc is not None:
            raise exc
        if isinstance(result, OrchError):
            return self.failed(result)
        return result

    @staticmethod
    async def collect(handle: AcceptedRequest, absorb: Callable[[OrchOutput], object]) -> OrchError | None:
        """Feed every output of the request to ``absorb``; its error terminal, if it ended in one."""
        async for msgs in handle.batches():
            for m in msgs:
                if isinstance(m, OrchError):
                    return m
                absorb(m)
        return None

    @staticmethod
    async def body(handle: AcceptedRequest, render: Callable[[OrchOutput], bytes],
                   failure: Callable[[str, str], bytes], *, first: bytes = b"", last: bytes = b"",
                   on_end: Callable[[], object] | None = None) -> AsyncIterator[bytes]:
        """The one streaming loop of every generation route.

        ``first``, then the request's outputs rendered, one chunk per
        dispatcher batch; an error terminal (or the engine stopping) ends
        them with ``failure(code, message)``; then ``last``.  ``on_end`` runs
        however the loop ends -- the client left too -- so what was generated
        counts.  Leaving early closes the request's stream, which aborts it.
        """
        if first:
            yield first
        batches = handle.batches()
        try:
            async for msgs in batches:
                out = []
                for m in msgs:
                    if isinstance(m, OrchError):
                        out.append(failure(m.kind, f"request failed: {m.kind}: {m.message}"))
                        break
                    out.append(render(m))
                chunk = b"".join(out)
                if chunk:
                    yield chunk
        except (EngineClosed, ValueError) as exc:
            yield failure("engine_closed", str(exc))
        finally:
            if on_end is not None:
                on_end()
            await batches.aclose()
        if last:
            yield last

    def stream(self, body: AsyncIterator[bytes], media_type: str = SSEResponse.media_type) -> Response:
        """A streamed 200 of ``body``'s chunks; a client that leaves aborts the request under it."""
        response = SSEResponse(body, on_disconnect=self.client_left)
        if media_type != SSEResponse.media_type:  # raw bytes (pcm): the same watch for the client leaving
            response.headers["content-type"] = media_type
        return self.ok(response)
