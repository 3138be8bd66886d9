"""Sampling parameters of one request, validated when made."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from chatapp.engine.guided import GuidedDecoding

_MAX_LOGPROBS = 20
_INT64_MAX = 2**63 - 1  # integers cross the IPC link as msgpack int64: larger ones cannot be sent


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop. ``temperature=0`` means greedy.

    ``max_tokens=None`` generates until a stop condition or the context is full
    (as Ollama's default does); the offline default is 256 new tokens.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 256
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None
    """None: no logprobs; 0: the chosen token's; N: also the top N."""
    prompt_logprobs: int | None = None
    """None: none; 0: each prompt token's logprob (the first has none); N: also the top N. The
    request then skips the prefix cache (every prompt position must be computed)."""
    logit_bias: dict[int, float] | None = None
    skip_special_tokens: bool = True
    guided: GuidedDecoding | dict[str, Any] | None = None
    """Hold the output to a grammar: GuidedDecoding(json_schema=...), or its fields as a dict."""
    stop_strings: tuple[str, ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"{name} {why}")

        if not isinstance(self.temperature, (int, float)) or self.temperature < 0:
            raise bad("temperature", f"must be >= 0, got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            raise bad("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or (self.top_k < 1 and self.top_k not in (0, -1)):
            raise bad("top_k", f"must be -1 or 0 (off) or >= 1, got {self.top_k!r}")
        if self.top_k > _INT64_MAX:
            raise bad("top_k", f"must fit in a signed 64-bit integer, got {self.top_k!r}")
        if not 0 <= self.min_p <= 1:
            raise bad("min_p", f"must be in [0, 1], got {self.min_p!r}")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise bad("max_tokens", f"must be at least 1, got {self.max_tokens!r}")
        if self.max_tokens is not None and self.max_tokens > _INT64_MAX:
            raise bad("max_tokens", f"must fit in a signed 64-bit integer, got {self.max_tokens!r}")
        if not -2 <= self.presence_penalty <= 2:
            raise bad("presence_penalty", f"must be in [-2, 2], got {self.presence_penalty!r}")
        if not -2 <= self.frequency_penalty <= 2:
            raise bad("frequency_penalty", f"must be in [-2, 2], got {self.frequency_penalty!r}")
        if not self.repetition_penalty > 0:
            raise bad("repetition_penalty", f"must be > 0, got {self.repetition_penalty!r}")
        if self.logprobs is not None and not 0 <= self.logprobs <= _MAX_LOGPROBS:
            raise bad("logprobs", f"must be between 0 and {_MAX_LOGPROBS}, got {self.logprobs!r}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= _MAX_LOGPROBS:
            raise bad("prompt_logprobs", f"must be between 0 and {_MAX_LOGPROBS}, got {self.prompt_logprobs!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or not -(2**63) <= self.seed < 2**63):
            raise bad("seed", f"must be an integer that fits in 64 bits, got {self.seed!r}")
        if isinstance(self.guided, dict):
            try:
                self.guided = GuidedDecoding(**self.guided)
            except TypeError as exc:  # an unknown field
                raise bad("guided", f"has an unknown field: {exc}") from None
        elif self.guided is not None and not isinstance(self.guided, GuidedDecoding):
            raise bad("guided", "must be a GuidedDecoding or a dict of its fields")
        if self.stop is None:
            self.stop_strings = ()
        elif isinstance(self.stop, str):
            self.stop_strings = (self.stop,) if self.stop else ()
        else:
            if not all(isinstance(s, str) for s in self.stop):
                raise bad("stop", "must be a string or a list of strings")
            self.stop_strings = tuple(s for s in self.stop if s)
        if self.stop_token_ids is not None and not all(
            isinstance(t, int) and 0 <= t <= _INT64_MAX for t in self.stop_token_ids
        ):
            raise bad("stop_token_ids", "must be a list of non-negative token ids")
        if self.logit_bias:
            for token, bias in self.logit_bias.items():
                if not isinstance(token, int) or token < 0:
                    raise bad("logit_bias", f"keys must be token ids, got {token!r}")
                if not -100 <= bias <= 100:
                    raise bad("logit_bias", f"values must be in [-100, 100], got {bias!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def uses_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0
