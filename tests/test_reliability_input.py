"""Bad input to the HTTP server (issue 9): every case gets a clear OpenAI-shaped 4xx naming the field,
while a healthy stream running at the same time finishes with exactly its solo text; then a
property-based fuzz of the request bodies that must never produce a 500.

Tiny random model with a short context (512 tokens), so even an unbounded max_tokens ends quickly.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.reliability_helpers import error_of, sse_data, stream_text
from tests.server_harness import ServedEngine, idle

pytestmark = pytest.mark.timeout(300)

KEY = "input-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
CONTEXT = 512
USER = [{"role": "user", "content": "Say something."}]
HEALTHY = {"prompt": "A healthy request that must not notice its neighbours:", "max_tokens": 24, "temperature": 0}


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> ServedEngine:
    from tests.tiny_model import make_tiny_model

    model = make_tiny_model(tmp_path_factory.mktemp("tiny-ctx512"), max_position_embeddings=CONTEXT)
    engine = {"model": str(model), "num_kv_blocks": 128, "max_num_seqs": 16}
    with ServedEngine(tmp_path_factory.mktemp("runtime"), engine, api_key=KEY) as se:
        yield se


@pytest.fixture(scope="module")
def healthy_text(served: ServedEngine) -> str:
    """The healthy request's answer when it runs alone."""
    response = httpx.post(f"{served.url}/v1/completions", json=HEALTHY, headers=AUTH, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


async def _beside_a_healthy_stream(served: ServedEngine, send_bad: Any) -> tuple[httpx.Response, str]:
    """Start a healthy stream, wait until it is generating, send the bad request, then finish the stream."""
    async with httpx.AsyncClient(base_url=served.url, headers=AUTH, timeout=120) as http:
        async with http.stream("POST", "/v1/completions", json={**HEALTHY, "stream": True}) as stream:
            assert stream.status_code == 200
            lines = stream.aiter_lines()
            seen = []
            while not any(line.startswith("data: {") for line in seen):
                seen.append(await anext(lines))
            bad = await send_bad(http)
            seen += [line async for line in lines]
    text, finish, _ = stream_text(sse_data(seen))
    assert sse_data(seen)[-1] == "[DONE]" and finish in ("stop", "length")
    return bad, text


def _json(body: Any) -> bytes:
    return json.dumps(body).encode()


# (id, path, body bytes, extra headers, status, param, words the message must contain)
BAD_INPUT = [
    ("empty messages", "/v1/chat/completions", _json({"messages": []}), {}, 400, "messages", ["non-empty"]),
    ("messages missing", "/v1/chat/completions", _json({"max_tokens": 2}), {}, 400, "messages", ["required"]),
    (
        "invalid role",
        "/v1/chat/completions",
        _json({"messages": [{"role": "wizard", "content": "hi"}]}),
        {},
        400,
        "messages[0].role",
        ["wizard", "user"],
    ),
    (
        "tool result without its call id",
        "/v1/chat/completions",
        _json({"messages": [{"role": "user", "content": "hi"}, {"role": "tool", "content": "42"}]}),
        {},
        400,
        "messages[1].tool_call_id",
        ["tool_call_id is required"],
    ),
    (
        "tool result with no call before it",
        "/v1/chat/completions",
        _json(
            {"messages": [{"role": "user", "content": "hi"}, {"role": "tool", "tool_call_id": "c1", "content": "42"}]}
        ),
        {},
        400,
        "messages[1].role",
        ["must answer an earlier assistant message's tool_calls"],
    ),
    (
        "role not a string",
        "/v1/chat/completions",
        _json({"messages": [{"role": 7, "content": "hi"}]}),
        {},
        400,
        "messages[0].role",
        ["string"],
    ),
    ("message not an object", "/v1/chat/completions", _json({"messages": ["hi"]}), {}, 400, "messages[0]", []),
    (
        "non-UTF-8 bytes",
        "/v1/chat/completions",
        b'{"messages": [{"role": "user", "content": "caf\xe9 \xff\xfe"}], "max_tokens": 2}',
        {},
        400,
        None,
        ["UTF-8"],
    ),
    (
        "lone surrogate escape",
        "/v1/chat/completions",
        b'{"messages": [{"role": "user", "content": "a \\ud800 b"}], "max_tokens": 2}',
        {},
        400,
        "messages[0].content",
        ["surrogate"],
    ),
    (
        "lone surrogate in a text part",
        "/v1/chat/completions",
        b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udc00"}]}]}',
        {},
        400,
        "messages[0].content[0].text",
        ["surrogate"],
    ),
    (
        "lone surrogate in the model",
        "/v1/chat/completions",
        b'{"messages": [{"role": "user", "content": "hi"}], "model": "\\ud83d"}',
        {},
        400,
        "model",
        ["surrogate"],
    ),
    (
        "lone surrogate in stop",
        "/v1/chat/completions",
        b'{"messages": [{"role": "user", "content": "hi"}], "stop": ["ok", "\\udfff"]}',
        {},
        400,
        "stop[1]",
        ["surrogate"],
    ),
    (
        "lone surrogate prompt",
        "/v1/completions",
        b'{"prompt": ["fine", "\\ud800"], "max_tokens": 2}',
        {},
        400,
        "prompt[1]",
        ["surrogate"],
    ),
    ("lone surrogate input", "/v1/embeddings", b'{"input": "\\ud800"}', {}, 400, "input", ["surrogate"]),
    (
        "1 MB chat prompt",
        "/v1/chat/completions",
        _json({"messages": [{"role": "user", "content": "lorem " * 175_000}], "max_tokens": 2}),
        {},
        400,
        "messages",
        [f"maximum context length is {CONTEXT} tokens"],
    ),
    (
        "1 MB text prompt",
        "/v1/completions",
        _json({"prompt": "lorem " * 175_000, "max_tokens": 2}),
        {},
        400,
        "prompt",
        [f"maximum context length is {CONTEXT} tokens"],
    ),
    (
        "temperature -1",
        "/v1/chat/completions",
        _json({"messages": USER, "temperature": -1}),
        {},
        400,
        "temperature",
        [">= 0"],
    ),
    ("top_p 2", "/v1/chat/completions", _json({"messages": USER, "top_p": 2}), {}, 400, "top_p", ["(0, 1]"]),
    (
        "stream_options without stream",
        "/v1/completions",
        _json({"prompt": "Hi", "stream_options": {"include_usage": True}}),
        {},
        400,
        "stream_options",
        ["only allowed when stream is true"],
    ),
    (
        "max_tokens 0",
        "/v1/chat/completions",
        _json({"messages": USER, "max_tokens": 0}),
        {},
        400,
        "max_tokens",
        ["at least 1"],
    ),
    (
        "max_completion_tokens 0",
        "/v1/chat/completions",
        _json({"messages": USER, "max_completion_tokens": 0}),
        {},
        400,
        "max_completion_tokens",
        ["at least 1"],
    ),
    (
        "max_tokens 10^30",
        "/v1/completions",
        _json({"prompt": "hi", "max_tokens": 10**30}),
        {},
        400,
        "max_tokens",
        ["64-bit"],
    ),
    ("top_k 10^30", "/v1/chat/completions", _json({"messages": USER, "top_k": 10**30}), {}, 400, "top_k", ["64-bit"]),
    (
        "stop list of 300",
        "/v1/chat/completions",
        _json({"messages": USER, "stop": ["x"] * 300}),
        {},
        400,
        "stop",
        ["at most 256"],
    ),
    (
        "unknown model",
        "/v1/chat/completions",
        _json({"messages": USER, "model": "gpt-4o"}),
        {},
        404,
        "model",
        ["gpt-4o", "not a local model"],
    ),
    (
        "malformed JSON",
        "/v1/chat/completions",
        b'{"messages": [{"role": "user", "content": "hi"}',
        {},
        400,
        None,
        ["not valid JSON", "line 1"],
    ),
    ("a JSON array body", "/v1/chat/completions", b"[1, 2, 3]", {}, 400, None, ["JSON object"]),
    ("an empty body", "/v1/chat/completions", b"", {}, 400, None, ["empty"]),
    (
        "a form body",
        "/v1/chat/completions",
        b"messages=hi&max_tokens=2",
        {"Content-Type": "application/x-www-form-urlencoded"},
        400,
        None,
        ["not valid JSON", "application/x-www-form-urlencoded"],
    ),
    (
        "NaN temperature",
        "/v1/chat/completions",
        b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}',
        {},
        400,
        "temperature",
        [],
    ),
    ("token id out of range", "/v1/completions", _json({"prompt": [1, 2, 10**9]}), {}, 400, "prompt", ["out of range"]),
]


