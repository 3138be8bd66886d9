"""Build our model straight from a GGUF file, tensor by tensor, with no float32 model in between.

Two ways, chosen by the model runner:
- native (the CPU with our C++ kernels): every projection keeps the file's own blocks, repacked
  into our kernels' tiles (csrc/gguf_repack.cpp), each tensor in its own type (a Q4_K_M file runs
  Q4_K and Q6_K side by side). The token embeddings stay in the file and are de-quantised a row
  at a time as tokens come (Q3_K and IQ4_NL are held exactly by the kinds of Q6_K and Q8_0). Types our
  kernels do not take (F16, BF16, Q2_K, IQ4_XS and the other IQ types, ...) are
  de-quantised to float32 for that tensor alone: slower, still exact.
- float (a GPU, or no compiler): each tensor is de-quantised by the `gguf` package into the
  model's dtype as it is read.
Either way, one tensor's file pages are dropped from memory once it has been used.
"""

from __future__ import annotations

import warnings
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
    GGUFWeights,
    LinearWeights,
    check_embedding,
    check_layer_count,
    dequantize_rows,
    native_weight_bytes,
)
from chatapp.engine.models.llama import DecoderLayer, LlamaForCausalLM, RMSNorm


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


def load_gguf_native(gguf: GGUFModelFile, mc: ModelConfig, max_positions: int, ext: ModuleType) -> LlamaForCausalLM:
    """Our CPU model with every projection in the file's own blocks (float32 activations)."""
    check_layer_count(gguf, mc)
    device, dtype = torch.device("cpu"), torch.float32
    model = model_class(mc)(mc, max_positions, device="meta")
    weights = GGUFWeights(gguf, mc)

    def set_norm(module: nn.Module | None, values: np.ndarray | None) -> None:
        if module is not None and values is not None:
            module.weight = nn.Parameter(_torch(values), requires_grad=False)

    model.norm.weight = nn.Parameter(
        _torch(weights.floats("output_norm.weight", (mc.hidden_size,))), requires_grad=False
    )
    for i, module in enumerate(model.layers):
        layer = cast(DecoderLayer | GemmaDecoderLayer, module)  # the model's layer_class
        attn, mlp, w = layer.self_attn, layer.mlp, weights.layer(ext, i)
        set_norm(layer.input_layernorm, w.input_norm)
        set_norm(layer.mlp_input_norm, w.mlp_in_norm)
        set_norm(attn.q_norm, w.q_norm)
        set_norm(attn.k_norm, w.k_norm)
        if isinstance(layer, GemmaDecoderLayer):
            set_norm(layer.post_attention_layernorm, w.attn_out_norm)
            set_norm(layer.post_feedforward_layernorm, w.mlp_out_norm)
        attn.qkv_proj, attn.o_proj = _torch_linear(w.qkv, ext), _torch_linear(w.o, ext)
        mlp.gate_up_proj, mlp.down_proj = _torch_linear(w.gate_up, ext), _torch_linear(w.down, ext)
    model.quantized_lm_head = _torch_linear(weights.lm_head(ext), ext)
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


def _torch_linear(weights: LinearWeights, ext: ModuleType) -> nn.Module:
    """Our block-quantized layer over the packed arrays (shared, not copied), or a float one."""
    bias = None if weights.bias is None else _torch(weights.bias)
    if weights.packed is not None:
        parts = [PackedPart(_torch(packed), kind, rows) for packed, kind, rows in weights.packed]
        return BlockQuantLinear(parts, weights.in_features, bias, ext)
    assert weights.dense is not None  # LinearWeights holds one or the other
    dense = nn.Linear(weights.in_features, weights.out_features, bias=bias is not None, device="meta")
    dense.weight = nn.Parameter(_torch(weights.dense), requires_grad=False)
    if bias is not None:
        dense.bias = nn.Parameter(bias, requires_grad=False)
    return dense
