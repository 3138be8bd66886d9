"""Guided decoding (chatapp/engine/guided.py) in the engine and structured output on the OpenAI port,
on the real bundled model: the grammar always holds, and free requests beside it are untouched."""

from __future__ import annotations

import json
import re
from typing import Literal

import openai
import pytest
from openai import OpenAI
from pydantic import BaseModel

from chatapp.engine.guided import GuidedDecoding, GuidedDecodingError
from chatapp.engine.llm import LLM
from chatapp.engine.sampling_params import SamplingParams
from tests.server_harness import ServedEngine, idle

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 40},
        "temperature": {"type": "integer"},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "temperature", "unit"],
    "additionalProperties": False,
}
ASK = [{"role": "user", "content": "What's the weather in Paris today? Answer in JSON."}]
# Any JSON object: the 135M model closes this one (open-ended ones can ramble past max_tokens).
CAPITAL = [{"role": "user", "content": 'Return a JSON object with the key "answer" holding the capital of France.'}]


def assert_weather(text: str) -> dict:
    data = json.loads(text)
    assert set(data) == {"city", "temperature", "unit"}, data
    assert isinstance(data["city"], str) and len(data["city"]) <= 40
    assert isinstance(data["temperature"], int) and data["unit"] in ("celsius", "fahrenheit")
    return data


# -- the engine -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(kv_cache_memory_gib=0.1)


def test_a_batch_mixing_guided_and_free_requests(llm: LLM) -> None:
    """Each guided request follows its grammar, sampled or greedy; the free ones give exactly what
    they give alone (the masks touch the guided rows only)."""
    free_prompts = [
        [{"role": "user", "content": "Tell me a short story about a dragon."}],
        [{"role": "user", "content": "What is 2 + 2?"}],
    ]
    free = SamplingParams(temperature=0, max_tokens=24)
    alone = [o.outputs[0].token_ids for o in llm.chat(free_prompts, free)]
    guided = [
        SamplingParams(temperature=0, max_tokens=64, guided=GuidedDecoding(json_schema=WEATHER)),
        SamplingParams(temperature=1.0, seed=3, max_tokens=64, guided=GuidedDecoding(json_schema=WEATHER)),
        SamplingParams(temperature=0.7, seed=5, max_tokens=8, guided={"choice": ["yes", "no", "maybe not"]}),
        SamplingParams(temperature=1.0, seed=7, max_tokens=16, guided={"regex": r"[A-Z][a-z]{2,8} [0-9]{1,3}"}),
        SamplingParams(temperature=0.8, seed=9, max_tokens=48, guided={"json_object": True}),
    ]
    outs = llm.chat([ASK] * 4 + [CAPITAL] + free_prompts, guided + [free, free])
    texts = [o.outputs[0].text for o in outs]
    assert [o.outputs[0].finish_reason for o in outs[:5]] == ["stop"] * 5
    assert_weather(texts[0])
    assert_weather(texts[1])
    assert texts[2] in ("yes", "no", "maybe not")
    assert re.fullmatch(r"[A-Z][a-z]{2,8} [0-9]{1,3}", texts[3]), texts[3]
    assert isinstance(json.loads(texts[4]), dict)
    assert [o.outputs[0].token_ids for o in outs[5:]] == alone


def test_without_the_grammar_the_model_does_not_answer_in_the_schema(llm: LLM) -> None:
    """The control: the same greedy request unguided is not that JSON, so the grammar did the work."""
    text = llm.chat([ASK], SamplingParams(temperature=0, max_tokens=64))[0].outputs[0].text
    with pytest.raises((ValueError, AssertionError)):
        assert_weather(text)


def test_a_bad_spec_is_a_clear_error_before_anything_runs(llm: LLM) -> None:
    with pytest.raises(GuidedDecodingError, match="invalid json schema"):
        llm.chat([ASK], SamplingParams(guided={"json_schema": {"type": "objekt"}}))
    with pytest.raises(GuidedDecodingError, match="invalid regex"):
        llm.chat([ASK], SamplingParams(guided={"regex": "(unclosed"}))
    with pytest.raises(ValueError, match="exactly one of"):
        SamplingParams(guided={"regex": "a", "choice": ["b"]})
    with pytest.raises(ValueError, match="unknown field"):
        SamplingParams(guided={"jsonschema": {}})


def test_a_grammar_that_fails_to_compile_in_the_engine_fails_that_request_only(llm: LLM) -> None:
    """Compiled on the engine's worker thread: a spec that slipped past the checks finishes its own
    request with an error, and the loop goes on with the rest."""
    core = llm.core
    core.add_request("bad", llm.tokenizer.encode("Hi"), SamplingParams(guided={"grammar": "start: undefined_rule"}))
    core.add_request("good", llm.tokenizer.encode("Hi"), SamplingParams(max_tokens=3, ignore_eos=True))
    finished = {}
    while core.has_work():
        for out in core.step():
            if out.finished:
                finished[out.request_id] = out
    assert finished["bad"].finish_reason == "error" and "invalid grammar" in finished["bad"].error
    assert finished["good"].finish_reason == "length"


