"""Every error leaves the server in OpenAI's shape: ``{"error": {message, type, param, code}}``.

Clients (the openai SDK, litellm, editors) parse that shape to show the user
what went wrong, and the SDK retries 5xx answers, so a client's mistake must
always be a 4xx. The engine's exceptions are mapped here, in one place.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Sequence
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from chatapp.engine.api import EngineBusyError, EngineDeadError, InvalidRequestError
from chatapp.engine.tokenizer import ChatFormatError

log = logging.getLogger(__name__)

CONTEXT_LENGTH_PREFIX = "This model's maximum context length is"
SENT_CONTENT_TYPE = "chatapp.sent_content_type"
"""Scope key: the Content-Type the client sent, before middleware.AssumeJSON replaced it."""
RETRY_AFTER_SECONDS = 5


class APIError(Exception):
    """An error answer, raised anywhere in a request and rendered by the app's handler."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


class EngineFailure(Exception):
    """A stream ended with finish_reason "error" or "abort" (a model switch, an engine error)."""


class ClientGone(APIError):
    """The client closed the connection before the answer was ready; nobody reads this answer."""

    def __init__(self) -> None:
        super().__init__(499, "the client closed the connection", code="client_closed_request")


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def unsupported(param: str, what: str | None = None) -> APIError:
    """A known OpenAI feature this server does not implement: say so instead of ignoring it."""
    return APIError(400, f"{what or param} is not supported by this server", param=param, code="unsupported_parameter")


def unavailable(message: str) -> APIError:
    return APIError(
        503, message, type="server_error", code="engine_unavailable", headers={"Retry-After": str(RETRY_AFTER_SECONDS)}
    )


def from_engine_error(exc: BaseException, prompt_param: str) -> APIError:
    """Map an exception from the engine client (or prompt rendering) to its HTTP answer."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, InvalidRequestError):
        message = str(exc)
        if message.startswith(CONTEXT_LENGTH_PREFIX):
            return APIError(400, message, param=exc.param or prompt_param, code="context_length_exceeded")
        return bad_request(message, exc.param or prompt_param)
    if isinstance(exc, ChatFormatError):
        match = re.match(r"(messages\[\d+\](?:\.\w+)?(?:\[\d+\])?)", str(exc))
        return bad_request(str(exc), match.group(1) if match else "messages")
    if isinstance(exc, EngineFailure):
        return APIError(500, str(exc), type="server_error", code="engine_error")
    if isinstance(exc, EngineDeadError):
        return unavailable(f"the engine stopped ({exc}); it is restarting, retry shortly")
    if isinstance(exc, EngineBusyError):
        return unavailable(f"the engine is busy: {exc}")
    log.exception("unexpected error from the engine", exc_info=exc)
    return APIError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error")


def sampling_error(exc: ValueError, renames: dict[str, str]) -> APIError:
    """SamplingParams raises ``ValueError("<field> <why>")``; name the field the client sent."""
    message = str(exc)
    field = message.split(" ", 1)[0]
    param = renames.get(field, field)
    if param != field:
        message = param + message[len(field) :]
    return bad_request(message, param)


_UNION_TAGS = {"str", "int", "float", "bool", "dict", "list", "none"}


def _param_from_loc(loc: tuple[Any, ...]) -> str | None:
    """("body", "messages", 0, "content") -> "messages[0].content"."""
    out = ""
    for part in loc[1:] if loc[:1] == ("body",) else loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif not isinstance(part, str) or part in _UNION_TAGS or "[" in part or part.startswith("function-"):
            continue  # pydantic's names of union members ("str", "list[int]") add nothing for the client
        else:
            out += f".{part}" if out else part
    return out or None


async def _api_error(_: Request, exc: Exception) -> Response:
    assert isinstance(exc, APIError)
    return exc.response()


_JSON_KINDS = {
    list: "an array",
    str: "a string",
    int: "a number",
    float: "a number",
    bool: "a boolean",
    type(None): "null",
}


def empty_body() -> APIError:
    return bad_request("the request body is empty: send a JSON object", None)


def body_not_utf8(bad: UnicodeDecodeError) -> APIError:
    return bad_request(
        f"the request body is not valid UTF-8: byte 0x{bad.object[bad.start]:02x} at position "
        f"{bad.start} ({bad.reason}); send JSON encoded as UTF-8",
        None,
    )


def body_not_json(exc: json.JSONDecodeError, request: Request) -> APIError:
    """Where the JSON broke ("Expecting ',' delimiter at line 1 column 49"), and what was sent instead."""
    message = f"the request body is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}"
    sent_as = request.scope.get(SENT_CONTENT_TYPE)
    if sent_as and "json" not in sent_as.lower():
        message += f" (it was sent as {sent_as}; this API takes JSON)"
    return bad_request(message, None)


def not_an_object(data: Any) -> APIError:
    kind = _JSON_KINDS.get(type(data), "something else")
    return bad_request(f"the request body must be a JSON object, got {kind}", None)


def validation_failed(errors: Sequence[Any]) -> APIError:
    """pydantic's errors for a body: the first one, its field named as the client wrote it."""
    first: dict[str, Any] = errors[0] if errors else {"loc": (), "msg": "invalid request", "type": ""}
    if first.get("type") == "invalid_unicode":  # schemas._Body names the string itself
        return bad_request(str(first["msg"]), first["ctx"]["param"])
    param = _param_from_loc(tuple(first.get("loc", ())))
    message = f"{param}: {first['msg']}" if param else str(first["msg"])
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})"
    return bad_request(message, param)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    if exc.status_code == 404:
        message = f"no such route: {request.method} {request.url.path}"
    elif exc.status_code == 405:
        message = f"method {request.method} is not allowed on {request.url.path}"
    else:
        message = str(exc.detail)
    kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
    return APIError(
        exc.status_code,
        message,
        type=kind,
        code="not_found" if exc.status_code == 404 else None,
        headers=dict(exc.headers or {}),
    ).response()


async def _unexpected(_: Request, exc: Exception) -> Response:
    log.exception("unhandled error in the HTTP server", exc_info=exc)
    return APIError(500, f"internal error: {type(exc).__name__}", type="server_error").response()


def install_handlers(app: Starlette) -> None:
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(Exception, _unexpected)
