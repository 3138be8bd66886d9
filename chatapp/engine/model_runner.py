"""Runs the model on one scheduled batch: flatten, forward, sample.

Each step builds one flattened batch of every scheduled request's new tokens
(single-token decodes first, then prefill chunks), with positions, cache slots
and block tables, and runs one forward pass for all of them. Only the last
position of requests that reached the end of their known tokens is sampled,
so the LM head runs on those rows alone.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field
from types import ModuleType
from typing import Protocol

import numpy as np
import torch

from chatapp.engine.attention import AttentionBackend, AttentionMetadata, TorchAttentionBackend, layer_attention
from chatapp.engine.config import ResolvedConfig
from chatapp.engine.cpu_load import CpuLoadMonitor
from chatapp.engine.cuda_graphs import DecodeGraphs, DecodeLayout, GraphInputs, capture_sizes, take_previous_tokens
from chatapp.engine.memory import return_freed_memory
from chatapp.engine.models.llama import LlamaForCausalLM
from chatapp.engine.models.loader import load_model
from chatapp.engine.models.source import ModelSource
from chatapp.engine.outputs import TokenLogprobs
from chatapp.engine.request import Request
from chatapp.engine.sampler import Sampler, SamplerOutput
from chatapp.engine.scheduler import ScheduledBatch
from chatapp.engine.step_inputs import (  # noqa: F401  (re-exported: the pool's sizing rules)
    KV_CONTEXTS,
    KV_SHARE_OF_FREE,
    PROMPT_LOGPROB_ROWS,
    WORKING_MEMORY_BYTES,
    FlatBatch,
    ModelTooLargeError,
    StepResult,
    check_fits,
    cpu_kv_blocks,
    cpu_threads_for,
    flatten_batch,
    kv_bytes_per_block,
    untouched_zeros,
)

log = logging.getLogger(__name__)


class CpuForward(Protocol):
    """The C++ layer loop's model (``CpuModel`` of chatapp/engine/csrc/cpu_forward.cpp)."""

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        local_cos: torch.Tensor,
        local_sin: torch.Tensor,
        k_caches: list[torch.Tensor],
        v_caches: list[torch.Tensor],
        slot_mapping: torch.Tensor,
        query_start_loc: torch.Tensor,
        seq_lens: torch.Tensor,
        block_tables: torch.Tensor,
        /,
    ) -> torch.Tensor: ...


class LaunchedStep:
    """A decode step sent to the device whose sampled tokens the host has not read yet.

    Its tokens stay on the device for the next step to take as inputs; a copy to the host is queued
    behind them, and :meth:`token_ids` waits for that copy alone.
    """

    def __init__(
        self, requests: list[Request], tokens: torch.Tensor, host_tokens: torch.Tensor, forward_seconds: float
    ) -> None:
        self.requests = requests
        self.tokens = tokens  # [b] on the device
        self.row_of = {r.request_id: i for i, r in enumerate(requests)}
        self.forward_seconds = forward_seconds  # the host's time to launch it (the device's is hidden)
        self._host_tokens = host_tokens
        self._ready: torch.cuda.Event | None = None
        if tokens.is_cuda:
            self._ready = torch.cuda.Event()  # type: ignore[no-untyped-call]
            self._ready.record()

    def token_ids(self) -> list[int]:
        """The sampled tokens, in request order (waits for the device to have finished the step)."""
        if self._ready is not None:
            self._ready.synchronize()
        tokens: list[int] = self._host_tokens.tolist()
        return tokens


