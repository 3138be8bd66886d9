"""A model's Jinja chat template, rendered as Hugging Face renders it, without transformers.

Why our own: transformers imports torch (over a second and ~250 MB), and every client (the TUI,
`chatapp serve`) renders chats. The template language is the one the Hub's templates are written
for: a sandboxed Jinja environment with trimmed blocks, loop controls, a `tojson` that keeps
non-ASCII text, `raise_exception` and `strftime_now`, and the `{% generation %}` block tag
(rendered as its body). tests/test_tokenizer.py holds it to transformers' output.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment


class _GenerationTag(Extension):
    """`{% generation %}...{% endgeneration %}` marks the assistant's tokens for training; we only render it."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        rendered: str = caller()
        return rendered


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False
) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=8)
def compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, "jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def render_chat_template(
    source: str,
    messages: list[dict[str, Any]],
    *,
    add_generation_prompt: bool,
    special_tokens: dict[str, str],
    **extra: Any,
) -> str:
    """The conversation as the model's prompt text. Template errors propagate as jinja2 errors."""
    return compile_template(source).render(
        messages=messages, add_generation_prompt=add_generation_prompt, **special_tokens, **extra
    )
