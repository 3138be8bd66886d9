"""The HTTP server driven by the official openai SDK, on the real bundled model (issue 6).

One engine and one server (with an API key) for the whole module; every
generation is short and greedy unless sampling itself is under test.
"""

from __future__ import annotations

import base64
import math
from typing import Any

import httpx
import numpy as np
import openai
import pytest
from openai import OpenAI

from chatapp.engine.sampling_params import SamplingParams
from chatapp.engine.tokenizer import Tokenizer
from chatapp.store import resolve_model
from tests.server_harness import ServedEngine, idle

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

KEY = "sdk-test-key"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> ServedEngine:
    with ServedEngine(tmp_path_factory.mktemp("runtime"), {"kv_cache_memory_gib": 0.25}, api_key=KEY) as se:
        yield se


@pytest.fixture(scope="module")
def sdk(served: ServedEngine) -> OpenAI:
    return OpenAI(base_url=f"{served.url}/v1", api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def model(served: ServedEngine) -> str:
    return served.client.model_info.name


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer(resolve_model(None).path)


def engine_run(served: ServedEngine, params: SamplingParams, **prompt: Any) -> tuple[str, list[int]]:
    """The same request straight through the engine client, bypassing HTTP."""

    async def go() -> tuple[str, list[int]]:
        text, ids = "", []
        async for delta in served.client.generate(params=params, **prompt):
            text += delta.text
            ids += delta.token_ids
        return text, ids

    return served.run(go)


def raw(served: ServedEngine, method: str, path: str, key: str | None = KEY, **kwargs: Any) -> httpx.Response:
    headers = kwargs.pop("headers", {})
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    return httpx.request(method, served.url + path, headers=headers, timeout=60, **kwargs)


def assert_error_shape(body: dict[str, Any]) -> dict[str, Any]:
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["message"]
    return body["error"]


# -- models, health, metrics, openapi -----------------------------------------------


def test_models_lists_the_loaded_model_first(served: ServedEngine, sdk: OpenAI, model: str) -> None:
    models = sdk.models.list()
    assert models.data[0].id == model == "SmolLM2-135M-Instruct"
    assert models.data[0].object == "model" and models.data[0].owned_by and models.data[0].created > 0
    response = raw(served, "GET", "/v1/models")
    assert response.headers["content-type"] == "application/json"
    assert response.json()["object"] == "list"
    assert sdk.models.retrieve(model).id == model


def test_health_needs_no_key_and_metrics_do(served: ServedEngine) -> None:
    health = raw(served, "GET", "/health", key=None)
    assert health.status_code == 200 and health.json()["status"] == "ok"
    assert raw(served, "GET", "/metrics", key=None).status_code == 401
    metrics = raw(served, "GET", "/metrics").text
    for name in (
        "chatapp_requests_running",
        "chatapp_requests_waiting",
        "chatapp_kv_cache_blocks_used",
        "chatapp_kv_cache_blocks_total",
        "chatapp_prefix_cache_hit_rate",
        "chatapp_preemptions_total",
        "chatapp_prompt_tokens_total",
        "chatapp_generation_tokens_total",
    ):
        assert f"# TYPE {name} " in metrics and f'{name}{{model="SmolLM2-135M-Instruct"}} ' in metrics
    # Every EngineStats counter is exported, each said in its unit (the prefix cache counts tokens).
    stats = served.stats()
    from chatapp.server.routes.ops import _METRICS

    for field, name, _kind, help_text in _METRICS:
        assert hasattr(stats, field) and f"# HELP {name} {help_text}" in metrics
    assert "# HELP chatapp_prefix_cache_queries_total Prompt tokens looked up." in metrics


def test_openapi_document_lists_the_endpoints(served: ServedEngine) -> None:
    doc = raw(served, "GET", "/openapi.json").json()
    for path in ("/v1/models", "/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/health", "/metrics"):
        assert path in doc["paths"]


# -- chat ------------------------------------------------------------------------------


def test_chat_matches_the_engine_and_counts_tokens_like_the_tokenizer(
    served: ServedEngine, sdk: OpenAI, model: str, tokenizer: Tokenizer
) -> None:
    out = sdk.chat.completions.create(model=model, messages=QUESTION, max_tokens=MAX_TOKENS, temperature=0)
    text, ids = engine_run(served, SamplingParams(temperature=0, max_tokens=MAX_TOKENS), messages=QUESTION)
    assert out.id.startswith("chatcmpl-") and out.object == "chat.completion" and out.model == model
    choice = out.choices[0]
    assert choice.message.role == "assistant" and choice.message.content == text and text
    assert choice.finish_reason in ("stop", "length") and choice.logprobs is None
    assert out.usage.prompt_tokens == len(tokenizer.render_chat(QUESTION))
    assert out.usage.completion_tokens == len(ids)
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens


def test_chat_stream_shape_and_usage(sdk: OpenAI, model: str, tokenizer: Tokenizer) -> None:
    whole = sdk.chat.completions.create(model=model, messages=QUESTION, max_tokens=MAX_TOKENS, temperature=0)
    chunks = list(
        sdk.chat.completions.create(
            model=model,
            messages=QUESTION,
            max_tokens=MAX_TOKENS,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("chatcmpl-")
    assert all(c.object == "chat.completion.chunk" and c.model == model for c in chunks)
    first = chunks[0].choices[0]
    assert first.delta.role == "assistant" and first.delta.content == "" and first.finish_reason is None
    *with_choices, usage_chunk = chunks
    assert usage_chunk.choices == [] and usage_chunk.usage is not None
    assert all(c.usage is None for c in with_choices)
    finishes = [c.choices[0].finish_reason for c in with_choices if c.choices[0].finish_reason is not None]
    assert finishes == [whole.choices[0].finish_reason]
    last = with_choices[-1].choices[0]
    assert last.finish_reason is not None and last.delta.content is None and last.delta.role is None
    text = "".join(c.choices[0].delta.content or "" for c in with_choices)
    assert text == whole.choices[0].message.content
    assert usage_chunk.usage.prompt_tokens == len(tokenizer.render_chat(QUESTION))
    assert usage_chunk.usage.completion_tokens == whole.usage.completion_tokens


def test_stream_without_include_usage_has_no_usage_chunk(served: ServedEngine, model: str) -> None:
    body = {"model": model, "messages": QUESTION, "max_tokens": 2, "temperature": 0, "stream": True}
    response = raw(served, "POST", "/v1/chat/completions", json=body)
    assert response.headers["content-type"].startswith("text/event-stream")
    events = [line[len("data: ") :] for line in response.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert all('"usage"' not in e and '"choices":[]' not in e for e in events[:-1])


def test_max_completion_tokens_limits_the_answer(sdk: OpenAI, model: str) -> None:
    out = sdk.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Tell me a long story."}],
        max_completion_tokens=3,
        temperature=0,
    )
    assert out.usage.completion_tokens == 3 and out.choices[0].finish_reason == "length"


def test_n_choices_with_a_seed_are_repeatable_and_differ(sdk: OpenAI, model: str, tokenizer: Tokenizer) -> None:
    first_prompt_tokens = len(tokenizer.render_chat(QUESTION))

    def ask() -> list[str]:
        out = sdk.chat.completions.create(
            model=model, messages=QUESTION, max_tokens=MAX_TOKENS, n=2, seed=1234, temperature=1.0
        )
        assert [c.index for c in out.choices] == [0, 1]
        assert 2 <= out.usage.completion_tokens <= 2 * MAX_TOKENS  # both choices counted
        assert out.usage.prompt_tokens == first_prompt_tokens  # the shared prompt once
        return [c.message.content for c in out.choices]

    first, again = ask(), ask()
    assert first == again  # seed i and seed+1 for the two choices, both repeatable
    assert first[0] != first[1]


def test_seed_repeats_and_other_seeds_differ(sdk: OpenAI, model: str) -> None:
    def ask(seed: int) -> str:
        return (
            sdk.chat.completions.create(
                model=model, messages=QUESTION, max_tokens=MAX_TOKENS, seed=seed, temperature=1.0
            )
            .choices[0]
            .message.content
        )

    assert ask(7) == ask(7)
    assert len({ask(7), ask(8), ask(9)}) > 1


def test_stop_string_ends_the_answer_before_it(sdk: OpenAI, model: str) -> None:
    greedy = sdk.chat.completions.create(model=model, messages=QUESTION, max_tokens=MAX_TOKENS, temperature=0)
    text = greedy.choices[0].message.content
    words = text.split()
    assert len(words) >= 3, text
    stop = " " + words[2]
    out = sdk.chat.completions.create(
        model=model, messages=QUESTION, max_tokens=MAX_TOKENS, temperature=0, stop=["never-appears", stop]
    )
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].message.content == text[: text.index(stop)]


def test_chat_logprobs(sdk: OpenAI, model: str) -> None:
    out = sdk.chat.completions.create(
        model=model, messages=QUESTION, max_tokens=MAX_TOKENS, temperature=0, logprobs=True, top_logprobs=3
    )
    content = out.choices[0].logprobs.content
    # one entry a token of the answer; an answer that ended on <|im_end|> (7 tokens here) does not list that token,
    # which usage still counts (test_the_end_of_turn_token_is_never_in_logprobs)
    ended = out.choices[0].finish_reason == "stop"
    assert len(content) == out.usage.completion_tokens - ended
    for entry in content:
        assert len(entry.top_logprobs) == 3 and entry.logprob <= 0
        assert entry.top_logprobs[0].token == entry.token  # greedy picks the most likely token
        assert math.isclose(entry.top_logprobs[0].logprob, entry.logprob, abs_tol=1e-4)
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob >= entry.top_logprobs[2].logprob
    assert "".join(e.token for e in content).startswith(out.choices[0].message.content)


@pytest.mark.parametrize("stream", [False, True])
def test_the_end_of_turn_token_is_never_in_logprobs(sdk: OpenAI, model: str, stream: bool) -> None:
    """An answer that stops on <|im_end|> lists its content's tokens only, as OpenAI does."""
    ask = [{"role": "user", "content": "What is 2 + 2?"}]  # answered in 12 tokens, then <|im_end|>
    args = dict(model=model, messages=ask, max_tokens=64, temperature=0, logprobs=True)
    if stream:
        chunks = list(sdk.chat.completions.create(stream=True, stream_options={"include_usage": True}, **args))
        entries = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        finish = next(c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason)
        used = chunks[-1].usage.completion_tokens
    else:
        out = sdk.chat.completions.create(**args)
        entries, text = out.choices[0].logprobs.content, out.choices[0].message.content
        finish, used = out.choices[0].finish_reason, out.usage.completion_tokens
    assert finish == "stop"
    assert "".join(e.token for e in entries) == text
    assert len(entries) == used - 1  # usage still counts the token the model generated
    assert all("<|im_end|>" not in e.token for e in entries)


def test_echo_gives_the_prompt_back_with_its_logprobs(sdk: OpenAI, model: str, tokenizer: Tokenizer) -> None:
    """A prompt's echoed logprobs score its tokens as the model scored them when it wrote them."""
    prompt = "The capital of France is"
    first = sdk.completions.create(model=model, prompt=prompt, max_tokens=3, temperature=0, logprobs=1)
    ids = tokenizer.encode(prompt) + tokenizer.encode(first.choices[0].text)[: len(first.choices[0].logprobs.tokens)]
    echoed = sdk.completions.create(model=model, prompt=ids, max_tokens=1, temperature=0, logprobs=1, echo=True)
    lp = echoed.choices[0].logprobs
    n = len(ids)
    assert echoed.choices[0].text.startswith(prompt + first.choices[0].text)
    assert len(lp.tokens) == n + 1 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    written = first.choices[0].logprobs.token_logprobs
    assert lp.token_logprobs[n - len(written) : n] == pytest.approx(written, abs=1e-3)
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    streamed = list(
        sdk.completions.create(model=model, prompt=ids, max_tokens=1, temperature=0, logprobs=1, echo=True, stream=True)
    )
    assert "".join(c.choices[0].text for c in streamed) == echoed.choices[0].text
    plain = sdk.completions.create(model=model, prompt=prompt, max_tokens=2, temperature=0, echo=True)
    assert plain.choices[0].text.startswith(prompt) and plain.choices[0].logprobs is None


def test_logprobs_zero_has_no_top_logprobs(sdk: OpenAI, model: str) -> None:
    # Greedy: a sampled answer may end after " Paris." (as one in a full local run did), leaving fewer than 3 tokens.
    out = sdk.completions.create(
        model=model, prompt="The capital of France is", max_tokens=3, temperature=0, logprobs=0
    )
    lp = out.choices[0].logprobs
    assert out.choices[0].finish_reason == "length"
    assert lp.top_logprobs is None and len(lp.tokens) == len(lp.token_logprobs) == 3


def test_logit_bias_bans_the_greedy_first_token(sdk: OpenAI, model: str, tokenizer: Tokenizer) -> None:
    greedy = sdk.chat.completions.create(model=model, messages=QUESTION, max_tokens=1, temperature=0, logprobs=True)
    banned = tokenizer.encode(greedy.choices[0].logprobs.content[0].token)[0]
    out = sdk.chat.completions.create(
        model=model, messages=QUESTION, max_tokens=1, temperature=0, logprobs=True, logit_bias={str(banned): -100}
    )
    assert tokenizer.encode(out.choices[0].logprobs.content[0].token)[0] != banned


# -- completions ------------------------------------------------------------------------


def test_completions_text_list_and_token_prompts(
    served: ServedEngine, sdk: OpenAI, model: str, tokenizer: Tokenizer
) -> None:
    prompt = "The capital of France is"
    ids = tokenizer.encode(prompt)
    text, out_ids = engine_run(served, SamplingParams(temperature=0, max_tokens=MAX_TOKENS), prompt=prompt)
    single = sdk.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
    assert single.id.startswith("cmpl-") and single.object == "text_completion"
    assert single.choices[0].text == text
    assert single.usage.prompt_tokens == len(ids) and single.usage.completion_tokens == len(out_ids)
    from_ids = sdk.completions.create(model=model, prompt=ids, max_tokens=MAX_TOKENS, temperature=0)
    assert from_ids.choices[0].text == text
    two = sdk.completions.create(model=model, prompt=[prompt, "1, 2, 3,"], max_tokens=MAX_TOKENS, temperature=0)
    assert [c.index for c in two.choices] == [0, 1] and two.choices[0].text == text
    assert two.usage.prompt_tokens == len(ids) + len(tokenizer.encode("1, 2, 3,"))


def test_completions_stream_and_logprobs(sdk: OpenAI, model: str) -> None:
    prompt = "The capital of France is"
    whole = sdk.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, logprobs=2)
    lp = whole.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == whole.usage.completion_tokens
    assert all(
        len(top) == 2 and max(top.values()) == pytest.approx(chosen, abs=1e-4)
        for top, chosen in zip(lp.top_logprobs, lp.token_logprobs)
    )
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    chunks = list(
        sdk.completions.create(
            model=model,
            prompt=prompt,
            max_tokens=MAX_TOKENS,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert len({c.id for c in chunks}) == 1
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [
        whole.choices[0].finish_reason
    ]


# -- embeddings ---------------------------------------------------------------------------


def test_embeddings_float_and_base64(served: ServedEngine, sdk: OpenAI, model: str, tokenizer: Tokenizer) -> None:
    inputs = ["The capital of France is Paris.", "Bread is baked in an oven."]
    as_float = sdk.embeddings.create(model=model, input=inputs, encoding_format="float")
    default = sdk.embeddings.create(model=model, input=inputs)  # the SDK asks for base64 and decodes it
    direct = served.run(lambda: served.client.embed(inputs))
    assert [d.index for d in as_float.data] == [0, 1]
    for f, b, d in zip(as_float.data, default.data, direct):
        assert len(f.embedding) == 576 == len(d)  # SmolLM2-135M's hidden size
        assert np.allclose(f.embedding, d, atol=1e-6)
        assert np.allclose(b.embedding, np.float32(d), atol=0)
        assert math.isclose(float(np.linalg.norm(f.embedding)), 1.0, abs_tol=1e-4)
    assert as_float.usage.prompt_tokens == sum(len(tokenizer.encode(t)) for t in inputs)
    raw_b64 = raw(served, "POST", "/v1/embeddings", json={"input": inputs[0], "encoding_format": "base64"}).json()
    decoded = np.frombuffer(base64.b64decode(raw_b64["data"][0]["embedding"]), dtype="<f4")
    assert np.allclose(decoded, direct[0], atol=1e-6)


# -- errors -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"n": 0}, "n"),
        ({"max_completion_tokens": 0}, "max_completion_tokens"),
        ({"logprobs": True, "top_logprobs": 50}, "top_logprobs"),
        ({"logit_bias": {"not-a-token": 1}}, "logit_bias"),
        ({"tools": [{"type": "function", "function": {"name": "no spaces allowed"}}]}, "tools[0].function.name"),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"temperature": "hot"}, "temperature"),  # a pydantic error: 400, not FastAPI's 422
        ({"seed": 2**70}, "seed"),
        ({"stop": ["x"] * 300}, "stop"),
    ],
)
def test_invalid_parameters_are_400_naming_the_field(
    sdk: OpenAI, model: str, extra: dict[str, Any], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        sdk.chat.completions.create(model=model, messages=QUESTION, max_tokens=2, extra_body=extra)
    assert info.value.status_code == 400 and info.value.param == param
    assert_error_shape(info.value.response.json())


def test_unsupported_content_parts_name_the_part(sdk: OpenAI, model: str) -> None:
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "What is this?"},
                {"type": "image_url", "image_url": {"url": "data:,"}},
            ],
        }
    ]
    with pytest.raises(openai.BadRequestError) as info:
        sdk.chat.completions.create(model=model, messages=messages, max_tokens=2)
    assert info.value.param == "messages[0].content[1]" and "image" in info.value.message
    with pytest.raises(openai.BadRequestError) as info:
        sdk.chat.completions.create(model=model, messages=[{"role": "tool", "content": "x"}], max_tokens=2)
    assert info.value.param == "messages[0].tool_call_id"


