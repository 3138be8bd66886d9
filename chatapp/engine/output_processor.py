"""Token ids from the core -> text for users: detokenisation, stop strings, results.

Runs beside the client (in-process for the offline LLM, in each client process
for the engine server), keeping per-token Python work out of the engine loop.
A stop string is found here, so the request is reported for abort in the core.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from chatapp.engine.detokenizer import IncrementalDetokenizer
from chatapp.engine.outputs import CompletionOutput, EngineCoreOutput, FinishReason, RequestOutput, TokenLogprobs
from chatapp.engine.sampling_params import SamplingParams
from chatapp.engine.tokenizer import Tokenizer


@dataclass
class OutputDelta:
    """What one request gained in one step: the unit a stream yields."""

    request_id: str
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs] | None
    finished: bool
    finish_reason: FinishReason | None
    stop_reason: str | int | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    error: str | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # in the first delta, when asked


@dataclass
class _RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    detok: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    arrival: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    num_cached_tokens: int = 0
    prompt_logprobs: list[TokenLogprobs | None] | None = None


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._states: dict[str, _RequestState] = {}
        self.finished: dict[str, RequestOutput] = {}

    def add_request(
        self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams
    ) -> None:
        detok = IncrementalDetokenizer(
            self.tokenizer.hf, prompt_token_ids, params.stop_strings, params.skip_special_tokens
        )
        self._states[request_id] = _RequestState(request_id, prompt, prompt_token_ids, params, detok)

    def has(self, request_id: str) -> bool:
        return request_id in self._states

    def drop(self, request_id: str) -> None:
        self._states.pop(request_id, None)

    def process(self, outputs: list[EngineCoreOutput]) -> tuple[list[OutputDelta], list[str]]:
        """Turn core outputs into deltas; also return request ids the core must abort (stop strings)."""
        deltas: list[OutputDelta] = []
        to_abort: list[str] = []
        for out in outputs:
            state = self._states.get(out.request_id)
            if state is None:
                continue  # already finished here (a stop string), the core's abort echo
            if out.new_token_ids and state.first_token_time is None:
                state.first_token_time = time.monotonic()
            state.num_cached_tokens = out.num_cached_tokens
            state.token_ids.extend(out.new_token_ids)
            if out.new_logprobs:
                state.logprobs.extend(out.new_logprobs)
            if out.prompt_logprobs is not None:
                state.prompt_logprobs = out.prompt_logprobs
            finished = out.finish_reason is not None
            text = state.detok.add_tokens(out.new_token_ids, finished)
            finish_reason = out.finish_reason
            stop_reason: str | int | None = None
            if state.detok.stop_reason is not None:
                if not finished:
                    to_abort.append(out.request_id)
                finished, finish_reason, stop_reason = True, FinishReason.STOP, state.detok.stop_reason
            elif (
                finish_reason == FinishReason.STOP
                and state.token_ids
                and state.token_ids[-1] in (state.params.stop_token_ids or ())
            ):
                stop_reason = state.token_ids[-1]
            deltas.append(
                OutputDelta(
                    out.request_id,
                    text,
                    list(out.new_token_ids),
                    out.new_logprobs,
                    finished,
                    finish_reason,
                    stop_reason,
                    len(state.prompt_token_ids),
                    len(state.token_ids),
                    out.num_cached_tokens,
                    out.error,
                    out.prompt_logprobs,
                )
            )
            if finished:
                self._finish(state, finish_reason, stop_reason, out.error)
        return deltas, to_abort

    def _finish(
        self, state: _RequestState, finish_reason: FinishReason | None, stop_reason: str | int | None, error: str | None
    ) -> None:
        del self._states[state.request_id]
        if finish_reason in (FinishReason.STOP, FinishReason.LENGTH):
            self.tokenizer.remember_output(state.detok.text, state.token_ids)
        now = time.monotonic()
        metrics = {"latency_s": now - state.arrival}
        if state.first_token_time is not None:
            metrics["ttft_s"] = state.first_token_time - state.arrival
        completion = CompletionOutput(
            0,
            state.detok.text,
            state.token_ids,
            finish_reason,
            stop_reason,
            state.logprobs if state.params.logprobs is not None else None,
        )
        self.finished[state.request_id] = RequestOutput(
            state.request_id,
            state.prompt,
            state.prompt_token_ids,
            [completion],
            True,
            state.num_cached_tokens,
            error,
            metrics,
            state.prompt_logprobs,
        )
