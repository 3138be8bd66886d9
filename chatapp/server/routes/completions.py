"""POST /v1/completions: plain text completion of one or more prompts (text or token ids)."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request

from chatapp.engine.api import EngineClient
from chatapp.server import generation as gen
from chatapp.server.errors import unsupported
from chatapp.server.logprobs import (
    completion_logprobs,
    echoed_prompt_logprobs,
    join_columns,
    without_end_of_turn,
)
from chatapp.server.routing import Router
from chatapp.server.schemas import Completion, CompletionRequest
from chatapp.server.sse import event_stream
from chatapp.server.state import ServerState

router = Router()

MAX_PROMPTS = 64


@router.post("/v1/completions", body=CompletionRequest, answer=Completion, errors=(400, 404, 503), streams=True)
async def completions(body: CompletionRequest, request: Request, state: ServerState) -> Any:
    """Continue one or more prompts (text or token ids), whole or streamed."""
    client, model = await state.engine_for(body.model)
    info = client.model_info
    if body.suffix:
        raise unsupported("suffix")
    gen.check_stream_options(body)
    n = gen.check_n(body.n)
    if body.best_of is not None and body.best_of != n:
        raise unsupported("best_of", "best_of other than n")
    echo_logprobs = body.logprobs if body.echo else None  # the prompt's logprobs come with it
    params = gen.sampling_params(
        body,
        n=n,
        vocab_size=info.vocab_size,
        max_tokens=body.max_tokens,
        logprobs=body.logprobs,
        prompt_logprobs=echo_logprobs,
    )
    prompts = await gen.token_id_lists(client, body.prompt, "prompt", MAX_PROMPTS)
    for i, ids in enumerate(prompts):
        gen.check_context(ids, info.max_model_len, body.max_tokens, "prompt" if len(prompts) == 1 else f"prompt[{i}]")

    request_id = f"cmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    # Choice k is prompt k // n, sample k % n (OpenAI's order).
    streams = gen.ChoiceStreams(client, [ids for ids in prompts for _ in range(n)], params * len(prompts), request_id)
    prompt_tokens = sum(len(ids) for ids in prompts)
    top_n = body.logprobs
    echo = _Echo(client, body.prompt, prompts, n, top_n) if body.echo else None
    if not body.stream:
        try:
            results = await gen.until_disconnect(request, streams.collect(n * len(prompts)))
        except Exception as exc:  # noqa: BLE001
            raise state.error(exc, "prompt") from None
        choices = []
        for k, r in enumerate(results):
            logprobs = (
                completion_logprobs(
                    client.tokenizer,
                    *without_end_of_turn(client.tokenizer, r.token_ids, r.logprobs, r.finish_reason == "stop"),
                    top_n,
                    0,
                )[0]
                if top_n is not None
                else None
            )
            text = r.text
            if echo is not None:
                text, logprobs = echo.prepend(k, text, logprobs, r.prompt_logprobs)
            choices.append({"index": k, "text": text, "logprobs": logprobs, "finish_reason": r.finish_reason})
        completion = sum(r.num_output_tokens for r in results)
        usage = gen.usage(prompt_tokens, completion)
        return Completion.model_validate(
            {"id": request_id, "created": created, "model": model, "choices": choices, "usage": usage}
        )

    try:
        first = await gen.first_delta(request, streams)
    except Exception as exc:  # noqa: BLE001
        raise state.error(exc, "prompt") from None
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    chunks = _chunks(
        client,
        streams,
        first,
        request_id=request_id,
        created=created,
        model=model,
        prompt_tokens=prompt_tokens,
        top_n=top_n,
        include_usage=include_usage,
        echo=echo,
    )
    return event_stream(chunks, lambda exc: state.error(exc, "prompt"))


class _Echo:
    """``echo``: each choice's text and logprobs start with its prompt's (OpenAI's legacy option)."""

    def __init__(self, client: EngineClient, raw: Any, prompts: list[list[int]], n: int, top_n: int | None) -> None:
        self.client, self.prompts, self.n, self.top_n = client, prompts, n, top_n
        texts = [raw] if isinstance(raw, str) else raw if raw and isinstance(raw[0], str) else None
        self.texts = texts or [client.tokenizer.decode(ids) for ids in prompts]

    def prepend(self, choice: int, text: str, logprobs: dict[str, Any] | None, prompt_logprobs: Any):
        """(the prompt's text + text, the prompt's columns + logprobs) for choice k."""
        prompt = choice // self.n
        text = self.texts[prompt] + text
        if self.top_n is None:
            return text, logprobs
        cols, offset = echoed_prompt_logprobs(
            self.client.tokenizer, self.prompts[prompt], prompt_logprobs or [], self.top_n
        )
        if logprobs is None:
            return text, cols
        shifted = {**logprobs, "text_offset": [o + offset for o in logprobs["text_offset"]]}
        return text, join_columns(cols, shifted)


async def _chunks(
    client: EngineClient,
    streams: gen.ChoiceStreams,
    first: tuple[int, Any] | None,
    *,
    request_id: str,
    created: int,
    model: str,
    prompt_tokens: int,
    top_n: int | None,
    include_usage: bool,
    echo: _Echo | None = None,
) -> AsyncIterator[dict[str, Any]]:
    """text_completion events: text chunks, then one chunk with the finish_reason per choice (with
    echo, a choice's first chunk starts with its prompt)."""
    base: dict[str, Any] = {"id": request_id, "object": "text_completion", "created": created, "model": model}

    def chunk(index: int, text: str, logprobs: Any = None, finish: str | None = None) -> dict[str, Any]:
        event = {**base, "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}]}
        if include_usage:
            event["usage"] = None
        return event

    offsets: dict[int, int] = {}
    echoed: set[int] = set()
    completion_tokens = 0
    try:
        item = first
        while item is not None:
            index, delta = item
            logprobs = None
            if top_n is not None and delta.logprobs:
                stopped = delta.finished and delta.finish_reason == "stop"
                ids, lps = without_end_of_turn(client.tokenizer, delta.token_ids, delta.logprobs, stopped)
                logprobs, offsets[index] = completion_logprobs(client.tokenizer, ids, lps, top_n, offsets.get(index, 0))
            text = delta.text
            if echo is not None and index not in echoed:
                echoed.add(index)
                text, logprobs = echo.prepend(index, text, logprobs, delta.prompt_logprobs)
                if logprobs is not None:
                    offsets[index] = (logprobs["text_offset"] or [0])[-1] + len(
                        logprobs["tokens"][-1] if logprobs["tokens"] else ""
                    )
            if text or logprobs:
                yield chunk(index, text, logprobs)
            if delta.finished:
                gen.check_finish(delta)
                completion_tokens += delta.num_output_tokens
                yield chunk(index, "", None, delta.finish_reason)
            item = await streams.next()
        if include_usage:
            yield {**base, "choices": [], "usage": gen.usage(prompt_tokens, completion_tokens)}
    finally:
        await streams.aclose()
