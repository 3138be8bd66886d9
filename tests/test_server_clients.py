"""Real clients' request shapes replayed as raw JSON (Zed, Continue, Open WebUI), CORS, and an
engine that dies under a live stream (issue 6). Tiny random model: the shapes are the point here.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from tests.server_harness import ServedEngine

pytestmark = pytest.mark.timeout(180)

KEY = "replay-key"
SYSTEM = "You are a helpful coding assistant."


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> ServedEngine:
    from tests.tiny_model import make_tiny_model

    model = make_tiny_model(tmp_path_factory.mktemp("tiny-8k"), max_position_embeddings=8192)
    engine = {"model": str(model), "num_kv_blocks": 1024, "max_num_seqs": 16}
    with ServedEngine(tmp_path_factory.mktemp("runtime"), engine, api_key=KEY) as se:
        yield se


@pytest.fixture(scope="module")
def model(served: ServedEngine) -> str:
    return served.client.model_info.name


def sse_events(text: str) -> list[Any]:
    """Parse an SSE body the way clients do: one JSON document per `data:` line, then [DONE]."""
    events = []
    for block in text.split("\n\n"):
        if not block.strip():
            continue
        assert block.startswith("data: "), block
        data = block[len("data: ") :]
        events.append(data if data == "[DONE]" else json.loads(data))
    assert events and events[-1] == "[DONE]" and "[DONE]" not in events[:-1]
    return events[:-1]


def check_usage(usage: dict[str, Any]) -> None:
    assert all(isinstance(usage[k], int) for k in ("prompt_tokens", "completion_tokens", "total_tokens"))
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


def check_chat_stream(events: list[dict[str, Any]], include_usage: bool) -> str:
    """What Zed's and Continue's stream parsers read: choices[].delta.{role,content}, finish_reason, usage."""
    assert len({e["id"] for e in events}) == 1
    body = events[:-1] if include_usage else events
    for event in body:
        assert event["object"] == "chat.completion.chunk" and len(event["choices"]) == 1
        choice = event["choices"][0]
        assert choice["index"] == 0 and isinstance(choice["delta"], dict)
        assert set(choice["delta"]) <= {"role", "content"}
        assert choice["delta"].get("role", "assistant") == "assistant"
        assert choice["finish_reason"] in (None, "stop", "length")
        assert ("usage" in event and event["usage"] is None) if include_usage else "usage" not in event
    assert body[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert [e["choices"][0]["finish_reason"] for e in body if e["choices"][0]["finish_reason"]] == ["length"]
    assert body[-1]["choices"][0]["delta"] == {}
    if include_usage:
        assert events[-1]["choices"] == []
        check_usage(events[-1]["usage"])
    return "".join(e["choices"][0]["delta"].get("content", "") for e in body)


def test_zed_request_shape(served: ServedEngine, model: str) -> None:
    """Zed's OpenAI-compatible provider: max_completion_tokens only, include_usage, a stop list, multipart content."""
    body = {
        "model": model,
        "messages": [
            {"role": "system", "content": SYSTEM},
            {
                "role": "user",
                "content": [{"type": "text", "text": "Explain this code:"}, {"type": "text", "text": "fn main() {}"}],
            },
        ],
        "stream": True,
        "max_completion_tokens": 6,
        "stop": ["<|im_end|>"],
        "temperature": 1.0,
        "stream_options": {"include_usage": True},
        "prompt_cache_key": "thread-1234",
    }
    response = httpx.post(
        f"{served.url}/v1/chat/completions", json=body, timeout=60, headers={"Authorization": f"Bearer {KEY}"}
    )
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    events = sse_events(response.text)
    check_chat_stream(events, include_usage=True)
    assert events[-1]["usage"]["completion_tokens"] == 6


