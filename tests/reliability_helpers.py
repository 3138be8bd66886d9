"""Shared by the tests/test_reliability_*.py modules: SSE parsing and error-shape checks over raw HTTP."""

from __future__ import annotations

import json
from typing import Any

import httpx

ERROR_KEYS = {"message", "type", "param", "code"}


def error_of(response: httpx.Response) -> dict[str, Any]:
    """The ``error`` object of an OpenAI-shaped error answer (asserting the shape on the way)."""
    assert response.headers.get("content-type", "").startswith("application/json"), response.text[:300]
    body = response.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == ERROR_KEYS, error
    assert isinstance(error["message"], str) and error["message"], error
    assert "Traceback" not in error["message"], error
    return error


def sse_data(lines: list[str]) -> list[Any]:
    """The ``data:`` payloads of an SSE body (JSON decoded; ``[DONE]`` kept as the string)."""
    events = []
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: ") :]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def stream_text(events: list[Any]) -> tuple[str, str | None, dict[str, Any] | None]:
    """(text, finish_reason, usage) of a one-choice chat or text-completion stream; errors fail."""
    text, finish, usage = "", None, None
    for event in events:
        if event == "[DONE]":
            continue
        assert "error" not in event, event
        if event.get("usage"):
            usage = event["usage"]
        for choice in event["choices"]:
            assert choice["index"] == 0
            text += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
            finish = choice["finish_reason"] or finish
    return text, finish, usage
