"""Tool calling: how a model writes tool calls, the grammar that holds it to them, and the parser
that reads them back (used by the OpenAI port; the engine itself only sees a guided grammar).

Each chat template family has its own format, told apart by what the template writes:
- Hermes (Qwen2.5/Qwen3, Hermes, and our fallback): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
  one block per call;
- Llama 3.x: the whole answer is ``{"name": ..., "parameters": {...}}`` (several joined by ";"),
  optionally after ``<|python_tag|>``;
- Mistral: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]``.

A template that cannot render tools (the bundled SmolLM2's) gets the Hermes format through a system
prompt (``fallback_system_prompt``), and with ``tool_choice="auto"`` a grammar that allows either a
plain answer or tool calls, so that even a small model produces calls that parse.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def mistral_call_id() -> str:
    """Mistral's templates take only 9-character alphanumeric call ids."""
    return uuid.uuid4().hex[:9]


def _hoist_definitions(parameters: dict[str, Any], prefix: str, into: dict[str, Any]) -> dict[str, Any]:
    """A tool's ``$defs``/``definitions`` moved into ``into`` (renamed ``prefix + name``) and its
    ``#/$defs/...`` references rewritten: nested under a call's arguments, the schema's own root
    is no longer the document's root (pydantic models with nested models use these)."""
    local = {**parameters.get("definitions", {}), **parameters.get("$defs", {})}
    if not local:
        return parameters
    for name, schema in local.items():
        into[prefix + name] = schema

    def rewrite(node: Any) -> Any:
        if isinstance(node, dict):
            out = {
                k: rewrite(v) for k, v in node.items() if k not in ("$defs", "definitions") or node is not parameters
            }
            ref = out.get("$ref")
            if isinstance(ref, str):
                for root in ("#/$defs/", "#/definitions/"):
                    if ref.startswith(root):
                        out["$ref"] = "#/$defs/" + prefix + ref[len(root) :]
            return out
        if isinstance(node, list):
            return [rewrite(v) for v in node]
        return node

    for name in local:
        into[prefix + name] = rewrite(into[prefix + name])
    hoisted: dict[str, Any] = rewrite(parameters)
    return hoisted


def _call_schema(tool: dict[str, Any], arguments_key: str, definitions: dict[str, Any]) -> dict[str, Any]:
    fn = tool["function"]
    parameters = fn.get("parameters") or {"type": "object", "properties": {}}
    parameters = _hoist_definitions(parameters, f"{fn['name']}__", definitions)
    return {
        "type": "object",
        "properties": {"name": {"const": fn["name"]}, arguments_key: parameters},
        "required": ["name", arguments_key],
        "additionalProperties": False,
    }


def _calls_schema(tools: list[dict[str, Any]], arguments_key: str) -> dict[str, Any]:
    definitions: dict[str, Any] = {}
    schemas = [_call_schema(t, arguments_key, definitions) for t in tools]
    schema = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    return {**schema, "$defs": definitions} if definitions else schema


# Parallel calls in one answer, at most: small models otherwise repeat a call until max_tokens.
MAX_PARALLEL_CALLS = 4


def _repeat(rule: str, separator: str, parallel: bool) -> str:
    """One to MAX_PARALLEL_CALLS of ``rule`` (Lark alternatives; one when not parallel)."""
    if not parallel:
        return rule
    joiner = f" {separator} " if separator else " "
    return " | ".join(joiner.join([rule] * k) for k in range(1, MAX_PARALLEL_CALLS + 1))


def _lark_json(schema: dict[str, Any]) -> str:
    """A JSON Schema as a Lark rule, laid out on one line as json.dumps writes it (free whitespace
    would let the JSON swallow the newline the format puts after it)."""
    layout = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
    return "%json " + json.dumps({**schema, "x-guidance": layout}, separators=(",", ":"))


class ToolFormat:
    """One family's way of writing tool calls."""

    name = ""
    marker = ""  # what opens the calls in an answer (text before it is the answer's content)
    bare_starts: tuple[str, ...] = ()  # how an answer that is nothing but calls may begin

    def grammar(self, tools: list[dict[str, Any]], *, required: bool, parallel: bool) -> str:
        """A Lark grammar (llguidance's dialect) for the answer: tool calls only (required, or a named
        tool: ``tools`` is then that one), or either a plain answer or tool calls."""
        raise NotImplementedError

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """(content, calls) of a whole answer; no calls when the answer holds none that parse."""
        raise NotImplementedError


