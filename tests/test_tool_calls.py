"""Tool calling: the formats' parsers and grammars (chatapp/engine/tools.py) and /v1/chat/completions
with tools through the openai SDK on the bundled model, whose template knows no tools (our fallback)."""

from __future__ import annotations

import json
from pathlib import Path

import openai
import pytest
from openai import OpenAI

from chatapp.engine.guided import GrammarCompiler, GuidedDecoding
from chatapp.engine.tokenizer import Tokenizer
from chatapp.engine.tools import (
    HERMES,
    LLAMA3_JSON,
    MISTRAL,
    CallSplitter,
    fallback_messages,
    tool_format,
)
from chatapp.store import bundled_gguf_path
from tests.server_harness import ServedEngine, idle

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME_TOOL = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {"type": "object", "properties": {"timezone": {"type": "string"}}, "required": ["timezone"]},
    },
}
TOOLS = [WEATHER_TOOL, TIME_TOOL]


def check_call(name: str, arguments: str) -> dict:
    """A call is to one of TOOLS with arguments valid for its schema."""
    args = json.loads(arguments)
    if name == "get_weather":
        assert set(args) == {"city", "unit"} and isinstance(args["city"], str), args
        assert args["unit"] in ("celsius", "fahrenheit")
    else:
        assert name == "get_time" and isinstance(args["timezone"], str), (name, args)
    return args


# -- formats --------------------------------------------------------------------------------------


def test_hermes_answers_parse_into_content_and_calls() -> None:
    text = (
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n'
        '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"timezone": "CET"}}\n</tool_call>'
    )
    content, calls = HERMES.parse(text)
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris", "unit": "celsius"}),
        ("get_time", {"timezone": "CET"}),
    ]
    assert len({c.id for c in calls}) == 2 and all(c.id.startswith("call_") for c in calls)
    broken = 'Sure <tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>'
    assert HERMES.parse(broken) == (broken, [])  # not calls after all: the answer stays as written
    assert HERMES.parse("No tools needed.") == ("No tools needed.", [])


def test_llama3_and_mistral_answers_parse() -> None:
    content, calls = LLAMA3_JSON.parse(
        '<|python_tag|>{"name": "get_time", "parameters": {"timezone": "UTC"}}; '
        '{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "celsius"}}'
    )
    assert content == "" and [c.name for c in calls] == ["get_time", "get_weather"]
    assert LLAMA3_JSON.parse("The time is noon.") == ("The time is noon.", [])
    content, calls = MISTRAL.parse('[TOOL_CALLS][{"name": "get_time", "arguments": {"timezone": "UTC"}}]')
    assert content == "" and json.loads(calls[0].arguments) == {"timezone": "UTC"}
    assert MISTRAL.parse("[TOOL_CALLS][{oops") == ("[TOOL_CALLS][{oops", [])


@pytest.mark.parametrize(
    "template, expected",
    [
        ("{% for m in messages %}{{ m.content }}{% endfor %}", ("hermes", False)),
        ("{% if tools %}<tools>{{ tools }}</tools>{% endif %}<tool_call>", ("hermes", True)),
        ("{% if tools %}{{ tools }}{% endif %}<|python_tag|>", ("llama3_json", True)),
        ("{% if tools %}[AVAILABLE_TOOLS]{% endif %}[TOOL_CALLS]", ("mistral", True)),
    ],
)
def test_the_format_is_told_by_the_template(template: str, expected: tuple[str, bool]) -> None:
    fmt, native = tool_format(template)
    assert (fmt.name, native) == expected


def test_streamed_content_stops_where_a_call_begins() -> None:
    answer = 'I will look.<tool_call>\n{"name": "get_time", "arguments": {"timezone": "UTC"}}\n</tool_call>'
    splitter = CallSplitter(HERMES, calls_only=False)
    shown = "".join(splitter.feed(ch) for ch in answer)  # one character at a time: the worst case
    assert shown == "I will look."
    rest, calls = splitter.finish()
    assert rest == "" and [c.name for c in calls] == ["get_time"]
    # A "<" that does not open a call is held only until it cannot, then shown.
    splitter = CallSplitter(HERMES, calls_only=False)
    shown = "".join(splitter.feed(ch) for ch in "a <b> and <tool> ok")
    assert shown + splitter.finish()[0] == "a <b> and <tool> ok"
    splitter = CallSplitter(LLAMA3_JSON, calls_only=False)
    assert splitter.feed('{"name": "get_time", "parameters": {"timezone": "UTC"}}') == ""
    assert [c.name for c in splitter.finish()[1]] == ["get_time"]


