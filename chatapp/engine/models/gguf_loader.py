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
from types import ModuleType
from typing import Callable

import numpy as np
import torch
from torch import nn

from chatapp.engine.block_quant import BlockQuantLinear, PackedPart
from chatapp.engine.models.config import ModelConfig
from chatapp.engine.models.gguf_file import GGUFError, GGUFModelFile, GGUFTensor
from chatapp.engine.models.llama import LlamaForCausalLM

log = logging.getLogger(__name__)

# GGUF types our kernels run as they are (csrc/gguf_repack.cpp says into which packed kind).
NATIVE_TYPES = frozenset({"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"})


def dequantize_rows(tensor: GGUFTensor, rows: np.ndarray | slice = slice(None)) -> np.ndarray:
    """float32 [rows, columns] of a tensor, exactly as the `gguf` package de-quantises them."""
    from gguf import GGMLQuantizationType, quants

    data = np.asarray(tensor.data[rows])
    return np.asarray(quants.dequantize(data, GGMLQuantizationType(tensor.type_id)), dtype=np.float32)


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


class _Loader:
    def __init__(self, gguf: GGUFModelFile, mc: ModelConfig) -> None:
        self.gguf, self.mc = gguf, mc

    def raw(self, name: str, heads: int | None = None) -> GGUFTensor:
        """A tensor, its rows put back in Hugging Face order when the converter permuted them."""
        tensor = self.gguf.tensor(name)
        if heads is None or not self.gguf.permuted_qk:
            return tensor
        rows = _unpermute_rows(tensor.shape[0], heads)
        return GGUFTensor(tensor.name, tensor.type_name, tensor.type_id, tensor.shape, tensor.data[rows], tensor.offset)

    def float_tensor(self, name: str, shape: tuple[int, ...], heads: int | None = None) -> torch.Tensor:
        tensor = self.raw(name, heads)
        if tensor.shape != shape:
            raise GGUFError(f"tensor {name} has shape {tensor.shape}, expected {shape}")
        values = _torch(dequantize_rows(tensor)).reshape(shape)
        self.gguf.release(self.gguf.tensor(name))
        return values

    def projections(self, layer: int, kind: str) -> list[tuple[str, int, int | None]]:
        """(tensor name, rows, rope heads to un-permute) of a fused projection's parts."""
        mc, p = self.mc, f"blk.{layer}."
        if kind == "qkv":
            kv = mc.num_kv_heads * mc.head_dim
            return [(p + "attn_q.weight", mc.num_heads * mc.head_dim, mc.num_heads),
                    (p + "attn_k.weight", kv, mc.num_kv_heads), (p + "attn_v.weight", kv, None)]
        if kind == "o":
            return [(p + "attn_output.weight", mc.hidden_size, None)]
        if kind == "gate_up":
            return [(p + "ffn_gate.weight", mc.intermediate_size, None), (p + "ffn_up.weight", mc.intermediate_size, None)]
        return [(p + "ffn_down.weight", mc.hidden_size, None)]

    def bias(self, layer: int, kind: str) -> torch.Tensor | None:
        names = {"qkv": ["attn_q.bias", "attn_k.bias", "attn_v.bias"], "gate_up": ["ffn_gate.bias", "ffn_up.bias"],
                 "down": ["ffn_down.bias"], "o": ["attn_output.bias"]}[kind]
        parts = []
        for (weight, rows, heads), name in zip(self.projections(layer, kind), names):
            full = f"blk.{layer}.{name}"
            if full not in self.gguf.tensors:
                return None
            tensor = self.raw(full, heads) if heads else self.gguf.tensor(full)
            parts.append(_torch(dequantize_rows(tensor)).reshape(rows))
        return torch.cat(parts)


def _unpermute_rows(rows: int, heads: int) -> np.ndarray:
    """Row order that undoes llama.cpp's q/k permutation (interleaved -> rotate-half pairs)."""
    head_dim = rows // heads
    r = np.arange(rows)
    h, within = r // head_dim, r % head_dim
    half = head_dim // 2
    return h * head_dim + 2 * (within % half) + within // half


def _check_layer_count(gguf: GGUFModelFile, mc: ModelConfig) -> None:
    last = f"blk.{mc.num_layers - 1}.attn_norm.weight"
    if last not in gguf.tensors:
        raise GGUFError(f"{gguf.path.name} says {mc.num_layers} layers but lacks tensor {last}")


