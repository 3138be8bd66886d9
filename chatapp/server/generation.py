"""Shared by the chat and text-completion routes: prompts, sampling parameters,
running n engine streams together, and stopping them when the client leaves.

Engine streams are always read by their own asyncio tasks. A client that goes
away makes Starlette cancel the response inside an anyio cancel scope, where
every later ``await`` is cancelled again; a stream read directly there could
not finish its abort. Cancelling our own reader tasks instead lets each stream
close (and abort its request in the engine) normally.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import anyio
from starlette.requests import Request

from chatapp.engine.api import EngineClient, context_length_error
from chatapp.engine.guided import GuidedDecoding
from chatapp.engine.output_processor import OutputDelta
from chatapp.engine.outputs import FinishReason, TokenLogprobs
from chatapp.engine.sampling_params import SamplingParams
from chatapp.server.errors import APIError, ClientGone, EngineFailure, bad_request, sampling_error
from chatapp.server.schemas import SamplingFields
from chatapp.server.structured import guided_decoding

T = TypeVar("T")

MAX_N = 16
MAX_STOP_STRINGS = 256
# Tokenising a few KB takes well under a millisecond; anything bigger goes to a
# thread so one huge prompt cannot stall every other stream on the event loop.
_INLINE_TOKENIZE_CHARS = 16_384


# -- prompts --------------------------------------------------------------------


async def _maybe_in_thread(size: int, fn: Any, *args: Any, **kwargs: Any) -> Any:
    if size <= _INLINE_TOKENIZE_CHARS:
        return fn(*args, **kwargs)
    return await asyncio.to_thread(fn, *args, **kwargs)


async def render_chat(
    client: EngineClient,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    *,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
) -> list[int]:
    """Token ids of a conversation (raises ChatFormatError for a bad one)."""
    size = sum(len(str(m.get("content") or "")) for m in messages)
    render = functools.partial(
        client.tokenizer.render_chat,
        add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message,
    )
    return await _maybe_in_thread(size, render, messages, tools=tools)


async def encode(client: EngineClient, text: str) -> list[int]:
    return await _maybe_in_thread(len(text), client.tokenizer.encode, text)


def check_token_ids(ids: Sequence[int], vocab_size: int, param: str) -> None:
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise bad_request(f"token id {bad} is out of range: this model's ids are 0..{vocab_size - 1}", param)


def check_context(ids: Sequence[int], max_model_len: int, max_tokens: int | None, param: str) -> None:
    """A prompt must leave room for at least one new token; a long max_tokens is cut at the context's end."""
    if not ids:
        raise bad_request(f"{param} is empty", param)
    if len(ids) >= max_model_len:
        raise APIError(
            400, context_length_error(max_model_len, len(ids), max_tokens), param=param, code="context_length_exceeded"
        )


# -- sampling parameters -------------------------------------------------------


def check_n(n: int | None) -> int:
    n = 1 if n is None else n
    if not 1 <= n <= MAX_N:
        raise bad_request(f"n must be between 1 and {MAX_N}, got {n}", "n")
    return n


def _one_grammar(tools: GuidedDecoding | None, asked: GuidedDecoding | None) -> GuidedDecoding | None:
    if tools is not None and asked is not None:
        raise bad_request("response_format cannot be combined with tool calls that need a grammar", "response_format")
    return tools if tools is not None else asked


def check_stream_options(body: SamplingFields) -> None:
    """As OpenAI: stream_options belongs to streamed requests only (a client that sends it without
    stream: true expects a stream it would not get)."""
    if body.stream_options is not None and not body.stream:
        raise bad_request("stream_options is only allowed when stream is true", "stream_options")


