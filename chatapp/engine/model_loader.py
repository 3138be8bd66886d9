"""Loading one model in the engine process: off the loop thread, with progress, within the budget.

The engine loop keeps answering clients (and stepping the models already loaded) while a
ModelLoader builds an EngineCore on its own thread; the loader's own log lines become the progress
text clients show.
"""

from __future__ import annotations

import dataclasses
import logging
import threading

from chatapp.engine.api import ModelInfo
from chatapp.engine.config import EngineConfig
from chatapp.engine.core import EngineCore
from chatapp.engine.model_pool import GIB, MemoryBudget, ModelSlot, estimate_weight_bytes
from chatapp.engine.tokenizer import clients_build_tokenizer, prepare_tokenizer_files

log = logging.getLogger("chatapp.engine.process")


class ModelLoader(threading.Thread):
    """Builds an EngineCore off the loop thread, so clients are answered (and other models step) meanwhile."""

    def __init__(self, config: EngineConfig, slot: ModelSlot, budget: MemoryBudget | None = None) -> None:
        super().__init__(name="engine-loader", daemon=True)
        self.config = config
        self.slot = slot
        self.budget = budget  # checked here first (the default model: nothing else is loaded then)
        self.core: EngineCore | None = None
        self.error: BaseException | None = None
        self.detail = f"loading {config.model or 'the bundled model'}"
        self._handler = _ProgressHandler(self)

    def run(self) -> None:
        logging.getLogger("chatapp").addHandler(self._handler)
        try:
            if self.budget is not None:
                self.config = fit_default_model(self.config, self.budget)
            core = EngineCore(self.config)
            # Built once per GGUF file (transformers, here where torch is loaded anyway), so the
            # clients that attach load only tokenizer.json and the template; not where clients build it.
            if not clients_build_tokenizer(core.model.path):
                prepare_tokenizer_files(core.model.path)
            self.core = core
        except BaseException as exc:  # reported to the clients by the loop, never lost
            log.exception("loading the model failed")
            self.error = exc
        finally:
            logging.getLogger("chatapp").removeHandler(self._handler)


class _ProgressHandler(logging.Handler):
    """Turns the loader's own log lines into the progress text clients show."""

    def __init__(self, loader: ModelLoader) -> None:
        super().__init__(logging.INFO)
        self.loader = loader

    def emit(self, record: logging.LogRecord) -> None:
        if record.thread == self.loader.ident:
            self.loader.detail = record.getMessage()


def fit_default_model(config: EngineConfig, budget: MemoryBudget) -> EngineConfig:
    """The default model's config under the memory budget: refused with the figures when it cannot fit,
    its KV pool held to the room its weights leave."""
    from chatapp.engine.model_ref import resolve_model_spec

    if budget.budget_bytes is None:
        return config
    weights = estimate_weight_bytes(resolve_model_spec(config.model).path)
    user_cap = int(config.kv_cache_memory_gib * GIB) if config.kv_cache_memory_gib is not None else None
    plan = budget.plan(weights, [], user_cap)
    assert plan is not None  # nothing else is loaded, so nothing can hold the room
    if plan.kv_cap_bytes is None or config.num_kv_blocks is not None:
        return config
    return dataclasses.replace(config, kv_cache_memory_gib=plan.kv_cap_bytes / GIB)


def model_info(core: EngineCore) -> ModelInfo:
    cfg, mc = core.config, core.model_config
    return ModelInfo(
        name=core.model.name,
        path=str(core.model.path),
        architecture=mc.architecture,
        max_model_len=core.max_model_len,
        vocab_size=mc.vocab_size,
        device=cfg.device,
        dtype=cfg.dtype,
        attention_backend=cfg.attention_backend,
        quantization=cfg.quantization,
        block_size=cfg.block_size,
        num_kv_blocks=core.kv.num_blocks,
        load_seconds=round(core.load_seconds, 3),
    )


def precheck_model(spec: str | None) -> None:
    """Fail fast on a model that does not exist, before running requests are ended for it.

    GGUF files (the bundled model too) are left to the loader, which reports a bad file clearly.
    """
    from chatapp.engine.model_ref import resolve_model_spec

    if spec is None or spec in ("default",) or spec.endswith(".gguf"):
        return
    resolve_model_spec(spec)
