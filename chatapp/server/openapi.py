"""The API's OpenAPI 3.1 document, from the routes' declarations (routing.Endpoint) and pydantic's schemas,
and the two pages that show it in a browser (/docs: Swagger UI, /redoc: ReDoc, both from a CDN).

Editors and agent frameworks never read it; people exploring the API do, as they would vLLM's. It is
built on the first request for it, not at start.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import HTMLResponse, Response

from chatapp.server.routing import Endpoint
from chatapp.server.schemas import ErrorResponse

if TYPE_CHECKING:
    from pydantic.json_schema import JsonSchemaMode

_SECURITY_SCHEMES = {
    "HTTPBearer": {"type": "http", "scheme": "bearer", "description": "the key given to `chatapp serve --api-key`"},
    "APIKeyHeader": {
        "type": "apiKey",
        "in": "header",
        "name": "x-api-key",
        "description": "the same key, as Continue sends it",
    },
}
_REASONS = {400: "Bad request", 401: "Missing or wrong API key", 404: "Not found", 503: "The engine is not ready"}
_PATH_PARAMETER = re.compile(r"\{(\w+)(?::\w+)?\}")


def document(
    title: str, version: str, description: str, open_routes: list[Endpoint], keyed_routes: list[Endpoint], keyed: bool
) -> dict[str, Any]:
    """The whole document; ``keyed``: the server wants a key on ``keyed_routes`` (then they say so)."""
    from pydantic.json_schema import models_json_schema  # ~40 ms of imports, for the rare reader of the document

    wanted: list[tuple[type[BaseModel], JsonSchemaMode]] = [(ErrorResponse, "serialization")]
    for e in open_routes + keyed_routes:
        if e.body is not None:
            wanted.append((e.body, "validation"))
        if e.answer is not None:
            wanted.append((e.answer, "serialization"))
    refs, definitions = models_json_schema(list(dict.fromkeys(wanted)), ref_template="#/components/schemas/{model}")

    def schema(model: type[BaseModel], mode: JsonSchemaMode) -> dict[str, Any]:
        return dict(refs[(model, mode)])

    paths: dict[str, dict[str, Any]] = {}
    for e in open_routes + keyed_routes:
        needs_key = keyed and e in keyed_routes
        paths.setdefault(_PATH_PARAMETER.sub(r"{\1}", e.path), {})[e.method.lower()] = _operation(e, schema, needs_key)
    components: dict[str, Any] = {"schemas": definitions.get("$defs", {})}
    if keyed:
        components["securitySchemes"] = _SECURITY_SCHEMES
    return {
        "openapi": "3.1.0",
        "info": {"title": title, "version": version, "description": description},
        "paths": paths,
        "components": components,
    }


def _operation(
    e: Endpoint, schema: Callable[[type[BaseModel], JsonSchemaMode], dict[str, Any]], needs_key: bool
) -> dict[str, Any]:
    if e.text:
        ok: dict[str, Any] = {"text/plain": {"schema": {"type": "string"}}}
    else:
        ok = {"application/json": {"schema": schema(e.answer, "serialization") if e.answer else {"type": "object"}}}
    if e.streams:
        ok["text/event-stream"] = {"schema": {"type": "string", "description": 'with "stream": true: SSE chunks'}}
    responses: dict[str, Any] = {"200": {"description": "Successful answer", "content": ok}}
    error = {"application/json": {"schema": schema(ErrorResponse, "serialization")}}
    for status in (*e.errors, *((401,) if needs_key else ())):
        responses[str(status)] = {"description": _REASONS.get(status, "Error"), "content": error}
    operation: dict[str, Any] = {"summary": e.summary, "operationId": e.handler.__name__, "responses": responses}
    parameters = _PATH_PARAMETER.findall(e.path)
    if parameters:
        operation["parameters"] = [
            {"name": name, "in": "path", "required": True, "schema": {"type": "string"}} for name in parameters
        ]
    if e.body is not None:
        operation["requestBody"] = {
            "required": True,
            "content": {"application/json": {"schema": schema(e.body, "validation")}},
        }
    if needs_key:
        operation["security"] = [{"HTTPBearer": []}, {"APIKeyHeader": []}]
    return operation


_SWAGGER = """<!doctype html>
<html><head><meta charset="utf-8"><title>{title} - API</title>
<link rel="stylesheet" href="https://cdn.jsdelivr.net/npm/swagger-ui-dist@5/swagger-ui.css"></head>
<body><div id="swagger-ui"></div>
<script src="https://cdn.jsdelivr.net/npm/swagger-ui-dist@5/swagger-ui-bundle.js"></script>
<script>SwaggerUIBundle({{url: "/openapi.json", dom_id: "#swagger-ui"}});</script>
</body></html>
"""
_REDOC = """<!doctype html>
<html><head><meta charset="utf-8"><title>{title} - API</title></head>
<body><redoc spec-url="/openapi.json"></redoc>
<script src="https://cdn.jsdelivr.net/npm/redoc@2/bundles/redoc.standalone.js"></script>
</body></html>
"""


def page(kind: str, title: str) -> Callable[[Request], Awaitable[Response]]:
    """The handler of a page that shows the document: "swagger" (/docs) or "redoc" (/redoc)."""
    html = (_SWAGGER if kind == "swagger" else _REDOC).format(title=title)

    async def show(_request: Request) -> Response:
        return HTMLResponse(html)

    return show
