"""Test doubles for the TUI: an engine client that streams canned text, and a fixed model catalog.

The fake implements the part of chatapp.engine.api.EngineClient the TUI uses;
it is for UI behaviour only (the real engine is tested in test_tui_engine.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from chatapp.engine.api import EngineDeadError, EngineStats, InvalidRequestError, ModelInfo, context_length_error
from chatapp.engine.output_processor import OutputDelta
from chatapp.engine.sampling_params import SamplingParams
from chatapp.tui.model_catalog import HubEntry, LocalEntry, Progress, PullSize

INFO = ModelInfo(
    name="FakeLM-1M",
    path="/models/fake",
    architecture="LlamaForCausalLM",
    max_model_len=2048,
    vocab_size=1000,
    device="cpu",
    dtype="float32",
    attention_backend="torch",
    quantization=None,
    block_size=16,
    num_kv_blocks=256,
    load_seconds=0.0,
)


@dataclass
class FakeClient:
    """Answers every request with ``reply`` (or ``reply_for(messages)``), a few characters per delta.

    ``hold``: when set to an Event, the stream stops after ``hold_after`` deltas until it is set,
    so a test can act "mid-stream" without timing.
    """

    reply: str = "Hello from the fake engine."
    chunk: int = 4
    hold: asyncio.Event | None = None
    hold_after: int = 2
    title_reply: str = "A Fake Title"
    """What the fake answers when the app asks it to name a session."""
    title_requests: list[Any] = field(default_factory=list)
    finish_reason: str = "stop"
    """How every stream ends ("length": cut at the token limit)."""
    state: str = "ready"
    model_info: ModelInfo = INFO
    requests: list[dict[str, Any]] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)
    stats_value: EngineStats = field(
        default_factory=lambda: EngineStats(
            model="fake",
            device="cpu",
            kv_blocks_total=256,
            kv_blocks_free=192,
            kv_blocks_used=64,
            prefix_cache_queries=0,
            prefix_cache_hits=0,
            prefix_cache_hit_rate=0.5,
            num_preemptions=0,
            num_running=0,
            num_waiting=0,
            prompt_tokens_total=0,
            generation_tokens_total=0,
            generation_tokens_per_second=0.0,
            forward_seconds_total=0.0,
            step_seconds_total=0.0,
        )
    )
    restarts: int = 0
    switched_to: list[str | None] = field(default_factory=list)
    loaded: dict[str, ModelInfo] = field(default_factory=dict)
    """Models loaded beside the default one (through bind(...).ready())."""
    refused: list[Any] = field(default_factory=list)
    max_messages: int | None = None
    """A prompt of more messages than this is refused as over the context (as the engine refuses one
    of more tokens than its context)."""
    summary_reply: str = "They talked about planets."
    summary_requests: list[Any] = field(default_factory=list)

    def reply_for(self, messages: list[dict[str, Any]]) -> str:
        return self.reply

    def bind(self, model: str | None) -> FakeModelView:
        return FakeModelView(self, model)

    def model_handle_info(self, model: str) -> ModelInfo | None:
        return self.loaded.get(model)

    async def generate(
        self,
        prompt: Any = None,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        messages: list[dict[str, Any]] | None = None,
        continue_final_message: bool = False,
        model: str | None = None,
    ) -> AsyncIterator[OutputDelta]:
        if self.state == "dead":
            raise EngineDeadError("the fake engine is dead")
        rid = request_id or f"fake-{len(self.requests)}"
        if "-title-" in rid:  # the app naming a session: answered apart, so tests count only chats
            self.title_requests.append(messages)
            yield OutputDelta(rid, self.title_reply, [1], None, False, None, None, 10, 1, 0)
            yield OutputDelta(rid, "", [], None, True, "stop", None, 10, 1, 0)
            return
        if "-summary-" in rid:  # the pane summarising old turns to fit the context
            self.summary_requests.append(messages)
            if self.max_messages is not None and len(messages[0]["content"]) > 2000:
                raise InvalidRequestError(context_length_error(2048, 4000, None), "messages")
            yield OutputDelta(rid, self.summary_reply, [1], None, False, None, None, 10, 1, 0)
            yield OutputDelta(rid, "", [], None, True, "stop", None, 10, 1, 0)
            return
        if self.max_messages is not None and messages is not None and len(messages) > self.max_messages:
            self.refused.append(messages)
            raise InvalidRequestError(context_length_error(2048, 3000 + len(messages), 32), "messages")
        self.requests.append(
            {
                "messages": messages,
                "params": params,
                "request_id": rid,
                "continue": continue_final_message,
                "model": model,
            }
        )
        text = (f"[{model}] " if model else "") + self.reply_for(messages or [])
        pieces = [text[i : i + self.chunk] for i in range(0, len(text), self.chunk)]
        n = 0
        try:
            for piece in pieces:
                if self.hold is not None and n == self.hold_after:
                    await self.hold.wait()
                n += 1
                await asyncio.sleep(0)
                yield OutputDelta(rid, piece, [n], None, False, None, None, 10, n, 0)
            yield OutputDelta(rid, "", [], None, True, self.finish_reason, None, 10, n, 0)
        except (GeneratorExit, asyncio.CancelledError):  # closed or cancelled mid-stream: the engine aborts
            self.aborted.append(rid)
            raise

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    async def stats(self) -> EngineStats:
        if self.state == "dead":
            raise EngineDeadError("the fake engine is dead")
        return self.stats_value

    async def embed(self, inputs: list[Any]) -> list[list[float]]:
        return [[0.0] for _ in inputs]

    async def switch_model(self, model: str | None) -> ModelInfo:
        self.switched_to.append(model)
        self.model_info = ModelInfo(**{**self.model_info.__dict__, "name": model or INFO.name})
        return self.model_info

    async def restart(self) -> None:
        self.restarts += 1
        self.state = "ready"

    async def close(self) -> None:
        pass


@dataclass
class FakeModelView:
    """FakeClient narrowed to one model, as AsyncEngineClient.bind gives (its answers name the model)."""

    client: FakeClient
    model: str | None

    @property
    def model_info(self) -> ModelInfo:
        return self.client.loaded.get(self.model or "", self.client.model_info)

    async def ready(self) -> ModelInfo:
        if self.model is not None:
            self.client.loaded[self.model] = ModelInfo(**{**INFO.__dict__, "name": self.model, "max_model_len": 4096})
        return self.model_info

    def generate(self, prompt: Any = None, params: Any = None, request_id: str | None = None, **kwargs: Any) -> Any:
        return self.client.generate(prompt, params, request_id, model=self.model, **kwargs)

    async def abort(self, request_id: str) -> None:
        await self.client.abort(request_id)

    async def stats(self) -> EngineStats:
        return await self.client.stats()

    async def close(self) -> None:
        pass


def factory(client: FakeClient):
    async def make() -> FakeClient:
        return client

    return make


@dataclass
class FakeCatalog:
    """A fixed local list and Hub results, and a pull that reports progress in steps."""

    local: list[LocalEntry] = field(
        default_factory=lambda: [
            LocalEntry("SmolLM2-135M-Instruct", "bundled", 94_000_000, "LlamaForCausalLM, 135M params, Q4_1"),
            LocalEntry("Qwen/Qwen2.5-0.5B-Instruct", "hf-cache", 988_000_000, "Qwen2ForCausalLM, 494M params, bf16"),
        ]
    )
    results: list[HubEntry] = field(
        default_factory=lambda: [
            HubEntry("HuggingFaceTB/SmolLM2-360M-Instruct", 1_250_000, 1_450_000_000, "fits"),
            HubEntry("Qwen/Qwen2.5-7B-Instruct", 9_800_000, 30_500_000_000, "will be slow"),
            HubEntry("meta-llama/Llama-3.1-70B-Instruct", 4_100_000, 282_000_000_000, "will not fit"),
        ]
    )
    pull_steps: int = 4
    step_bytes: int = 1000
    gate: Any = None
    """A threading.Event the pull waits on between steps (lets a test cancel mid-download)."""
    search_error: Exception | None = None
    """Raised by search (the Hub unreachable, say)."""

    def list_local(self) -> list[LocalEntry]:
        return list(self.local)

    def search(self, query: str) -> list[HubEntry]:
        if self.search_error is not None:
            raise self.search_error
        return [r for r in self.results if query.lower() in r.repo_id.lower()]

    def plan(self, spec: str) -> PullSize:
        return PullSize(spec, self.pull_steps * self.step_bytes)

    def pull(self, spec: str, progress: Progress) -> str:
        for _ in range(self.pull_steps):
            if self.gate is not None:
                self.gate.wait(5)
            progress(self.step_bytes)
        return spec
