"""``POST /v1/images/generations``: the OpenAI Images API shape over a text-to-image pipeline.

Request fields: ``prompt`` (required), ``n`` (1 only), ``size``
(``"WIDTHxHEIGHT"``, multiples of 16 up to 512; default ``"256x256"``: a CPU
model), ``response_format`` (``"b64_json"`` only: nothing is stored to serve
a URL from), ``model`` (optional; if given, the model this server serves),
``user`` (accepted, unused); extensions ``negative_prompt``,
``guidance_scale``, ``num_inference_steps`` and ``seed``.  Any other field,
or a value out of range, is a 400 whose ``param`` names the field.  The
answer is ``{"created", "data": [{"b64_json": <PNG>}]}`` plus a ``trio_orch``
extension saying how the image was made (size, steps, guidance and the
companion it used).

One server process serves one pipeline: ``trio-orch serve --pipeline
text2image`` serves images, the default pipeline serves chat completions;
on a server whose pipeline makes no images this route answers 400 naming
``model``.  It is a generation route: while the engine sheds, a POST to it
gets 429 with ``Retry-After`` before its body is read (the app's
``Shedder``), and one the engine sheds after all gets the same 429.  A client
that disconnects while waiting aborts its request (and its negative-prompt
companion) in the orchestrator.
"""

from __future__ import annotations

import base64
import json
import logging
import math
import time
import uuid
from collections.abc import Sequence
from functools import partial
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from stages.registry import image_of
from trio_orch.engine import Engine, EngineClosed, Overloaded
from trio_orch.http.metrics import FrontMetrics
from trio_orch.http.openai_chat import orch_error_status
from trio_orch.http.schemas import error_body
from trio_orch.http.streaming import until_done_or_gone
from trio_orch.http.text2image import ImageOptionError, ImageRequest, parse_size
from trio_orch.types import OrchError, OrchOutput

__all__ = ["IMAGES", "image_route", "parse_image_request"]

log = logging.getLogger("trio_orch.http.openai_images")

IMAGES = "/v1/images/generations"
_MADE = ("width", "height", "steps", "guidance_scale", "guided_by")  # the extension: how it was made
_KNOWN = {"prompt", "n", "size", "response_format", "model", "user", "negative_prompt", "guidance_scale",
          "num_inference_steps", "seed"}


def _typed(body: dict[str, Any], name: str, types: tuple[type, ...], what: str) -> Any:
    value = body[name]
    if isinstance(value, bool) or not isinstance(value, types):
        raise ImageOptionError(name, f"{name} must be {what}, got {json.dumps(value)[:80]}")
    return value


def parse_image_request(body: Any, model_name: str) -> ImageRequest:
    """An OpenAI images request body -> a checked :class:`ImageRequest` (ImageOptionError names the field)."""
    if not isinstance(body, dict):
        raise ImageOptionError("body", "the request body must be a JSON object")
    unknown = sorted(set(body) - _KNOWN)
    if unknown:
        raise ImageOptionError(unknown[0], f"unsupported field {unknown[0]!r} "
                                           f"(supported: {', '.join(sorted(_KNOWN))})")
    if "prompt" not in body:
        raise ImageOptionError("prompt", "prompt is required")
    prompt = _typed(body, "prompt", (str,), "a string")
    if "model" in body and _typed(body, "model", (str,), "a string") != model_name:
        raise ImageOptionError("model", f"this server serves model {model_name!r}, not {body['model']!r}")
    if "n" in body and _typed(body, "n", (int,), "an integer") != 1:
        raise ImageOptionError("n", f"n must be 1 (one image per request), got {body['n']}")
    if "response_format" in body and _typed(body, "response_format", (str,), "a string") != "b64_json":
        raise ImageOptionError("response_format",
                               "response_format must be 'b64_json' (no image URLs are served)")
    if "user" in body:
        _typed(body, "user", (str,), "a string")
    width, height = parse_size(body.get("size", "256x256"))
    negative = _typed(body, "negative_prompt", (str,), "a string") if "negative_prompt" in body else None
    g = _typed(body, "guidance_scale", (int, float), "a number") if "guidance_scale" in body else 4.0
    steps = _typed(body, "num_inference_steps", (int,), "an integer") if "num_inference_steps" in body else 8
    seed = _typed(body, "seed", (int,), "an integer") if "seed" in body else 0
    return ImageRequest(prompt, negative, width, height, steps, float(g), seed).checked()