class ModelRunner:
    def __init__(self, config: ResolvedConfig, source: ModelSource) -> None:
        self.config = config  # resolved and frozen; what this runner decides is on the runner itself
        if config.quantization == "gguf" and source.gguf is None:
            # Asked for a GGUF file's own blocks, a checkpoint of floats would otherwise run unquantized.
            raise ValueError(
                f"quantization='gguf' keeps a GGUF file's own weight types, and {source.path.name} is not a "
                "GGUF file: use auto, int4, int8 or None"
            )
        self.quantization: str | None = config.quantization  # "auto" becomes what was applied
        self.mc = source.config
        self.device = config.torch_device()
        self.dtype = config.torch_dtype()
        if self.device.type == "cpu":
            torch.set_num_threads(config.num_threads)
        self.cpu_load = CpuLoadMonitor(config.num_threads)
        # On the CPU in float32 our C++ layer loop runs the model (with its own key layout);
        # otherwise the Python model with the torch (SDPA) or Triton attention backend.
        ext = self._cpu_extension()
        self.block_size = config.block_size
        self.weight_bytes = 0  # what the weights take once loaded (the engine's memory budget counts it)
        if self.device.type == "cpu":
            weight_bytes = self.weight_bytes = self._weight_bytes(source, ext)
            self.num_blocks = self._choose_num_blocks(weight_bytes)
            check_fits(weight_bytes, self.num_blocks * self.bytes_per_block(), self.mc)
        start = time.perf_counter()
        self.model = self._load(source, ext)
        log.info(
            "loaded %s weights (%s) in %.2f s", self.mc.architecture, self.quantization, time.perf_counter() - start
        )
        if self.device.type != "cpu":
            self.num_blocks = self._choose_num_blocks()
        self.sampler = Sampler()
        self._read_back_buffers: list[torch.Tensor] = []  # pinned, for LaunchedStep (two, used in turn)
        self.launched_steps = 0  # decode steps run overlapped (tests check that they were)
        layer_loop = self._layer_loop_applies(ext)
        self.kv_caches = self._allocate_kv_caches(self.num_blocks, transposed_keys=layer_loop)
        self.cpu_forward = self._build_cpu_forward(ext) if layer_loop else None
        self.attn: AttentionBackend | None = None if self.cpu_forward is not None else self._make_attention_backend()
        self.decode_graphs = self._capture_decode_graphs()

    # -- set-up -------------------------------------------------------------

    def _native_gguf(self, source: ModelSource, ext: ModuleType | None) -> bool:
        return (
            source.gguf is not None
            and self.config.quantization in ("auto", "gguf")
            and ext is not None
            and ext.block_quant_fast()
        )

    def _weight_bytes(self, source: ModelSource, ext: ModuleType | None) -> int:
        """What the loaded weights will take, to refuse a model that cannot fit before loading it."""
        if self._native_gguf(source, ext):
            from chatapp.engine.models.gguf_weights import native_weight_bytes

            assert source.gguf is not None  # checked by _native_gguf
            return native_weight_bytes(source.gguf, self.mc)
        elem = torch.tensor([], dtype=self.dtype).element_size()
        if self._quantization_mode() is None or source.gguf is not None:
            # A GGUF file off our kernels is de-quantised whole before any quantizing: floats at the peak.
            return self.mc.num_parameters() * elem
        # Quantized as loaded: projections at most 1 byte a weight (int8; int4 is less), the
        # embeddings in float, plus the one float layer in hand at a time.
        mc = self.mc
        embed = mc.vocab_size * mc.hidden_size
        head = 0 if mc.tie_word_embeddings else embed
        layers = mc.num_parameters() - embed - head
        return layers + head + embed * elem + (layers // mc.num_layers) * elem

    def _quantization_mode(self) -> str | None:
        """The quantization to apply while loading floats (CPU): auto, int4, int8 or None."""
        return self.quantization if self.quantization in ("auto", "int4", "int8") else None

    def _load(self, source: ModelSource, ext: ModuleType | None) -> LlamaForCausalLM:
        """The model's weights: a GGUF file's own blocks where our kernels run them, else floats,
        quantized layer by layer as they load (recorded in self.quantization: int4, int8 or None)."""
        cfg = self.config
        max_model_len = cfg.max_model_len
        if self._native_gguf(source, ext):
            from chatapp.engine.models.gguf_loader import load_gguf_native

            assert source.gguf is not None and ext is not None  # checked by _native_gguf
            self.quantization = "gguf"
            return load_gguf_native(source.gguf, self.mc, max_model_len, ext)
        if self.quantization == "gguf" and source.gguf is not None:
            log.warning("the GGUF file's own types need our AVX2 or AVX-512 kernels; de-quantising to float32")
        mode = self._quantization_mode()
        quantizer = None
        if mode is not None:
            from chatapp.engine.load_quantizer import LoadQuantizer, calibration_prefill

            quantizer = LoadQuantizer(
                mode,
                ext,
                lambda: calibration_prefill(
                    source.path, self.mc, self.device, cfg.torch_kv_dtype(), max_model_len, self.block_size
                ),
            )
        if source.gguf is None:
            model = load_model(source.path, self.mc, self.dtype, self.device, max_model_len, quantizer)
        else:
            from chatapp.engine.models.gguf_loader import load_gguf_float

            model = load_gguf_float(source.gguf, self.mc, self.dtype, self.device, max_model_len)
            if quantizer is not None:
                quantizer.run(model)
        self.quantization = None if quantizer is None else quantizer.applied
        return_freed_memory()
        return model

    def bytes_per_block(self) -> int:
        return kv_bytes_per_block(self.config, self.mc)

    def _choose_num_blocks(self, weight_bytes: int = 0) -> int:
        """The pool's size: forced, profiled (GPU), else as step_inputs.cpu_kv_blocks says."""
        cfg = self.config
        if self.device.type == "cuda" and cfg.num_kv_blocks is None:
            return self._profile_gpu_blocks()
        return cpu_kv_blocks(cfg, self.bytes_per_block(), weight_bytes)

    def _profile_gpu_blocks(self) -> int:
        """Run the worst-case steps, then give the KV pool what is left of this engine's share.

        The share is ``gpu_memory_utilization`` of the card, and everything on the card once those
        steps have run counts against it: other programs and this engine's other models, these
        weights, the steps' activations (freed into torch's cache, where later steps reuse them)
        and the library kernels the steps loaded (CUDA loads them lazily, on first use, outside
        torch's allocator: counting torch's peak alone, an engine on an H100 came out 1 GiB over
        its share). So a second model never counts the first's memory as free.
        ``kv_cache_memory_gib`` caps the pool as on the CPU.
        """
        torch.cuda.reset_peak_memory_stats()
        dummy_caches = self._allocate_kv_caches(1)
        backend = self._make_attention_backend(dummy_caches)
        with torch.inference_mode():
            self._run_largest_prefill(backend)
            self._run_decode_batch_sizes(backend)
        torch.cuda.synchronize()
        del dummy_caches, backend
        free, total = torch.cuda.mem_get_info()
        used = total - free
        budget = total * self.config.gpu_memory_utilization - used
        if self.config.kv_cache_memory_gib is not None:
            budget = min(budget, self.config.kv_cache_memory_gib * 2**30)
        blocks = int(budget // self.bytes_per_block())
        gib = 2**30
        log.info(
            "GPU memory: %.2f GiB in use after the worst-case steps (this step's peak %.2f GiB), KV pool %.2f GiB",
            used / gib,
            torch.cuda.max_memory_allocated() / gib,
            max(blocks, 0) * self.bytes_per_block() / gib,
        )
        if blocks < 1:
            raise ModelTooLargeError(
                f"no GPU memory is left for the KV cache: this engine may use "
                f"{self.config.gpu_memory_utilization:.0%} of {total / gib:.1f} GiB and {used / gib:.1f} GiB is "
                f"in use with this model's weights and activations; raise gpu_memory_utilization, lower "
                f"max_num_batched_tokens, or pick a smaller model"
            )
        return blocks

    def _run_largest_prefill(self, backend: AttentionBackend) -> None:
        """A step of max_num_batched_tokens prompt tokens, sampling as many rows as a step can."""
        n = self.config.max_num_batched_tokens
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.zeros(n, dtype=torch.long, device=dev),
            query_start_loc=torch.tensor([0, n], dtype=torch.int32, device=dev),
            seq_lens=torch.tensor([n], dtype=torch.int32, device=dev),
            block_tables=torch.zeros(1, -(-n // self.block_size), dtype=torch.int32, device=dev),
            query_lens_cpu=[n],
            seq_lens_cpu=[n],
            num_decodes=0,
            max_query_len=n,
            max_seq_len=n,
        )
        backend.begin_step(meta)
        ids = torch.zeros(n, dtype=torch.long, device=dev)
        hidden = self.model(ids, torch.arange(n, device=dev) % self.config.max_model_len, backend)
        self.model.compute_logits(hidden[-min(n, self.config.max_num_seqs) :])

    def _run_decode_batch_sizes(self, backend: AttentionBackend) -> None:
        """A decode step of each batch size the CUDA graphs will capture, so the kernels they use
        are loaded (and counted) before the pool takes what is left."""
        if not self.config.cuda_graphs:
            return
        from chatapp.engine.attention_triton import TritonAttentionBackend

        if not isinstance(backend, TritonAttentionBackend):
            return
        sizes = capture_sizes(self.config.max_num_seqs)
        inputs = GraphInputs(sizes[-1], 1, self.device)  # every row reads the dummy pool's one block
        for size in sizes:
            backend.begin_decode_step(inputs.metadata(size), inputs.tile_req[:size], inputs.tile_q0[:size])
            self.model.compute_logits(self.model(inputs.longs[0, :size], inputs.longs[1, :size], backend))

    def _allocate_kv_caches(
        self, num_blocks: int, transposed_keys: bool = False
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer (keys, values), each [num_blocks, block_size, kv_heads, head_dim].

        With ``transposed_keys`` (our C++ CPU path) keys are [num_blocks, kv_heads, head_dim,
        block_size] instead, so 16 keys of a block sit side by side for a decode's vector loads.
        """
        mc = self.mc
        shape = (mc.num_layers, 2, num_blocks, self.block_size, mc.num_kv_heads, mc.head_dim)
        dtype = self.config.torch_kv_dtype()
        # Zeroed, not empty: padded key positions are masked, but 0 * NaN would still poison them.
        pool = (
            _untouched_zeros(shape, dtype)
            if self.device.type == "cpu"
            else torch.zeros(shape, dtype=dtype, device=self.device)
        )
        caches = [(pool[i, 0], pool[i, 1]) for i in range(mc.num_layers)]
        if transposed_keys:
            key_shape = (num_blocks, mc.num_kv_heads, mc.head_dim, self.block_size)
            caches = [(k.view(key_shape), v) for k, v in caches]
        return caches

    def _make_attention_backend(
        self, kv_caches: list[tuple[torch.Tensor, torch.Tensor]] | None = None
    ) -> AttentionBackend:
        kv_caches = kv_caches if kv_caches is not None else self.kv_caches
        layers = layer_attention(self.mc)
        plain = all(spec.window is None and spec.softcap is None for spec in layers)
        if self.config.attention_backend == "triton" and plain:  # no windows or soft-caps in Triton yet
            from chatapp.engine.attention_triton import TritonAttentionBackend

            return TritonAttentionBackend(kv_caches, self.mc.num_heads, self.mc.head_dim, layers[0].scale)
        return TorchAttentionBackend(kv_caches, self.mc.num_heads, self.mc.head_dim, layers)

    def _capture_decode_graphs(self) -> DecodeGraphs | None:
        """CUDA graphs of the decode forward (cuda_graphs.py says why), where they apply: on a GPU,
        with the Triton backend (its decode plan needs no per-step tensors) and not turned off."""
        if not self.config.cuda_graphs:  # on the CPU, where Triton need not be installed
            return None
        from chatapp.engine.attention_triton import TritonAttentionBackend

        if not isinstance(self.attn, TritonAttentionBackend):
            return None
        max_blocks = -(-self.config.max_model_len // self.block_size)
        with torch.inference_mode():
            return DecodeGraphs(self.model, self.attn, self.config.max_num_seqs, max_blocks, self.device)

    # -- one step -----------------------------------------------------------

    def weights_ready(self, timeout_s: float) -> bool:
        """True: this runner's weights are in place from its load on (ArrayRunner's may still be packing)."""
        return True

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch, block_ids: dict[str, list[int]]) -> StepResult:
        """Run one forward over the batch and sample where a request reached its end."""
        if self.decode_graphs is not None and all(n == 1 for n in batch.num_new_tokens):
            layout = self._decode_layout(batch, block_ids)
            if layout is not None:
                return self._execute_decode_graph(layout[0], layout[1])
        step = self._prepare(batch, block_ids)
        start = time.perf_counter()
        hidden = self._forward(step)
        prompt_logprobs = self._prompt_logprobs(hidden, step) if step.prompt_rows else {}
        if not step.sample_rows:
            return StepResult([], SamplerOutput([], []), time.perf_counter() - start, prompt_logprobs)
        sampled_reqs = [step.requests[i] for i in step.sample_rows]
        logits = self.model.compute_logits(hidden[step.logits_indices])
        forward_seconds = time.perf_counter() - start
        return StepResult(sampled_reqs, self.sampler(logits, sampled_reqs), forward_seconds, prompt_logprobs)

    @torch.inference_mode()
    def launch_decode(
        self, batch: ScheduledBatch, block_ids: dict[str, list[int]], previous: LaunchedStep | None
    ) -> LaunchedStep:
        """Launch a decode-only step and sample it on the device, without waiting for it.

        Requests whose last token is pending (sampled by ``previous``, not yet read back) take it
        from ``previous``'s device tokens. Every request must sample without its token history
        (sampler.samples_without_history): their host token lists are not complete yet.
        """
        start = time.perf_counter()
        reqs = batch.requests
        previous_rows = np.fromiter(
            (previous.row_of[r.request_id] if r.token_pending and previous else -1 for r in reqs),
            np.int64,
            len(reqs),
        )
        if any(r.token_pending for r in reqs) and previous is None:
            raise RuntimeError("a pending token with no launched step to take it from")
        previous_tokens = previous.tokens if previous is not None and (previous_rows >= 0).any() else None
        layout = self._decode_layout(batch, block_ids) if self.decode_graphs is not None else None
        if layout is not None:
            assert self.decode_graphs is not None
            graph_layout = dataclasses.replace(layout[1], previous_rows=previous_rows)
            hidden = self.decode_graphs.run(graph_layout, previous_tokens)
        else:
            step = self._prepare(batch, block_ids)  # decodes only: its order is the batch's
            if previous_tokens is not None:
                rows = torch.from_numpy(previous_rows).to(self.device)
                take_previous_tokens(step.input_ids, rows, previous_tokens)
            hidden = self._forward(step)
        tokens = self.sampler.device_tokens(self.model.compute_logits(hidden), reqs)
        self.launched_steps += 1
        return LaunchedStep(reqs, tokens, self._read_back(tokens), time.perf_counter() - start)

    def _read_back(self, tokens: torch.Tensor) -> torch.Tensor:
        """A host tensor that will hold ``tokens``: on a GPU, a queued copy into pinned memory.

        Two buffers in turn: a step's copy is queued before the host reads the previous step's.
        """
        if not tokens.is_cuda:
            return tokens
        if not self._read_back_buffers:
            size = self.config.max_num_seqs
            self._read_back_buffers = [torch.empty(size, dtype=torch.long).pin_memory() for _ in range(2)]
        buffer = self._read_back_buffers[self.launched_steps % 2][: tokens.shape[0]]
        buffer.copy_(tokens, non_blocking=True)
        return buffer

    def _decode_layout(
        self, batch: ScheduledBatch, block_ids: dict[str, list[int]]
    ) -> tuple[list[Request], DecodeLayout] | None:
        """A decode-only step as host arrays for the captured graphs, or None when none fits it."""
        assert self.decode_graphs is not None
        reqs = batch.requests
        tables = [block_ids[r.request_id] for r in reqs]
        width = max(len(t) for t in tables)
        if not self.decode_graphs.fits(len(reqs), width) or len(batch.requests_to_sample()) != len(reqs):
            return None
        bs = self.block_size
        positions = np.fromiter((r.num_computed_tokens for r in reqs), np.int64, len(reqs))
        table_np = np.zeros((len(reqs), width), dtype=np.int32)
        for i, t in enumerate(tables):
            table_np[i, : len(t)] = t
        rows = np.arange(len(reqs))
        layout = DecodeLayout(
            token_ids=np.fromiter((r.all_token_ids[p] for r, p in zip(reqs, positions)), np.int64, len(reqs)),
            positions=positions,
            slots=table_np[rows, positions // bs].astype(np.int64) * bs + positions % bs,
            seq_lens=(positions + 1).astype(np.int32),
            block_tables=table_np,
        )
        return reqs, layout

    def _execute_decode_graph(self, reqs: list[Request], layout: DecodeLayout) -> StepResult:
        assert self.decode_graphs is not None
        start = time.perf_counter()
        hidden = self.decode_graphs.run(layout)
        logits = self.model.compute_logits(hidden)
        forward_seconds = time.perf_counter() - start
        return StepResult(reqs, self.sampler(logits, reqs), forward_seconds)

    def _prompt_logprobs(self, hidden: torch.Tensor, step: _PreparedStep) -> dict[str, tuple[int, list[TokenLogprobs]]]:
        """Each asking request's prompt tokens scored by the positions before them in this chunk."""
        out = {}
        for req, first_row, first_position, targets in step.prompt_rows:
            scored: list[TokenLogprobs] = []
            # A slice of rows at a time: a whole chunk's logits over a 150k vocabulary would be GBs.
            for at in range(0, len(targets), PROMPT_LOGPROB_ROWS):
                part = targets[at : at + PROMPT_LOGPROB_ROWS]
                rows = torch.arange(first_row + at, first_row + at + len(part), device=hidden.device)
                logprobs = torch.log_softmax(self.model.compute_logits(hidden[rows]).float(), dim=-1)
                chosen = logprobs.gather(1, torch.tensor(part, device=hidden.device)[:, None])[:, 0].tolist()
                top_n = req.params.prompt_logprobs
                tops: list[list[tuple[int, float]]] = [[] for _ in part]
                if top_n:
                    values, ids = logprobs.topk(top_n, dim=-1)
                    tops = [list(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
                scored += [TokenLogprobs(c, t) for c, t in zip(chosen, tops)]
            out[req.request_id] = (first_position, scored)
        return out

    @torch.inference_mode()
    def hidden_states(self, batch: ScheduledBatch, block_ids: dict[str, list[int]]) -> list[torch.Tensor]:
        """Final hidden states of each request's new tokens (for embeddings), in batch order."""
        step = self._prepare(batch, block_ids)
        hidden = self._forward(step)
        starts = step.meta.query_start_loc.tolist()
        by_request = {r.request_id: hidden[starts[i] : starts[i + 1]] for i, r in enumerate(step.requests)}
        return [by_request[r.request_id] for r in batch.requests]

    def _forward(self, step: _PreparedStep) -> torch.Tensor:
        if self.device.type == "cpu":
            threads = cpu_threads_for(step.flat, self.cpu_load, self.config.num_threads)
            if torch.get_num_threads() != threads:
                torch.set_num_threads(threads)
        if self.cpu_forward is None:
            assert self.attn is not None  # made whenever the C++ layer loop is not
            self.attn.begin_step(step.meta)
            hidden: torch.Tensor = self.model(step.input_ids, step.positions, self.attn)
            return hidden
        meta, model = step.meta, self.model
        x = model.embed(step.input_ids)
        (cos, sin), (local_cos, local_sin) = model.rope_tables(step.positions)
        return self.cpu_forward.forward(
            x,
            cos,
            sin,
            local_cos,
            local_sin,
            self._k_caches,
            self._v_caches,
            meta.slot_mapping,
            meta.query_start_loc,
            meta.seq_lens,
            meta.block_tables,
        )

    def _cpu_extension(self) -> ModuleType | None:
        """Our compiled CPU code, where it applies (CPU, float32, torch attention) and builds."""
        if (
            not self.config.cpu_kernels
            or self.device.type != "cpu"
            or self.dtype != torch.float32
            or self.config.attention_backend != "torch"
        ):
            return None
        from chatapp.engine import cpu_kernels

        return cpu_kernels.load()

    def _layer_loop_applies(self, ext: ModuleType | None) -> bool:
        """Whether the C++ layer loop runs the model: with the extension, and a float16 or float32 KV cache
        (what its attention reads). With a bfloat16 cache the Python model runs the layers, our linear
        kernels still doing its projections."""
        return ext is not None and self.config.torch_kv_dtype() in (torch.float16, torch.float32)

    def _build_cpu_forward(self, ext: ModuleType | None) -> CpuForward | None:
        """The C++ layer loop (chatapp/engine/csrc/cpu_forward.cpp), or None without the extension.

        It follows the Python model step for step without the interpreter's
        per-op cost, which dominates small decode steps.
        """
        if ext is None:
            return None
        from chatapp.engine.cpu_forward import build_cpu_model

        self._k_caches = [k for k, _ in self.kv_caches]
        self._v_caches = [v for _, v in self.kv_caches]
        cpu_model: CpuForward = build_cpu_model(ext, self.model)
        return cpu_model

    def _prepare(self, batch: ScheduledBatch, block_ids: dict[str, list[int]]) -> _PreparedStep:
        """The flattened batch (step_inputs.flatten_batch) as tensors on the model's device."""
        flat = flatten_batch(batch, block_ids, self.block_size)
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.from_numpy(flat.slots).to(dev),
            query_start_loc=torch.from_numpy(flat.query_start.astype(np.int32)).to(dev),
            seq_lens=torch.tensor(flat.seq_lens, dtype=torch.int32, device=dev),
            block_tables=torch.from_numpy(flat.block_tables).to(dev),
            query_lens_cpu=flat.query_lens,
            seq_lens_cpu=flat.seq_lens,
            num_decodes=flat.num_decodes,
            max_query_len=max(flat.query_lens),
            max_seq_len=max(flat.seq_lens),
        )
        return _PreparedStep(
            flat=flat,
            requests=flat.requests,
            input_ids=torch.from_numpy(flat.token_ids).to(dev),
            positions=torch.from_numpy(flat.positions).to(dev),
            meta=meta,
            sample_rows=flat.sample_rows,
            logits_indices=torch.from_numpy(flat.logits_rows).to(dev),
            prompt_rows=flat.prompt_rows,
        )


@dataclass
class _PreparedStep:
    flat: FlatBatch
    requests: list[Request]  # in flattened-batch order (decodes first)
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    sample_rows: list[int]
    logits_indices: torch.Tensor
    # (request, its first row, the first prompt position scored, the prompt tokens scored)
    prompt_rows: list[tuple[Request, int, int, list[int]]] = field(default_factory=list)


def _untouched_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor whose memory is committed only where it is first written (untouched_zeros)."""
    numel = 1
    for n in shape:
        numel *= n
    buffer = untouched_zeros(numel * torch.tensor([], dtype=dtype).element_size())
    return torch.frombuffer(buffer, dtype=dtype, count=numel).view(shape)
