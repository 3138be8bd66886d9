"""Tool calling on /v1/chat/completions: ``tools``, ``tool_choice`` and ``parallel_tool_calls`` turned
into a prompt (the model's own template, or our fallback), a grammar where the calls must be valid,
and the answer read back as OpenAI ``tool_calls`` (engine/tools.py holds the formats)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from chatapp.engine.guided import GuidedDecoding, GuidedDecodingError
from chatapp.engine.tools import CallSplitter, ToolFormat, fallback_messages, tool_format
from chatapp.server.errors import bad_request
from chatapp.server.schemas import ChatCompletionRequest

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


@dataclass(frozen=True)
class ToolPlan:
    """What a request's tools mean for this model."""

    fmt: ToolFormat
    native: bool  # the model's template renders the tool definitions itself
    tools: list[dict[str, Any]]  # what the model is offered (a named tool_choice: that one)
    required: bool  # "required" or a named function: the answer is calls and nothing else
    parallel: bool

    def guided(self) -> GuidedDecoding | None:
        """The grammar: calls valid for their schemas where calls are required, and on our fallback
        (either a plain answer or calls); a model that knows its tools answers freely under auto."""
        if not self.required and self.native:
            return None
        spec = GuidedDecoding(grammar=self.fmt.grammar(self.tools, required=self.required, parallel=self.parallel))
        try:
            spec.check()
        except GuidedDecodingError as exc:
            raise bad_request(f"the tools' parameters cannot be turned into a grammar: {exc}", "tools") from None
        return spec

    def prompt(self, messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
        """(messages, tools for the template) to render."""
        if self.native:
            return messages, self.tools
        return fallback_messages(messages, self.tools), None

    def splitter(self) -> CallSplitter:
        return CallSplitter(self.fmt, calls_only=self.required)


def plan_tools(body: ChatCompletionRequest, chat_template: str | None) -> ToolPlan | None:
    """None when the request has no tools or tool_choice is "none" (tools are then ignored, as OpenAI)."""
    tools = _check_tools(body.tools)
    choice = body.tool_choice
    if not tools:
        if choice not in (None, "none", "auto"):
            raise bad_request("tool_choice needs tools", "tool_choice")
        return None
    if choice in (None, "auto"):
        offered, required = tools, False
    elif choice == "none":
        return None
    elif choice == "required":
        offered, required = tools, True
    elif isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        offered = [t for t in tools if t["function"]["name"] == name]
        if not offered:
            raise bad_request(f"tool_choice names {name!r}, which is not among the tools", "tool_choice")
        required = True
    else:
        raise bad_request(
            'tool_choice must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}',
            "tool_choice",
        )
    fmt, native = tool_format(chat_template)
    # A named function is called once (what naming it asks for; small models otherwise repeat it).
    parallel = body.parallel_tool_calls is not False and not isinstance(choice, dict)
    return ToolPlan(fmt, native, offered, required, parallel)


def _check_tools(tools: list[Any] | None) -> list[dict[str, Any]]:
    if not tools:
        return []
    names = set()
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(fn, dict):
            raise bad_request('each tool must be {"type": "function", "function": {...}}', f"tools[{i}]")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise bad_request("a function name must be 1-64 letters, digits, _ or -", f"tools[{i}].function.name")
        if name in names:
            raise bad_request(f"two tools are named {name!r}", f"tools[{i}].function.name")
        names.add(name)
        parameters = fn.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise bad_request("parameters must be a JSON Schema object", f"tools[{i}].function.parameters")
    return tools
