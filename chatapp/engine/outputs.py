"""What the engine core sends out each step, and what users of the engine get back.

Core outputs are msgspec structs so the engine process can ship them cheaply;
``RequestOutput`` is the user-facing result (vLLM-shaped).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import msgspec


class FinishReason(enum.StrEnum):
    """Why a request ended: the OpenAI API's words, plus "abort" (the client stopped it) and "error"."""

    STOP = "stop"  # an end-of-sequence token or a stop string
    LENGTH = "length"  # max_tokens or the context ran out
    ABORT = "abort"
    ERROR = "error"  # the request failed (its ``error`` says why); others went on


class TokenLogprobs(msgspec.Struct, array_like=True):
    """Logprob of the chosen token and the top-N alternatives as (token_id, logprob)."""

    logprob: float
    top: list[tuple[int, float]]


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    """New tokens of one request in one step (token ids only; text is made by the client)."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: FinishReason | None = None
    new_logprobs: list[TokenLogprobs] | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    error: str | None = None
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # with the first token, when asked

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: str | int | None = None  # the stop string or token that ended it
    logprobs: list[TokenLogprobs] | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0
    error: str | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # per prompt token; None for the first
