"""Runs a GGUF model on the CPU with our C++ layer loop and numpy arrays: no torch in the process.

Why: importing torch's Python module took 1.1 s of the engine's ~1.9 s warm start, and the CPU path
for GGUF files never needed it: the C++ layer loop (csrc/cpu_forward.cpp) does every layer, and
around it there is only an embedding lookup, the LM head and sampling. The extension links against
libtorch, whose libraries load in ~0.2 s without the Python module (cpu_kernels.py).

The same steps as model_runner.ModelRunner's CPU path (same flattening, same kernels, same bits of
the hidden states); where that runner applies and this one does not (a GPU, checkpoint directories,
int8/int4 quantization, overlapped steps) EngineCore builds that one instead (runner_for).
"""

from __future__ import annotations

import logging
import time
from types import ModuleType

import numpy as np

from chatapp.engine.array_sampler import ArraySampler, token_logprobs
from chatapp.engine.config import ResolvedConfig
from chatapp.engine.cpu_load import CpuLoadMonitor
from chatapp.engine.huge_pages import Pacer, WeightArena, collapse_in_background, weight_arena_bytes
from chatapp.engine.models.array_model import ArrayModel, load_array_model
from chatapp.engine.models.gguf_weights import native_weight_bytes
from chatapp.engine.models.source import ModelSource
from chatapp.engine.outputs import TokenLogprobs
from chatapp.engine.sampling_rules import SamplerOutput
from chatapp.engine.scheduler import ScheduledBatch
from chatapp.engine.step_inputs import (
    PROMPT_LOGPROB_ROWS,
    FlatBatch,
    StepResult,
    check_fits,
    cpu_kv_blocks,
    cpu_threads_for,
    flatten_batch,
    kv_bytes_per_block,
    untouched_zeros,
)

log = logging.getLogger(__name__)

_KV_DTYPES = {"float32": np.float32, "float16": np.float16}


def array_extension(config: ResolvedConfig, source: ModelSource) -> ModuleType | None:
    """Our extension when this runner applies to the model and config, else None (the torch runner's)."""
    if config.runner == "torch":
        return None
    reasons = []
    if source.gguf is None:
        reasons.append("the model is not a GGUF file")
    if config.device != "cpu" or config.dtype != "float32" or config.attention_backend != "torch":
        reasons.append("it runs on the CPU in float32 only")
    if config.quantization not in ("auto", "gguf"):
        reasons.append(f"quantization={config.quantization!r} is the torch runner's")
    if config.overlap_steps:
        reasons.append("overlapped steps are the torch runner's")
    if config.kv_cache_dtype not in _KV_DTYPES:
        reasons.append(f"its KV cache is float16 or float32, not {config.kv_cache_dtype}")
    if not config.cpu_kernels:
        reasons.append("the C++ kernels are turned off")
    ext = None
    if not reasons:
        from chatapp.engine import cpu_kernels

        ext = cpu_kernels.load()
        if ext is None or not ext.block_quant_fast():
            reasons.append("our vector kernels are not built for this machine")
    if reasons:
        if config.runner == "array":
            raise ValueError(f"runner='array' cannot run this model: {'; '.join(reasons)}")
        return None
    return ext


