"""Build our model straight from a GGUF file, tensor by tensor, with no float32 model in between.

Two ways, chosen by the model runner:
- native (the CPU with our C++ kernels): every projection keeps the file's own blocks, repacked
  into our kernels' tiles (csrc/gguf_repack.cpp), each tensor in its own type (a Q4_K_M file runs
  Q4_K and Q6_K side by side). The token embeddings stay in the file and are de-quantised a row
  at a time as tokens come. Types our kernels do not take (F16, BF16, IQ*, Q2_K, Q3_K, ...) are
  de-quantised to float32 for that tensor alone: slower, still exact.
- float (a GPU, or no compiler): each tensor is de-quantised by the `gguf` package into the
  model's dtype as it is read.
Either way, one tensor's file pages are dropped from memory once it has been used.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from types import ModuleType
from typing import cast

import numpy as np
import torch
from torch import nn

from chatapp.engine.block_quant import BlockQuantLinear, PackedPart
from chatapp.engine.models.config import ModelConfig
from chatapp.engine.models.gemma import GemmaDecoderLayer, model_class
from chatapp.engine.models.gguf_file import GGUFError, GGUFModelFile, GGUFTensor
from chatapp.engine.models.gguf_weights import (  # noqa: F401  (dequantize_rows, native_weight_bytes: re-exported)
    NATIVE_TYPES,
    GGUFWeights,
    Projection,
    check_embedding,
    check_layer_count,
    dequantize_rows,
    native_weight_bytes,
)
from chatapp.engine.models.llama import DecoderLayer, LlamaForCausalLM, RMSNorm

log = logging.getLogger(__name__)


def _torch(array: np.ndarray) -> torch.Tensor:
    with warnings.catch_warnings():  # read-only memory maps: we never write through them
        warnings.simplefilter("ignore")
        return torch.from_numpy(array)


class GGUFEmbedding(nn.Module):
    """Token embeddings read from the file's rows as they are needed, de-quantised exactly.

    Why: the embedding matrix is the largest single tensor of small models (and 0.5 GB of an 8B
    one); a step needs only its tokens' rows, so nothing of it is copied or expanded at load.
    """

    def __init__(self, tensor: GGUFTensor, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.tensor, self.dtype, self.device = tensor, dtype, device
        self.num_embeddings, self.embedding_dim = tensor.shape

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1).cpu().numpy()
        unique, inverse = np.unique(flat, return_inverse=True)
        rows = _torch(dequantize_rows(self.tensor, unique))[torch.from_numpy(inverse.reshape(-1))]
        return rows.to(device=self.device, dtype=self.dtype).view(*ids.shape, self.embedding_dim)


def _layer_norms(layer: DecoderLayer | GemmaDecoderLayer, i: int) -> list[tuple[RMSNorm, str]]:
    """(norm module, GGUF tensor) of a layer. llama.cpp's Gemma files store the weights with the 1
    already added, which is what our norms multiply by."""
    p = f"blk.{i}."
    if isinstance(layer, GemmaDecoderLayer):
        return [
            (layer.input_layernorm, p + "attn_norm.weight"),
            (layer.post_attention_layernorm, p + "post_attention_norm.weight"),
            (layer.pre_feedforward_layernorm, p + "ffn_norm.weight"),
            (layer.post_feedforward_layernorm, p + "post_ffw_norm.weight"),
        ]
    return [(layer.input_layernorm, p + "attn_norm.weight"), (layer.post_attention_layernorm, p + "ffn_norm.weight")]


def load_gguf_float(
    gguf: GGUFModelFile, mc: ModelConfig, dtype: torch.dtype, device: torch.device, max_positions: int
) -> LlamaForCausalLM:
    """Every tensor de-quantised into a float model of ``dtype`` (GPU, or the CPU without our kernels)."""
    check_layer_count(gguf, mc)
    model = model_class(mc)(mc, max_positions, device="meta")
    model = model.to_empty(device=device).to(dtype)
    loader = GGUFWeights(gguf, mc)

    def put(dest: torch.Tensor, name: str, heads: int | None = None) -> None:
        dest.copy_(_torch(loader.floats(name, tuple(dest.shape), heads)))

    with torch.no_grad():
        put(model.embed_tokens.weight, "token_embd.weight")
        put(model.norm.weight, "output_norm.weight")
        if model.lm_head is not None:
            put(model.lm_head.weight, "output.weight")
        for i, module in enumerate(model.layers):
            layer = cast(DecoderLayer | GemmaDecoderLayer, module)  # the model's layer_class
            attn, mlp = layer.self_attn, layer.mlp
            for norm_module, name in _layer_norms(layer, i):
                put(norm_module.weight, name)
            if attn.q_norm is not None:
                assert attn.k_norm is not None  # set together in Attention.__init__
                put(attn.q_norm.weight, f"blk.{i}.attn_q_norm.weight")
                put(attn.k_norm.weight, f"blk.{i}.attn_k_norm.weight")
            for kind, linear in (
                # nn.Linear in a freshly built model (only loaders and quantizers swap them)
                ("qkv", cast(nn.Linear, attn.qkv_proj)),
                ("o", cast(nn.Linear, attn.o_proj)),
                ("gate_up", cast(nn.Linear, mlp.gate_up_proj)),
                ("down", cast(nn.Linear, mlp.down_proj)),
            ):
                start = 0
                for name, rows, heads in loader.projections(i, kind):
                    put(linear.weight[start : start + rows], name, heads)
                    start += rows
                if linear.bias is not None:
                    bias = loader.bias(i, kind)
                    if bias is None:
                        raise GGUFError(f"{gguf.path.name} lacks the biases of layer {i}'s {kind} projection")
                    linear.bias.copy_(_torch(bias))
    model.build_rope(dtype, device)
    model.eval()
    return model


def load_gguf_native(
    gguf: GGUFModelFile,
    mc: ModelConfig,
    max_positions: int,
    ext: ModuleType,
    progress: Callable[[int, int], None] | None = None,
) -> LlamaForCausalLM:
    """Our CPU model with every projection in the file's own blocks (float32 activations)."""
    check_layer_count(gguf, mc)
    device, dtype = torch.device("cpu"), torch.float32
    model = model_class(mc)(mc, max_positions, device="meta")
    loader = GGUFWeights(gguf, mc)
    h = mc.hidden_size

    def norm(module: nn.Module, name: str, size: int) -> None:
        module.weight = nn.Parameter(_torch(loader.floats(name, (size,))), requires_grad=False)

    def linear(parts: Projection, bias_values: np.ndarray | None) -> nn.Module:
        tensors = loader.checked_tensors(parts)
        k = tensors[0].shape[-1]
        bias = None if bias_values is None else _torch(bias_values)
        if all(t.type_name in NATIVE_TYPES for t in tensors):
            packed = [PackedPart(_torch(a), kind, rows) for a, kind, rows in loader.repack(ext, parts, tensors)]
            return BlockQuantLinear(packed, k, bias, ext)
        log.info(
            "%s: %s is not a type our kernels run; de-quantised to float32",
            parts[0][0],
            "/".join(sorted({t.type_name for t in tensors})),
        )
        dense = nn.Linear(k, sum(rows for _n, rows, _h in parts), bias=bias is not None)
        with torch.no_grad():
            dense.weight.copy_(
                _torch(np.concatenate([loader.floats(name, (rows, k), heads) for name, rows, heads in parts]))
            )
            if bias is not None:
                dense.bias.copy_(bias)
        return dense

    norm(model.norm, "output_norm.weight", h)
    total = mc.num_layers
    for i, module in enumerate(model.layers):
        layer = cast(DecoderLayer | GemmaDecoderLayer, module)  # the model's layer_class
        attn, mlp = layer.self_attn, layer.mlp
        for norm_module, name in _layer_norms(layer, i):
            norm(norm_module, name, h)
        if attn.q_norm is not None:
            assert attn.k_norm is not None  # set together in Attention.__init__
            norm(attn.q_norm, f"blk.{i}.attn_q_norm.weight", mc.head_dim)
            norm(attn.k_norm, f"blk.{i}.attn_k_norm.weight", mc.head_dim)
        attn.qkv_proj = linear(loader.projections(i, "qkv"), loader.bias(i, "qkv") if mc.attention_bias else None)
        attn.o_proj = linear(loader.projections(i, "o"), None)
        mlp.gate_up_proj = linear(loader.projections(i, "gate_up"), loader.bias(i, "gate_up") if mc.mlp_bias else None)
        mlp.down_proj = linear(loader.projections(i, "down"), loader.bias(i, "down") if mc.mlp_bias else None)
        if progress is not None:
            progress(i + 1, total)
    head_name = "token_embd.weight" if mc.tie_word_embeddings else "output.weight"
    model.quantized_lm_head = linear([(head_name, mc.vocab_size, None)], None)
    model.lm_head = None
    # Stands in for nn.Embedding (num_embeddings, embedding_dim, forward); no .weight, and none is needed:
    # the LM head is quantized_lm_head.
    model.embed_tokens = cast(nn.Embedding, GGUFEmbedding(check_embedding(gguf, mc), dtype, device))
    still_meta = [name for name, p in model.named_parameters() if p.is_meta]
    if still_meta:
        raise GGUFError(f"{gguf.path.name}: no weights loaded for {', '.join(still_meta[:4])}")
    model.build_rope(dtype, device)
    model.eval()
    return model
