"""What a model is, read from its files without loading it, and whether it fits in memory.

`models list`, `models info`, `models pull` and the TUI's Hub search all show
the same facts (architecture, parameters, quantisation, context length,
supported or not and why) and the same memory label, so they live here.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
from dataclasses import dataclass, replace
from pathlib import Path, PurePosixPath
from typing import Any

from chatapp.engine.models.checkpoint_files import CheckpointError, checkpoint_files
from chatapp.engine.models.gguf_split import files_size

# GGUF `general.architecture` -> the Hugging Face class our engine runs for it (one map, the engine's).

log = logging.getLogger(__name__)

# What weights cost loaded on the CPU: a GGUF file runs its own blocks (its size is what it takes);
# a safetensors model is read in float32 before it is quantised, so 4 bytes a parameter at peak.
FLOAT32_BYTES_PER_PARAMETER = 4
# A Hub listing of a GGUF repo knows only the parameter count: a Q4_K_M file's ~4.85 bits a weight.
GGUF_BYTES_PER_PARAMETER_GUESS = 0.61
# The CPU KV cache is float16 (EngineConfig.kv_cache_dtype): bytes per cached value.
KV_BYTES_PER_VALUE = 2
# The smallest context worth running with: one 2k-token conversation.
MIN_KV_TOKENS = 2048
# The engine's own working memory beside weights and cache (step_inputs.WORKING_MEMORY_BYTES).
WORKING_BYTES = 512 << 20
# The engine gives its KV pool at most this share of what is left beside the weights (KV_SHARE_OF_FREE).
KV_SHARE = 0.5
# Above this share of available memory the rest of the system starts to swap.
TIGHT_MEMORY_SHARE = 0.75
# Decoding reads every weight once per token; at 20-50 GB/s of CPU memory bandwidth more than
# 4 GiB of weights (a 7B model in 4 bits) decodes at a few tokens a second.
SLOW_WEIGHT_BYTES = 4 << 30

FITS, SLOW, WONT_FIT = "fits", "will be slow", "will not fit"


@dataclass(frozen=True)
class ModelFacts:
    """Facts about a model, any of which may be unknown (None)."""

    architecture: str | None  # e.g. "LlamaForCausalLM" (a GGUF file: its converted class)
    family: str | None  # model_type / GGUF architecture, e.g. "llama", "qwen2"
    parameters: int | None
    quantization: str | None  # "bf16", "f32", "Q4_1", "gptq", ...
    context_length: int | None
    kv_bytes_per_token: int | None  # in the CPU's float16 cache
    supported: bool
    reason: str = ""  # why not supported; empty when supported
    weights_bytes: int | None = None  # loaded on the CPU, when known better than from the parameters


@dataclass(frozen=True)
class MemoryEstimate:
    """Memory a model needs to run here (weights + KV cache at its default context) against what is free."""

    weights_bytes: int
    kv_bytes: int  # 0 when the KV size is unknown (e.g. a Hub listing)
    kv_tokens: int  # the context the KV figure is for: the model's own, held to what memory allows
    available_bytes: int
    label: str  # FITS, SLOW or WONT_FIT

    @property
    def total_bytes(self) -> int:
        return self.weights_bytes + self.kv_bytes

    def describe(self) -> str:
        kv = f" + {format_bytes(self.kv_bytes)} KV cache for {self.kv_tokens:,} tokens" if self.kv_bytes else ""
        return (
            f"{self.label}: needs about {format_bytes(self.total_bytes)} "
            f"({format_bytes(self.weights_bytes)} weights{kv}), "
            f"{format_bytes(self.available_bytes)} available"
        )


def available_memory() -> int:
    """Memory the engine could use now, from psutil (what the OS could hand out without swapping)."""
    import psutil

    return int(psutil.virtual_memory().available)


def estimate_memory(
    weights_bytes: int,
    kv_bytes_per_token: int | None = None,
    *,
    context_tokens: int | None = None,
    available_bytes: int | None = None,
) -> MemoryEstimate:
    """Weights plus the KV cache of one full default context, labelled "fits" / "will be slow" / "will not fit".

    The default context is the model's own, held (as the engine holds it) to what half of the
    memory left beside the weights can cache, but never counted below MIN_KV_TOKENS.
    """
    available = available_memory() if available_bytes is None else int(available_bytes)
    weights = int(weights_bytes)
    kv = tokens = 0
    if kv_bytes_per_token:
        wanted = context_tokens or MIN_KV_TOKENS
        room = int(max(0, available - weights - WORKING_BYTES) * KV_SHARE) // kv_bytes_per_token
        tokens = min(wanted, max(room, MIN_KV_TOKENS))
        kv = tokens * kv_bytes_per_token
    total = weights + kv
    if total > available:
        label = WONT_FIT
    elif total > TIGHT_MEMORY_SHARE * available or weights > SLOW_WEIGHT_BYTES:
        label = SLOW
    else:
        label = FITS
    return MemoryEstimate(weights, kv, tokens, available, label)


def estimate_for(facts: ModelFacts, *, available_bytes: int | None = None) -> MemoryEstimate | None:
    """The memory estimate of a model whose weight size or parameter count is known, else None."""
    weights = facts.weights_bytes or (facts.parameters * FLOAT32_BYTES_PER_PARAMETER if facts.parameters else None)
    if not weights:
        return None
    return estimate_memory(
        weights, facts.kv_bytes_per_token, context_tokens=facts.context_length, available_bytes=available_bytes
    )


def format_bytes(n: int | None) -> str:
    if n is None:
        return "?"
    size = float(n)
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if size < 1000 or unit == "TB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1000
    raise AssertionError("unreachable")


def format_count(n: int | None) -> str:
    """135M, 1.5B: parameter counts as people write them."""
    if n is None:
        return "?"
    for div, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= div:
            value = n / div
            return f"{value:.1f}{suffix}" if value < 10 else f"{value:.0f}{suffix}"
    return str(n)


# --- Hugging Face model directories and configs ---------------------------------------------


def facts_from_config(
    hf_config: dict[str, Any],
    generation_config: dict[str, Any] | None = None,
    *,
    parameters: int | None = None,
    weights_dtype: str | None = None,
) -> ModelFacts:
    """Facts from a config.json dict; `parameters` (exact, if known) beats the estimate from shapes."""
    from chatapp.engine.models.config import UnsupportedModelError, check_supported, model_config_from_dict

    archs = hf_config.get("architectures") or []
    arch = archs[0] if archs else None
    family = hf_config.get("model_type")
    quant_cfg = hf_config.get("quantization_config")
    quant_method = quant_cfg.get("quant_method") if isinstance(quant_cfg, dict) else None
    quantization = quant_method or weights_dtype or _short_dtype(hf_config.get("torch_dtype") or hf_config.get("dtype"))
    context = hf_config.get("max_position_embeddings")
    try:
        check_supported(hf_config)
        if quant_method:
            raise UnsupportedModelError(
                f"{quant_method} quantised checkpoints are not supported; use an unquantised or a GGUF version"
            )
        mc = model_config_from_dict(hf_config, generation_config)
    except UnsupportedModelError as e:
        return ModelFacts(arch, family, parameters, quantization, context, None, False, str(e))
    except (KeyError, TypeError, ValueError) as e:  # a config.json missing the fields the engine needs
        return ModelFacts(
            arch,
            family,
            parameters,
            quantization,
            context,
            None,
            False,
            f"config.json is incomplete or malformed ({type(e).__name__}: {e})",
        )
    return ModelFacts(
        arch,
        family,
        parameters or mc.num_parameters(),
        quantization,
        mc.max_position_embeddings,
        mc.kv_bytes_per_token // 4 * KV_BYTES_PER_VALUE,
        True,
    )


def _short_dtype(name: Any) -> str | None:
    return {"float32": "f32", "float16": "f16", "bfloat16": "bf16"}.get(str(name), None) if name else None


def count_safetensors(files: list[Path]) -> tuple[int, str | None]:
    """(parameter count, dtype of most tensors) from the files' headers; no tensor data is read."""
    from safetensors import safe_open

    total = 0
    by_dtype: dict[str, int] = {}
    for path in files:
        with safe_open(str(path), framework="np") as f:
            for name in f.keys():
                tensor = f.get_slice(name)
                n = 1
                for dim in tensor.get_shape():
                    n *= dim
                total += n
                dtype = tensor.get_dtype().lower()
                by_dtype[dtype] = by_dtype.get(dtype, 0) + n
    main = max(by_dtype, key=lambda d: by_dtype[d]) if by_dtype else None
    return total, {"f32": "f32", "f16": "f16", "bf16": "bf16"}.get(main or "", main)


