"""The application: routes, auth, error shapes, body limit and (opt-in) CORS, on Starlette (routing.py says why)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from starlette.applications import Starlette
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from chatapp import __version__
from chatapp.engine.api import EngineClient
from chatapp.server import openapi
from chatapp.server.auth import require_api_key
from chatapp.server.errors import install_handlers
from chatapp.server.middleware import DEFAULT_MAX_BODY_BYTES, AssumeJSON, BodySizeLimit, RequestCounter
from chatapp.server.routes import chat, completions, embeddings, models, ops, responses
from chatapp.server.routing import Endpoint, get_route, starlette_route
from chatapp.server.state import ServerState, get_state

TITLE = "chatapp"
DESCRIPTION = "A local OpenAI-compatible API on chatapp's engine."


def create_app(
    client: EngineClient | None = None,
    *,
    api_key: str | None = None,
    cors_origins: Sequence[str] = (),
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
) -> Starlette:
    """An app serving ``client`` (None: answer 503 until ``app.state.server.attach(client)``).

    The app never cares which EngineClient implementation it gets.
    """
    open_routes = list(ops.health_router.endpoints)  # no key: probes and the TUI ask it
    keyed_routes: list[Endpoint] = []
    for router in (models.router, chat.router, responses.router, completions.router, embeddings.router):
        keyed_routes += router.endpoints
    keyed_routes += ops.metrics_router.endpoints
    routes = [starlette_route(e, get_state, None) for e in open_routes]
    routes += [starlette_route(e, get_state, require_api_key) for e in keyed_routes]

    described: dict[str, Any] | None = None

    async def openapi_json(request: Request) -> Response:
        nonlocal described
        await require_api_key(request)  # a no-op without a key
        if described is None:  # built when first asked for: pydantic's schema work is nobody else's wait
            described = openapi.document(TITLE, __version__, DESCRIPTION, open_routes, keyed_routes, bool(api_key))
        return JSONResponse(described)

    routes.append(get_route("/openapi.json", openapi_json))
    # With a key, the browsable docs pages go: a browser cannot send the key to fetch the description they show.
    if not api_key:
        routes += [
            get_route(path, openapi.page(kind, TITLE)) for path, kind in (("/docs", "swagger"), ("/redoc", "redoc"))
        ]
    app = Starlette(routes=routes)
    app.state.server = ServerState(client)
    app.state.api_key = api_key or None
    install_handlers(app)

    # The last added is the outermost: CORS headers go on every answer (a 413 included),
    # and the body limit applies before anything reads the body.
    app.add_middleware(AssumeJSON)
    app.add_middleware(RequestCounter, counts=app.state.server.requests)
    app.add_middleware(BodySizeLimit, max_bytes=max_body_bytes)
    if cors_origins:  # no CORS headers at all unless origins were named
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(cors_origins),
            allow_methods=["GET", "POST"],
            allow_headers=["Authorization", "Content-Type", "x-api-key"],
            max_age=600,
        )
    return app