def image_route(engine: Engine, *, model_name: str, outputs: Sequence[str] | None,
                front: FrontMetrics) -> Route:
    """``POST /v1/images/generations`` over ``engine``'s pipeline (``front`` counts its answers).

    ``outputs``: each stage's output modality; the route serves images only
    when a final stage gives ``"image"``.
    """
    makes_images = outputs is not None and any(outputs[k] == "image" for k in engine.final_stage_ids)

    def error(status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
              code: str | None = None, retry_after: float | None = None) -> JSONResponse:
        front.count(IMAGES, status)
        if status < 500:
            log.log(logging.INFO if status == 429 else logging.WARNING, "refused an image request (%d): %s",
                    status, message)
        headers = {"retry-after": str(max(1, math.ceil(retry_after)))} if retry_after is not None else None
        return JSONResponse(error_body(message, kind, param, code), status_code=status, headers=headers)

    async def collect(req: ImageRequest, rid: str) -> OrchOutput | OrchError:
        async for m in engine.generate(req.stage0_prompt(), request_id=rid, companions=req.companions(rid)):
            if m.finished:
                return m
        raise EngineClosed("the request ended without a terminal")  # pragma: no cover (the contract)

    async def generations(request: Request) -> Response:
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
            return error(400, f"malformed JSON in the request body: {exc}", code="invalid_json")
        if not makes_images:
            return error(400, f"model {model_name!r} makes no images: serve an image pipeline "
                              "(trio-orch serve --pipeline text2image)", "model")
        try:
            req = parse_image_request(body, model_name)
        except ImageOptionError as exc:
            return error(400, str(exc), exc.field)
        if not engine.running:
            why = engine.closed_reason or "it has not started"
            return error(503, f"the engine is not running: {why}", kind="server_error", code="engine_closed")
        rid = f"img-{uuid.uuid4().hex[:16]}"
        msg, exc, left = await until_done_or_gone(partial(collect, req, rid), request.receive)
        if left:  # the client left: cancelling the collector aborted the request
            log.info("image request %s: the client disconnected; aborted", rid)
            front.disconnects += 1
            front.count(IMAGES, 499)
            return Response(status_code=499)
        if isinstance(exc, Overloaded):
            return error(429, str(exc), kind="rate_limit_error", code="overloaded",
                         retry_after=exc.retry_after)
        if isinstance(exc, EngineClosed):
            return error(503, str(exc), kind="server_error", code="engine_closed")
        if exc is not None:
            raise exc
        if isinstance(msg, OrchError):
            return error(orch_error_status(msg), f"request failed: {msg.kind}: {msg.message}",
                         kind="server_error", code=msg.kind)
        png = image_of(msg.data)
        if png is None:
            return error(500, "the pipeline's output is not an image", kind="server_error")
        data = msg.data
        log.info("image request %s: %sx%s, %s steps, guidance %s%s", rid, data.get("width"),
                 data.get("height"), data.get("steps"), data.get("guidance_scale"),
                 f" used the companion {data['guided_by']!r}" if data.get("guided_by") else " off")
        front.count(IMAGES, 200)
        return JSONResponse({
            "created": int(time.time()),
            "data": [{"b64_json": base64.b64encode(png).decode()}],
            "trio_orch": {k: data.get(k) for k in _MADE},
        })

    return Route(IMAGES, generations, methods=["POST"])