def parse_logit_bias(raw: dict[str, float] | None, vocab_size: int) -> dict[int, float] | None:
    """JSON object keys are strings: {"1234": -100} -> {1234: -100.0}."""
    if not raw:
        return None
    out = {}
    for key, bias in raw.items():
        try:
            token = int(key)
        except ValueError:
            raise bad_request(f"logit_bias keys must be token ids, got {key!r}", "logit_bias") from None
        if not 0 <= token < vocab_size:
            raise bad_request(f"logit_bias token id {token} is out of range 0..{vocab_size - 1}", "logit_bias")
        out[token] = bias
    return out


def sampling_params(
    body: SamplingFields,
    *,
    n: int,
    vocab_size: int,
    max_tokens: int | None,
    logprobs: int | None,
    renames: dict[str, str] | None = None,
    guided: GuidedDecoding | None = None,
    prompt_logprobs: int | None = None,
) -> list[SamplingParams]:
    """One SamplingParams per choice; with a seed, choice i uses seed + i so the choices differ.

    guided: a grammar the caller sets (tool calls); the request's own (response_format) may not be
    given beside it."""
    if body.seed is not None and not -(2**63) <= body.seed <= 2**63 - n:  # the engine's generators take int64
        raise bad_request(f"seed must fit in a signed 64-bit integer, got {body.seed}", "seed")
    stop = body.stop
    if isinstance(stop, list) and len(stop) > MAX_STOP_STRINGS:
        raise bad_request(f"stop may hold at most {MAX_STOP_STRINGS} strings, got {len(stop)}", "stop")
    common: dict[str, Any] = dict(
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=-1 if body.top_k is None else body.top_k,
        min_p=0.0 if body.min_p is None else body.min_p,
        max_tokens=max_tokens,
        stop=stop,
        presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
        logprobs=logprobs,
        logit_bias=parse_logit_bias(body.logit_bias, vocab_size),
        ignore_eos=bool(body.ignore_eos),
        guided=_one_grammar(guided, guided_decoding(body)),
        prompt_logprobs=prompt_logprobs,
    )
    try:
        return [SamplingParams(**common, seed=None if body.seed is None else body.seed + i) for i in range(n)]
    except ValueError as exc:
        raise sampling_error(exc, renames or {}) from None


# -- running the streams -------------------------------------------------------


@dataclass
class ChoiceResult:
    """One choice, gathered for a non-streaming answer."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    prompt_logprobs: list[TokenLogprobs | None] | None = None


class ChoiceStreams:
    """Reads several engine streams at once (n choices, several prompts) as one sequence of (index, delta).

    Requests with the same prompt share its KV blocks through the prefix
    cache, but only blocks already computed can be found there: submitted
    together, each would compute the whole prompt itself. So the first
    request of each distinct prompt goes first and its twins follow as soon
    as it yields its first token (its prompt then sits in the cache).
    """

    def __init__(
        self, client: EngineClient, prompts: list[list[int]], params: list[SamplingParams], request_id: str
    ) -> None:
        self._client = client
        self._prompts = prompts
        self._params = params
        self._request_id = request_id
        self._queue: asyncio.Queue[tuple[int, OutputDelta | None, BaseException | None]] = asyncio.Queue()
        self._open = len(prompts)
        self._tasks: list[asyncio.Task[None]] = []
        self._closed = False
        self._twins: dict[int, list[int]] = {}
        first_with: dict[tuple[int, ...], int] = {}
        for i, ids in enumerate(prompts):
            leader = first_with.setdefault(tuple(ids), i)
            if leader == i:
                self._twins[i] = []
                self._start(i)
            else:
                self._twins[leader].append(i)

    def _start(self, index: int) -> None:
        if self._closed:
            return
        stream = self._client.generate(self._prompts[index], self._params[index], f"{self._request_id}-{index}")
        self._tasks.append(asyncio.create_task(self._pump(index, stream)))

    def _start_twins(self, index: int) -> None:
        for twin in self._twins.pop(index, ()):
            self._start(twin)

    async def _pump(self, index: int, stream: Any) -> None:
        try:
            async for delta in stream:
                self._start_twins(index)
                self._queue.put_nowait((index, delta, None))
        except Exception as exc:  # noqa: BLE001  handed to the reader, which maps it
            self._queue.put_nowait((index, None, exc))
        finally:
            self._start_twins(index)  # a leader that failed early must not strand its twins
            aclose = getattr(stream, "aclose", None)
            if aclose is not None:
                with contextlib.suppress(Exception):
                    await aclose()
            self._queue.put_nowait((index, None, None))

    async def next(self) -> tuple[int, OutputDelta] | None:
        """The next delta of any choice; None once all have ended. Re-raises a stream's error."""
        while self._open:
            index, delta, error = await self._queue.get()
            if error is not None:
                raise error
            if delta is None:
                self._open -= 1
                continue
            return index, delta
        return None

    async def aclose(self) -> None:
        """Stop every stream (aborting unfinished requests); safe inside a cancelled scope."""
        self._closed = True
        for task in self._tasks:
            task.cancel()
        with anyio.CancelScope(shield=True), anyio.move_on_after(10):
            await asyncio.gather(*self._tasks, return_exceptions=True)

    async def collect(self, count: int) -> list[ChoiceResult]:
        """Run every stream to its end (non-streaming answers)."""
        results = [ChoiceResult() for _ in range(count)]
        try:
            while (item := await self.next()) is not None:
                index, delta = item
                result = results[index]
                result.text += delta.text
                result.token_ids += delta.token_ids
                if delta.logprobs:
                    result.logprobs += delta.logprobs
                if delta.prompt_logprobs is not None:
                    result.prompt_logprobs = delta.prompt_logprobs
                result.num_prompt_tokens = delta.num_prompt_tokens
                result.num_output_tokens = delta.num_output_tokens
                if delta.finished:
                    check_finish(delta)
                    result.finish_reason = delta.finish_reason
        finally:
            await self.aclose()
        return results


