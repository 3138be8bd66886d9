"""Our routes on Starlette: each declared once, with its body model, its answers and whether it needs the key.

Why not FastAPI: importing it costs ~0.15 s of CPU (its OpenAPI models are built at import), and the
serving process spends it on the way to its first /health, beside the engine loading on the other core:
`chatapp serve`'s imports went from ~0.45 to ~0.29 s. What we used of it is here: a JSON body checked by
its pydantic model (errors.py shapes the 400s), the answer's model written out as JSON, the key check, and
the OpenAPI document built from the same declarations.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from chatapp.server.errors import body_not_json, body_not_utf8, empty_body, not_an_object, validation_failed

Handler = Callable[..., Awaitable[Any]]


@dataclass(frozen=True)
class Endpoint:
    """One route as the app serves it and as the OpenAPI document describes it."""

    method: str
    path: str
    handler: Handler
    body: type[BaseModel] | None = None  # the JSON body's model (POST)
    answer: type[BaseModel] | None = None  # the 200 answer's model, None for a free-form JSON object
    errors: tuple[int, ...] = ()  # statuses answered with an ErrorResponse
    streams: bool = False  # with "stream": true the answer is server-sent events
    text: bool = False  # the answer is plain text (/metrics)
    summary: str = ""


@dataclass
class Router:
    """A module's endpoints, gathered by the app (app.py) with or without the key check."""

    endpoints: list[Endpoint] = field(default_factory=list)

    def get(self, path: str, **options: Any) -> Callable[[Handler], Handler]:
        return self._add("GET", path, options)

    def post(self, path: str, **options: Any) -> Callable[[Handler], Handler]:
        return self._add("POST", path, options)

    def _add(self, method: str, path: str, options: dict[str, Any]) -> Callable[[Handler], Handler]:
        def register(handler: Handler) -> Handler:
            doc = inspect.getdoc(handler) or ""
            summary = options.pop("summary", None) or doc.split("\n", 1)[0]
            self.endpoints.append(Endpoint(method, path, handler, summary=summary, **options))
            return handler

        return register


Check = Callable[[Request], Awaitable[None]]


def starlette_route(endpoint: Endpoint, state_of: Callable[[Request], Any], check: Check | None) -> Route:
    """A Starlette route that runs ``check`` (the key), reads and validates the body, and calls the handler
    with what its signature names: ``body``, ``request``, ``state`` and the path's parameters."""
    wanted = set(inspect.signature(endpoint.handler).parameters)

    async def run(request: Request) -> Response:
        if check is not None:
            await check(request)
        kwargs: dict[str, Any] = {name: value for name, value in request.path_params.items() if name in wanted}
        if endpoint.body is not None:
            kwargs["body"] = await read_body(request, endpoint.body)
        if "request" in wanted:
            kwargs["request"] = request
        if "state" in wanted:
            kwargs["state"] = state_of(request)
        return as_response(await endpoint.handler(**kwargs))

    return _route(endpoint.path, run, endpoint.method, endpoint.handler.__name__)


def get_route(path: str, run: Callable[[Request], Awaitable[Response]]) -> Route:
    """A GET route outside the API's declarations (the OpenAPI document and its pages)."""
    return _route(path, run, "GET", path.strip("/"))


def _route(path: str, run: Callable[[Request], Awaitable[Response]], method: str, name: str) -> Route:
    route = Route(path, run, methods=[method], name=name)
    assert route.methods is not None  # set: methods were named
    route.methods.discard("HEAD")  # GET only, as the API always was: a HEAD gets a 405, not a bodiless answer
    return route


async def read_body(request: Request, model: type[BaseModel]) -> BaseModel:
    """The request's JSON body as ``model``; a 400 in OpenAI's shape that says what is wrong otherwise."""
    raw = await request.body()
    if not raw:
        raise empty_body()
    try:
        data = json.loads(raw)  # bytes: UTF-8, -16 or -32, as the JSON standard allows
    except UnicodeDecodeError as exc:
        raise body_not_utf8(exc) from None
    except json.JSONDecodeError as exc:
        raise body_not_json(exc, request) from None
    if not isinstance(data, dict):
        raise not_an_object(data)
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise validation_failed(exc.errors()) from None


def as_response(answer: Any) -> Response:
    """A handler's answer as sent: a Response as it is, a model as its JSON (aliases, JSON types), else JSON."""
    if isinstance(answer, Response):
        return answer
    if isinstance(answer, BaseModel):
        return JSONResponse(answer.model_dump(mode="json", by_alias=True))
    return JSONResponse(answer)
