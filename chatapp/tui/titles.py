"""A session's title from its first exchange, as chat apps name their conversations: asked of the local
model in the background (a few tokens, greedy), else the first words of the question. Only a session
still called by its placeholder ("Chat 3") is named; a title the user gave stays."""

from __future__ import annotations

import re

from chatapp.engine.api import EngineClient
from chatapp.engine.reasoning import split_reasoning
from chatapp.engine.sampling_params import SamplingParams

PLACEHOLDER = re.compile(r"^Chat \d+$")
MAX_TITLE_CHARS = 48
_ASK = (
    "Write a title of at most six words for a conversation that starts with the question below. "
    "Answer with the title alone.\n\nQuestion: {question}"
)


def is_placeholder(title: str) -> bool:
    return not title or bool(PLACEHOLDER.match(title))


def from_question(question: str) -> str:
    """The question's first line, cut at a word before MAX_TITLE_CHARS (the fallback title)."""
    line = next((part.strip() for part in question.splitlines() if part.strip()), "")
    if len(line) <= MAX_TITLE_CHARS:
        return line
    cut = line[:MAX_TITLE_CHARS].rsplit(" ", 1)[0].rstrip(" ,.;:")
    return (cut or line[:MAX_TITLE_CHARS]) + "…"


def clean(text: str) -> str | None:
    """A model's answer as a title: one line, no quotes, "Title:" or final full stop; None if unusable
    (a reasoning model still thinking, a preamble such as "Sure! Here is a title:")."""
    _thought, text = split_reasoning(text)
    line = next((part.strip() for part in text.splitlines() if part.strip()), "")
    if line.startswith("<") or line.endswith(":"):
        return None
    line = re.sub(r"^(title\s*:\s*)", "", line, flags=re.IGNORECASE)
    line = line.strip().strip("\"'*#`.").strip()
    if not line or len(line) > MAX_TITLE_CHARS:
        return None
    return line


async def ask_model(client: EngineClient, question: str, request_id: str) -> str | None:
    """The local model's title for a conversation starting with ``question`` (None if it gave none)."""
    params = SamplingParams(temperature=0.0, max_tokens=16)
    messages = [{"role": "user", "content": _ASK.format(question=question[:1000])}]
    text = ""
    gen = client.generate(messages=messages, params=params, request_id=request_id)
    try:
        async for delta in gen:
            text += delta.text
    finally:
        aclose = getattr(gen, "aclose", None)
        if aclose is not None:
            await aclose()
    return clean(text)