class HermesFormat(ToolFormat):
    name = "hermes"
    marker = "<tool_call>"
    _block = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)

    def grammar(self, tools: list[dict[str, Any]], *, required: bool, parallel: bool) -> str:
        start = "start: calls" if required else "start: TEXT | calls"
        return "\n".join(
            [
                start,
                "calls: " + _repeat("call", "", parallel),
                r"TEXT: /[^<\s][\s\S]*/",  # a plain answer: anything that does not open with a call
                r'call: "<tool_call>\n" args "\n</tool_call>" "\n"?',
                "args: " + _lark_json(_calls_schema(tools, "arguments")),
            ]
        )

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        at = text.find(self.marker)
        if at < 0:
            return text, []
        calls = []
        for body in self._block.findall(text[at:]) or [text[at + len(self.marker) :]]:
            call = _call_from_json(body, "arguments")
            if call is None:
                return text, []  # not calls after all: the answer stays as written
            calls.append(call)
        return text[:at].strip(), _unique(calls)


class Llama3JsonFormat(ToolFormat):
    name = "llama3_json"
    marker = "<|python_tag|>"
    bare_starts = ("{", "<|python_tag|>")

    def grammar(self, tools: list[dict[str, Any]], *, required: bool, parallel: bool) -> str:
        start = "start: calls" if required else "start: TEXT | calls"
        return "\n".join(
            [
                start,
                "calls: " + _repeat("call", '"; "', parallel),
                r"TEXT: /[^{\s][\s\S]*/",
                "call: " + _lark_json(_calls_schema(tools, "parameters")),
            ]
        )

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        body = text.strip().removeprefix(self.marker).strip()
        if not body.startswith("{"):
            return text, []
        calls = []
        for part in _split_json_objects(body):
            call = _call_from_json(part, "parameters") or _call_from_json(part, "arguments")
            if call is None:
                return text, []
            calls.append(call)
        return "", _unique(calls)


class MistralFormat(ToolFormat):
    name = "mistral"
    marker = "[TOOL_CALLS]"  # a special token: decoded text usually lacks it, the bare list remains
    bare_starts = ("[{", "[TOOL_CALLS]")

    def grammar(self, tools: list[dict[str, Any]], *, required: bool, parallel: bool) -> str:
        items = {
            "type": "array",
            "items": _calls_schema(tools, "arguments"),
            "minItems": 1,
            "maxItems": MAX_PARALLEL_CALLS if parallel else 1,
        }
        start = "start: calls" if required else "start: TEXT | calls"
        return "\n".join(
            [start, r"TEXT: /[^\[\s][\s\S]*/", 'calls: "[TOOL_CALLS]" array', "array: " + _lark_json(items)]
        )

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        at = text.find(self.marker)
        if at >= 0:
            content, body = text[:at].strip(), text[at + len(self.marker) :].strip()
        elif text.lstrip().startswith("[{"):
            content, body = "", text.strip()
        else:
            return text, []
        try:
            items, _end = json.JSONDecoder().raw_decode(body)  # anything after the list (an end token) ignored
        except json.JSONDecodeError:
            return text, []
        items = items if isinstance(items, list) else [items]
        calls = [_call_from_obj(item, "arguments", mistral_call_id) for item in items]
        found = [c for c in calls if c is not None]
        if not calls or len(found) != len(calls):
            return text, []
        return content, _unique(found)


def _unique(calls: list[ToolCall]) -> list[ToolCall]:
    """Calls with the same name and arguments once: a repeat is a small model looping, not intent."""
    seen: set[tuple[str, str]] = set()
    out = []
    for call in calls:
        if (call.name, call.arguments) not in seen:
            seen.add((call.name, call.arguments))
            out.append(call)
    return out


def _split_json_objects(text: str) -> list[str]:
    """'{...}; {...}' -> ['{...}', '{...}'] (Llama 3's way of writing several calls)."""
    decoder = json.JSONDecoder()
    parts, at = [], 0
    while at < len(text):
        try:
            _obj, end = decoder.raw_decode(text, at)
        except json.JSONDecodeError:
            return [text]
        parts.append(text[at:end])
        at = end
        while at < len(text) and text[at] in " ;\n\t":
            at += 1
    return parts


def _call_from_json(text: str, arguments_key: str) -> ToolCall | None:
    try:
        return _call_from_obj(json.loads(text), arguments_key)
    except json.JSONDecodeError:
        return None


def _call_from_obj(obj: Any, arguments_key: str, make_id: Any = new_call_id) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = obj.get(arguments_key, {})
    if isinstance(arguments, str):  # some models write the arguments as JSON text
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(obj["name"], json.dumps(arguments, ensure_ascii=False), make_id())