@pytest.mark.parametrize(
    "path, body, headers, status, param, words", [case[1:] for case in BAD_INPUT], ids=[case[0] for case in BAD_INPUT]
)
def test_bad_input_is_a_clear_4xx_and_a_neighbour_is_unharmed(
    served: ServedEngine,
    healthy_text: str,
    path: str,
    body: bytes,
    headers: dict[str, str],
    status: int,
    param: str | None,
    words: list[str],
) -> None:
    async def send_bad(http: httpx.AsyncClient) -> httpx.Response:
        return await http.post(path, content=body, headers={"Content-Type": "application/json", **headers})

    response, neighbour = asyncio.run(_beside_a_healthy_stream(served, send_bad))
    assert response.status_code == status, response.text
    error = error_of(response)
    assert error["param"] == param, error
    assert error["type"] == "invalid_request_error"
    for word in words:
        assert word in error["message"], error
    assert neighbour == healthy_text


# -- accepted on purpose ---------------------------------------------------------------------------


def test_a_system_message_alone_is_answered(served: ServedEngine) -> None:
    """OpenAI accepts a conversation without a user turn, and so do we (the template renders it)."""
    for messages in (
        [{"role": "system", "content": "You are terse."}],
        [{"role": "system", "content": "You are terse."}, {"role": "assistant", "content": "Hi."}],
    ):
        response = httpx.post(
            f"{served.url}/v1/chat/completions",
            headers=AUTH,
            timeout=60,
            json={"messages": messages, "max_tokens": 3, "temperature": 0},
        )
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["completion_tokens"] >= 1


