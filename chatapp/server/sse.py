"""Server-sent events the way OpenAI streams them: ``data: <json>`` per event, then ``data: [DONE]``.

Once a stream has begun its status line is sent, so a later error can only
travel as an event: ``data: {"error": {...}}``, followed by ``[DONE]`` so
clients stop reading cleanly.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.responses import StreamingResponse

from chatapp.server.errors import APIError

_DONE = "data: [DONE]\n\n"


def _event(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


async def _encode(
    events: AsyncIterator[dict[str, Any]], to_api_error: Callable[[BaseException], APIError]
) -> AsyncIterator[str]:
    try:
        async for payload in events:
            yield _event(payload)
    except Exception as exc:  # noqa: BLE001  every error becomes an error event
        yield _event(to_api_error(exc).body())
    yield _DONE


def event_stream(
    events: AsyncIterator[dict[str, Any]], to_api_error: Callable[[BaseException], APIError]
) -> StreamingResponse:
    return StreamingResponse(
        _encode(events, to_api_error),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )
