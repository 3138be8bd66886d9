"""A remote session's client against a server that answers with streams of other shapes."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from chatapp.engine.outputs import FinishReason
from chatapp.tui.remote_client import RemoteClient, RemoteError


class _Stream:
    """A one-route server whose /v1/chat/completions answers with ``body``, as server-sent events."""

    def __init__(self) -> None:
        self.body = b""
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("content-length", 0)))
                self.send_response(200)
                self.send_header("content-type", "text/event-stream")
                self.end_headers()
                self.wfile.write(owner.body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"


@pytest.fixture(scope="module")
def stream() -> Iterator[_Stream]:
    server = _Stream()
    yield server
    server.server.shutdown()


def _chunk(**changes: object) -> dict[str, object]:
    choice = {"index": 0, "delta": {"content": "hi"}, "finish_reason": None}
    chunk: dict[str, object] = {"id": "c", "object": "chat.completion.chunk", "created": 0, "model": "m"}
    return {**chunk, "choices": [choice], **changes}


def _events(*payloads: object) -> bytes:
    lines = [p if isinstance(p, bytes) else json.dumps(p).encode() for p in payloads]
    return b"".join(b"data: " + line + b"\n\n" for line in lines) + b"data: [DONE]\n\n"


async def _answer(url: str) -> list[tuple[str, bool, FinishReason | None, int]]:
    client = RemoteClient(url, None, "m", timeout_s=10)
    try:
        return [
            (d.text, d.finished, d.finish_reason, d.num_output_tokens)
            async for d in client.generate(messages=[{"role": "user", "content": "hi"}])
        ]
    finally:
        await client.close()


async def test_a_well_formed_stream_is_read(stream: _Stream) -> None:
    stream.body = _events(
        _chunk(),
        _chunk(choices=[{"index": 0, "delta": {}, "finish_reason": "length"}]),
        _chunk(choices=[], usage={"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}),
    )
    assert await _answer(stream.url) == [("hi", False, None, 1), ("", True, FinishReason.LENGTH, 1)]


@pytest.mark.parametrize(
    "payload",
    [
        b"{not json",
        _chunk(choices=[0]),
        _chunk(choices=[{"index": 0, "delta": {"content": 5}, "finish_reason": None}]),
        _chunk(usage={"prompt_tokens": "three", "completion_tokens": 1, "total_tokens": 4}),
    ],
    ids=["not-json", "choice-is-a-number", "content-is-a-number", "count-is-text"],
)
async def test_a_stream_of_another_shape_is_a_remote_error_naming_the_server(stream: _Stream, payload: object) -> None:
    """Found by fuzzing streams: each was a JSONDecodeError, AttributeError or TypeError out of the client,
    or a number handed to the pane as text, which the pane's worker dropped without saying why."""
    stream.body = _events(_chunk(), payload)
    with pytest.raises(RemoteError, match=rf"{stream.url} sent a stream that is not a chat completion"):
        await _answer(stream.url)