def test_a_json_body_with_another_content_type_is_read_as_json(served: ServedEngine, healthy_text: str) -> None:
    """`curl -d` sends form-urlencoded; every POST route takes JSON, so a JSON body is taken as meant."""
    for content_type in ("text/plain", "application/x-www-form-urlencoded", None):
        headers = {**AUTH, **({"Content-Type": content_type} if content_type else {})}
        response = httpx.post(f"{served.url}/v1/completions", content=_json(HEALTHY), headers=headers, timeout=60)
        assert response.status_code == 200, (content_type, response.text)
        assert response.json()["choices"][0]["text"] == healthy_text


def test_max_tokens_beyond_the_context_is_cut_at_the_context_end(served: ServedEngine) -> None:
    """10^9 new tokens can never fit: the answer runs to the end of the context, as with no max_tokens."""
    body = {"prompt": "Count with me: one two three", "max_tokens": 10**9, "temperature": 0, "ignore_eos": True}
    response = httpx.post(f"{served.url}/v1/completions", json=body, headers=AUTH, timeout=120)
    assert response.status_code == 200, response.text
    data = response.json()
    assert data["choices"][0]["finish_reason"] == "length"
    assert data["usage"]["total_tokens"] == served.client.model_info.max_model_len == CONTEXT


def test_a_stop_list_of_100_strings_is_honoured(served: ServedEngine, healthy_text: str) -> None:
    words = healthy_text.split()
    assert len(words) >= 4, healthy_text
    stop = [f"never-{i}" for i in range(99)] + [" " + words[3]]
    response = httpx.post(f"{served.url}/v1/completions", json={**HEALTHY, "stop": stop}, headers=AUTH, timeout=60)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert choice["text"] == healthy_text[: healthy_text.index(" " + words[3])]


# -- property-based fuzz of the request bodies ---------------------------------------------------
#
# Every field gets a valid value most of the time, an edge value (out of range, huge, awkward text)
# sometimes and any JSON value at all now and then, so most bodies get past validation and run in
# the engine while each check still meets bad values. Unknown extra fields are mixed in too.