class ArrayRunner:
    """The torch-free CPU runner: load, size the KV pool, and run scheduled batches."""

    def __init__(self, config: ResolvedConfig, source: ModelSource, ext: ModuleType) -> None:
        assert source.gguf is not None  # array_extension said this runner applies
        self.config = config
        self.quantization = "gguf"
        self.mc = mc = source.config
        self.block_size = config.block_size
        self.launched_steps = 0  # never: overlapped steps are the torch runner's
        self._ext = ext
        ext.set_num_threads(config.num_threads)
        self.cpu_load = CpuLoadMonitor(config.num_threads)
        self.weight_bytes = native_weight_bytes(source.gguf, mc)
        self.num_blocks = cpu_kv_blocks(config, self.bytes_per_block(), self.weight_bytes)
        check_fits(self.weight_bytes, self.num_blocks * self.bytes_per_block(), mc)
        start = time.perf_counter()
        self.weight_arena = WeightArena(weight_arena_bytes(source.gguf, self.weight_bytes))
        self.model: ArrayModel = load_array_model(
            source.gguf, mc, config.max_model_len, ext, self.weight_arena, defer_packing=True
        )
        log.info(
            "loaded %s weights (gguf) in %.2f s%s",
            mc.architecture,
            time.perf_counter() - start,
            "; their tiles are packed in the background" if self.model.packer is not None else "",
        )
        if config.huge_pages:
            collapse_in_background(self.weight_arena, source.gguf.path.name, Pacer(), self.model.packer)
        self.sampler = ArraySampler()
        self.kv_caches = self._allocate_kv_caches()
        self._k_caches = [k for k, _ in self.kv_caches]
        self._v_caches = [v for _, v in self.kv_caches]

    def bytes_per_block(self) -> int:
        return kv_bytes_per_block(self.config, self.mc)

    def _allocate_kv_caches(self) -> list[tuple[np.ndarray, np.ndarray]]:
        """Per layer (keys [blocks, kv_heads, head_dim, block_size], values [blocks, block_size, kv_heads,
        head_dim]): keys transposed so 16 keys of a block sit side by side for a decode's vector loads.
        Zeroed (padded key positions are masked, but 0 * NaN would still poison them) and committed
        only as chats fill it (step_inputs.untouched_zeros)."""
        mc, bs, n = self.mc, self.block_size, self.num_blocks
        dtype = np.dtype(_KV_DTYPES[self.config.kv_cache_dtype])
        shape = (mc.num_layers, 2, n, bs, mc.num_kv_heads, mc.head_dim)
        pool = np.frombuffer(untouched_zeros(int(np.prod(shape)) * dtype.itemsize), dtype=dtype).reshape(shape)
        key_shape = (n, mc.num_kv_heads, mc.head_dim, bs)
        return [(pool[i, 0].reshape(key_shape), pool[i, 1]) for i in range(mc.num_layers)]

    # -- one step -----------------------------------------------------------

    def weights_ready(self, timeout_s: float) -> bool:
        """Whether the weights' tiles are filled (or their packing failed: the forward then says why), waiting at
        most timeout_s for them. Why ask: a step run before then would block the engine's loop while they pack."""
        packer = self.model.packer
        return packer is None or packer.wait_for(timeout_s)

    def execute(self, batch: ScheduledBatch, block_ids: dict[str, list[int]]) -> StepResult:
        """Run one forward over the batch and sample where a request reached its end."""
        flat = flatten_batch(batch, block_ids, self.block_size)
        start = time.perf_counter()
        hidden = self._forward(flat)
        prompt_logprobs = self._prompt_logprobs(hidden, flat) if flat.prompt_rows else {}
        if not flat.sample_rows:
            return StepResult([], SamplerOutput([], []), time.perf_counter() - start, prompt_logprobs)
        sampled = [flat.requests[i] for i in flat.sample_rows]
        logits = self.model.compute_logits(flat.sampled_hidden(hidden))
        forward_seconds = time.perf_counter() - start
        return StepResult(sampled, self.sampler(logits, sampled), forward_seconds, prompt_logprobs)

    def hidden_states(self, batch: ScheduledBatch, block_ids: dict[str, list[int]]) -> list[np.ndarray]:
        """Final hidden states of each request's new tokens (for embeddings), in batch order."""
        flat = flatten_batch(batch, block_ids, self.block_size)
        hidden = self._forward(flat)
        starts = flat.query_start.tolist()
        by_request = {r.request_id: hidden[starts[i] : starts[i + 1]] for i, r in enumerate(flat.requests)}
        return [by_request[r.request_id] for r in batch.requests]

    def _forward(self, flat: FlatBatch) -> np.ndarray:
        self.model.wait_for_weights()  # first: the packing's threads must not see the thread count change
        threads = cpu_threads_for(flat, self.cpu_load, self.config.num_threads)
        if self._ext.get_num_threads() != threads:
            self._ext.set_num_threads(threads)
        return self.model.forward(
            flat.token_ids,
            flat.positions,
            self._k_caches,
            self._v_caches,
            flat.slots,
            flat.query_start.astype(np.int32),
            np.asarray(flat.seq_lens, dtype=np.int32),
            flat.block_tables,
        )

    def _prompt_logprobs(self, hidden: np.ndarray, flat: FlatBatch) -> dict[str, tuple[int, list[TokenLogprobs]]]:
        """Each asking request's prompt tokens scored by the positions before them in this chunk."""
        out = {}
        for req, first_row, first_position, targets in flat.prompt_rows:
            scored: list[TokenLogprobs] = []
            top_n = req.params.prompt_logprobs or 0
            # A slice of rows at a time: a whole chunk's logits over a 150k vocabulary would be GBs.
            for at in range(0, len(targets), PROMPT_LOGPROB_ROWS):
                part = targets[at : at + PROMPT_LOGPROB_ROWS]
                logits = self.model.compute_logits(hidden[first_row + at : first_row + at + len(part)])
                for row, token in zip(logits, part):
                    scored.append(token_logprobs(row, token, top_n))
            out[req.request_id] = (first_position, scored)
        return out
