"""Reasoning models' think blocks as reasoning_content (chatapp/engine/reasoning.py, server/answers.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from openai import OpenAI

from chatapp.engine.reasoning import ReasoningSplitter, prompt_opens_thinking, split_reasoning, template_reasons
from tests.server_harness import ServedEngine
from tests.tiny_model import make_tiny_model


def stream(text: str, starts_inside: bool = False) -> tuple[str, str]:
    """One character at a time, the worst case for tags split across deltas."""
    splitter = ReasoningSplitter(starts_inside)
    reasoning = content = ""
    for ch in text:
        r, c = splitter.feed(ch)
        reasoning, content = reasoning + r, content + c
    r, c = splitter.finish()
    return reasoning + r, content + c


@pytest.mark.parametrize(
    "text, starts_inside, expected",
    [
        ("<think>\nLet me add.\n</think>\n\nIt is 4.", False, ("Let me add.\n", "It is 4.")),
        ("Let me add.</think>It is 4.", True, ("Let me add.", "It is 4.")),  # the prompt opened the block
        ("<think>Still thinking", False, ("Still thinking", "")),  # never closed: all reasoning
        ("It is 4. <think> is a tag.", False, (None, "It is 4. <think> is a tag.")),  # not at the start
        ("<thin", False, (None, "<thin")),
    ],
)
def test_think_blocks_split_whole_and_streamed(text: str, starts_inside: bool, expected: tuple) -> None:
    assert split_reasoning(text, starts_inside) == expected
    reasoning, content = stream(text, starts_inside)
    assert (reasoning if expected[0] is not None else None, content) == expected


def test_only_templates_that_think_are_split() -> None:
    assert template_reasons("{{ '<think>\\n' }}{% for m in messages %}{{ m.content }}{% endfor %}")
    assert not template_reasons("{% for m in messages %}{{ m.content }}{% endfor %}")
    assert prompt_opens_thinking("<|Assistant|><think>\n") and not prompt_opens_thinking("<|assistant|>\n")


# -- through the server: a tiny model whose template thinks, its answer forced by a grammar ----------


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> ServedEngine:
    path: Path = make_tiny_model(tmp_path_factory.mktemp("m") / "thinker", "Qwen3ForCausalLM", num_heads=4, seed=2)
    (path / "chat_template.jinja").write_text(
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
        "{# reasoning models write <think> blocks #}"
    )
    with ServedEngine(tmp_path_factory.mktemp("runtime"), {"model": str(path), "kv_cache_memory_gib": 0.05}) as se:
        yield se


THOUGHT = r"<think>\nI (think|reckon) so\.\n</think>\n\n(Yes|No)\."


@pytest.mark.parametrize("stream_it", [False, True])
def test_reasoning_content_comes_apart_from_the_answer(served: ServedEngine, stream_it: bool) -> None:
    sdk = OpenAI(base_url=f"{served.url}/v1", api_key="none", max_retries=0, timeout=120)
    args = dict(
        model=served.client.model_info.name,
        messages=[{"role": "user", "content": "Is it?"}],
        max_tokens=40,
        extra_body={"guided_regex": THOUGHT},
    )
    if stream_it:
        reasoning = content = ""
        for chunk in sdk.chat.completions.create(stream=True, **args):
            delta = chunk.choices[0].delta
            reasoning += getattr(delta, "reasoning_content", None) or ""
            content += delta.content or ""
    else:
        message = sdk.chat.completions.create(**args).choices[0].message
        reasoning, content = message.reasoning_content, message.content
    assert reasoning in ("I think so.\n", "I reckon so.\n"), reasoning
    assert content in ("Yes.", "No."), content
