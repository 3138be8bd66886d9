"""The offline API: ``LLM(model).generate(prompts, params)`` and ``.chat(conversations, params)``."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

from chatapp.engine.api import EngineStats
from chatapp.engine.config import EngineConfig
from chatapp.engine.core import EngineCore
from chatapp.engine.output_processor import OutputProcessor
from chatapp.engine.outputs import RequestOutput
from chatapp.engine.sampling_params import SamplingParams
from chatapp.engine.tokenizer import Tokenizer

if TYPE_CHECKING:
    import torch

Prompt = str | list[int]


class LLM:
    """Runs the engine core in this process and drives its step loop until the batch is done."""

    def __init__(self, model: str | None = None, **overrides: Any) -> None:
        config = EngineConfig.from_overrides(model, **overrides)
        self.core = EngineCore(config)
        self.config = self.core.config
        self.tokenizer = Tokenizer(self.core.model.path)
        self.tokenizer.save_files()  # no start to hurry here: the files are kept at once, as they always were
        self.processor = OutputProcessor(self.tokenizer)
        self._ids = itertools.count()

    def generate(
        self, prompts: Prompt | Sequence[Prompt], params: SamplingParams | Sequence[SamplingParams] | None = None
    ) -> list[RequestOutput]:
        """Complete prompts (a string, a list of strings, or token-id lists), in input order."""
        batch: Sequence[Prompt]
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            batch = [cast(Prompt, prompts)]
        else:
            batch = cast(Sequence[Prompt], prompts)
        items: list[tuple[str | None, list[int]]] = []
        for prompt in batch:
            if isinstance(prompt, str):
                items.append((prompt, self.tokenizer.encode(prompt)))
            else:
                items.append((None, list(prompt)))
        return self._run(items, params)

    def chat(
        self,
        conversations: list[dict[str, Any]] | Sequence[list[dict[str, Any]]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Answer OpenAI-style message lists rendered with the model's chat template."""
        batch: Sequence[list[dict[str, Any]]]
        if conversations and isinstance(conversations[0], dict):
            batch = [cast(list[dict[str, Any]], conversations)]
        else:
            batch = cast(Sequence[list[dict[str, Any]]], conversations)
        items: list[tuple[str | None, list[int]]] = [(None, self.tokenizer.render_chat(list(c))) for c in batch]
        return self._run(items, params)

    def stats(self) -> EngineStats:
        return self.core.stats()

    def prompt_logits(self, token_ids: list[int]) -> torch.Tensor:
        """Logits at every position of ``token_ids`` from one prefill (teacher forcing).

        For quality checks: how closely two engines (float32, int8, a GGUF file's own types) follow
        each other on the same tokens. It runs on a scratch request, outside the scheduler.
        """
        import numpy as np
        import torch

        from chatapp.engine.array_runner import ArrayRunner
        from chatapp.engine.model_runner import ModelRunner
        from chatapp.engine.request import Request
        from chatapp.engine.scheduler import ScheduledBatch

        core = self.core
        req = Request(
            "\0prompt-logits",
            list(token_ids),
            SamplingParams(max_tokens=1),
            frozenset(),
            core.config.block_size,
            core.max_model_len,
        )
        if not core.kv.allocate_slots(req, len(token_ids)):
            raise ValueError(f"{len(token_ids)} tokens do not fit the free KV cache")
        try:
            hidden = core.runner.hidden_states(
                ScheduledBatch([req], [len(token_ids)]), {req.request_id: core.kv.block_ids(req.request_id)}
            )[0]
            if isinstance(core.runner, ArrayRunner):  # the torch-free runner (array_runner.py)
                assert isinstance(hidden, np.ndarray)
                return torch.from_numpy(core.runner.model.compute_logits(hidden))
            assert isinstance(core.runner, ModelRunner) and isinstance(hidden, torch.Tensor)
            with torch.inference_mode():
                logits: torch.Tensor = core.runner.model.compute_logits(hidden)
                return logits
        finally:
            core.kv.free(req.request_id)

    def _run(
        self, items: list[tuple[str | None, list[int]]], params: SamplingParams | Sequence[SamplingParams] | None
    ) -> list[RequestOutput]:
        if params is None:
            params = SamplingParams()
        if isinstance(params, SamplingParams):
            params = [params] * len(items)
        if len(params) != len(items):
            raise ValueError(f"got {len(params)} SamplingParams for {len(items)} prompts")
        for p in params:
            if p.guided is not None:
                assert not isinstance(p.guided, dict)  # SamplingParams.__post_init__ made it a GuidedDecoding
                p.guided.check()  # a bad schema, regex or grammar: GuidedDecodingError (a ValueError) now
        ids = []
        for (text, token_ids), p in zip(items, params):
            request_id = f"offline-{next(self._ids)}"
            ids.append(request_id)
            self.processor.add_request(request_id, text, token_ids, p)
            self.core.add_request(request_id, token_ids, p)
        while self.core.has_work():
            _, to_abort = self.processor.process(self.core.step())
            if to_abort:
                self.core.abort(to_abort)
        return [self.processor.finished.pop(i) for i in ids]
