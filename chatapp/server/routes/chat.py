"""POST /v1/chat/completions: chat answers, whole or streamed."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request

from chatapp.engine.api import EngineClient
from chatapp.engine.sampling_params import SamplingParams
from chatapp.server import generation as gen
from chatapp.server.answers import AnswerShape
from chatapp.server.errors import bad_request, unsupported
from chatapp.server.logprobs import chat_logprobs, without_end_of_turn
from chatapp.server.routing import Router
from chatapp.server.schemas import ChatCompletion, ChatCompletionRequest
from chatapp.server.sse import event_stream
from chatapp.server.state import ServerState
from chatapp.server.tool_calls import plan_tools

router = Router()

_UNSUPPORTED_PARTS = {
    "image_url": "image input",
    "input_image": "image input",
    "input_audio": "audio input",
    "audio": "audio input",
    "file": "file input",
}


def _check_supported(body: ChatCompletionRequest) -> None:
    """Refuse features we cannot honour by name, instead of answering as if they were not asked for."""
    if body.functions:
        raise unsupported("functions", "function calling (functions)")
    if body.function_call not in (None, "none", "auto"):
        raise unsupported("function_call")
    if body.audio is not None or (body.modalities and set(body.modalities) - {"text"}):
        raise unsupported("modalities" if body.audio is None else "audio", "audio output")
    if body.top_logprobs is not None and not body.logprobs:
        raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
    for i, message in enumerate(body.messages):
        if isinstance(message.content, list):
            for j, part in enumerate(message.content):
                kind = part.get("type")
                if kind in _UNSUPPORTED_PARTS:
                    raise unsupported(f"messages[{i}].content[{j}]", f"{_UNSUPPORTED_PARTS[kind]} ({kind!r} parts)")
                if kind == "text" and not isinstance(part.get("text"), str):
                    raise bad_request(
                        f"messages[{i}].content[{j}].text must be a string", f"messages[{i}].content[{j}].text"
                    )


@dataclass
class ChatJob:
    """A chat request made ready to run: its prompt, one SamplingParams per choice, and how to read
    the answers (also what /v1/responses runs)."""

    client: EngineClient
    model: str
    prompt: list[int]
    params: list[SamplingParams]
    shape: AnswerShape
    n: int
    top_n: int


async def prepare_chat(body: ChatCompletionRequest, state: ServerState) -> ChatJob:
    """Check, render and tokenize a chat request (raising APIError for anything wrong in it)."""
    client, model = await state.engine_for(body.model)
    info = client.model_info
    _check_supported(body)
    gen.check_stream_options(body)
    n = gen.check_n(body.n)
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    top_n = (body.top_logprobs or 0) if body.logprobs else 0
    plan = plan_tools(body, client.tokenizer.hf.chat_template)
    params = gen.sampling_params(
        body,
        guided=plan.guided() if plan else None,
        n=n,
        vocab_size=info.vocab_size,
        max_tokens=max_tokens,
        logprobs=top_n if body.logprobs else None,
        renames={
            "max_tokens": "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens",
            "logprobs": "top_logprobs",
        },
    )
    messages = [m.model_dump(exclude_none=True) for m in body.messages]
    template_tools = None
    if plan is not None:
        messages, template_tools = plan.prompt(messages)
    try:
        prompt = await gen.render_chat(
            client,
            messages,
            template_tools,
            add_generation_prompt=body.add_generation_prompt,
            continue_final_message=body.continue_final_message,
        )
    except Exception as exc:  # noqa: BLE001  ChatFormatError and friends -> 400
        raise state.error(exc, "messages") from None
    gen.check_context(prompt, info.max_model_len, max_tokens, "messages")
    return ChatJob(client, model, prompt, params, AnswerShape.of(client.tokenizer, prompt, plan), n, top_n)


@router.post(
    "/v1/chat/completions", body=ChatCompletionRequest, answer=ChatCompletion, errors=(400, 404, 503), streams=True
)
async def chat_completions(body: ChatCompletionRequest, request: Request, state: ServerState) -> Any:
    """Answer a conversation, whole or streamed."""
    job = await prepare_chat(body, state)
    client, prompt, n = job.client, job.prompt, job.n
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    streams = gen.ChoiceStreams(client, [prompt] * n, job.params, request_id)
    if not body.stream:
        try:
            results = await gen.until_disconnect(request, streams.collect(n))
        except Exception as exc:  # noqa: BLE001
            raise state.error(exc, "messages") from None
        choices = []
        for i, r in enumerate(results):
            logprobs = (
                {
                    "content": chat_logprobs(
                        client.tokenizer, *_answer_tokens(client, r.token_ids, r.logprobs, r), job.top_n
                    )
                }
                if body.logprobs
                else None
            )
            message, called = job.shape.message(r.text)
            finish = "tool_calls" if called and r.finish_reason == "stop" else r.finish_reason
            choices.append({"index": i, "message": message, "logprobs": logprobs, "finish_reason": finish})
        completion = sum(r.num_output_tokens for r in results)
        usage = gen.usage(len(prompt), completion)
        return ChatCompletion.model_validate(
            {"id": request_id, "created": created, "model": job.model, "choices": choices, "usage": usage}
        )

    # Headers and each choice's role chunk go out now, before the first token: a client waiting
    # on a long prompt sees a live stream. A failure from here on travels as an error event.
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    chunks = _chunks(
        client,
        streams,
        request_id=request_id,
        created=created,
        model=job.model,
        n=n,
        prompt_tokens=len(prompt),
        top_n=job.top_n if body.logprobs else None,
        include_usage=include_usage,
        shape=job.shape,
    )
    return event_stream(chunks, lambda exc: state.error(exc, "messages"))


def _answer_tokens(client: EngineClient, token_ids: list[int], logprobs: list, result: Any) -> tuple[list, list]:
    stopped = bool(getattr(result, "finished", True)) and result.finish_reason == "stop"
    return without_end_of_turn(client.tokenizer, token_ids, logprobs, stopped)


async def _chunks(
    client: EngineClient,
    streams: gen.ChoiceStreams,
    *,
    request_id: str,
    created: int,
    model: str,
    n: int,
    prompt_tokens: int,
    top_n: int | None,
    include_usage: bool,
    shape: AnswerShape,
) -> AsyncIterator[dict[str, Any]]:
    """chat.completion.chunk events: a role chunk per choice, content chunks, one finish chunk per choice.

    A reasoning model's think block streams as ``reasoning_content``. With tools, content streams
    up to where a call could begin; the calls come whole, one ``tool_calls`` delta each, before
    the finish chunk ("tool_calls")."""
    base: dict[str, Any] = {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model}

    def chunk(index: int, delta: dict[str, Any], logprobs: Any = None, finish: str | None = None) -> dict[str, Any]:
        event = {**base, "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]}
        if include_usage:
            event["usage"] = None
        return event

    completion_tokens = 0
    splitters = [shape.splitter() for _ in range(n)]
    try:
        for i in range(n):
            yield chunk(i, {"role": "assistant", "content": ""})
        item = await streams.next()
        while item is not None:
            index, delta = item
            logprobs = None
            if top_n is not None and delta.logprobs:
                ids, lps = _answer_tokens(client, delta.token_ids, delta.logprobs, delta)
                logprobs = {"content": chat_logprobs(client.tokenizer, ids, lps, top_n)}
            fields = splitters[index].feed(delta.text)
            if fields or logprobs:
                yield chunk(index, fields or {"content": ""}, logprobs)
            if delta.finished:
                gen.check_finish(delta)
                completion_tokens += delta.num_output_tokens
                rest, calls = splitters[index].finish()
                if rest:
                    yield chunk(index, rest)
                for k, call in enumerate(calls):
                    yield chunk(index, {"tool_calls": [{"index": k, **call.to_openai()}]})
                finish = "tool_calls" if calls and delta.finish_reason == "stop" else delta.finish_reason
                yield chunk(index, {}, None, finish)
            item = await streams.next()
        if include_usage:
            yield {**base, "choices": [], "usage": gen.usage(prompt_tokens, completion_tokens)}
    finally:
        await streams.aclose()
