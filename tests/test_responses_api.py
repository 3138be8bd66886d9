"""POST /v1/responses (chatapp/server/routes/responses.py) through the openai SDK, on the bundled model:
the same answers as /v1/chat/completions, in the Responses API's shapes and stream events."""

from __future__ import annotations

import json
from typing import Literal

import openai
import pytest
from openai import OpenAI
from pydantic import BaseModel

from tests.server_harness import ServedEngine, idle

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

WEATHER_TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "The current weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
        "additionalProperties": False,
    },
}


def test_text_in_text_out_matches_chat(bundled_sdk: OpenAI, bundled_model: str) -> None:
    response = bundled_sdk.responses.create(
        model=bundled_model, instructions="Answer briefly.", input="What is 2 + 2?", temperature=0, max_output_tokens=24
    )
    chat = bundled_sdk.chat.completions.create(
        model=bundled_model,
        messages=[{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "What is 2 + 2?"}],
        temperature=0,
        max_tokens=24,
    )
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.output_text == chat.choices[0].message.content
    assert response.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens


def test_streamed_events_build_the_same_text(bundled_sdk: OpenAI, bundled_model: str) -> None:
    args = dict(model=bundled_model, input="Name three colours.", temperature=0, max_output_tokens=20)
    whole = bundled_sdk.responses.create(**args)
    events = list(bundled_sdk.responses.create(stream=True, **args))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == whole.output_text
    done = next(e for e in events if e.type == "response.output_text.done")
    assert done.text == whole.output_text
    assert events[-1].response.output_text == whole.output_text


def test_structured_output_with_parse(bundled_sdk: OpenAI, bundled_model: str) -> None:
    class Answer(BaseModel):
        answer: str
        confidence: Literal["low", "high"]

    parsed = bundled_sdk.responses.parse(
        model=bundled_model,
        input='Return a JSON object with the key "answer" holding the capital of France.',
        text_format=Answer,
        temperature=0,
        max_output_tokens=40,
    )
    assert isinstance(parsed.output_parsed, Answer), parsed.output_text


@pytest.mark.parametrize("stream", [False, True])
def test_a_function_call_and_its_output_round_trip(bundled_sdk: OpenAI, bundled_model: str, stream: bool) -> None:
    args = dict(
        model=bundled_model,
        input="What's the weather in Paris?",
        tools=[WEATHER_TOOL],
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=60,
        temperature=0,  # sampled without a seed, the argument string can run past max_output_tokens (it did once)
    )
    if stream:
        events = list(bundled_sdk.responses.create(stream=True, **args))
        assert "response.function_call_arguments.done" in [e.type for e in events]
        response = events[-1].response
    else:
        response = bundled_sdk.responses.create(**args)
    calls = [item for item in response.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather"
    assert isinstance(json.loads(calls[0].arguments)["city"], str)
    follow_up = bundled_sdk.responses.create(
        model=bundled_model,
        input=[
            {"role": "user", "content": "What's the weather in Paris?"},
            {
                "type": "function_call",
                "call_id": calls[0].call_id,
                "name": "get_weather",
                "arguments": calls[0].arguments,
            },
            {"type": "function_call_output", "call_id": calls[0].call_id, "output": "22 C and sunny"},
        ],
        tools=[WEATHER_TOOL],
        max_output_tokens=30,
    )
    assert follow_up.status in ("completed", "incomplete") and follow_up.output


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"previous_response_id": "resp_123"}, "previous_response_id"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "data:,"}]}]},
            "input[0].content[0]",
        ),
    ],
)
def test_what_is_not_supported_is_a_400_naming_it(
    bundled_sdk: OpenAI, bundled_model: str, bundled_server: ServedEngine, extra: dict, param: str
) -> None:
    body = {"input": "hi", **extra}
    with pytest.raises(openai.BadRequestError) as info:
        bundled_sdk.responses.create(model=bundled_model, max_output_tokens=4, extra_body=body)
    assert info.value.param == param, info.value.message
    assert idle(bundled_server.stats())