async def first_delta(request: Request, streams: ChoiceStreams) -> tuple[int, OutputDelta] | None:
    """Wait for the first delta before a stream's headers go out, so early errors are still HTTP errors."""
    try:
        return await until_disconnect(request, streams.next())
    except BaseException:
        await streams.aclose()
        raise


def check_finish(delta: OutputDelta) -> None:
    if delta.finish_reason == FinishReason.ERROR:
        raise EngineFailure(delta.error or "the engine failed this request")
    if delta.finish_reason == FinishReason.ABORT:
        raise EngineFailure("the request was aborted in the engine")


# -- client disconnects ----------------------------------------------------------


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await ``work``, but cancel it (aborting its engine requests) if the client disconnects first.

    Needed before the response starts: a non-streaming answer or the first
    token of a stream can wait a long time in the engine's queue, and nothing
    else notices a client that timed out meanwhile.
    """
    task = asyncio.ensure_future(work)
    watcher = asyncio.create_task(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
            with anyio.CancelScope(shield=True):
                await asyncio.gather(task, return_exceptions=True)
        watcher.cancel()
    if task.cancelled():
        raise ClientGone()
    return task.result()


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    """OpenAI's usage object; the prompt counts once however many choices were asked for."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


async def token_id_lists(
    client: EngineClient, given: str | list[int] | list[str] | list[list[int]], field: str, max_items: int
) -> list[list[int]]:
    """OpenAI's text-or-tokens inputs (one string, one id list, or a list of either) -> checked id lists.

    Errors name the item (``prompt[2]``) when several were given, as the SDK user wrote them."""
    items = [given] if isinstance(given, str) or (given and isinstance(given[0], int)) else given
    if not items:
        raise bad_request(f"{field} must not be empty", field)
    if len(items) > max_items:
        raise bad_request(f"at most {max_items} {field}s per request, got {len(items)}", field)
    out = []
    for i, item in enumerate(items):
        param = field if len(items) == 1 else f"{field}[{i}]"
        ids = await encode(client, item) if isinstance(item, str) else list(item)  # type: ignore[arg-type]
        check_token_ids(ids, client.model_info.vocab_size, param)
        out.append(ids)
    return out
