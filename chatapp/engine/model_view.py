"""One engine client seen as serving one model: what a server route or a TUI pane holds.

The engine holds several models (model_pool.py); a ModelView narrows the shared AsyncEngineClient to
one of them, so code written for "the" model (the EngineClient protocol: ``model_info``,
``tokenizer``, ``generate``) runs unchanged on any. ``await view.ready()`` loads the model on demand.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from chatapp.engine.api import EngineBusyError, EngineStats, ModelInfo
from chatapp.engine.output_processor import OutputDelta
from chatapp.engine.sampling_params import SamplingParams
from chatapp.engine.tokenizer import Tokenizer

if TYPE_CHECKING:
    from chatapp.engine.client import AsyncEngineClient


class ModelView:
    """``client`` restricted to ``model`` (None: the engine's default model)."""

    def __init__(self, client: AsyncEngineClient, model: str | None) -> None:
        self.client = client
        self.model = model

    @property
    def state(self) -> str:
        return str(self.client.state)

    async def ready(self) -> ModelInfo:
        """Load the model if the engine does not hold it (waits for the load); its facts."""
        if self.model is None:
            return self.client.model_info
        return await self.client.load_model(self.model)

    @property
    def model_info(self) -> ModelInfo:
        if self.model is None:
            return self.client.model_info
        info = self.client.model_handle_info(self.model)
        if info is None:
            raise EngineBusyError(f"the model {self.model} is not loaded yet; retry shortly")
        return info

    @property
    def tokenizer(self) -> Tokenizer:
        if self.model is None:
            return self.client.tokenizer
        tokenizer = self.client.model_tokenizer(self.model)
        if tokenizer is None:
            raise EngineBusyError(f"the model {self.model} is not loaded yet; retry shortly")
        return tokenizer

    def generate(
        self,
        prompt: str | list[int] | None = None,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        messages: list[dict[str, Any]] | None = None,
        continue_final_message: bool = False,
    ) -> AsyncIterator[OutputDelta]:
        return self.client.generate(
            prompt,
            params,
            request_id,
            messages=messages,
            continue_final_message=continue_final_message,
            model=self.model,
        )

    async def abort(self, request_id: str) -> None:
        await self.client.abort(request_id)

    async def stats(self) -> EngineStats:
        return await self.client.stats()

    async def embed(self, inputs: list[str | list[int]]) -> list[list[float]]:
        return await self.client.embed(inputs, model=self.model)

    async def switch_model(self, model: str | None) -> ModelInfo:
        return await self.client.switch_model(model)

    async def close(self) -> None:
        """A view owns nothing: the client it narrows is closed by its owner."""
