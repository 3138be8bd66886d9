"""API-key check for every route but /health.

The key is accepted as ``Authorization: Bearer <key>`` (the openai SDK,
curl) or ``x-api-key: <key>`` (Continue, Anthropic-style clients), and is
compared in constant time so response timing does not leak it.
"""

from __future__ import annotations

import hmac

from starlette.requests import Request

from chatapp.server.errors import APIError


def _unauthorized(message: str, code: str) -> APIError:
    return APIError(401, message, code=code, headers={"WWW-Authenticate": "Bearer"})


def bearer_token(authorization: str | None) -> str | None:
    """The credentials of ``Authorization: Bearer <credentials>`` (the scheme in any case), else None."""
    scheme, _, credentials = (authorization or "").partition(" ")
    if scheme.lower() != "bearer":
        return None
    return credentials.strip() or None


async def require_api_key(request: Request) -> None:
    """Raise a 401 unless the request carries the server's key (nothing to check when it has none)."""
    expected: str | None = request.app.state.api_key
    if expected is None:
        return
    bearer, header_key = bearer_token(request.headers.get("authorization")), request.headers.get("x-api-key")
    # Either header may carry it; the right key in one is enough even if the other is wrong
    # (Continue sends "Authorization: Bearer undefined" beside its x-api-key).
    given = [k for k in (bearer, header_key) if k]
    if not given:
        raise _unauthorized(
            "Missing API key: send it as 'Authorization: Bearer <key>' or 'x-api-key: <key>'.", "missing_api_key"
        )
    matches = [hmac.compare_digest(k.encode(), expected.encode()) for k in given]  # both compared, always
    if not any(matches):
        raise _unauthorized("Incorrect API key provided.", "invalid_api_key")
