"""One configuration object for the engine, passed down to every part.

The user sets a few fields (or none); :meth:`EngineConfig.finalize` fills the
rest from the model and the machine, so every component reads one resolved
object instead of taking long argument lists.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import psutil

if TYPE_CHECKING:
    import torch

# Names only: clients build configs too, and must not pay for importing torch (~1.2 s, ~250 MB).
_DTYPES = {
    "float32": "float32",
    "fp32": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
}


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs to know; ``None`` means "choose for me".

    Frozen: :meth:`finalize` resolves it once, before the model runner is built, into a
    :class:`ResolvedConfig` with concrete types. Nothing else changes a config.
    """

    model: str | None = None
    """A name from the model store, a model directory or a GGUF file; None is the bundled model."""
    dtype: str = "auto"
    """auto (float32 on the CPU, the checkpoint's half type on a GPU), float32, bfloat16, float16."""
    device: str = "auto"
    """auto (CUDA when available, else CPU), cpu or cuda."""
    block_size: int = 16
    """Tokens per KV cache block."""
    kv_cache_memory_gib: float | None = None
    """CPU: the most memory the KV pool may take. None: what the work needs, KV_CONTEXTS full contexts
    (max_model_len tokens each), held to a share of the memory left beside the weights. Either way
    the pool is committed as blocks are first written, so an idle engine holds little of it."""
    kv_cache_dtype: str = "auto"
    """auto (float16 on the CPU, the model's dtype on a GPU), float16, bfloat16 or float32 (what the
    Hugging Face equivalence tests use: bit for bit the model's own keys and values)."""
    gpu_memory_utilization: float = 0.9
    """GPU: the share of device memory the engine may use (weights, activations and KV pool)."""
    num_kv_blocks: int | None = None
    """Forces the pool size in blocks (tests use it to force preemption)."""
    max_num_seqs: int | None = None
    """At most this many requests run at once."""
    max_num_batched_tokens: int | None = None
    """Per-step token budget shared by decodes and prefill chunks."""
    long_prefill_token_threshold: int | None = None
    """A prompt computes at most this many tokens per step (chunked prefill)."""
    max_model_len: int | None = None
    """Longest sequence (prompt + output); capped by the model and the KV pool."""
    enable_prefix_caching: bool = True
    attention_backend: str = "auto"
    """auto (triton on CUDA, torch on the CPU), torch or triton."""
    cuda_graphs: bool = True
    """On a GPU, replay decode steps from CUDA graphs captured at start (cuda_graphs.py); False runs
    every step eagerly (vLLM's enforce_eager), for debugging."""
    overlap_steps: bool | None = None
    """Launch the next decode step before reading back the current one's tokens, so the host's
    per-step work (scheduling, inputs, outputs) runs while the device computes (core.py says how).
    None: on a GPU, where the device would otherwise wait for the host; the CPU computes in the
    host's own thread, so there is nothing to hide. True turns it on anywhere (tests do on the CPU)."""
    cpu_kernels: bool = True
    """On the CPU in float32, run the model through our C++ layer loop (built on first use)."""
    huge_pages: bool = True
    """Once a GGUF model has loaded on the CPU, move its packed weights into 2 MB pages in the background
    (Linux; huge_pages.py): decoding reads them faster."""
    runner: str = "auto"
    """auto: a GGUF file on the CPU with our kernels runs on the torch-free runner (array_runner.py:
    the engine starts ~1 s sooner, without importing torch), everything else on the torch runner
    (model_runner.py); "array" insists on the first (an error says why it cannot), "torch" on the second."""
    quantization: str | None = "auto"
    """auto, "gguf", "int4", "int8" or None. On the CPU, auto runs a GGUF file's weights in their own
    types ("gguf": Q4_0 ... Q8_0, Q4_K, Q5_K, Q6_K kept exactly, csrc/gguf_repack.cpp), a safetensors
    model's in int4 when they already are 4- and 8-bit blocks and int8 otherwise; on a GPU, none.
    "int4": 4-bit blocks for every projection, 8-bit for the LM head (block_quant.py);
    "int8": calibrated dynamic int8 (quantization.py). Both CPU only."""
    stream_interval_ms: float = 25.0
    """Longest a streamed token waits to share a message with the next ones (stream_buffer.py says
    why); a request's first and last tokens never wait. 0: a message every step."""
    num_threads: int | None = None
    """torch intra-op threads on the CPU; None: the physical core count."""
    seed: int = 0
    memory_gib: float | None = None
    """The engine process's memory budget for all its models (weights, KV pools, working memory):
    a model that needs room unloads the least recently used idle ones first (model_pool.py). None:
    the memory the machine has available."""
    max_loaded_models: int = 3
    """At most this many models loaded at once (Ollama's CPU default)."""
    keep_alive_s: float | None = 300.0
    """A model loaded on demand is unloaded after this many idle seconds (Ollama's keep_alive);
    None keeps it. The default model and preloaded ones stay."""
    preload: tuple[str, ...] = ()
    """More models to load at start, beside ``model`` (`chatapp serve --model A --model B`)."""

    @classmethod
    def from_overrides(cls, model: str | None = None, **overrides: Any) -> EngineConfig:
        """Build a config from keyword overrides, rejecting unknown names clearly."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise TypeError(
                f"unknown engine option(s): {', '.join(unknown)}; known options: {', '.join(sorted(known))}"
            )
        return cls(model=model, **overrides)

    # -- resolution ---------------------------------------------------------

    def finalize(self, *, checkpoint_dtype: torch.dtype | None, model_max_len: int) -> ResolvedConfig:
        """Every "auto"/None choice made from the model and machine, once, before the runner is built."""
        device = _resolve_device(self.device)
        dtype = _resolve_dtype(self.dtype, device, checkpoint_dtype)
        backend = _resolve_backend(self.attention_backend, device)
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        on_gpu = device == "cuda"
        max_num_seqs = self.max_num_seqs if self.max_num_seqs is not None else (256 if on_gpu else 64)
        budget = self.max_num_batched_tokens
        if budget is None:
            budget = 8192 if on_gpu else 1024
        threshold = self.long_prefill_token_threshold if self.long_prefill_token_threshold is not None else budget
        if self.kv_cache_memory_gib is not None and not self.kv_cache_memory_gib > 0:
            raise ValueError(f"kv_cache_memory_gib must be more than 0, got {self.kv_cache_memory_gib}")
        quantization = None if self.quantization in ("none", "") else self.quantization
        if quantization == "auto" and device != "cpu":
            quantization = None  # on the CPU the model runner decides, once it has the weights
        if quantization not in (None, "auto", "gguf", "int4", "int8"):
            raise ValueError(f"quantization must be auto, gguf, int4, int8 or None, got {quantization!r}")
        if quantization in ("gguf", "int4", "int8") and device != "cpu":
            raise ValueError(f"quantization={quantization!r} runs on the CPU only (our CPU kernels)")
        if self.runner not in ("auto", "array", "torch"):
            raise ValueError(f"runner must be auto, array or torch, got {self.runner!r}")
        if not self.stream_interval_ms >= 0:
            raise ValueError(f"stream_interval_ms must be 0 or more, got {self.stream_interval_ms}")
        for name, value in (
            ("max_num_seqs", max_num_seqs),
            ("max_num_batched_tokens", budget),
            ("long_prefill_token_threshold", threshold),
        ):
            if value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}")
        return ResolvedConfig(
            model=self.model,
            dtype=dtype,
            device=device,
            block_size=self.block_size,
            kv_cache_memory_gib=self.kv_cache_memory_gib,
            kv_cache_dtype=_resolve_kv_dtype(self.kv_cache_dtype, device, dtype, backend),
            gpu_memory_utilization=self.gpu_memory_utilization,
            num_kv_blocks=self.num_kv_blocks,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=budget,
            long_prefill_token_threshold=threshold,
            max_model_len=min(self.max_model_len or model_max_len, model_max_len),
            enable_prefix_caching=self.enable_prefix_caching,
            attention_backend=backend,
            cpu_kernels=self.cpu_kernels,
            huge_pages=self.huge_pages,
            runner=self.runner,
            cuda_graphs=self.cuda_graphs and on_gpu,
            overlap_steps=on_gpu if self.overlap_steps is None else self.overlap_steps,
            quantization=quantization,
            stream_interval_ms=self.stream_interval_ms,
            num_threads=self.num_threads or psutil.cpu_count(logical=False) or os.cpu_count() or 1,
            seed=self.seed,
        )


@dataclass(frozen=True)
class ResolvedConfig:
    """The engine's configuration with every choice made: what the runner, scheduler and core read.

    Built only by :meth:`EngineConfig.finalize`; its fields have concrete types where EngineConfig's
    say "choose for me" with None. EngineCore folds in, once, what only loading the weights can tell
    (the quantization "auto" chose, the KV pool's size and the context it allows)."""

    model: str | None
    dtype: str
    """float32, bfloat16 or float16."""
    device: str
    """cpu or cuda."""
    block_size: int
    kv_cache_memory_gib: float | None
    """The user's cap on the pool; None: sized to the work (ModelRunner)."""
    kv_cache_dtype: str
    gpu_memory_utilization: float
    num_kv_blocks: int | None
    """Before loading: a forced pool size, or None (the runner sizes it). After EngineCore folds the
    runner's decisions in: the pool's size."""
    max_num_seqs: int
    max_num_batched_tokens: int
    long_prefill_token_threshold: int
    max_model_len: int
    enable_prefix_caching: bool
    attention_backend: str
    """torch or triton."""
    cpu_kernels: bool
    huge_pages: bool
    runner: str
    """auto, array or torch (EngineConfig.runner)."""
    cuda_graphs: bool
    overlap_steps: bool
    quantization: str | None
    """auto (the runner decides on the CPU), gguf, int4, int8 or None; after loading, what was applied."""
    stream_interval_ms: float
    num_threads: int
    seed: int

    def torch_device(self) -> torch.device:
        import torch

        return torch.device(self.device)

    def torch_dtype(self) -> torch.dtype:
        import torch

        dtype: torch.dtype = getattr(torch, _DTYPES[self.dtype])
        return dtype

    def torch_kv_dtype(self) -> torch.dtype:
        import torch

        dtype: torch.dtype = getattr(torch, _DTYPES[self.kv_cache_dtype])
        return dtype


def _resolve_device(device: str) -> str:
    if device == "auto":
        if no_gpu_here():
            return "cpu"
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be auto, cpu or cuda, got {device!r}")
    import torch

    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' was asked for but no CUDA GPU is available")
    return device


def no_gpu_here() -> bool:
    """True where torch could not see a GPU, told without importing it (~1.1 s, which the torch-free
    CPU runner saves): on Linux, no NVIDIA, AMD or WSL GPU device node; elsewhere a CPU-only torch build.
    The device nodes are looked at first: importing importlib.metadata and reading package metadata
    costs ~25 ms of the start."""
    import sys

    nodes = ("/dev/nvidiactl", "/dev/nvidia0", "/dev/kfd", "/dev/dxg")
    if sys.platform == "linux" and not any(os.path.exists(node) for node in nodes):
        return True
    import importlib.metadata

    try:
        return "+cpu" in importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return False  # let the import say what is wrong


def _resolve_dtype(dtype: str, device: str, checkpoint_dtype: torch.dtype | None) -> str:
    if dtype == "auto":
        if device == "cpu":
            return "float32"
        import torch

        if checkpoint_dtype in (torch.float16, torch.bfloat16):
            return "float16" if checkpoint_dtype == torch.float16 else "bfloat16"
        return "bfloat16"
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {dtype!r}")
    return {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}.get(dtype, dtype)


def _resolve_kv_dtype(kv_dtype: str, device: str, dtype: str, backend: str) -> str:
    """Half the bytes of float32 on the CPU: the cache is the memory that grows with every chat, and
    decode reads all of it each step. Our CPU attention widens halves exactly, so only the stored
    keys and values are rounded (benchmarks/quality.py measures the effect)."""
    if kv_dtype == "auto":
        return "float16" if device == "cpu" and backend == "torch" else dtype
    if kv_dtype not in _DTYPES:
        raise ValueError(f"kv_cache_dtype must be auto, float16, bfloat16 or float32, got {kv_dtype!r}")
    return _DTYPES[kv_dtype]


def _resolve_backend(backend: str, device: str) -> str:
    if backend == "auto":
        return "triton" if device == "cuda" else "torch"
    if backend not in ("torch", "triton"):
        raise ValueError(f"attention_backend must be auto, torch or triton, got {backend!r}")
    return backend