def facts_from_model_dir(model_dir: Path) -> ModelFacts:
    """Facts from a Hugging Face model directory: config.json plus the safetensors headers."""
    try:
        hf_config = json.loads((model_dir / "config.json").read_text())
        gen_path = model_dir / "generation_config.json"
        generation = json.loads(gen_path.read_text()) if gen_path.exists() else None
    except FileNotFoundError:
        return ModelFacts(None, None, None, None, None, None, False, "no config.json")
    except (OSError, ValueError) as e:
        return ModelFacts(None, None, None, None, None, None, False, f"config.json is unreadable: {e}")
    try:
        files = checkpoint_files(model_dir)
        missing = [f.name for f in files if not f.exists()]
    except CheckpointError as e:
        return _unsupported(facts_from_config(hf_config, generation), f"the safetensors index is unreadable: {e}")
    if not files:
        return _unsupported(
            facts_from_config(hf_config, generation), "no .safetensors weights (chatapp loads safetensors or GGUF only)"
        )
    if missing:
        return _unsupported(
            facts_from_config(hf_config, generation),
            f"incomplete: missing {', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}",
        )
    try:
        params, dtype = count_safetensors(files)
    except Exception as e:  # a truncated or foreign file: report it rather than crash a listing
        return _unsupported(facts_from_config(hf_config, generation), f"unreadable weights: {e}")
    return facts_from_config(hf_config, generation, parameters=params, weights_dtype=dtype)


