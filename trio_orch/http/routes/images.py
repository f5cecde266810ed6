"""``POST /v1/images/generations``: the OpenAI Images API shape over a text-to-image pipeline.

Request fields: ``prompt`` (required), ``n`` (1 only), ``size``
(``"WIDTHxHEIGHT"``, multiples of 16 up to 512; default ``"256x256"``: a CPU
model), ``response_format`` (``"b64_json"`` only: nothing is stored to serve
a URL from), ``model`` (optional; if given, a model this server serves),
``user`` (accepted, unused); extensions ``negative_prompt``,
``guidance_scale``, ``num_inference_steps`` and ``seed``.  The body is
read (:func:`~trio_orch.openai.images.parse_image_request`) against
:class:`~trio_orch.openai.protocol.ImageGenerationRequest` as every route's
is: a wrong type or a value out of range is a 400 whose ``param`` names the field, a model not
served a 404, an unknown field ignored and logged.  The
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
import time
import uuid
from collections.abc import Sequence
from functools import partial

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from stages.registry import image_of
from trio_orch.engine.api import EngineClient, Overloaded
from trio_orch.http.generation import OpenAIRoute
from trio_orch.http.limits import HTTPLimits
from trio_orch.http.metrics import FrontMetrics
from trio_orch.openai.images import ImageRequest, parse_image_request
from trio_orch.openai.protocol import ImageGenerationRequest, ServedModels
from trio_orch.openai.validation import BadRequest
from trio_orch.types import OrchError, OrchOutput

__all__ = ["IMAGES", "image_route"]

IMAGES = "/v1/images/generations"
_MADE = ("width", "height", "steps", "guidance_scale", "guided_by")  # the extension: how it was made


def image_route(engine: EngineClient, *, models: ServedModels, outputs: Sequence[str] | None,
                front: FrontMetrics, limits: HTTPLimits) -> Route:
    """``POST /v1/images/generations`` over ``engine``'s pipeline (``front`` counts its answers).

    ``outputs``: each stage's output modality; the route serves images only
    when a final stage gives ``"image"``.
    """
    makes_images = outputs is not None and any(outputs[k] == "image" for k in engine.final_stage_ids)
    route = OpenAIRoute(engine, IMAGES, front, limits)

    async def collect(req: ImageRequest, rid: str, priority: int) -> OrchOutput | OrchError | JSONResponse:
        try:
            async for m in engine.generate(req.stage0_prompt(), request_id=rid,
                                           companions=req.companions(rid), priority=priority):
                if m.finished:
                    return m
        except Overloaded as exc:
            return route.overloaded(exc)
        raise AssertionError("the request ended without a terminal")  # pragma: no cover (the contract)

    def read(raw: bytes) -> tuple[ImageGenerationRequest, ImageRequest]:
        """The one check of an image request."""
        body = route.parse(raw, ImageGenerationRequest)
        if not makes_images:
            raise BadRequest(f"model {models.name!r} makes no images: serve an image pipeline "
                             "(trio-orch serve --pipeline text2image)", "model")
        models.resolve(body.model)
        return body, parse_image_request(body)

    async def generations(request: Request) -> Response:
        try:
            body, req = read(await request.body())
        except BadRequest as exc:
            return route.bad(exc)
        refused = route.not_running()
        if refused is not None:
            return refused
        rid = f"img-{uuid.uuid4().hex[:16]}"
        # 499 if the client left first
        msg = await route.wait(partial(collect, req, rid, body.priority), request)
        if isinstance(msg, Response):
            return msg
        png = image_of(msg.data)
        if png is None:
            return route.error(500, "the pipeline's output is not an image", "server_error")
        data = msg.data
        return route.ok(JSONResponse({
            "created": int(time.time()),
            "data": [{"b64_json": base64.b64encode(png).decode()}],
            "trio_orch": {k: data.get(k) for k in _MADE},
        }))

    return Route(IMAGES, generations, methods=["POST"])
