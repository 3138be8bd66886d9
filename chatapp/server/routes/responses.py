"""POST /v1/responses: OpenAI's Responses API, the stateless subset, run as a chat completion.

Input text or items (messages, function calls and their outputs), ``instructions``, function
``tools``, ``text.format`` for structured output, streamed as the Responses API's events or not.
Nothing is stored, so ``previous_response_id`` is refused (send the whole conversation instead).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import StreamingResponse

from chatapp.server import generation as gen
from chatapp.server.errors import APIError, bad_request, unsupported
from chatapp.server.routes.chat import ChatJob, prepare_chat
from chatapp.server.routing import Router
from chatapp.server.schemas import ChatCompletionRequest, ResponsesRequest
from chatapp.server.state import ServerState

router = Router()

_TEXT_TYPES = ("input_text", "output_text", "text")


def _text_of(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if (
                not isinstance(part, dict)
                or part.get("type") not in _TEXT_TYPES
                or not isinstance(part.get("text"), str)
            ):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise unsupported(f"{where}.content[{j}]", f"{kind!r} content (only text parts are supported)")
            texts.append(part["text"])
        return "".join(texts)
    raise bad_request("content must be a string or a list of text parts", f"{where}.content")


def _messages(body: ResponsesRequest) -> list[dict[str, Any]]:
    """The input as chat messages: instructions first, consecutive function calls as one assistant turn."""
    messages: list[dict[str, Any]] = []
    if body.instructions:
        messages.append({"role": "system", "content": body.instructions})
    if isinstance(body.input, str):
        return [*messages, {"role": "user", "content": body.input}]
    for i, item in enumerate(body.input):
        where = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            messages.append({"role": item.get("role"), "content": _text_of(item.get("content"), where)})
        elif kind == "function_call":
            call = {
                "id": item.get("call_id") or item.get("id"),
                "type": "function",
                "function": {"name": item.get("name"), "arguments": item.get("arguments") or "{}"},
            }
            if messages and messages[-1]["role"] == "assistant" and messages[-1].get("tool_calls"):
                messages[-1]["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            text = output if isinstance(output, str) else json.dumps(output)
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": text})
        elif kind == "reasoning":
            continue  # a reasoning model's earlier thoughts: chat templates drop them too
        else:
            raise unsupported(f"{where}.type", f"{kind!r} input items")
    return messages


def _chat_request(body: ResponsesRequest) -> ChatCompletionRequest:
    if body.previous_response_id is not None:
        raise unsupported("previous_response_id", "previous_response_id (nothing is stored: send the whole input)")
    tools = None
    if body.tools:
        tools = []
        for i, tool in enumerate(body.tools):
            if tool.get("type") != "function":
                raise unsupported(f"tools[{i}].type", f"{tool.get('type')!r} tools (only function tools run here)")
            fn = {k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool}
            tools.append({"type": "function", "function": fn})
    choice = body.tool_choice
    if isinstance(choice, dict) and choice.get("type") == "function" and "name" in choice:
        choice = {"type": "function", "function": {"name": choice["name"]}}
    response_format = None
    fmt = (body.text or {}).get("format")
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        response_format = {"type": "json_schema", "json_schema": {k: v for k, v in fmt.items() if k != "type"}}
    elif isinstance(fmt, dict):
        response_format = fmt
    try:
        # Validated from plain data: the converted input is dicts, checked here as a chat request's would be.
        return ChatCompletionRequest.model_validate(
            {
                "model": body.model,
                "messages": _messages(body),
                "tools": tools,
                "tool_choice": choice,
                "parallel_tool_calls": body.parallel_tool_calls,
                "response_format": response_format,
                "temperature": body.temperature,
                "top_p": body.top_p,
                "max_completion_tokens": body.max_output_tokens,
                "user": body.user,
            }
        )
    except ValueError as exc:  # a pydantic error on a converted field
        raise bad_request(f"input is not a valid conversation: {exc}", "input") from None


class _Output:
    """The response object as it grows: output items, then status and usage."""

    def __init__(self, body: ResponsesRequest, job: ChatJob) -> None:
        self.body, self.job = body, job
        self.id = f"resp_{uuid.uuid4().hex}"
        self.created = int(time.time())

    def response(
        self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None = None, reason: str | None = None
    ) -> dict[str, Any]:
        body = self.body
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "model": self.job.model,
            "output": output,
            "usage": usage,
            "incomplete_details": {"reason": reason} if reason else None,
            "error": None,
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": None,
            "temperature": body.temperature,
            "top_p": body.top_p,
            "tool_choice": body.tool_choice or "auto",
            "tools": body.tools or [],
            "text": body.text or {"format": {"type": "text"}},
            "metadata": body.metadata or {},
            "store": False,
        }

    def usage(self, output_tokens: int) -> dict[str, Any]:
        prompt = len(self.job.prompt)
        return {
            "input_tokens": prompt,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": output_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt + output_tokens,
        }


def _message_item(text: str, status: str = "completed") -> dict[str, Any]:
    return {
        "type": "message",
        "id": f"msg_{uuid.uuid4().hex}",
        "status": status,
        "role": "assistant",
        "content": [{"type": "output_text", "text": text, "annotations": []}] if status == "completed" else [],
    }


def _call_item(call: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": f"fc_{uuid.uuid4().hex}",
        "call_id": call["id"],
        "name": call["function"]["name"],
        "arguments": call["function"]["arguments"],
        "status": "completed",
    }


def _reasoning_item(text: str) -> dict[str, Any]:
    return {
        "type": "reasoning",
        "id": f"rs_{uuid.uuid4().hex}",
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}],
    }


@router.post("/v1/responses", body=ResponsesRequest, errors=(400, 404, 503), streams=True)
async def create_response(body: ResponsesRequest, request: Request, state: ServerState) -> Any:
    """OpenAI's Responses API, the stateless subset, run as a chat completion."""
    job = await prepare_chat(_chat_request(body), state)
    out = _Output(body, job)
    streams = gen.ChoiceStreams(job.client, [job.prompt], job.params, out.id)
    if not body.stream:
        try:
            (result,) = await gen.until_disconnect(request, streams.collect(1))
        except Exception as exc:  # noqa: BLE001
            raise state.error(exc, "input") from None
        message, _called = job.shape.message(result.text)
        items = []
        if message.get("reasoning_content"):
            items.append(_reasoning_item(message["reasoning_content"]))
        if message.get("content"):
            items.append(_message_item(message["content"]))
        items += [_call_item(c) for c in message.get("tool_calls") or []]
        if not any(i["type"] != "reasoning" for i in items):
            items.append(_message_item(""))  # an empty answer is still a message
        length = result.finish_reason == "length"
        return out.response(
            "incomplete" if length else "completed",
            items,
            out.usage(result.num_output_tokens),
            "max_output_tokens" if length else None,
        )
    # response.created goes out now, before the first token; later failures are error events.
    return StreamingResponse(
        _encode(_events(out, streams), lambda exc: state.error(exc, "input")),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


async def _events(out: _Output, streams: gen.ChoiceStreams) -> AsyncIterator[dict[str, Any]]:
    """The Responses API's stream: created, the output items as they form, then completed."""
    splitter = out.job.shape.splitter()
    items: list[dict[str, Any]] = []
    text_item: dict[str, Any] | None = None
    text = reasoning = ""
    yield {"type": "response.created", "response": out.response("in_progress", [])}
    yield {"type": "response.in_progress", "response": out.response("in_progress", [])}

    def close_reasoning() -> list[dict[str, Any]]:
        """The reasoning item, whole, once the think block has ended (it precedes the answer)."""
        nonlocal reasoning
        if not reasoning:
            return []
        item, reasoning = _reasoning_item(reasoning), ""
        index = len(items)
        items.append(item)
        return [
            {"type": "response.output_item.added", "output_index": index, "item": item},
            {"type": "response.output_item.done", "output_index": index, "item": item},
        ]

    def open_text() -> list[dict[str, Any]]:
        nonlocal text_item
        text_item = _message_item("", "in_progress")
        index = len(items)
        items.append(text_item)
        return [
            {"type": "response.output_item.added", "output_index": index, "item": text_item},
            {
                "type": "response.content_part.added",
                "item_id": text_item["id"],
                "output_index": index,
                "content_index": 0,
                "part": {"type": "output_text", "text": "", "annotations": []},
            },
        ]

    def text_delta(delta: str) -> dict[str, Any]:
        assert text_item is not None
        return {
            "type": "response.output_text.delta",
            "item_id": text_item["id"],
            "output_index": items.index(text_item),
            "content_index": 0,
            "delta": delta,
        }

    def close_text() -> list[dict[str, Any]]:
        nonlocal text_item
        if text_item is None:
            return []
        index = items.index(text_item)
        done = {**_message_item(text), "id": text_item["id"]}
        items[index] = done
        text_item = None
        part = {"type": "output_text", "text": text, "annotations": []}
        return [
            {
                "type": "response.output_text.done",
                "item_id": done["id"],
                "output_index": index,
                "content_index": 0,
                "text": text,
            },
            {
                "type": "response.content_part.done",
                "item_id": done["id"],
                "output_index": index,
                "content_index": 0,
                "part": part,
            },
            {"type": "response.output_item.done", "output_index": index, "item": done},
        ]

    try:
        item = await streams.next()
        while item is not None:
            _index, delta = item
            fields = splitter.feed(delta.text)
            reasoning += fields.get("reasoning_content", "")
            if fields.get("content"):
                if text_item is None:
                    for event in close_reasoning() + open_text():
                        yield event
                text += fields["content"]
                yield text_delta(fields["content"])
            if delta.finished:
                gen.check_finish(delta)
                rest, calls = splitter.finish()
                reasoning += rest.get("reasoning_content", "")
                if rest.get("content") or (text_item is None and not calls):  # an empty answer: still a message
                    if text_item is None:
                        for event in close_reasoning() + open_text():
                            yield event
                    if rest.get("content"):
                        text += rest["content"]
                        yield text_delta(rest["content"])
                for event in close_text() + close_reasoning():
                    yield event
                for call in calls:
                    call_item = _call_item(call.to_openai())
                    index = len(items)
                    items.append(call_item)
                    yield {
                        "type": "response.output_item.added",
                        "output_index": index,
                        "item": {**call_item, "arguments": "", "status": "in_progress"},
                    }
                    yield {
                        "type": "response.function_call_arguments.delta",
                        "item_id": call_item["id"],
                        "output_index": index,
                        "delta": call_item["arguments"],
                    }
                    yield {
                        "type": "response.function_call_arguments.done",
                        "item_id": call_item["id"],
                        "output_index": index,
                        "arguments": call_item["arguments"],
                    }
                    yield {"type": "response.output_item.done", "output_index": index, "item": call_item}
                length = delta.finish_reason == "length"
                final = out.response(
                    "incomplete" if length else "completed",
                    items,
                    out.usage(delta.num_output_tokens),
                    "max_output_tokens" if length else None,
                )
                yield {"type": "response.incomplete" if length else "response.completed", "response": final}
            item = await streams.next()
    finally:
        await streams.aclose()


async def _encode(events: AsyncIterator[dict[str, Any]], to_api_error) -> AsyncIterator[str]:
    """``event: <type>`` and ``data: <json>`` per event, numbered; an error becomes an error event."""
    sequence = 0
    try:
        async for event in events:
            event["sequence_number"] = sequence
            sequence += 1
            yield f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False, separators=(',', ':'))}\n\n"
    except Exception as exc:  # noqa: BLE001
        error: APIError = to_api_error(exc)
        detail = error.body()["error"]
        payload = {
            "type": "error",
            "code": detail.get("code"),
            "message": detail["message"],
            "param": detail.get("param"),
            "sequence_number": sequence,
        }
        yield f"event: error\ndata: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"