def _unsupported(facts: ModelFacts, reason: str) -> ModelFacts:
    return replace(facts, supported=False, reason=reason)


# --- GGUF files -------------------------------------------------------------------------------


def facts_from_gguf(path: Path) -> ModelFacts:
    """Facts from a GGUF file's header, cached: parsing it reads the whole vocabulary (~3 s)."""
    try:
        summary = _gguf_summary(path)
    except Exception as e:  # truncated or not GGUF at all: say so in the listing rather than crash it
        return ModelFacts(None, None, None, None, None, None, False, f"unreadable GGUF file ({e})")
    # What the engine's CPU packing of these tensors holds (for most types the file's own bytes; 1.9x for the
    # types it widens, 4 bytes a weight for those it runs in float32); a summary without it: the files' size.
    return replace(facts_from_gguf_summary(summary), weights_bytes=summary.get("cpu_weight_bytes") or files_size(path))


def facts_from_gguf_summary(summary: dict[str, Any]) -> ModelFacts:
    """Facts from a GGUF summary: {"architecture", "parameters", "quantization", "context_length", ...}.

    The Hub's model info carries the same keys for GGUF repos (`gguf`), so
    pre-download checks use this too.
    """
    from chatapp.engine.models.gguf_file import GGUF_ARCHITECTURES  # here: it brings numpy (CLI start-up)

    family = summary.get("architecture")
    arch = GGUF_ARCHITECTURES.get(family or "")
    params = summary.get("parameters") or summary.get("total")
    context = summary.get("context_length")
    quant = summary.get("quantization")
    if arch is None:
        reason = (
            f"GGUF architecture {family or 'unknown'!r} is not supported by chatapp's engine; "
            f"it runs {', '.join(GGUF_ARCHITECTURES)}"
        )
        return ModelFacts(None, family, params, quant, context, None, False, reason)
    kv = None
    if all(summary.get(k) for k in ("block_count", "head_count_kv", "head_dim")):
        kv = 2 * summary["block_count"] * summary["head_count_kv"] * summary["head_dim"] * KV_BYTES_PER_VALUE
    return ModelFacts(arch, family, params, quant, context, kv, True)


# Part of a cached summary's key: a summary cached by an older chatapp lacks keys read_gguf_summary adds since.
_SUMMARY_VERSION = 2


def _packings() -> str:
    """Which kind holds each GGUF type, and its bytes, as part of a cached summary's key: a chatapp that packs
    a type otherwise (IQ4_XS ran in float32 before it had a kind) must not take an older weight figure."""
    from chatapp.engine.block_kinds import KIND_FOR_GGUF_TYPE, TILE_BYTES

    return repr((sorted(KIND_FOR_GGUF_TYPE.items()), sorted(TILE_BYTES.items())))