def test_continue_request_shape(served: ServedEngine, model: str) -> None:
    """Continue: x-api-key instead of Authorization, include_usage, a long stop list, max_tokens, penalties."""
    stop = [
        "<|im_start|>",
        "<|im_end|>",
        "<|endoftext|>",
        "\n\n\n",
        "```\n\n",
        "/src/",
        "#- coding: utf-8",
        "\ndef ",
        "\nclass ",
        "\nif __name__",
        "\n# ",
        "<fim_prefix>",
        "<fim_suffix>",
        "<fim_middle>",
        "<file_sep>",
        "<|fim▁begin|>",
        "<|fim▁hole|>",
        "<|fim▁end|>",
        "</s>",
        "[/INST]",
        "<EOT>",
        "\n\n\n\n",
    ]
    body = {
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Write a haiku."}],
        "model": model,
        "max_tokens": 6,
        "temperature": 0.5,
        "top_p": 0.9,
        "frequency_penalty": 0.1,
        "presence_penalty": 0.1,
        "stop": stop,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    response = httpx.post(f"{served.url}/v1/chat/completions", json=body, timeout=60, headers={"x-api-key": KEY})
    assert response.status_code == 200
    events = sse_events(response.text)
    text = check_chat_stream(events, include_usage=True)
    assert not any(s in text for s in stop)


def test_open_webui_request_shape(served: ServedEngine, model: str) -> None:
    """Open WebUI: lists models, then chats with many fields of its own (ignored), streamed and not."""
    headers = {"Authorization": f"Bearer {KEY}"}
    listing = httpx.get(f"{served.url}/v1/models", headers=headers).json()
    assert listing["object"] == "list" and listing["data"][0]["id"] == model
    extras = {
        "metadata": {"chat_id": "c1", "message_id": "m1", "session_id": "s1"},
        "features": {"web_search": False, "image_generation": False},
        "variables": {"{{USER_NAME}}": "user"},
        "params": {},
        "files": [],
        "tool_ids": None,
        "chat_id": "c1",
        "id": "m1",
        "session_id": "s1",
        "background_tasks": {"title_generation": True, "tags_generation": True},
        "keep_alive": "5m",
    }
    messages = [{"role": "user", "content": "Hello!"}]
    whole = httpx.post(
        f"{served.url}/v1/chat/completions",
        headers=headers,
        timeout=60,
        json={
            "model": model,
            "messages": messages,
            "stream": False,
            "max_tokens": 5,
            "top_k": 40,
            "min_p": 0.05,
            "user": "user-1",
            **extras,
        },
    )
    assert whole.status_code == 200, whole.text
    data = whole.json()
    assert data["object"] == "chat.completion" and isinstance(data["choices"][0]["message"]["content"], str)
    check_usage(data["usage"])
    streamed = httpx.post(
        f"{served.url}/v1/chat/completions",
        headers=headers,
        timeout=60,
        json={"model": model, "messages": messages, "stream": True, "max_tokens": 5, **extras},
    )
    check_chat_stream(sse_events(streamed.text), include_usage=False)


def test_developer_role_is_a_system_message(served: ServedEngine, model: str) -> None:
    def ask(role: str) -> dict[str, Any]:
        messages = [{"role": role, "content": SYSTEM}, {"role": "user", "content": "Hi"}]
        response = httpx.post(
            f"{served.url}/v1/chat/completions",
            headers={"Authorization": f"Bearer {KEY}"},
            json={"model": model, "messages": messages, "max_tokens": 4, "temperature": 0},
        )
        assert response.status_code == 200, response.text
        return response.json()

    developer, system = ask("developer"), ask("system")
    assert developer["usage"] == system["usage"]
    assert developer["choices"][0]["message"] == system["choices"][0]["message"]


def test_models_lists_every_local_model_and_any_of_them_answers_by_name(
    served: ServedEngine, model: str, tiny_llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 19: /v1/models lists the local store by readable ids (never paths), the loaded ones marked;
    a request naming one that is not loaded loads it beside the default model and answers."""
    from chatapp import store
    from chatapp.server import state

    monkeypatch.setattr(state, "CATALOG_TTL_S", 0.0)  # list the store afresh on every request
    listing = [  # the store's LocalModel shape
        SimpleNamespace(
            name=model,
            source="bundled",
            path=Path(served.client.model_info.path),
            size_bytes=1,
            facts=SimpleNamespace(supported=True),
        ),
        SimpleNamespace(
            name=str(tiny_llama),
            source="directory",
            path=tiny_llama,
            size_bytes=1,
            facts=SimpleNamespace(supported=True),
        ),
        SimpleNamespace(
            name="org/broken",
            source="hf-cache",
            path=Path("/nowhere"),
            size_bytes=1,
            facts=SimpleNamespace(supported=False),
        ),
    ]
    monkeypatch.setattr(store, "list_models", lambda: listing, raising=False)
    auth = {"Authorization": f"Bearer {KEY}"}
    data = httpx.get(f"{served.url}/v1/models", headers=auth).json()["data"]
    assert [(m["id"], m["loaded"]) for m in data] == [(model, True), (tiny_llama.name, False)]
    assert data[0]["max_model_len"] == served.client.model_info.max_model_len > 0
    assert all(m["object"] == "model" and m["owned_by"] == "chatapp" and m["created"] > 0 for m in data)

    answer = httpx.post(
        f"{served.url}/v1/chat/completions",
        headers=auth,
        json={"model": tiny_llama.name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
        timeout=120,
    )
    assert answer.status_code == 200, answer.text
    assert answer.json()["model"] == tiny_llama.name
    data = httpx.get(f"{served.url}/v1/models", headers=auth).json()["data"]
    assert [(m["id"], m["loaded"]) for m in data] == [(model, True), (tiny_llama.name, True)]
    assert data[1]["max_model_len"] > 0
    assert httpx.get(f"{served.url}/v1/models/{tiny_llama.name}", headers=auth).json()["loaded"] is True

    for missing in ("org/other-model", "org/broken"):
        other = httpx.post(
            f"{served.url}/v1/chat/completions",
            headers=auth,
            json={"model": missing, "messages": [{"role": "user", "content": "hi"}]},
        )
        assert other.status_code == 404 and other.json()["error"]["param"] == "model"


def test_cors_headers_only_for_named_origins(served: ServedEngine) -> None:
    from chatapp.server import start_server

    preflight = {
        "Origin": "http://localhost:3000",
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type",
    }
    default = httpx.options(f"{served.url}/v1/chat/completions", headers=preflight)
    assert "access-control-allow-origin" not in default.headers
    plain = httpx.get(
        f"{served.url}/v1/models", headers={"Origin": "http://localhost:3000", "Authorization": f"Bearer {KEY}"}
    )
    assert plain.status_code == 200 and "access-control-allow-origin" not in plain.headers

    async def start() -> Any:
        return await start_server(served.client, "127.0.0.1", 0, api_key=KEY, cors_origins=["http://localhost:3000"])

    handle = served.run(start)
    try:
        allowed = httpx.options(f"{handle.url}/v1/chat/completions", headers=preflight)
        assert allowed.status_code == 200
        assert allowed.headers["access-control-allow-origin"] == "http://localhost:3000"
        other = httpx.options(f"{handle.url}/v1/chat/completions", headers={**preflight, "Origin": "http://evil.test"})
        assert "access-control-allow-origin" not in other.headers
        listed = httpx.get(
            f"{handle.url}/v1/models", headers={"Origin": "http://localhost:3000", "Authorization": f"Bearer {KEY}"}
        )
        assert listed.headers["access-control-allow-origin"] == "http://localhost:3000"
    finally:
        served.run(handle.stop)


def test_engine_death_mid_stream_is_an_error_event_then_the_server_recovers(served: ServedEngine, model: str) -> None:
    """Runs last: it kills this module's engine. The stream ends with an error event and [DONE];
    the server answers 503 with Retry-After while it restarts the engine, then serves again."""
    headers = {"Authorization": f"Bearer {KEY}"}
    body = {"model": model, "prompt": "Once upon a time", "max_tokens": 100_000, "stream": True}
    lines = []
    with httpx.stream("POST", f"{served.url}/v1/completions", json=body, headers=headers, timeout=60) as r:
        for line in r.iter_lines():
            lines.append(line)
            if len(lines) == 6:
                os.kill(served.client.engine_pid, signal.SIGKILL)
    events = [line[len("data: ") :] for line in lines if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])
    assert set(error) == {"error"} and error["error"]["message"] and error["error"]["type"] == "server_error"

    during = httpx.post(
        f"{served.url}/v1/completions", json={**body, "stream": False, "max_tokens": 2}, headers=headers, timeout=60
    )
    assert during.status_code == 503 and int(during.headers["retry-after"]) > 0
    assert during.json()["error"]["code"] == "engine_unavailable"

    deadline = time.monotonic() + 120
    while httpx.get(f"{served.url}/health").status_code != 200:
        assert time.monotonic() < deadline, "the engine did not come back"
        time.sleep(0.25)
    after = httpx.post(
        f"{served.url}/v1/completions", json={**body, "stream": False, "max_tokens": 2}, headers=headers, timeout=60
    )
    assert after.status_code == 200 and after.json()["usage"]["completion_tokens"] == 2