def test_a_compile_that_breaks_unexpectedly_fails_its_request_only(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    core = llm.core

    def broken(spec: GuidedDecoding):
        raise RuntimeError("llguidance cannot read this tokenizer")

    monkeypatch.setattr(core._grammars, "_compile", broken)
    core.add_request("broken", llm.tokenizer.encode("Hi"), SamplingParams(guided={"regex": "a+"}))
    core.add_request("free", llm.tokenizer.encode("Hi"), SamplingParams(max_tokens=2, ignore_eos=True))
    finished = {}
    while core.has_work():
        for out in core.step():
            if out.finished:
                finished[out.request_id] = out
    assert finished["broken"].finish_reason == "error"
    assert "unavailable for this model: llguidance cannot read this tokenizer" in finished["broken"].error
    assert finished["free"].finish_reason == "length"


def test_a_request_aborted_while_its_grammar_compiles_ends_at_once(llm: LLM) -> None:
    core = llm.core
    core.add_request("soon-gone", llm.tokenizer.encode("Hi"), SamplingParams(guided={"choice": ["a", "b"]}))
    core.abort(["soon-gone"])
    outputs = core.step()
    assert [(o.request_id, o.finish_reason) for o in outputs] == [("soon-gone", "abort")]
    assert not core.has_work()


def test_a_schema_crosses_the_process_boundary_whole() -> None:
    """Sent as JSON text: msgpack alone cannot carry an integer past 64 bits, which a schema may hold."""
    import msgspec

    from chatapp.engine.ipc import params_from_wire, params_to_wire

    schema = {"type": "integer", "maximum": 10**30}
    params = SamplingParams(guided={"json_schema": schema})
    wire = msgspec.msgpack.decode(msgspec.msgpack.encode(params_to_wire(params)))
    assert params_from_wire(wire).guided == GuidedDecoding(json_schema=schema)


# -- the OpenAI port ------------------------------------------------------------------------------


class Weather(BaseModel):
    city: str
    temperature: int
    unit: Literal["celsius", "fahrenheit"]


def test_sdk_parse_returns_the_pydantic_object(bundled_sdk: OpenAI, bundled_model: str) -> None:
    completion = bundled_sdk.chat.completions.parse(
        model=bundled_model, messages=ASK, response_format=Weather, temperature=0, max_completion_tokens=64
    )
    parsed = completion.choices[0].message.parsed
    assert isinstance(parsed, Weather), completion.choices[0].message.content
    assert completion.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("stream", [False, True])
def test_json_object_output_parses(bundled_sdk: OpenAI, bundled_model: str, stream: bool) -> None:
    args = dict(
        model=bundled_model,
        messages=CAPITAL,
        response_format={"type": "json_object"},
        temperature=0.8,
        seed=11,
        max_tokens=80,
    )
    if stream:
        text = "".join(
            c.choices[0].delta.content or "" for c in bundled_sdk.chat.completions.create(stream=True, **args)
        )
    else:
        text = bundled_sdk.chat.completions.create(**args).choices[0].message.content
    assert isinstance(json.loads(text), dict), text


def test_json_schema_streamed_and_whole_agree(bundled_sdk: OpenAI, bundled_model: str) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "weather", "schema": WEATHER, "strict": True}}
    args = dict(model=bundled_model, messages=ASK, response_format=fmt, temperature=0, max_tokens=64)
    whole = bundled_sdk.chat.completions.create(**args).choices[0].message.content
    streamed = "".join(
        c.choices[0].delta.content or "" for c in bundled_sdk.chat.completions.create(stream=True, **args)
    )
    assert_weather(whole)
    assert streamed == whole


def test_vllm_guided_fields_on_both_endpoints(bundled_sdk: OpenAI, bundled_model: str) -> None:
    chat = bundled_sdk.chat.completions.create(
        model=bundled_model, messages=ASK, max_tokens=8, extra_body={"guided_choice": ["sunny", "rainy"]}
    )
    assert chat.choices[0].message.content in ("sunny", "rainy")
    text = bundled_sdk.completions.create(
        model=bundled_model,
        prompt="The year the moon landing happened:",
        max_tokens=8,
        extra_body={"guided_regex": r" ?\d{4}"},
    )
    assert re.fullmatch(r" ?\d{4}", text.choices[0].text), text.choices[0].text


@pytest.mark.parametrize(
    "extra, param, message",
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}},
            "response_format.json_schema",
            "objekt",
        ),
        ({"response_format": {"type": "xml"}}, "response_format.type", "xml"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "needs a json_schema"),
        ({"guided_regex": "(unclosed"}, "guided_regex", "invalid regex"),
        ({"guided_choice": []}, "guided_choice", "non-empty"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice", "not several"),
    ],
)
def test_a_bad_structure_is_a_400_naming_it(
    bundled_sdk: OpenAI, bundled_model: str, bundled_server: ServedEngine, extra: dict, param: str, message: str
) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        bundled_sdk.chat.completions.create(model=bundled_model, messages=ASK, max_tokens=4, extra_body=extra)
    assert info.value.param == param and message in info.value.message, info.value.message
    assert idle(bundled_server.stats())


@pytest.mark.parametrize("blocked_share", [0.02, 0.98])
def test_masking_touches_exactly_the_blocked_logits(blocked_share: float) -> None:
    """Both ways of masking (the blocked entries, or all then the allowed restored) give masked_fill's
    result, on whole and on strided rows."""
    import numpy as np
    import torch

    from chatapp.engine.sampler import _mask_out

    rng = np.random.default_rng(0)
    blocked = rng.random((3, 1000)) < blocked_share
    blocked[0, 100:400] = blocked_share > 0.5  # whole words of one kind, as masks mostly are
    # llguidance's layout: bit t of a row's int32 words set when token t is allowed
    padded = np.zeros((3, 1024), dtype=bool)
    padded[:, :1000] = ~blocked
    words = np.packbits(padded, axis=-1, bitorder="little").view(np.int32)
    logits = torch.randn(3, 1000)
    expected = logits.masked_fill(torch.from_numpy(blocked), float("-inf"))
    whole = logits.clone()
    _mask_out(whole, words)
    assert torch.equal(whole, expected)
    strided = torch.randn(1000, 3).T
    expected = strided.masked_fill(torch.from_numpy(blocked), float("-inf"))
    _mask_out(strided, words)
    assert torch.equal(strided, expected)