def test_missing_field_and_bad_json_are_400(served: ServedEngine) -> None:
    missing = raw(served, "POST", "/v1/chat/completions", json={"max_tokens": 2})
    assert missing.status_code == 400 and assert_error_shape(missing.json())["param"] == "messages"
    broken = raw(
        served, "POST", "/v1/chat/completions", content=b'{"messages": [', headers={"Content-Type": "application/json"}
    )
    assert broken.status_code == 400 and "JSON" in assert_error_shape(broken.json())["message"]
    nan = raw(
        served,
        "POST",
        "/v1/chat/completions",
        content=b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}',
    )
    assert nan.status_code == 400 and assert_error_shape(nan.json())["param"] == "temperature"


def test_prompt_too_long_gets_the_context_length_message(
    served: ServedEngine, sdk: OpenAI, model: str, tokenizer: Tokenizer
) -> None:
    limit = served.client.model_info.max_model_len
    content = "hello " * limit
    with pytest.raises(openai.BadRequestError) as info:
        sdk.chat.completions.create(model=model, messages=[{"role": "user", "content": content}], max_tokens=5)
    prompt_len = len(tokenizer.render_chat([{"role": "user", "content": content}]))
    message = info.value.body["message"]
    assert message.startswith(f"This model's maximum context length is {limit} tokens")
    assert f"{prompt_len} in the messages" in message
    assert info.value.code == "context_length_exceeded" and info.value.param == "messages"
    with pytest.raises(openai.BadRequestError) as info:
        sdk.completions.create(model=model, prompt=content, max_tokens=5)
    assert info.value.body["message"].startswith(f"This model's maximum context length is {limit} tokens")
    assert info.value.param == "prompt"


