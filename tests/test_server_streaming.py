"""Streams open as soon as a request is admitted: chat's role chunk and the Responses API's
response.created go out before the engine has produced a token (a fake engine held at its start)."""

from __future__ import annotations

import asyncio
import json

import httpx

from chatapp.engine.tokenizer import Tokenizer
from chatapp.server import start_server
from chatapp.store import bundled_gguf_path
from tests.tui_fakes import FakeClient


async def _first_event_then_rest(path: str, body: dict) -> tuple[dict, list[dict]]:
    """(the first event, received while the engine is held before its first token; the events after)."""
    fake = FakeClient(reply="Paris is the capital.", hold=asyncio.Event(), hold_after=0)
    fake.tokenizer = Tokenizer(bundled_gguf_path())
    handle = await start_server(fake, "127.0.0.1", 0)
    try:
        async with httpx.AsyncClient(timeout=30) as http:
            async with http.stream("POST", handle.url + path, json={**body, "stream": True}) as response:
                assert response.status_code == 200
                lines = response.aiter_lines()
                data = [line async for line in _data_lines(lines, 1)]
                first = json.loads(data[0])
                assert fake.requests, "the request reached the engine"
                fake.hold.set()  # only now may the engine produce its first token
                rest = [json.loads(line) async for line in _data_lines(lines) if line != "[DONE]"]
        return first, rest
    finally:
        await handle.stop()


async def _data_lines(lines, limit: int | None = None):
    count = 0
    async for line in lines:
        if line.startswith("data: "):
            yield line[len("data: ") :]
            count += 1
            if limit is not None and count == limit:
                return


async def test_chat_sends_its_role_chunk_before_the_first_token() -> None:
    first, rest = await _first_event_then_rest(
        "/v1/chat/completions", {"messages": [{"role": "user", "content": "Capital of France?"}]}
    )
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in rest if e["choices"])
    assert text == "Paris is the capital."


async def test_responses_sends_created_before_the_first_token() -> None:
    first, rest = await _first_event_then_rest("/v1/responses", {"input": "Capital of France?"})
    assert first["type"] == "response.created" and first["response"]["status"] == "in_progress"
    assert rest[-1]["type"] == "response.completed"
    assert rest[-1]["response"]["output"][0]["content"][0]["text"] == "Paris is the capital."
