"""``GET /openapi.json`` and ``GET /docs``: the real routes, described from the app itself.

The document is made once, from the routes :func:`~trio_orch.http.app.create_app`
assembled (so it lists exactly what this server answers: ``/admin/...`` only
with an admin token, ``/v1/images/generations`` beside the others, the
``/v1/realtime`` WebSocket as its upgrade), with each POST route's request
body as JSON Schema made from its ``msgspec`` schema (:data:`REQUEST_SCHEMAS`;
a test checks that every POST route has one).  Both routes are open without
the API key, as ``/health`` is (:class:`~trio_orch.http.auth.ApiKeyAuth`);
routes behind the key or the admin token say so (``security``).  ``/docs``
is Swagger UI, loaded by the browser from its CDN (as FastAPI's is).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import HTMLResponse, Response
from starlette.routing import BaseRoute, Route, WebSocketRoute

from trio_orch import __version__
from trio_orch.http.auth import ADMIN_PREFIX, ApiKeyAuth
from trio_orch.http.routes.admin import ROUTES as ADMIN_ROUTES
from trio_orch.http.routes.chat import CHAT
from trio_orch.http.routes.completions import COMPLETIONS
from trio_orch.http.routes.images import IMAGES
from trio_orch.http.routes.speech import SPEECH
from trio_orch.http.routes.tokenize import DETOKENIZE, TOKENIZE
from trio_orch.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ImageGenerationRequest,
    SpeechRequest,
    TokenizeRequest,
)

__all__ = ["DOCS", "OPENAPI", "REQUEST_SCHEMAS", "openapi_document", "openapi_routes"]

OPENAPI = "/openapi.json"
DOCS = "/docs"

#: each POST route's request body
REQUEST_SCHEMAS: dict[str, type[msgspec.Struct]] = {
    CHAT: ChatCompletionRequest, COMPLETIONS: CompletionRequest, SPEECH: SpeechRequest,
    IMAGES: ImageGenerationRequest, TOKENIZE: TokenizeRequest, DETOKENIZE: DetokenizeRequest,
    **{f"{ADMIN_PREFIX}{name}": schema for name, (_, schema, _) in ADMIN_ROUTES.items()},
}

_PARAM = re.compile(r"\{(\w+)(?::\w+)?\}")

_SWAGGER = """<!doctype html>
<html><head><title>trio-orch API</title><meta charset="utf-8">
<link rel="stylesheet" href="https://cdn.jsdelivr.net/npm/swagger-ui-dist@5/swagger-ui.css"></head>
<body><div id="swagger-ui"></div>
<script src="https://cdn.jsdelivr.net/npm/swagger-ui-dist@5/swagger-ui-bundle.js"></script>
<script>SwaggerUIBundle({url: %s, dom_id: "#swagger-ui"});</script>
</body></html>
"""


def openapi_document(routes: Sequence[BaseRoute], *, api_key: bool, root_path: str = "") -> dict[str, Any]:
    """The OpenAPI 3.1 document of ``routes`` (``api_key``: the server asks for one)."""
    schemas = [REQUEST_SCHEMAS[r.path] for r in routes if isinstance(r, Route) and r.path in REQUEST_SCHEMAS]
    refs, components = msgspec.json.schema_components(schemas, ref_template="#/components/schemas/{name}")
    body = dict(zip((s.__name__ for s in schemas), refs, strict=True))
    paths: dict[str, dict[str, Any]] = {}
    for r in routes:
        if isinstance(r, WebSocketRoute):
            paths[r.path] = {"get": {"summary": "WebSocket session (OpenAI's Realtime protocol): the upgrade",
                                     "responses": {"101": {"description": "Switching Protocols"}},
                                     **_security(r.path, api_key)}}
            continue
        if not isinstance(r, Route):
            continue
        path = _PARAM.sub(r"{\1}", r.path)
        operations = paths.setdefault(path, {})
        for method in sorted((r.methods or set()) - {"HEAD"}):
            op: dict[str, Any] = {"operationId": f"{method.lower()}_{path.strip('/').replace('/', '_')}",
                                  "responses": {"200": {"description": "OK"}}, **_security(r.path, api_key)}
            params = _PARAM.findall(r.path)
            if params:
                op["parameters"] = [{"name": p, "in": "path", "required": True, "schema": {"type": "string"}}
                                    for p in params]
            schema = REQUEST_SCHEMAS.get(r.path)
            if method == "POST" and schema is not None:
                op["requestBody"] = {"required": not r.path.startswith(ADMIN_PREFIX),
                                     "content": {"application/json": {"schema": body[schema.__name__]}}}
            operations[method.lower()] = op
    doc: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {"title": "trio-orch", "version": __version__,
                 "description": "OpenAI's and vLLM's HTTP dialect over a multi-stage pipeline"},
        "paths": paths,
        "components": {"schemas": components,
                       "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
    }
    if root_path:
        doc["servers"] = [{"url": root_path}]
    return doc


def _security(path: str, api_key: bool) -> dict[str, Any]:
    """An operation's ``security``: the admin token for ``/admin/...``; the API key elsewhere, if any."""
    if path.startswith(ADMIN_PREFIX) or (api_key and path not in ApiKeyAuth.OPEN):
        return {"security": [{"bearer": []}]}
    return {}


def openapi_routes(routes: Sequence[BaseRoute], *, api_key: bool, root_path: str = "") -> list[BaseRoute]:
    """``/openapi.json`` (the document of ``routes``, made now) and ``/docs``."""
    text = json.dumps(openapi_document(routes, api_key=api_key, root_path=root_path)).encode()

    async def document(request: Request) -> Response:
        return Response(text, media_type="application/json")

    async def docs(request: Request) -> Response:
        return HTMLResponse(_SWAGGER % json.dumps(root_path + OPENAPI))

    return [Route(OPENAPI, document, methods=["GET"]), Route(DOCS, docs, methods=["GET"])]