def test_wrong_or_missing_key_is_401(served: ServedEngine, model: str) -> None:
    wrong = OpenAI(base_url=f"{served.url}/v1", api_key="not-the-key", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as info:
        wrong.chat.completions.create(model=model, messages=QUESTION, max_tokens=2)
    assert info.value.status_code == 401 and info.value.code == "invalid_api_key"
    missing = raw(served, "GET", "/v1/models", key=None)
    assert missing.status_code == 401 and assert_error_shape(missing.json())["code"] == "missing_api_key"
    via_header = raw(served, "GET", "/v1/models", key=None, headers={"x-api-key": KEY})
    assert via_header.status_code == 200
    # Continue sends "Bearer undefined" beside its x-api-key: the right key in either header is enough.
    beside = raw(served, "GET", "/v1/models", key=None, headers={"x-api-key": KEY, "Authorization": "Bearer undefined"})
    assert beside.status_code == 200
    both_wrong = raw(served, "GET", "/v1/models", key=None, headers={"x-api-key": "no", "Authorization": "Bearer no"})
    assert both_wrong.status_code == 401


def test_unknown_model_and_route_are_404(served: ServedEngine, sdk: OpenAI, model: str) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        sdk.chat.completions.create(model="gpt-4o", messages=QUESTION, max_tokens=2)
    assert info.value.param == "model" and model in info.value.message
    alias = sdk.chat.completions.create(model=model.lower(), messages=QUESTION, max_tokens=1)
    assert alias.model == model
    route = raw(served, "POST", "/v1/no-such-thing", json={})
    assert route.status_code == 404 and assert_error_shape(route.json())["code"] == "not_found"


def test_oversized_body_is_413_before_parsing(served: ServedEngine, sdk: OpenAI, model: str) -> None:
    huge = [{"role": "user", "content": "x" * (5 * 2**20)}]
    with pytest.raises(openai.APIStatusError) as info:
        sdk.chat.completions.create(model=model, messages=huge, max_tokens=2)
    assert info.value.status_code == 413 and info.value.code == "request_too_large"

    def chunked():  # no Content-Length: counted as it arrives
        for _ in range(6):
            yield b"x" * 2**20

    response = raw(served, "POST", "/v1/chat/completions", content=chunked())
    assert response.status_code == 413 and assert_error_shape(response.json())


def test_engine_loading_is_503_with_retry_after(served: ServedEngine) -> None:
    """A second server on a client that has not started yet: the engine is "loading"."""
    from chatapp.engine.client import AsyncEngineClient
    from chatapp.server import start_server

    async def start() -> Any:
        return await start_server(AsyncEngineClient(), "127.0.0.1", 0)

    handle = served.run(start)
    try:
        sdk = OpenAI(base_url=f"{handle.url}/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.InternalServerError) as info:
            sdk.chat.completions.create(model="anything", messages=QUESTION, max_tokens=2)
        assert info.value.status_code == 503 and info.value.response.headers["retry-after"]
        assert_error_shape(info.value.response.json())
        health = httpx.get(f"{handle.url}/health")
        assert health.status_code == 503 and health.json()["status"] == "loading"
        assert health.headers["retry-after"]
    finally:
        served.run(handle.stop)


def test_engine_is_idle_after_the_module(served: ServedEngine) -> None:
    assert idle(served.wait_until(idle))


def test_continue_final_message_goes_on_with_the_answer(
    served: ServedEngine, sdk: OpenAI, model: str, tokenizer: Tokenizer
) -> None:
    """vLLM's continue_final_message: the reply continues the given assistant text, exactly as the
    engine continues that open prompt (no new turn is started)."""
    partial = "The capital of France is"
    messages = [
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": partial},
    ]
    out = sdk.chat.completions.create(
        model=model,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=8,
        temperature=0,
        extra_body={"continue_final_message": True, "add_generation_prompt": False},
    )
    ids = tokenizer.render_chat(messages, continue_final_message=True)
    assert tokenizer.decode(ids, skip_special_tokens=False).endswith(partial)
    expected, _ = engine_run(served, SamplingParams(max_tokens=8, temperature=0), prompt=ids)
    assert out.choices[0].message.content == expected and expected
    assert out.usage is not None and out.usage.prompt_tokens == len(ids)
    plain = sdk.chat.completions.create(model=model, messages=messages[:1], max_tokens=8, temperature=0)
    assert plain.usage is not None and plain.usage.prompt_tokens != len(ids)
