"""Synthetic Llama-shaped GGUF files of any size and tensor types, with the bundled tokenizer.

The weights are random but valid blocks of each type (tests/gguf_blocks.py), so a file of any
GGUF type our loader takes can be made here without llama.cpp. The tokenizer and chat template
are copied from the bundled SmolLM2 file, so prompts and detokenisation are real.
benchmarks/gguf_files.py writes the 135M, ~1B and ~7B shapes with the same code.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter

from tests.gguf_blocks import random_blocks

_TOKENIZER_KEYS = (
    "tokenizer.ggml.model",
    "tokenizer.ggml.pre",
    "tokenizer.ggml.tokens",
    "tokenizer.ggml.token_type",
    "tokenizer.ggml.merges",
    "tokenizer.ggml.bos_token_id",
    "tokenizer.ggml.eos_token_id",
    "tokenizer.ggml.unknown_token_id",
    "tokenizer.ggml.padding_token_id",
    "tokenizer.ggml.add_bos_token",
    "tokenizer.ggml.add_space_prefix",
    "tokenizer.chat_template",
)


@dataclass(frozen=True)
class LlamaShape:
    hidden: int = 256
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 512
    vocab: int = 49152  # the bundled tokenizer's
    context: int = 2048


# The shapes benchmarks and tests use (the tokenizer is always SmolLM2's 49,152 tokens).
SHAPES = {
    "tiny": LlamaShape(),
    "135m": LlamaShape(hidden=576, layers=30, heads=9, kv_heads=3, intermediate=1536, context=8192),
    "1b": LlamaShape(hidden=2048, layers=22, heads=32, kv_heads=4, intermediate=5632, context=4096),
    "7b": LlamaShape(hidden=4096, layers=32, heads=32, kv_heads=8, intermediate=14336, context=8192),
}

# Q4_K_M as llama.cpp makes it: Q4_K, with Q6_K for the output and for half the v and down projections.
MIXES = {
    "Q4_K_M": {"default": "Q4_K", "output": "Q6_K", "attn_v": "Q6_K", "ffn_down": "Q6_K"},
    "Q5_K_M": {"default": "Q5_K", "output": "Q6_K", "attn_v": "Q6_K", "ffn_down": "Q6_K"},
    "Q3_K_M": {"default": "Q3_K", "output": "Q6_K", "attn_v": "Q5_K", "ffn_down": "Q4_K"},
}


@lru_cache(maxsize=1)
def bundled_tokenizer_fields() -> dict[str, tuple[Any, GGUFValueType, GGUFValueType | None]]:
    from chatapp.store import bundled_gguf_path

    reader = GGUFReader(str(bundled_gguf_path()))
    fields = {}
    for key in _TOKENIZER_KEYS:
        field = reader.fields.get(key)
        if field is None:
            continue
        main = field.types[0]
        sub = field.types[1] if main == GGUFValueType.ARRAY else None
        fields[key] = (field.contents(), main, sub)
    return fields


def tensor_type(name: str, layer: int, mix: str) -> str:
    """The GGUF type of a tensor in a file of type ``mix`` (one type, or a K-quant mix)."""
    if mix not in MIXES:
        return mix
    rules = MIXES[mix]
    if name == "output":
        return rules["output"]
    if name in ("attn_v", "ffn_down") and layer % 2 == 0:  # llama.cpp: the "more important" half
        return rules[name]
    return rules["default"]


def write_llama_gguf(
    path: Path,
    shape: LlamaShape = LlamaShape(),
    mix: str = "Q8_0",
    *,
    tied: bool = False,
    seed: int = 0,
    weight_size: float = 0.05,
    embed_type: str | None = None,
    split_max_tensors: int = 0,
) -> Path:
    """A random Llama-architecture GGUF file at ``path`` with tensors of type ``mix``; with
    ``split_max_tensors``, the same model split as llama.cpp's gguf-split writes it (``path``'s stem
    plus ``-00001-of-0000N.gguf``...; the first part is returned)."""
    rng = np.random.default_rng(seed)
    writer = GGUFWriter(str(path), "llama", split_max_tensors=split_max_tensors)
    writer.add_block_count(shape.layers)
    writer.add_context_length(shape.context)
    writer.add_embedding_length(shape.hidden)
    writer.add_feed_forward_length(shape.intermediate)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(shape.vocab)
    writer.add_rope_dimension_count(shape.hidden // shape.heads)
    for key, (value, main, sub) in bundled_tokenizer_fields().items():
        writer.add_key_value(key, value, main, sub_type=sub)

    def quantized(name: str, rows: int, cols: int, type_name: str, size: float = weight_size) -> None:
        if type_name in ("F16", "F32", "BF16"):  # plain floats (llama-quantize's input)
            values = rng.standard_normal((rows, cols), dtype=np.float32) * size
            if type_name == "BF16":  # the top half of each float32, rounded to nearest even as converters do
                bits = values.view(np.uint32).astype(np.uint64)
                halves = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
                writer.add_tensor(name, halves.view(np.uint8), raw_dtype=GGMLQuantizationType.BF16)
                return
            writer.add_tensor(name, values.astype(np.float16 if type_name == "F16" else np.float32))
            return
        data = random_blocks(type_name, rows, cols, rng, size)
        writer.add_tensor(name, data, raw_dtype=GGMLQuantizationType[type_name])

    def norm(name: str, size: int) -> None:
        writer.add_tensor(name, (1.0 + 0.1 * rng.standard_normal(size)).astype(np.float32))

    head_dim = shape.hidden // shape.heads
    quantized("token_embd.weight", shape.vocab, shape.hidden, embed_type or tensor_type("token_embd", 0, mix), 1.0)
    norm("output_norm.weight", shape.hidden)
    if not tied:
        quantized("output.weight", shape.vocab, shape.hidden, tensor_type("output", 0, mix))
    for i in range(shape.layers):
        p = f"blk.{i}."
        norm(p + "attn_norm.weight", shape.hidden)
        norm(p + "ffn_norm.weight", shape.hidden)
        for name, rows, cols in (
            ("attn_q", shape.heads * head_dim, shape.hidden),
            ("attn_k", shape.kv_heads * head_dim, shape.hidden),
            ("attn_v", shape.kv_heads * head_dim, shape.hidden),
            ("attn_output", shape.hidden, shape.heads * head_dim),
            ("ffn_gate", shape.intermediate, shape.hidden),
            ("ffn_up", shape.intermediate, shape.hidden),
            ("ffn_down", shape.hidden, shape.intermediate),
        ):
            quantized(p + name + ".weight", rows, cols, tensor_type(name, i, mix))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    if split_max_tensors:
        first = sorted(path.parent.glob(f"{path.stem}-00001-of-*.gguf"))
        assert len(first) == 1, "the split writer names its parts NAME-00001-of-0000N.gguf"
        return first[0]
    return path


# Hugging Face architecture -> llama.cpp's GGUF architecture name, for write_hf_model_gguf.
_GGUF_ARCH = {
    "Phi3ForCausalLM": "phi3",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
    "SmolLM3ForCausalLM": "smollm3",
    "Qwen3ForCausalLM": "qwen3",
    "LlamaForCausalLM": "llama",
}


def _llama3_rope_factors(rope: dict, head_dim: int) -> np.ndarray:
    """Llama 3.1's frequency factors as llama.cpp's converter stores them (rope_freqs.weight)."""
    base, factor = rope.get("rope_theta", 10000.0), rope["factor"]
    low, high = rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
    old_len = rope["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    factors = []
    for freq in 1.0 / (base ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim)):
        wavelen = 2 * np.pi / freq
        if wavelen < high_wavelen:
            factors.append(1.0)
        elif wavelen > low_wavelen:
            factors.append(factor)
        else:
            smooth = (old_len / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(factors, dtype=np.float32)


def _llama_cpp_permute(weights: np.ndarray, heads: int) -> np.ndarray:
    """q/k rows as llama.cpp's converter writes them for Llama-type files (interleaved RoPE pairs)."""
    return (
        weights.reshape(heads, 2, weights.shape[0] // heads // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def write_hf_model_gguf(model_dir: Path, path: Path, type_name: str) -> Path:
    """A Hugging Face checkpoint (Phi-3, Gemma 2/3, SmolLM3) as llama.cpp's converter lays out its GGUF
    file: its tensor names, fused Phi-3 projections, LongRoPE factor tensors, Gemma norms with their 1
    added, SmolLM3's permuted q/k rows; projections and embeddings in ``type_name`` (F32, or a type
    `gguf` can quantize)."""
    import json

    from gguf import quants
    from safetensors.torch import load_file

    hf = json.loads((model_dir / "config.json").read_text())
    hf_arch = hf["architectures"][0]
    arch = _GGUF_ARCH[hf_arch]
    gemma = arch.startswith("gemma")
    weights = {
        k.removeprefix("model."): v.float().numpy() for k, v in load_file(model_dir / "model.safetensors").items()
    }
    heads = hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
    rope = hf.get("rope_parameters") or {}
    global_rope = rope.get("full_attention", rope)
    writer = GGUFWriter(str(path), arch)
    writer.add_block_count(hf["num_hidden_layers"])
    writer.add_context_length(hf["max_position_embeddings"])
    writer.add_embedding_length(hf["hidden_size"])
    writer.add_feed_forward_length(hf["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(hf["num_key_value_heads"])
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(hf["rms_norm_eps"])
    writer.add_rope_freq_base(global_rope.get("rope_theta", 10000.0))
    writer.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 1.0)))
    writer.add_vocab_size(hf["vocab_size"])
    if global_rope.get("rope_type") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(global_rope["factor"])
    if rope.get("rope_type") == "llama3":
        writer.add_tensor("rope_freqs.weight", _llama3_rope_factors(rope, head_dim))
    if rope.get("rope_type") == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    if rope.get("rope_type") == "longrope":
        original = hf["original_max_position_embeddings"]
        factor = hf["max_position_embeddings"] / original
        writer.add_key_value(f"{arch}.rope.scaling.original_context_length", original, GGUFValueType.UINT32)
        attn_factor = float(np.sqrt(1 + np.log(factor) / np.log(original)))
        writer.add_key_value(f"{arch}.rope.scaling.attn_factor", attn_factor, GGUFValueType.FLOAT32)
        writer.add_tensor("rope_factors_long.weight", np.asarray(rope["long_factor"], dtype=np.float32))
        writer.add_tensor("rope_factors_short.weight", np.asarray(rope["short_factor"], dtype=np.float32))
    if gemma:
        writer.add_sliding_window(hf["sliding_window"])
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):
            if hf.get(key) is not None:
                writer.add_key_value(f"{arch}.{key}", float(hf[key]), GGUFValueType.FLOAT32)
    for key, (value, main, sub) in bundled_tokenizer_fields().items():
        writer.add_key_value(key, value, main, sub_type=sub)

    def put(name: str, values: np.ndarray) -> None:
        if type_name == "F32":
            writer.add_tensor(name, np.ascontiguousarray(values, dtype=np.float32))
            return
        qtype = GGMLQuantizationType[type_name]
        writer.add_tensor(name, quants.quantize(np.ascontiguousarray(values, dtype=np.float32), qtype), raw_dtype=qtype)

    def norm(name: str, values: np.ndarray) -> None:
        writer.add_tensor(name, np.ascontiguousarray(values + (1.0 if gemma else 0.0), dtype=np.float32))

    put("token_embd.weight", weights["embed_tokens.weight"])
    norm("output_norm.weight", weights["norm.weight"])
    if "lm_head.weight" in weights:
        put("output.weight", weights["lm_head.weight"])
    for i in range(hf["num_hidden_layers"]):
        src, dst = f"layers.{i}.", f"blk.{i}."
        norm(dst + "attn_norm.weight", weights[src + "input_layernorm.weight"])
        put(dst + "attn_output.weight", weights[src + "self_attn.o_proj.weight"])
        put(dst + "ffn_down.weight", weights[src + "mlp.down_proj.weight"])
        if arch == "phi3":  # fused projections
            norm(dst + "ffn_norm.weight", weights[src + "post_attention_layernorm.weight"])
            put(dst + "attn_qkv.weight", weights[src + "self_attn.qkv_proj.weight"])
            put(dst + "ffn_up.weight", weights[src + "mlp.gate_up_proj.weight"])
            continue
        if arch in ("smollm3", "qwen3", "llama"):  # Llama's layout (q/k rows permuted by Llama's converter)
            norm(dst + "ffn_norm.weight", weights[src + "post_attention_layernorm.weight"])
            q, k = weights[src + "self_attn.q_proj.weight"], weights[src + "self_attn.k_proj.weight"]
            if arch in ("smollm3", "llama"):
                q, k = _llama_cpp_permute(q, heads), _llama_cpp_permute(k, hf["num_key_value_heads"])
            put(dst + "attn_q.weight", q)
            put(dst + "attn_k.weight", k)
            if src + "self_attn.q_norm.weight" in weights:
                norm(dst + "attn_q_norm.weight", weights[src + "self_attn.q_norm.weight"])
                norm(dst + "attn_k_norm.weight", weights[src + "self_attn.k_norm.weight"])
            put(dst + "attn_v.weight", weights[src + "self_attn.v_proj.weight"])
            put(dst + "ffn_gate.weight", weights[src + "mlp.gate_proj.weight"])
            put(dst + "ffn_up.weight", weights[src + "mlp.up_proj.weight"])
            continue
        norm(dst + "post_attention_norm.weight", weights[src + "post_attention_layernorm.weight"])
        norm(dst + "ffn_norm.weight", weights[src + "pre_feedforward_layernorm.weight"])
        norm(dst + "post_ffw_norm.weight", weights[src + "post_feedforward_layernorm.weight"])
        for ours, theirs in (("attn_q", "q_proj"), ("attn_k", "k_proj"), ("attn_v", "v_proj")):
            put(dst + ours + ".weight", weights[src + f"self_attn.{theirs}.weight"])
        if src + "self_attn.q_norm.weight" in weights:
            norm(dst + "attn_q_norm.weight", weights[src + "self_attn.q_norm.weight"])
            norm(dst + "attn_k_norm.weight", weights[src + "self_attn.k_norm.weight"])
        put(dst + "ffn_gate.weight", weights[src + "mlp.gate_proj.weight"])
        put(dst + "ffn_up.weight", weights[src + "mlp.up_proj.weight"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
