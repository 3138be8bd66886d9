"""The contract between the engine and its clients (the TUI and the HTTP server).

``AsyncEngineClient`` (chatapp/engine/client.py) implements :class:`EngineClient`
over IPC to the one background engine process; tests and tools may provide
other implementations. Clients tokenize prompts and detokenize outputs
themselves (see chatapp/engine/tokenizer.py and output_processor.py), so the
engine loop handles token ids only.
"""

from __future__ import annotations

import enum
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Protocol, cast

from chatapp.engine.output_processor import OutputDelta
from chatapp.engine.sampling_params import SamplingParams
from chatapp.engine.tokenizer import Tokenizer


class EngineError(RuntimeError):
    """Base of the errors a client raises about the engine itself."""


class EngineDeadError(EngineError):
    """The engine process died (or cannot be reached); pending requests are lost. Restart to go on."""


class EngineBusyError(EngineError):
    """The engine cannot take this work right now (loading, restarting, KV cache full); retry later."""


class InvalidRequestError(ValueError):
    """The request can never run as given (too long for the context, empty, bad token ids).

    ``param`` names the offending field where there is one, for the HTTP server's error shape.
    """

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class EngineState(enum.StrEnum):
    """Where a client's engine is in its life; the server's health and the TUI's status bar read it.

    A StrEnum, so it compares equal to its value and goes through JSON and logs as a plain string.
    """

    STARTING = "starting"  # looking for, or starting, the engine process
    LOADING = "loading"  # the engine is loading a model (state_detail has the progress line)
    READY = "ready"
    DEAD = "dead"  # the engine process died or could not start (state_detail says why)
    CLOSED = "closed"  # the client was closed


class ErrorKind(enum.StrEnum):
    """What kind of failure an engine reply or a failed load reports, so a client raises the right error."""

    BUSY = "busy"  # retry later: EngineBusyError
    INVALID = "invalid"  # the request or model spec can never work: InvalidRequestError
    INTERNAL = "internal"  # the engine failed: EngineError


@dataclass(frozen=True)
class EngineStats:
    """The engine's counters: GET /metrics, the TUI's status bar and tests read these fields.

    Prefix-cache figures count tokens (as vLLM's do): ``prefix_cache_queries`` prompt tokens were
    looked up, ``prefix_cache_hits`` of them found. The last three come from the engine process
    (zero from the in-process ``LLM``).
    """

    model: str
    device: str
    kv_blocks_total: int
    kv_blocks_free: int
    kv_blocks_used: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    prefix_cache_hit_rate: float
    num_preemptions: int
    num_running: int
    num_waiting: int
    prompt_tokens_total: int
    generation_tokens_total: int
    generation_tokens_per_second: float  # over the last seconds of work
    forward_seconds_total: float  # the model's forward and LM head
    step_seconds_total: float  # whole engine steps
    num_clients: int = 0
    busy_loop_seconds_total: float = 0.0  # the engine loop while it had work: steps, IPC, housekeeping
    engine_pid: int = 0


@dataclass(frozen=True)
class ModelInfo:
    name: str  # the id clients show and the server reports
    path: str
    architecture: str
    max_model_len: int
    vocab_size: int
    device: str
    dtype: str
    attention_backend: str
    quantization: str | None
    block_size: int
    num_kv_blocks: int
    load_seconds: float


@dataclass(frozen=True)
class ModelStatus:
    """One model the engine holds or is loading (the models call, /v1/models, the TUI's models screen)."""

    spec: str  # the normalised spec requests name it by
    state: str  # queued, loading, ready or failed
    detail: str
    default: bool  # the engine's default model (requests that name no model run on it)
    pinned: bool  # never unloaded for idling
    footprint_bytes: int  # weights, whole KV pool and working memory, once loaded
    idle_seconds: float
    num_requests: int
    info: ModelInfo | None = None


def loaded_model_info(client: object) -> ModelInfo | None:
    """The model ``client`` serves, or None while it has none (starting, loading): for status lines,
    which ask at any time, where the EngineClient protocol's ``model_info`` is for a ready client."""
    try:
        info = getattr(client, "model_info", None)
    except EngineBusyError:
        return None
    return cast("ModelInfo | None", info)


class EngineClient(Protocol):
    """What the TUI and the HTTP server may rely on."""

    @property
    def model_info(self) -> ModelInfo:
        """The served model (read once the client is ready)."""

    @property
    def tokenizer(self) -> Tokenizer:
        """The served model's tokenizer (read once the client is ready)."""

    def generate(
        self,
        prompt: str | list[int] | None = None,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        messages: list[dict[str, Any]] | None = None,
        continue_final_message: bool = False,
    ) -> AsyncIterator[OutputDelta]:
        """Stream one request's incremental outputs; exactly one of ``prompt``/``messages``.

        ``continue_final_message``: ``messages`` ends with an assistant answer to go on with (one cut
        at the token limit); the new text continues it instead of starting a new turn.

        Raises InvalidRequestError before the first item for a request that can
        never run, EngineDeadError if the engine dies. Each item carries the new
        text and token ids; the last has ``finished=True``, a finish_reason
        ("stop", "length", "abort" or "error") and the usage counts. Closing the
        iterator early (``aclose()``, or a task cancelled while reading) aborts
        the request in the engine.
        """

    async def abort(self, request_id: str) -> None:
        """Stop a request; its stream ends with finish_reason "abort"."""

    async def stats(self) -> EngineStats:
        """The engine's counters (see EngineStats)."""

    async def embed(self, inputs: list[str | list[int]]) -> list[list[float]]:
        """Mean-pooled, L2-normalised final hidden states of each input."""

    async def switch_model(self, model: str | None) -> ModelInfo:
        """Reload the engine with another model; running requests end with finish_reason "error"."""

    async def close(self) -> None:
        """Detach; an engine this client started and nobody else uses is shut down."""


def context_length_error(max_model_len: int, num_prompt: int, max_tokens: int | None) -> str:
    """The wording litellm (and so aider) recognises as a context-window error."""
    asked = num_prompt + (max_tokens or 0)
    return (
        f"This model's maximum context length is {max_model_len} tokens. However, you requested "
        f"{asked} tokens ({num_prompt} in the messages, {max_tokens or 0} in the completion). "
        f"Please reduce the length of the messages or completion."
    )
