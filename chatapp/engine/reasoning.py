"""Reasoning models (Qwen3, DeepSeek-R1 distills, SmolLM3): the ``<think>...</think>`` part of an
answer set apart from the answer, as vLLM and DeepSeek's API return it (``reasoning_content``).

Only a model whose chat template mentions ``<think>`` is split, so another model's literal
"<think>" stays in its answer. Some templates (DeepSeek-R1's) open the think block in the prompt
itself: the answer then starts inside it and only closes it.
"""

from __future__ import annotations

OPEN, CLOSE = "<think>", "</think>"


def template_reasons(chat_template: str | None) -> bool:
    return chat_template is not None and OPEN in chat_template


def prompt_opens_thinking(prompt_text: str) -> bool:
    """The rendered prompt ends inside a think block (the answer's first words are reasoning)."""
    tail = prompt_text.rstrip()
    return tail.endswith(OPEN)


def split_reasoning(text: str, starts_inside: bool = False) -> tuple[str | None, str]:
    """(reasoning or None, content) of a whole answer."""
    splitter = ReasoningSplitter(starts_inside)
    reasoning, content = splitter.feed(text)
    more_reasoning, more_content = splitter.finish()
    reasoning += more_reasoning
    return (reasoning if splitter.saw_reasoning else None), content + more_content


class ReasoningSplitter:
    """Splits a streamed answer into reasoning and content deltas, holding back only what could be
    the start of a tag."""

    def __init__(self, starts_inside: bool = False) -> None:
        self._held = ""
        self._state = "thinking" if starts_inside else "start"  # start -> thinking -> answer
        self.saw_reasoning = starts_inside
        self._after_tag = starts_inside

    def feed(self, text: str) -> tuple[str, str]:
        """New text in; (reasoning, content) that can be shown now out."""
        self._held += text
        reasoning = content = ""
        while True:
            if self._after_tag:  # the newlines that follow a tag belong to neither part
                self._held = self._held.lstrip("\n")
                if not self._held:
                    return reasoning, content
                self._after_tag = False
            if self._state == "start":
                stripped = self._held.lstrip()
                if stripped.startswith(OPEN):
                    self._held = stripped[len(OPEN) :]
                    self._state, self.saw_reasoning, self._after_tag = "thinking", True, True
                    continue
                if stripped and not OPEN.startswith(stripped):
                    self._state = "answer"
                    continue
                return reasoning, content  # empty, or a prefix of "<think>": wait
            if self._state == "thinking":
                at = self._held.find(CLOSE)
                if at >= 0:
                    reasoning += self._held[:at]
                    self._held = self._held[at + len(CLOSE) :]
                    self._state, self._after_tag = "answer", True
                    continue
                keep = _partial_tag(self._held, CLOSE)
                reasoning += self._held[: len(self._held) - keep]
                self._held = self._held[len(self._held) - keep :]
                return reasoning, content
            content += self._held
            self._held = ""
            return reasoning, content

    def finish(self) -> tuple[str, str]:
        """What is still held once the answer is complete."""
        held, self._held = self._held, ""
        if self._state == "thinking":
            return held, ""  # never closed: all of it was reasoning
        return "", held


def _partial_tag(text: str, tag: str) -> int:
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
