"""An assistant answer as the chat API returns it: reasoning (``reasoning_content``), content and
tool calls, from the model's text whole or streamed (engine/reasoning.py, server/tool_calls.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from chatapp.engine.reasoning import ReasoningSplitter, prompt_opens_thinking, template_reasons
from chatapp.engine.tools import CallSplitter, ToolCall
from chatapp.server.tool_calls import ToolPlan


@dataclass(frozen=True)
class AnswerShape:
    """What to read out of this request's answers."""

    reasons: bool  # split <think> blocks into reasoning_content
    starts_inside: bool  # the prompt opened the think block
    plan: ToolPlan | None

    @classmethod
    def of(cls, tokenizer: Any, prompt: list[int], plan: ToolPlan | None) -> AnswerShape:
        reasons = template_reasons(tokenizer.hf.chat_template)
        inside = reasons and prompt_opens_thinking(tokenizer.decode(prompt[-16:], skip_special_tokens=False))
        return cls(reasons, inside, plan)

    def message(self, text: str) -> tuple[dict[str, Any], bool]:
        """(the assistant message, whether it holds tool calls) for a whole answer."""
        splitter = self.splitter()
        fields = splitter.feed(text)
        rest, calls = splitter.finish()
        message: dict[str, Any] = {"role": "assistant", "content": fields.get("content", "") + rest.get("content", "")}
        reasoning = fields.get("reasoning_content", "") + rest.get("reasoning_content", "")
        if splitter.saw_reasoning:
            message["reasoning_content"] = reasoning
        if calls:
            message["content"] = message["content"] or None
            message["tool_calls"] = [c.to_openai() for c in calls]
        return message, bool(calls)

    def splitter(self) -> AnswerSplitter:
        return AnswerSplitter(
            ReasoningSplitter(self.starts_inside) if self.reasons else None,
            self.plan.splitter() if self.plan is not None else None,
        )


class AnswerSplitter:
    """One choice's streamed answer: reasoning first, then content, with tool calls held back."""

    def __init__(self, reasoning: ReasoningSplitter | None, calls: CallSplitter | None) -> None:
        self._reasoning = reasoning
        self._calls = calls

    @property
    def saw_reasoning(self) -> bool:
        return self._reasoning is not None and self._reasoning.saw_reasoning

    def feed(self, text: str) -> dict[str, str]:
        """New text in; the delta fields (reasoning_content, content) to send now out."""
        reasoning, content = self._reasoning.feed(text) if self._reasoning is not None else ("", text)
        return self._fields(reasoning, content)

    def finish(self) -> tuple[dict[str, str], list[ToolCall]]:
        reasoning, content = self._reasoning.finish() if self._reasoning is not None else ("", "")
        fields = self._fields(reasoning, content)
        calls: list[ToolCall] = []
        if self._calls is not None:
            rest, calls = self._calls.finish()
            if rest:
                fields["content"] = fields.get("content", "") + rest
        return fields, calls

    def _fields(self, reasoning: str, content: str) -> dict[str, str]:
        if self._calls is not None and content:
            content = self._calls.feed(content)
        fields = {}
        if reasoning:
            fields["reasoning_content"] = reasoning
        if content:
            fields["content"] = content
        return fields
