"""Opening an answer's stream so that it fits the model's context (the pane's chosen context fit).

Why apart from the pane: it is the one place the prompt is cut down, retried and summarised, and it
needs only the engine client, the pane's fit and a way to say what it did.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Protocol

from chatapp.engine.api import EngineClient, InvalidRequestError
from chatapp.engine.output_processor import OutputDelta
from chatapp.engine.sampling_params import SamplingParams
from chatapp.tui.context_fit import ContextFit, can_drop, dropped_part, fit_messages, is_context_error, summary_request

SUMMARY_TOKENS = 256
"""The longest summary of old turns the model is asked for."""


async def chained(first: OutputDelta | None, rest: AsyncIterator[OutputDelta]) -> AsyncIterator[OutputDelta]:
    """``first`` (already read from ``rest``), then the rest of the stream."""
    if first is not None:
        yield first
    async for delta in rest:
        yield delta


async def close(gen: AsyncIterator[OutputDelta]) -> None:
    aclose = getattr(gen, "aclose", None)
    if aclose is not None:
        await aclose()


class FitHolder(Protocol):
    """What keeps a session's context fit and shows a line about it (a chat pane)."""

    context_fit: ContextFit | None

    def notice(self, text: str) -> None: ...


async def open_stream(
    holder: FitHolder,
    client: EngineClient,
    messages: list[dict[str, str]],
    params: SamplingParams,
    request_id: str,
    continuing: bool,
) -> tuple[AsyncIterator[OutputDelta], OutputDelta | None]:
    """The answer's stream and its first delta. Under a context fit (context_fit.py), a prompt still
    over the context leaves one more old exchange out (summarising them anew) and tries again."""
    while True:
        fit = holder.context_fit
        if fit is not None and fit.mode == "summarise" and fit.dropped and not fit.summary:
            summary = await summarise(holder, client, dropped_part(messages, fit.dropped), request_id)
            fit = holder.context_fit = replace(fit, summary=summary)
        gen = client.generate(
            messages=fit_messages(messages, fit),
            params=params,
            request_id=request_id,
            continue_final_message=continuing,
        )
        try:
            first = await anext(gen)
        except StopAsyncIteration:
            return gen, None
        except InvalidRequestError as exc:
            await close(gen)
            if fit is None or not is_context_error(exc) or not can_drop(messages, fit.dropped):
                raise
            holder.context_fit = fit.more()
            continue
        if fit is not None and fit.dropped:
            how = "summarised" if fit.mode == "summarise" else "left out"
            holder.notice(f"The {fit.dropped} oldest exchange(s) are {how} to fit the model's context.")
        return gen, first


async def summarise(holder: FitHolder, client: EngineClient, part: list[dict[str, str]], request_id: str) -> str:
    """The model's summary of ``part``; when even that is too long, of its latest messages that fit."""
    holder.notice(f"Summarising {len(part)} old message(s) to fit the model's context…")
    params = SamplingParams(temperature=0, max_tokens=SUMMARY_TOKENS)
    for start in range(len(part)):
        gen = client.generate(
            messages=summary_request(part[start:]), params=params, request_id=f"{request_id}-summary-{start}"
        )
        text: list[str] = []
        try:
            async for delta in gen:
                text.append(delta.text)
            return "".join(text).strip()
        except InvalidRequestError as exc:
            if not is_context_error(exc):
                raise
        finally:
            await close(gen)
    return ""