HERMES, LLAMA3_JSON, MISTRAL = HermesFormat(), Llama3JsonFormat(), MistralFormat()


def tool_format(chat_template: str | None) -> tuple[ToolFormat, bool]:
    """The format a model writes calls in, and whether its template renders tool definitions itself."""
    template = chat_template or ""
    renders_tools = "tools" in template
    if "[TOOL_CALLS]" in template:
        return MISTRAL, renders_tools
    if "<tool_call>" in template:
        return HERMES, renders_tools
    if renders_tools and ("<|python_tag|>" in template or "ipython" in template):
        return LLAMA3_JSON, True
    return HERMES, renders_tools


def fallback_system_prompt(tools: list[dict[str, Any]]) -> str:
    """How a model whose template knows no tools is told about them (Hermes' words, our format)."""
    listed = "\n".join(json.dumps(t["function"], ensure_ascii=False) for t in tools)
    return (
        "You may call one or more functions to answer the user. The functions are listed in <tools></tools>:\n"
        f"<tools>\n{listed}\n</tools>\n"
        "To call a function, answer with only a JSON object holding its name and arguments in "
        "<tool_call></tool_call> tags, one block per call:\n"
        '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>\n'
        "Otherwise answer the user normally."
    )


def _flat_text(content: Any) -> str:
    """A message's text: a string, or its text parts joined (other parts are refused elsewhere)."""
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return content if isinstance(content, str) else ""


def fallback_messages(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A conversation with tools for a template that knows none: the tools described in the system
    prompt, earlier calls written out in our (Hermes) format, tool results as user turns."""
    out: list[dict[str, Any]] = []
    for message in messages:
        role = message.get("role")
        if role == "assistant" and message.get("tool_calls"):
            blocks = []
            for call in message["tool_calls"]:
                fn = call.get("function", {})
                arguments = fn.get("arguments") or "{}"
                if isinstance(arguments, str):
                    try:
                        arguments = json.loads(arguments)
                    except json.JSONDecodeError:
                        pass  # normalize_messages names the bad one
                body = json.dumps({"name": fn.get("name"), "arguments": arguments}, ensure_ascii=False)
                blocks.append(f"<tool_call>\n{body}\n</tool_call>")
            text = _flat_text(message.get("content"))
            out.append({"role": "assistant", "content": "\n".join(([text] if text else []) + blocks)})
        elif role == "tool":
            content = _flat_text(message.get("content"))
            out.append({"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"})
        else:
            out.append(message)
    prompt = fallback_system_prompt(tools)
    if out and out[0].get("role") in ("system", "developer") and isinstance(out[0].get("content"), str):
        out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + prompt}
    else:
        out.insert(0, {"role": "system", "content": prompt})
    return out


class CallSplitter:
    """Streams an answer's content while holding back what may be tool calls: text is released up to
    where the format's marker could begin; from the marker on, everything waits for ``finish``."""

    def __init__(self, fmt: ToolFormat, *, calls_only: bool) -> None:
        self.fmt = fmt
        self.calls_only = calls_only  # required / named: the whole answer is calls
        self._held = ""
        self._released = 0
        self._in_calls = calls_only

    def feed(self, text: str) -> str:
        """New text in; the content that can be shown now out."""
        self._held += text
        if self._in_calls:
            return ""
        if self.fmt.bare_starts and self._released == 0:  # calls written as the whole answer
            stripped = self._held.lstrip()
            if any(stripped.startswith(b) for b in self.fmt.bare_starts):
                self._in_calls = True
                return ""
            if not stripped or any(b.startswith(stripped) for b in self.fmt.bare_starts):
                return ""  # too short to tell yet
        marker = self.fmt.marker
        at = self._held.find(marker, self._released)
        if at >= 0:
            out, self._released, self._in_calls = self._held[self._released : at], at, True
            return out
        keep = _marker_prefix_len(self._held, marker)
        end = len(self._held) - keep
        out, self._released = self._held[self._released : end], max(self._released, end)
        return out

    def finish(self) -> tuple[str, list[ToolCall]]:
        """(the content not yet shown, the calls) once the answer is complete."""
        content, calls = self.fmt.parse(self._held)
        if not calls:
            return self._held[self._released :], []
        return ("" if self._released else content), calls  # text before the marker went out already


def _marker_prefix_len(text: str, marker: str) -> int:
    """How many trailing characters of ``text`` could be the start of ``marker``."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