def load_gguf_float(gguf: GGUFModelFile, mc: ModelConfig, dtype: torch.dtype, device: torch.device,
                    max_positions: int) -> LlamaForCausalLM:
    """Every tensor de-quantised into a float model of ``dtype`` (GPU, or the CPU without our kernels)."""
    _check_layer_count(gguf, mc)
    with torch.device("meta"):
        model = LlamaForCausalLM(mc, max_positions)
    model = model.to_empty(device=device).to(dtype)
    loader = _Loader(gguf, mc)
    h = mc.hidden_size

    def put(dest: torch.Tensor, name: str, heads: int | None = None) -> None:
        dest.copy_(loader.float_tensor(name, tuple(dest.shape), heads))

    with torch.no_grad():
        put(model.embed_tokens.weight, "token_embd.weight")
        put(model.norm.weight, "output_norm.weight")
        if model.lm_head is not None:
            put(model.lm_head.weight, "output.weight")
        for i, layer in enumerate(model.layers):
            attn, mlp = layer.self_attn, layer.mlp
            put(layer.input_layernorm.weight, f"blk.{i}.attn_norm.weight")
            put(layer.post_attention_layernorm.weight, f"blk.{i}.ffn_norm.weight")
            if attn.q_norm is not None:
                put(attn.q_norm.weight, f"blk.{i}.attn_q_norm.weight")
                put(attn.k_norm.weight, f"blk.{i}.attn_k_norm.weight")
            for kind, linear in (("qkv", attn.qkv_proj), ("o", attn.o_proj), ("gate_up", mlp.gate_up_proj),
                                 ("down", mlp.down_proj)):
                start = 0
                for name, rows, heads in loader.projections(i, kind):
                    put(linear.weight[start : start + rows], name, heads)
                    start += rows
                if linear.bias is not None:
                    bias = loader.bias(i, kind)
                    if bias is None:
                        raise GGUFError(f"{gguf.path.name} lacks the biases of layer {i}'s {kind} projection")
                    linear.bias.copy_(bias)
    del h
    model.build_rope(dtype, device)
    model.eval()
    return model


def load_gguf_native(gguf: GGUFModelFile, mc: ModelConfig, max_positions: int, ext: ModuleType,
                     progress: Callable[[int, int], None] | None = None) -> LlamaForCausalLM:
    """Our CPU model with every projection in the file's own blocks (float32 activations)."""
    _check_layer_count(gguf, mc)
    device, dtype = torch.device("cpu"), torch.float32
    with torch.device("meta"):
        model = LlamaForCausalLM(mc, max_positions)
    loader = _Loader(gguf, mc)
    h = mc.hidden_size

    def norm(module: nn.Module, name: str, size: int) -> None:
        module.weight = nn.Parameter(loader.float_tensor(name, (size,)).clone(), requires_grad=False)

    def linear(parts: list[tuple[str, int, int | None]], bias: torch.Tensor | None) -> nn.Module:
        tensors = [loader.raw(name, heads) for name, _rows, heads in parts]
        k = tensors[0].shape[1]
        for (name, rows, _heads), t in zip(parts, tensors):
            if t.shape != (rows, k):
                raise GGUFError(f"tensor {name} has shape {t.shape}, expected {(rows, k)}")
        if all(t.type_name in NATIVE_TYPES for t in tensors):
            packed = []
            for (name, rows, _heads), t in zip(parts, tensors):
                tiles, kind = ext.repack_gguf(_torch(np.ascontiguousarray(t.data)), t.type_id, k)
                packed.append(PackedPart(tiles, kind, rows))
                gguf.release(gguf.tensor(name))
            return BlockQuantLinear(packed, k, bias, ext)
        log.info("%s: %s is not a type our kernels run; de-quantised to float32",
                 parts[0][0], "/".join(sorted({t.type_name for t in tensors})))
        dense = nn.Linear(k, sum(rows for _n, rows, _h in parts), bias=bias is not None)
        with torch.no_grad():
            dense.weight.copy_(torch.cat([loader.float_tensor(name, (rows, k), heads) for name, rows, heads in parts]))
            if bias is not None:
                dense.bias.copy_(bias)
        return dense

    norm(model.norm, "output_norm.weight", h)
    total = mc.num_layers
    for i, layer in enumerate(model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        norm(layer.input_layernorm, f"blk.{i}.attn_norm.weight", h)
        norm(layer.post_attention_layernorm, f"blk.{i}.ffn_norm.weight", h)
        if attn.q_norm is not None:
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
    model.embed_tokens = GGUFEmbedding(gguf.tensor("token_embd.weight"), dtype, device)
    if model.embed_tokens.num_embeddings != mc.vocab_size or model.embed_tokens.embedding_dim != h:
        raise GGUFError(f"tensor token_embd.weight has shape {gguf.tensor('token_embd.weight').shape}, "
                        f"expected {(mc.vocab_size, h)}")
    still_meta = [name for name, p in model.named_parameters() if p.is_meta]
    if still_meta:
        raise GGUFError(f"{gguf.path.name}: no weights loaded for {', '.join(still_meta[:4])}")
    model.build_rope(dtype, device)
    model.eval()
    return model
