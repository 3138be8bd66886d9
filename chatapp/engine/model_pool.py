"""The models one engine process holds: a slot per model, and the memory budget that decides who stays.

Why one EngineCore per model (each with its own runner, KV pool and scheduler) rather than one
scheduler over per-model pools: a step runs one model's forward over one batch, so two models can
never share a batch anyway; separate cores keep the scheduler, KV manager and runner exactly as they
are for one model (prefix caching, preemption and their tests unchanged), and unloading a model is
dropping its core. Fairness is the engine loop's job: every model with work gets one step per turn
(see process.py), so a busy model cannot starve another's streams.

The budget counts each loaded model's weights and its whole KV pool (the pool is committed as it
is written, so this is its worst case). A model not loaded yet is counted by its files' size. When a
new model needs room, the least recently used idle models are unloaded first; a model that cannot
fit in the budget even alone is refused with the figures.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil

from chatapp.engine.api import ModelInfo
from chatapp.engine.models.gguf_split import files_size

if TYPE_CHECKING:
    from chatapp.engine.core import EngineCore

GIB = 2**30

MIN_KV_BYTES = 16 * 2**20
"""A model is given at least this much KV pool under a budget (a few thousand tokens of a small
model); with less room than its weights plus this, it waits for room or is refused."""

WORKING_BYTES = 256 * 2**20
"""Activations and buffers of one loaded model, beside its weights and KV pool."""


class ModelDoesNotFitError(ValueError):
    """A model that cannot fit in the engine's memory budget even with every other model unloaded."""


@dataclass
class ModelSlot:
    """One model in the engine: loading, ready, or failed, with who waits for it."""

    spec: str
    """The normalised model spec (ipc.normalize_model_spec): the slot's key."""
    pinned: bool
    """The engine's default model and those preloaded: never unloaded for idling (only for room)."""
    state: str = "queued"
    """queued (waiting for room or for another load to end), loading, ready or failed."""
    detail: str = ""
    core: EngineCore | None = None
    info: ModelInfo | None = None
    weight_estimate: int = 0
    """Its weights before loading (estimate_weight_bytes), for planning room."""
    footprint_bytes: int = 0
    """What it holds once loaded: weights, its whole KV pool and working memory (the budget's unit)."""
    last_used: float = field(default_factory=time.monotonic)
    load_waiters: list[tuple[bytes, int]] = field(default_factory=list)
    """(client identity, call id) of LoadModelCalls answered when the load ends."""
    queued_requests: list[tuple[bytes, Any]] = field(default_factory=list)
    """(client identity, AddRequest) that arrived before the model was ready."""
    num_requests: int = 0
    """Requests of clients running on this model now (the engine's owner map counts them)."""

    def touch(self) -> None:
        self.last_used = time.monotonic()

    def is_idle(self) -> bool:
        core = self.core
        return (
            self.state == "ready"
            and self.num_requests == 0
            and not self.queued_requests
            and not (core is not None and core.has_work())
        )


def estimate_weight_bytes(path: Path) -> int:
    """A model's weights before loading it: a GGUF file's size (all its parts', for a split model), or a
    directory's weight files."""
    if path.is_file():
        return files_size(path)
    total = 0
    for pattern in ("*.safetensors", "*.bin", "*.gguf"):
        total += sum(f.stat().st_size for f in path.glob(pattern) if f.is_file())
    return total


def loaded_footprint(core: EngineCore) -> int:
    """Weights plus the whole KV pool plus working memory of a loaded model."""
    runner = core.runner
    weights = getattr(runner, "weight_bytes", 0) or estimate_weight_bytes(core.model.path)
    return int(weights + runner.num_blocks * runner.bytes_per_block() + WORKING_BYTES)


@dataclass(frozen=True)
class RoomPlan:
    """What loading a model needs: whom to unload first, and the KV pool it may take."""

    evict: list[ModelSlot]
    kv_cap_bytes: int | None
    """None: no budget (the runner sizes the pool to the memory available)."""


class MemoryBudget:
    """Decides whether a model fits, whom to unload for it, and how big its KV pool may be."""

    def __init__(self, budget_gib: float | None, max_loaded: int) -> None:
        if budget_gib is not None and not budget_gib > 0:
            raise ValueError(f"memory_gib must be more than 0, got {budget_gib}")
        if max_loaded < 1:
            raise ValueError(f"max_loaded_models must be at least 1, got {max_loaded}")
        self.budget_bytes = int(budget_gib * GIB) if budget_gib is not None else None
        self.max_loaded = max_loaded

    def describe(self) -> str:
        if self.budget_bytes is None:
            return f"the memory available, at most {self.max_loaded} models"
        return f"{self.budget_bytes / GIB:.2f} GiB, at most {self.max_loaded} models"

    def plan(
        self,
        weights: int,
        loaded: Iterable[ModelSlot],
        kv_cap_bytes: int | None,
        keep: ModelSlot | None = None,
    ) -> RoomPlan | None:
        """Room for a model of ``weights`` bytes beside ``loaded``: the plan, or None to wait.

        ``keep`` (the engine's default model) is never unloaded. Raises ModelDoesNotFitError when
        the model could never fit, even with every other model unloaded. ``kv_cap_bytes`` is the
        user's own KV cap (kv_cache_memory_gib), which the plan never raises.
        """
        need = weights + MIN_KV_BYTES + WORKING_BYTES
        held = keep.footprint_bytes if keep is not None and keep.core is not None else 0
        if self.budget_bytes is not None and need + held > self.budget_bytes:
            beside = f" beside the default model's {held / GIB:.2f} GiB" if held else ""
            raise ModelDoesNotFitError(
                f"this model needs at least {need / GIB:.2f} GiB (weights {weights / GIB:.2f} GiB + KV cache "
                f"{MIN_KV_BYTES / GIB:.2f} GiB + {WORKING_BYTES / GIB:.2f} GiB working memory){beside} but the "
                f"engine's memory budget is {self.budget_bytes / GIB:.2f} GiB (memory_gib, `--memory-gib`)"
            )
        others = sorted(loaded, key=lambda s: s.last_used)  # least recently used first
        evict: list[ModelSlot] = []
        kept = list(others)

        def room() -> int:
            if self.budget_bytes is None:  # the machine's free memory, plus what unloading frees
                return int(psutil.virtual_memory().available) + sum(s.footprint_bytes for s in evict)
            return self.budget_bytes - sum(s.footprint_bytes for s in kept)

        for slot in others:
            if room() >= need and len(kept) < self.max_loaded:
                break
            if slot.is_idle() and slot is not keep:
                evict.append(slot)
                kept.remove(slot)
        if room() < need or len(kept) >= self.max_loaded:
            if not kept and self.budget_bytes is None:
                return RoomPlan(evict, kv_cap_bytes)  # alone: the runner's own check says if it fits
            return None  # busy models hold the room: wait until one is idle
        if self.budget_bytes is None:
            return RoomPlan(evict, kv_cap_bytes)
        cap = room() - weights - WORKING_BYTES
        return RoomPlan(evict, cap if kv_cap_bytes is None else min(cap, kv_cap_bytes))
