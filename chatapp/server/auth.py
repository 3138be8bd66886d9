"""API-key check for every route but /health.

The key is accepted as ``Authorization: Bearer <key>`` (the openai SDK,
curl) or ``x-api-key: <key>`` (Continue, Anthropic-style clients), and is
compared in constant time so response timing does not leak it.
"""

from __future__ import annotations

import hmac

from fastapi import Request, Security
from fastapi.security import APIKeyHeader, HTTPAuthorizationCredentials, HTTPBearer

from chatapp.server.errors import APIError

_bearer = HTTPBearer(auto_error=False, description="the key given to `chatapp serve --api-key`")
_header = APIKeyHeader(name="x-api-key", auto_error=False, description="the same key, as Continue sends it")


def _unauthorized(message: str, code: str) -> APIError:
    return APIError(401, message, code=code, headers={"WWW-Authenticate": "Bearer"})


async def require_api_key(
    request: Request,
    bearer: HTTPAuthorizationCredentials | None = Security(_bearer),
    header_key: str | None = Security(_header),
) -> None:
    expected: str | None = request.app.state.api_key
    if expected is None:
        return
    # Either header may carry it; the right key in one is enough even if the other is wrong
    # (Continue sends "Authorization: Bearer undefined" beside its x-api-key).
    given = [k for k in (bearer.credentials if bearer is not None else None, header_key) if k]
    if not given:
        raise _unauthorized(
            "Missing API key: send it as 'Authorization: Bearer <key>' or 'x-api-key: <key>'.", "missing_api_key"
        )
    matches = [hmac.compare_digest(k.encode(), expected.encode()) for k in given]  # both compared, always
    if not any(matches):
        raise _unauthorized("Incorrect API key provided.", "invalid_api_key")