@pytest.fixture(scope="module")
def compiler() -> GrammarCompiler:
    tokenizer = Tokenizer(bundled_gguf_path())
    return GrammarCompiler(tokenizer.hf.backend.to_str(), 49152, frozenset({2}))


@pytest.mark.parametrize("fmt", [HERMES, LLAMA3_JSON, MISTRAL], ids=lambda f: f.name)
@pytest.mark.parametrize("required", [True, False])
def test_each_format_grammar_takes_valid_calls_and_refuses_invalid_ones(
    compiler: GrammarCompiler, fmt, required: bool
) -> None:
    tokenizer = Tokenizer(bundled_gguf_path())
    spec = GuidedDecoding(grammar=fmt.grammar(TOOLS, required=required, parallel=True))
    key = "parameters" if fmt is LLAMA3_JSON else "arguments"
    call = json.dumps({"name": "get_weather", key: {"city": "Rome", "unit": "celsius"}})
    bad = json.dumps({"name": "get_weather", key: {"city": "Rome", "unit": "kelvin"}})
    wrap = {
        "hermes": lambda c: f"<tool_call>\n{c}\n</tool_call>",
        "llama3_json": lambda c: c,
        "mistral": lambda c: f"[TOOL_CALLS][{c}]",
    }[fmt.name]

    def accepts(text: str) -> bool:
        matcher = compiler.matcher(spec)
        ids = tokenizer.hf.encode(text, add_special_tokens=False)
        return all(matcher.consume_token(t) for t in ids) and matcher.is_accepting()

    assert accepts(wrap(call))
    assert not accepts(wrap(bad))
    assert accepts("Hello! It is sunny.") is (not required)


