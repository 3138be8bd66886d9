"""The FastAPI application: routers, auth, error shapes, body limit and (opt-in) CORS."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fastapi import Depends, FastAPI
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse

from chatapp import __version__
from chatapp.engine.api import EngineClient
from chatapp.server.auth import require_api_key
from chatapp.server.errors import install_handlers
from chatapp.server.middleware import DEFAULT_MAX_BODY_BYTES, AssumeJSON, BodySizeLimit, RequestCounter
from chatapp.server.routes import chat, completions, embeddings, models, ops, responses
from chatapp.server.state import ServerState


def create_app(
    client: EngineClient | None = None,
    *,
    api_key: str | None = None,
    cors_origins: Sequence[str] = (),
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
) -> FastAPI:
    """An app serving ``client`` (None: answer 503 until ``app.state.server.attach(client)``).

    The app never cares which EngineClient implementation it gets.
    """
    # With a key, every route but /health needs it, the API's description included; the browsable
    # docs pages go (a browser cannot send the key to fetch the description they show).
    docs: dict[str, Any] = {} if not api_key else {"openapi_url": None, "docs_url": None, "redoc_url": None}
    app = FastAPI(
        title="chatapp", version=__version__, description="A local OpenAI-compatible API on chatapp's engine.", **docs
    )
    app.state.server = ServerState(client)
    app.state.api_key = api_key or None
    install_handlers(app)

    app.include_router(ops.health_router)  # no key: probes and the TUI ask it
    keyed = [Depends(require_api_key)]
    if api_key:

        @app.get("/openapi.json", include_in_schema=False, dependencies=keyed)
        async def openapi() -> JSONResponse:
            return JSONResponse(app.openapi())

    for router in (
        models.router,
        chat.router,
        responses.router,
        completions.router,
        embeddings.router,
        ops.metrics_router,
    ):
        app.include_router(router, dependencies=keyed)

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
