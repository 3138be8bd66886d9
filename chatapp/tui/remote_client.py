"""A session's answers from a remote OpenAI-compatible server (vLLM, Ollama, our own `chatapp serve`).

It offers the part of :class:`chatapp.engine.api.EngineClient` that a chat pane
uses -- ``generate(messages=...)`` yielding :class:`OutputDelta` items, and
``abort`` -- so a pane streams the same way from either kind of backend.
Streaming uses the ``openai`` SDK's AsyncOpenAI with ``stream=True``.
"""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:
    import openai
    from openai.types.chat import ChatCompletionMessageParam

from chatapp.engine.api import EngineDeadError, InvalidRequestError
from chatapp.engine.output_processor import OutputDelta
from chatapp.engine.outputs import FinishReason
from chatapp.engine.sampling_params import SamplingParams

_ids = itertools.count(1)


class RemoteError(EngineDeadError):
    """The remote server could not be reached or answered with an error (the message says which)."""


class RemoteClient:
    """Chat completions from ``base_url`` (e.g. ``http://127.0.0.1:8000/v1``) for one model name."""

    def __init__(self, base_url: str, api_key: str | None, model: str, *, timeout_s: float = 60.0) -> None:
        self.base_url = base_url
        self.model = model
        import openai  # here: ~0.3 s of imports the TUI should not pay before its first screen

        # The SDK insists on a key; servers without auth ignore it.
        self._client = openai.AsyncOpenAI(
            base_url=base_url, api_key=api_key or "none", timeout=timeout_s, max_retries=0
        )
        self._streams: dict[str, Any] = {}

    async def generate(
        self,
        prompt: str | list[int] | None = None,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        messages: list[dict[str, Any]] | None = None,
        continue_final_message: bool = False,
    ) -> AsyncIterator[OutputDelta]:
        """Stream one chat completion as OutputDelta items (the last one finished, with usage)."""
        import openai

        if messages is None:
            raise InvalidRequestError("a remote session sends chat messages, not a raw prompt", "messages")
        params = params or SamplingParams()
        request_id = request_id or f"remote-{next(_ids)}"
        kwargs: dict[str, Any] = {"temperature": params.temperature, "top_p": params.top_p}
        if params.max_tokens is not None:
            kwargs["max_tokens"] = params.max_tokens
        if params.seed is not None:
            kwargs["seed"] = params.seed
        if params.stop_strings:
            kwargs["stop"] = list(params.stop_strings)
        if continue_final_message:  # vLLM's (and ours); a server without it may refuse the request
            kwargs["extra_body"] = {"continue_final_message": True, "add_generation_prompt": False}
        try:
            stream = await self._client.chat.completions.create(
                model=self.model,
                messages=cast("list[ChatCompletionMessageParam]", messages),
                stream=True,
                stream_options={"include_usage": True},
                **kwargs,
            )
        except openai.BadRequestError as exc:
            raise InvalidRequestError(f"{self.base_url} refused the request: {_detail(exc)}") from None
        except openai.APIStatusError as exc:
            raise RemoteError(f"{self.base_url} answered {exc.status_code}: {_detail(exc)}") from None
        except openai.APIError as exc:
            raise RemoteError(f"cannot reach {self.base_url}: {exc}") from None
        self._streams[request_id] = stream
        n_out = 0
        prompt_tokens = 0
        finish: FinishReason | None = None
        try:
            async for chunk in stream:
                # The SDK builds chunks without validating them: a server that sends other shapes (not
                # JSON, a choice that is a number, a count that is text) is checked here, where its
                # error can name the server, not in the pane that shows the text.
                if chunk.usage is not None:
                    prompt_tokens = _count(chunk.usage.prompt_tokens, prompt_tokens)
                    n_out = _count(chunk.usage.completion_tokens, n_out)
                for choice in chunk.choices or ():
                    text = choice.delta.content if choice.delta else None
                    if text is not None and not isinstance(text, str):
                        raise TypeError(f"a delta's content is {text!r}")
                    if text:
                        n_out += 1 if chunk.usage is None else 0
                        yield OutputDelta(request_id, text, [], None, False, None, None, prompt_tokens, n_out, 0)
                    if choice.finish_reason:
                        finish = _finish_reason(str(choice.finish_reason))
        except openai.APIError as exc:
            await stream.close()
            raise RemoteError(f"the stream from {self.base_url} broke off: {exc}") from None
        except (ValueError, TypeError, AttributeError) as exc:  # JSON errors are ValueErrors
            await stream.close()
            raise RemoteError(
                f"{self.base_url} sent a stream that is not a chat completion ({type(exc).__name__}: {exc})"
            ) from None
        finally:
            self._streams.pop(request_id, None)
        yield OutputDelta(request_id, "", [], None, True, finish or FinishReason.ABORT, None, prompt_tokens, n_out, 0)

    async def abort(self, request_id: str) -> None:
        """Close the HTTP stream: the server sees the disconnect and stops."""
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            await stream.close()

    async def close(self) -> None:
        await self._client.close()


def _detail(exc: openai.APIStatusError) -> str:
    body = exc.body
    if isinstance(body, dict):
        error = body.get("error", body)
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])
    return exc.message


def _count(value: Any, default: int) -> int:
    """A usage count from the stream: a whole number, or the default where the server sent none."""
    if value is None:
        return default
    if type(value) is not int or value < 0:
        raise TypeError(f"a token count is {value!r}")
    return value


def _finish_reason(remote: str) -> FinishReason:
    """A remote server's finish reason in our words: "length" stays, any other ending
    ("stop", "tool_calls", "content_filter") is a stop."""
    return FinishReason.LENGTH if remote == "length" else FinishReason.STOP