def test_fallback_writes_tools_calls_and_results_into_the_conversation() -> None:
    messages = [
        {"role": "user", "content": "Weather in Rome?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Rome", "unit": "celsius"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees, sunny"},
    ]
    out = fallback_messages(messages, TOOLS)
    assert out[0]["role"] == "system" and '"name": "get_weather"' in out[0]["content"]
    assert out[2] == {
        "role": "assistant",
        "content": "<tool_call>\n"
        + json.dumps({"name": "get_weather", "arguments": {"city": "Rome", "unit": "celsius"}})
        + "\n</tool_call>",
    }
    assert out[3] == {"role": "user", "content": "<tool_response>\n21 degrees, sunny\n</tool_response>"}


def test_a_template_that_knows_tools_renders_them_and_the_calls(tmp_path: Path) -> None:
    """Tools and earlier calls reach a tool-aware template as it expects them (arguments as objects)."""
    import shutil

    from chatapp.engine.tokenizer import prepare_tokenizer_files

    shutil.copytree(prepare_tokenizer_files(bundled_gguf_path()), tmp_path, dirs_exist_ok=True)
    (tmp_path / "chat_template.jinja").write_text(
        "{% if tools %}<tools>{% for t in tools %}{{ t.function.name }};{% endfor %}</tools>{% endif %}"
        "{% for m in messages %}[{{ m.role }}]{{ m.content }}"
        "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function.arguments.city }}</tool_call>{% endfor %}"
        "{% endfor %}"
    )
    tokenizer = Tokenizer(tmp_path)
    messages = [
        {"role": "user", "content": "Rome?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "c", "content": "sunny"},
    ]
    text = tokenizer.decode(tokenizer.render_chat(messages, add_generation_prompt=False, tools=TOOLS), False)
    assert text == "<tools>get_weather;get_time;</tools>[user]Rome?[assistant]<tool_call>Rome</tool_call>[tool]sunny"
    assert tool_format(tokenizer.hf.chat_template) == (HERMES, True)


# -- the OpenAI port (the bundled model: our fallback format) -----------------------------------


ASK = [{"role": "user", "content": "What is the weather in Paris right now, in celsius?"}]


def _streamed_calls(stream) -> tuple[str, list[tuple[str, str]], str | None]:
    content, calls, finish = "", {}, None
    for chunk in stream:
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for call in choice.delta.tool_calls or []:
            entry = calls.setdefault(call.index, ["", ""])
            entry[0] += call.function.name or ""
            entry[1] += call.function.arguments or ""
        finish = choice.finish_reason or finish
    return content, [tuple(v) for _k, v in sorted(calls.items())], finish


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("parallel", [True, False])
def test_required_gives_valid_calls(bundled_sdk: OpenAI, bundled_model: str, stream: bool, parallel: bool) -> None:
    args = dict(
        model=bundled_model,
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=parallel,
        temperature=0.7,
        seed=4,
        max_tokens=300,  # room for a few parallel calls: sampled, this model often makes two or three
    )
    if stream:
        content, calls, finish = _streamed_calls(bundled_sdk.chat.completions.create(stream=True, **args))
    else:
        reply = bundled_sdk.chat.completions.create(**args).choices[0]
        content, finish = reply.message.content, reply.finish_reason
        calls = [(c.function.name, c.function.arguments) for c in reply.message.tool_calls or []]
    assert finish == "tool_calls" and not content, (finish, content)
    assert calls and (parallel or len(calls) == 1)
    for name, arguments in calls:
        check_call(name, arguments)


def test_a_named_function_is_the_one_called(bundled_sdk: OpenAI, bundled_model: str) -> None:
    reply = bundled_sdk.chat.completions.create(
        model=bundled_model,
        messages=ASK,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        temperature=0,
        max_tokens=80,
    ).choices[0]
    assert reply.finish_reason == "tool_calls"
    assert [c.function.name for c in reply.message.tool_calls] == ["get_time"]
    check_call("get_time", reply.message.tool_calls[0].function.arguments)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_auto_answers_in_words_or_in_valid_calls(bundled_sdk: OpenAI, bundled_model: str, seed: int) -> None:
    reply = bundled_sdk.chat.completions.create(
        model=bundled_model, messages=ASK, tools=TOOLS, temperature=1.0, seed=seed, max_tokens=60
    ).choices[0]
    if reply.message.tool_calls:
        assert reply.finish_reason == "tool_calls"
        for call in reply.message.tool_calls:
            check_call(call.function.name, call.function.arguments)
    else:
        assert reply.message.content and not reply.message.content.lstrip().startswith("<tool_call>")


def test_a_tool_result_continues_the_conversation(
    bundled_sdk: OpenAI, bundled_model: str, bundled_server: ServedEngine
) -> None:
    first = bundled_sdk.chat.completions.create(
        model=bundled_model,
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=80,
        temperature=0,  # sampled, an argument string could run past max_tokens (it did once in CI)
    ).choices[0]
    call = first.message.tool_calls[0]
    messages = [
        *ASK,
        first.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "22 degrees celsius and sunny"},
    ]
    answer = bundled_sdk.chat.completions.create(
        model=bundled_model,
        messages=messages,
        tools=TOOLS,
        max_tokens=40,
        temperature=0,  # sampled, the answer could open another call and run past max_tokens (it did once in CI)
    ).choices[0]
    assert answer.message.content and not answer.message.tool_calls or answer.finish_reason == "tool_calls"
    # The result was in the prompt the model read.
    prompt = bundled_server.client.tokenizer.render_chat(fallback_messages(messages, TOOLS))
    assert "22 degrees celsius and sunny" in bundled_server.client.tokenizer.decode(prompt)


def test_tool_choice_none_ignores_the_tools(bundled_sdk: OpenAI, bundled_model: str) -> None:
    args = dict(model=bundled_model, messages=ASK, temperature=0, max_tokens=16)
    plain = bundled_sdk.chat.completions.create(**args).choices[0].message.content
    with_tools = bundled_sdk.chat.completions.create(tools=TOOLS, tool_choice="none", **args).choices[0].message
    assert with_tools.content == plain and not with_tools.tool_calls


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name"),
        ({"tools": [{"type": "retrieval"}]}, "tools[0]"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        (
            {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
            "response_format",
        ),
    ],
)
def test_bad_tool_requests_are_400s_naming_the_field(
    bundled_sdk: OpenAI, bundled_model: str, bundled_server: ServedEngine, extra: dict, param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        bundled_sdk.chat.completions.create(model=bundled_model, messages=ASK, max_tokens=4, extra_body=extra)
    assert info.value.param == param, info.value.message
    assert idle(bundled_server.stats())


def test_a_repeated_call_is_kept_once_and_calls_are_capped(compiler: GrammarCompiler) -> None:
    """A small model looping on one call gives it once; the grammar stops calls at MAX_PARALLEL_CALLS."""
    from chatapp.engine.tools import MAX_PARALLEL_CALLS

    block = '<tool_call>\n{"name": "get_time", "arguments": {"timezone": "UTC"}}\n</tool_call>\n'
    _content, calls = HERMES.parse(block * 3)
    assert [c.name for c in calls] == ["get_time"]
    tokenizer = Tokenizer(bundled_gguf_path())
    spec = GuidedDecoding(grammar=HERMES.grammar(TOOLS, required=True, parallel=True))
    matcher = compiler.matcher(spec)
    for token in tokenizer.hf.encode(block * MAX_PARALLEL_CALLS, add_special_tokens=False):
        assert matcher.consume_token(token)
    assert matcher.is_accepting()
    assert not all(matcher.consume_token(t) for t in tokenizer.hf.encode("<tool_call>", add_special_tokens=False))


def test_mistral_calls_parse_with_or_without_their_special_token_and_take_mistral_ids() -> None:
    """Decoded with special tokens skipped, a Mistral call is a bare list (its end token gone or not)."""
    for text in (
        '[TOOL_CALLS][{"name": "get_time", "arguments": {"timezone": "UTC"}}]</s>',
        '[{"name": "get_time", "arguments": {"timezone": "UTC"}}]',
    ):
        content, calls = MISTRAL.parse(text)
        assert content == "" and [c.name for c in calls] == ["get_time"]
        assert len(calls[0].id) == 9 and calls[0].id.isalnum()
    splitter = CallSplitter(MISTRAL, calls_only=False)
    assert "".join(splitter.feed(ch) for ch in '[{"name": "get_time", "arguments": {"timezone": "UTC"}}]') == ""
    assert [c.name for c in splitter.finish()[1]] == ["get_time"]
    splitter = CallSplitter(MISTRAL, calls_only=False)
    assert "".join(splitter.feed(ch) for ch in "[a link](x) and text") + splitter.finish()[0] == "[a link](x) and text"


def test_tools_whose_schemas_use_defs_compile_and_hold(compiler: GrammarCompiler) -> None:
    """Pydantic's nested models arrive as $defs references; nested under a call they still resolve."""
    tool = {
        "type": "function",
        "function": {
            "name": "book",
            "parameters": {
                "$defs": {
                    "Place": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
                },
                "type": "object",
                "properties": {"to": {"$ref": "#/$defs/Place"}},
                "required": ["to"],
            },
        },
    }
    tokenizer = Tokenizer(bundled_gguf_path())
    spec = GuidedDecoding(grammar=HERMES.grammar([tool, TIME_TOOL], required=True, parallel=False))
    spec.check()

    def accepts(text: str) -> bool:
        matcher = compiler.matcher(spec)
        return all(matcher.consume_token(t) for t in tokenizer.hf.encode(text, add_special_tokens=False))

    assert accepts('<tool_call>\n{"name": "book", "arguments": {"to": {"city": "Rome"}}}\n</tool_call>')
    assert not accepts('<tool_call>\n{"name": "book", "arguments": {"to": {"town": "Rome"}}}\n</tool_call>')


def test_fallback_takes_text_parts_beside_calls() -> None:
    messages = [
        {"role": "user", "content": "Rome?"},
        {
            "role": "assistant",
            "content": [{"type": "text", "text": "Checking."}],
            "tool_calls": [{"id": "c", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}],
        },
        {"role": "tool", "tool_call_id": "c", "content": [{"type": "text", "text": "noon"}]},
    ]
    out = fallback_messages(messages, TOOLS)
    assert out[2]["content"].startswith("Checking.\n<tool_call>")
    assert out[3]["content"] == "<tool_response>\nnoon\n</tool_response>"
