"""A request-body size limit, enforced before anything parses the body.

Plain ASGI (not BaseHTTPMiddleware, which would get in the way of streaming
and of disconnect detection). A declared Content-Length over the limit is
refused at once; a chunked body is counted as it arrives. After the body,
``receive`` is handed through, so routes still see ``http.disconnect``.

An oversized body is read to its end (discarding it, up to a bound) before
the 413 goes out: a client still writing when the server closes the
connection would see a reset instead of the error.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from chatapp.server.errors import SENT_CONTENT_TYPE, APIError

DEFAULT_MAX_BODY_BYTES = 4 * 2**20
_DRAIN_FACTOR = 16  # past this many times the limit, stop reading and just answer


class BodySizeLimit:
    def __init__(self, app: ASGIApp, max_bytes: int = DEFAULT_MAX_BODY_BYTES) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def _refuse(self, scope: Scope, receive: Receive, send: Send, received: int, more: bool) -> None:
        while more and received <= self.max_bytes * _DRAIN_FACTOR:
            message = await receive()
            if message["type"] != "http.request":
                return
            received += len(message.get("body", b""))
            more = message.get("more_body", False)
        error = APIError(
            413,
            f"The request body is larger than this server's limit of {self.max_bytes} bytes.",
            code="request_too_large",
        )
        await error.response()(scope, receive, send)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or ())
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._refuse(scope, receive, send, 0, True)
            return

        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left while sending
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await self._refuse(scope, receive, send, size, message.get("more_body", False))
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break

        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


class AssumeJSON:
    """Treat every POST body as JSON, whatever its Content-Type says.

    ``curl -d '{...}'`` sends ``application/x-www-form-urlencoded`` and some
    clients send no type at all; every POST route here takes JSON, so reading
    it as JSON is what the caller meant (and bad JSON still gets a clear 400, which
    names the type that was sent).
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            sent = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"content-type"), None)
            headers = [(k, v) for k, v in scope["headers"] if k != b"content-type"]
            scope = {**scope, "headers": headers + [(b"content-type", b"application/json")], SENT_CONTENT_TYPE: sent}
        await self.app(scope, receive, send)


class RequestCounter:
    """Counts the API's requests (``/v1/...``) as they run and in all, for the TUI's status bar.

    A streamed answer counts as running until its last chunk is sent (the app's call returns then).
    """

    def __init__(self, app: ASGIApp, counts: RequestCounts) -> None:
        self.app = app
        self.counts = counts

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope.get("path", "").startswith("/v1/"):
            await self.app(scope, receive, send)
            return
        self.counts.running += 1
        self.counts.total += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.counts.running -= 1


class RequestCounts:
    """How many API requests run now, and how many came since the server started."""

    def __init__(self) -> None:
        self.running = 0
        self.total = 0