# A GGUF file's type as its name says it (llama.cpp's labels: "Q4_K_M", "IQ4_XS", ...), in any case.
_TYPE_IN_NAME = re.compile(r"(?<![A-Z0-9])(I?Q\d_(?:K|\d|NL|XXS|XS|S|M)|TQ\d_\d|BF16|F16|F32)(?:_[SML])?(?![A-Z0-9])")


# File types named for a mix, not a tensor type: the type most of their tensors take (llama-quantize's).
_MOSTLY = {"IQ3_M": "IQ3_S", "IQ3_XS": "IQ3_S", "IQ2_M": "IQ2_S"}


def cpu_bytes_per_file_byte(filename: str) -> float:
    """How many bytes the engine's CPU packing holds per byte of a GGUF file of the type its name says.

    For a download not yet made, where only the file's name and size are known. 1.0 for the types our
    kernels run as they are; more for those held in a wider kind or run in float32 (4 bytes a weight).
    A name without a type, or a type not known here: 1.0. Mixed files keep some tensors in better types,
    so for the widened ones this errs high, on the side of not downloading what will not fit.
    """
    import gguf

    from chatapp.engine.block_kinds import KIND_FOR_GGUF_TYPE, SUPER_BLOCK, TILE, packed_bytes

    found = _TYPE_IN_NAME.search(PurePosixPath(filename).name.upper())
    name = found.group(1) if found else ""
    name = _MOSTLY.get(name, name)
    if name not in gguf.GGMLQuantizationType.__members__:
        return 1.0
    block, block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[name]]
    file_bytes_per_weight = block_bytes / block
    kind = KIND_FOR_GGUF_TYPE.get(name)
    # a tile of 16 rows of 256 inputs: whole blocks of every kind
    cpu_bytes_per_weight = packed_bytes(kind, TILE, SUPER_BLOCK) / (TILE * SUPER_BLOCK) if kind is not None else 4.0
    return max(1.0, cpu_bytes_per_weight / file_bytes_per_weight)


def _gguf_summary(path: Path) -> dict[str, Any]:
    from chatapp import paths

    stat = path.stat()
    identity = f"{_SUMMARY_VERSION}|{_packings()}|{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}"
    key = hashlib.blake2b(identity.encode(), digest_size=8).hexdigest()
    cache = paths.cache_dir() / "gguf-info" / f"{key}.json"
    try:
        return json.loads(cache.read_text())
    except (OSError, ValueError):
        pass
    summary = read_gguf_summary(path)
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_name(f"{cache.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(summary))
        os.replace(tmp, cache)
    except OSError as e:  # a read-only cache only costs speed
        log.debug("cannot cache GGUF summary of %s: %s", path, e)
    return summary


def read_gguf_summary(path: Path) -> dict[str, Any]:
    """Architecture, parameter count, quantisation and shape facts from a GGUF header (the engine's reader)."""
    import gguf

    from chatapp.engine.models.gguf_file import GGUFError, GGUFModelFile
    from chatapp.engine.models.gguf_weights import native_weight_bytes

    reader = GGUFModelFile(path)
    field = reader.field

    arch = field("general.architecture")
    heads = field(f"{arch}.attention.head_count")
    embed = field(f"{arch}.embedding_length")
    head_dim = field(f"{arch}.attention.key_length") or (embed // heads if heads and embed else None)
    file_type = field("general.file_type")
    try:
        quant = gguf.LlamaFileType(file_type).name.removeprefix("MOSTLY_") if file_type is not None else None
    except ValueError:
        quant = f"type {file_type}"
    try:
        cpu_weight_bytes: int | None = native_weight_bytes(reader, reader.model_config())
    except (GGUFError, ValueError):  # an architecture or header the engine refuses: facts_from_gguf_summary says why
        cpu_weight_bytes = None
    return {
        "architecture": arch,
        "parameters": int(sum(math.prod(t.shape) for t in reader.tensors.values())),
        "quantization": quant,
        "context_length": field(f"{arch}.context_length"),
        "block_count": field(f"{arch}.block_count"),
        "head_count_kv": field(f"{arch}.attention.head_count_kv") or heads,
        "head_dim": head_dim,
        "cpu_weight_bytes": cpu_weight_bytes,
    }
