"""A request as the engine core sees it: token ids in, token ids out.

The scheduler speaks only in "tokens computed vs tokens known": a fresh prompt,
a prefix-cache hit, a prefill chunk and a resumed preempted request differ only
in ``num_computed_tokens``.
"""

from __future__ import annotations

import enum
import hashlib
import time
from array import array
from typing import Any

from chatapp.engine.outputs import FinishReason, TokenLogprobs
from chatapp.engine.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"

    @property
    def finished(self) -> bool:
        return self not in (RequestStatus.WAITING, RequestStatus.RUNNING, RequestStatus.PREEMPTED)

    @property
    def finish_reason(self) -> FinishReason:
        """The reason a finished status reports (ValueError for a status that has not finished)."""
        return FinishReason(self.value)


PENDING_TOKEN = -1
"""The place-holder of a sampled token still on the device (see Request.append_pending_token)."""


def hash_block(parent_hash: bytes | None, token_ids: list[int]) -> bytes:
    """Hash of a full block, chained over its parent so equal hashes mean equal prefixes."""
    digest = hashlib.blake2b(parent_hash or b"root", digest_size=16)
    digest.update(array("q", token_ids).tobytes())
    return digest.digest()


class Request:
    """One generation request inside the engine core."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        eos_token_ids: frozenset[int],
        block_size: int,
        max_model_len: int,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.params = params
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0
        # Overlapped steps (EngineCore): the last token was sampled by a step still running on the
        # device; all_token_ids holds PENDING_TOKEN in its place until the engine reads it back.
        self.token_pending = False
        self.num_cached_tokens = 0  # prefix-cache hit at first admission, for usage stats
        self.status = RequestStatus.WAITING
        self.arrival_time = time.monotonic()
        self.error: str | None = None
        self.stop_token_ids = frozenset(params.stop_token_ids or ())
        self.eos_token_ids = frozenset() if params.ignore_eos else eos_token_ids
        limit = max_model_len - self.num_prompt_tokens
        self.max_output_tokens = limit if params.max_tokens is None else min(params.max_tokens, limit)
        # A seeded request's own random stream, made at first use by whichever sampler runs it (a
        # torch.Generator or a numpy Generator): this module stays free of torch.
        self.generator: Any = None
        # Guided decoding: the llguidance matcher (set once its grammar compiled, engine side only);
        # the sampler masks this request's logits with it and each new token advances it.
        self.matcher: Any = None
        # Asked-for prompt logprobs, by prompt position (position 0 has none), filled as chunks run.
        self.prompt_logprobs: list[TokenLogprobs | None] | None = None if params.prompt_logprobs is None else [None]
        self._block_size = block_size
        self.block_hashes: list[bytes] = []
        self._update_block_hashes()

    # -- token bookkeeping --------------------------------------------------

    @property
    def num_tokens(self) -> int:
        """Tokens known: the prompt plus everything sampled so far."""
        return len(self.all_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_prompt_tokens

    def add_prompt_logprobs(self, first_position: int, logprobs: list[TokenLogprobs]) -> None:
        """Logprobs of prompt tokens first_position, first_position + 1, ...; positions already held
        (computed again after a preemption) are kept as they were."""
        held = self.prompt_logprobs
        if held is None:
            return
        for position, lp in enumerate(logprobs, start=first_position):
            if position == len(held):
                held.append(lp)

    def append_token(self, token_id: int) -> None:
        self.all_token_ids.append(token_id)
        if self.matcher is not None and not self.matcher.consume_token(token_id):
            self.error = f"token {token_id} broke the output's grammar: {self.matcher.get_error()}"
        if len(self.all_token_ids) % self._block_size == 0:
            self._update_block_hashes()

    def append_pending_token(self) -> None:
        """Hold the place of a token the device has sampled but the host has not read yet.

        The count is what the scheduler needs to plan the next step; the value stays out of block
        hashes (they are made when the token is set) and is read by nothing else: only steps whose
        sampling needs no token history run ahead like this (EngineCore._can_overlap).
        """
        self.all_token_ids.append(PENDING_TOKEN)
        self.token_pending = True

    def set_pending_token(self, token_id: int) -> None:
        """Put the token read back from the device in its held place (the last one)."""
        assert self.token_pending and self.all_token_ids[-1] == PENDING_TOKEN
        self.all_token_ids.pop()
        self.token_pending = False
        self.append_token(token_id)

    @property
    def awaits_last_token(self) -> bool:
        """Its pending token is its last by length: there is nothing more to schedule for it."""
        return self.token_pending and self.num_output_tokens >= self.max_output_tokens

    def _update_block_hashes(self) -> None:
        bs = self._block_size
        tokens = self.all_token_ids
        while (len(self.block_hashes) + 1) * bs <= len(tokens):
            i = len(self.block_hashes)
            parent = self.block_hashes[-1] if self.block_hashes else None
            self.block_hashes.append(hash_block(parent, tokens[i * bs : (i + 1) * bs]))

    def check_stop(self, token_id: int) -> RequestStatus | None:
        """The finish status after sampling ``token_id``, or None to go on."""
        if token_id in self.eos_token_ids or token_id in self.stop_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if self.error is not None:
            return RequestStatus.FINISHED_ERROR
        if self.matcher is not None and self.matcher.is_stopped():
            return RequestStatus.FINISHED_STOPPED  # the grammar is complete: nothing may follow
        if self.num_output_tokens >= self.max_output_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, "
            f"computed={self.num_computed_tokens}/{self.num_tokens})"
        )