_awkward_text = st.lists(
    st.one_of(
        st.text(max_size=4),
        st.sampled_from(
            ["\x00", "\ud800", "\udfff", "\U0001f600", "\u202e", "{{", "{%", "<|im_end|>", "\n", "\\", '"']
        ),
    ),
    max_size=6,
).map("".join)
_text = st.one_of(st.text(max_size=30), st.text(max_size=30), st.text(max_size=30), _awkward_text)
_json_values = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(min_value=-(2**70), max_value=2**70),
        st.floats(allow_nan=True, allow_infinity=True),
        _text,
    ),
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(_text, inner, max_size=4)),
    max_leaves=10,
)
_huge = st.sampled_from([-1, 0, 2**31, 2**63 - 1, 2**63, 2**64, 10**30])


def _field(valid: st.SearchStrategy[Any], edge: st.SearchStrategy[Any] | None = None) -> st.SearchStrategy[Any]:
    """7 in 10 valid, 2 in 10 an edge value, 1 in 10 any JSON value."""
    edge = edge if edge is not None else _json_values
    return st.integers(min_value=0, max_value=9).flatmap(lambda k: valid if k < 7 else edge if k < 9 else _json_values)


_prob = _field(st.floats(min_value=0.05, max_value=1), st.sampled_from([0, -0.5, 1.5, 1e-320, 1e308]))
_message = st.fixed_dictionaries(
    {
        "role": _field(
            st.sampled_from(["system", "developer", "user", "assistant"]),
            st.sampled_from(["tool", "function", "", "USER", "ai"]),
        )
    },
    optional={
        "content": _field(
            st.one_of(_text, st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": _text}), max_size=3)),
            st.one_of(
                st.none(),
                st.lists(
                    st.fixed_dictionaries(
                        {"type": st.sampled_from(["image_url", "input_audio", "text", "x"])},
                        optional={"text": _json_values},
                    ),
                    max_size=2,
                ),
            ),
        ),
        "name": _field(_text),
    },
)
_sampling = {
    "model": _field(st.just(None), st.sampled_from(["", "/etc/passwd", "../../secret", "gpt-4o"])),
    "temperature": _field(st.floats(min_value=0, max_value=2), st.sampled_from([-1, 1e-6, 1e308, 3])),
    "top_p": _prob,
    "min_p": _field(st.floats(min_value=0, max_value=0.5), st.sampled_from([-0.1, 1, 2])),
    "top_k": _field(st.sampled_from([-1, 0, 1, 5, 50, 10**6]), _huge),
    "max_tokens": _field(st.integers(min_value=1, max_value=8), _huge),
    "n": _field(st.integers(min_value=1, max_value=3), st.sampled_from([0, 17, 10**30])),
    "seed": _field(st.integers(min_value=-(2**63), max_value=2**63 - 4), _huge),
    "stop": _field(st.one_of(_text, st.lists(_text, max_size=4)), st.lists(_text, min_size=257, max_size=260)),
    "presence_penalty": _field(st.floats(min_value=-2, max_value=2), st.sampled_from([-3, 2.5, 1e308])),
    "frequency_penalty": _field(st.floats(min_value=-2, max_value=2), st.sampled_from([-3, 2.5, 1e308])),
    "repetition_penalty": _field(st.floats(min_value=0.5, max_value=2), st.sampled_from([0, -1, 1e-300, 1e300])),
    "logit_bias": _field(
        st.dictionaries(
            st.integers(min_value=0, max_value=49151).map(str), st.floats(min_value=-100, max_value=100), max_size=3
        ),
        st.dictionaries(st.one_of(_text, _huge.map(str)), st.floats(), max_size=2),
    ),
    "stream": _field(st.booleans()),
    "stream_options": _field(st.fixed_dictionaries({"include_usage": st.booleans()})),
    "ignore_eos": _field(st.booleans()),
    "user": _field(_text),
}
_token_ids = st.lists(st.integers(min_value=0, max_value=49151), max_size=24)
_bad_token_ids = st.lists(st.one_of(st.integers(min_value=0, max_value=49151), _huge), min_size=1, max_size=5)
_extras = st.dictionaries(_text, _json_values, max_size=2)  # fields we do not know: ignored


def _body(required: dict[str, Any], optional: dict[str, Any]) -> st.SearchStrategy[dict[str, Any]]:
    return st.builds(lambda body, extra: {**extra, **body}, st.fixed_dictionaries(required, optional=optional), _extras)


_requests = st.one_of(
    st.tuples(
        st.just("/v1/chat/completions"),
        _body(
            {"messages": _field(st.lists(_message, min_size=1, max_size=4), st.just([]))},
            {
                **_sampling,
                "logprobs": _field(st.booleans()),
                "top_logprobs": _field(st.integers(0, 5), _huge),
                "max_completion_tokens": _sampling["max_tokens"],
                "tools": _field(st.none(), st.lists(_json_values, min_size=1, max_size=2)),
                "response_format": _field(st.just({"type": "text"}), st.just({"type": "json_object"})),
            },
        ),
    ),
    st.tuples(
        st.just("/v1/completions"),
        _body(
            {
                "prompt": _field(
                    st.one_of(
                        _text.filter(bool),
                        st.lists(_text.filter(bool), min_size=1, max_size=3),
                        _token_ids.filter(bool),
                        st.lists(_token_ids.filter(bool), min_size=1, max_size=3),
                    ),
                    st.one_of(st.just(""), st.just([]), _bad_token_ids),
                )
            },
            {
                **_sampling,
                "logprobs": _field(st.integers(0, 5), _huge),
                "echo": _field(st.just(False)),
                "best_of": _field(st.just(1), st.integers(2, 5)),
                "suffix": _field(st.none(), _text),
            },
        ),
    ),
    st.tuples(
        st.just("/v1/embeddings"),
        _body(
            {
                "input": _field(
                    st.one_of(
                        _text.filter(bool),
                        st.lists(_text.filter(bool), min_size=1, max_size=3),
                        _token_ids.filter(bool),
                    ),
                    _bad_token_ids,
                )
            },
            {
                "model": _sampling["model"],
                "encoding_format": _field(st.sampled_from(["float", "base64"])),
                "dimensions": _field(st.none(), st.integers()),
            },
        ),
    ),
)


def _encode(body: Any, cut: int | None) -> bytes:
    """JSON as Python writes it (NaN/Infinity and lone surrogates escaped), sometimes cut short."""
    raw = json.dumps(body).encode()
    return raw if cut is None else raw[: cut % (len(raw) + 1)]


def _check_answer(response: httpx.Response, body: Any) -> None:
    assert response.status_code in (200, 400, 404), (response.status_code, response.text[:500], body)
    if response.status_code != 200:
        assert error_of(response)["type"] == "invalid_request_error"
        return
    if response.headers["content-type"].startswith("text/event-stream"):
        events = sse_data(response.text.splitlines())
        assert events and events[-1] == "[DONE]"
        assert not any(isinstance(e, dict) and "error" in e for e in events), events[-3:]
    else:
        assert response.json()["object"] in ("chat.completion", "text_completion", "list")


def test_fuzzed_request_bodies_never_get_a_500(served: ServedEngine) -> None:
    http = httpx.Client(base_url=served.url, headers={**AUTH, "Content-Type": "application/json"}, timeout=120)
    answered: dict[int, int] = {}

    @settings(
        max_examples=800,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(request=_requests, cut=st.one_of(st.none(), st.none(), st.none(), st.integers(min_value=0)))
    def one(request: tuple[str, dict[str, Any]], cut: int | None) -> None:
        path, body = request
        response = http.post(path, content=_encode(body, cut))
        answered[response.status_code] = answered.get(response.status_code, 0) + 1
        _check_answer(response, body)

    try:
        one()
    finally:
        http.close()
    # The fuzz must have reached the engine often, not only the validators.
    assert answered.get(200, 0) >= 100 and answered.get(400, 0) >= 100, answered
    assert idle(served.wait_until(idle, timeout=30))
    still = httpx.post(f"{served.url}/v1/completions", json=HEALTHY, headers=AUTH, timeout=60)
    assert still.status_code == 200
