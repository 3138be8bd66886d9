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

from chatapp.engine.block_quant import KIND_FOR_GGUF_TYPE, TILE, TILE_BYTES, BlockQuantLinear, PackedPart, block_inputs
from chatapp.engine.models.config import ModelConfig
from chatapp.engine.models.gemma import GemmaDecoderLayer, model_class
from chatapp.engine.models.gguf_file import GGUFError, GGUFModelFile, GGUFTensor
from chatapp.engine.models.llama import DecoderLayer, LlamaForCausalLM, RMSNorm

log = logging.getLogger(__name__)

# GGUF types our kernels run as they are (csrc/gguf_repack.cpp says into which packed kind).
NATIVE_TYPES = frozenset(KIND_FOR_GGUF_TYPE)
_CHUNK_BYTES = 16 * 2**20  # file bytes repacked per call (and held in memory at once)


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
        """A tensor, its rows put back in Hugging Face order when the converter permuted them (a copy)."""
        tensor = self.gguf.tensor(name)
        order = self.row_order(tensor, heads)
        if order is None:
            return tensor
        return GGUFTensor(
            tensor.name, tensor.type_name, tensor.type_id, tensor.shape, tensor.data[order], tensor.offset
        )

    def row_order(self, tensor: GGUFTensor, heads: int | None) -> np.ndarray | None:
        if heads is None or not self.gguf.permuted_qk:
            return None
        return _unpermute_rows(tensor.shape[0], heads)

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
        tensors = self.gguf.tensors
        if kind == "qkv":
            kv = mc.num_kv_heads * mc.head_dim
            if p + "attn_qkv.weight" in tensors:  # Phi-3: one fused tensor, q then k then v
                return [(p + "attn_qkv.weight", mc.num_heads * mc.head_dim + 2 * kv, None)]
            return [
                (p + "attn_q.weight", mc.num_heads * mc.head_dim, mc.num_heads),
                (p + "attn_k.weight", kv, mc.num_kv_heads),
                (p + "attn_v.weight", kv, None),
            ]
        if kind == "o":
            return [(p + "attn_output.weight", mc.hidden_size, None)]
        if kind == "gate_up":
            if p + "ffn_gate.weight" not in tensors and p + "ffn_up.weight" in tensors:
                return [(p + "ffn_up.weight", 2 * mc.intermediate_size, None)]  # Phi-3: gate then up, fused
            return [
                (p + "ffn_gate.weight", mc.intermediate_size, None),
                (p + "ffn_up.weight", mc.intermediate_size, None),
            ]
        return [(p + "ffn_down.weight", mc.hidden_size, None)]

    def bias(self, layer: int, kind: str) -> torch.Tensor | None:
        names = {
            "qkv": ["attn_q.bias", "attn_k.bias", "attn_v.bias"],
            "gate_up": ["ffn_gate.bias", "ffn_up.bias"],
            "down": ["ffn_down.bias"],
            "o": ["attn_output.bias"],
        }[kind]
        parts = []
        for (_weight, rows, heads), name in zip(self.projections(layer, kind), names):
            full = f"blk.{layer}.{name}"
            if full not in self.gguf.tensors:
                return None
            tensor = self.raw(full, heads) if heads else self.gguf.tensor(full)
            parts.append(_torch(dequantize_rows(tensor)).reshape(rows))
        return torch.cat(parts)


def _repack_fused(
    ext: ModuleType, loader: _Loader, parts: list[tuple[str, int, int | None]], tensors: list[GGUFTensor], k: int
) -> list[PackedPart]:
    """Repack a projection's tensors; neighbours of one kind share one packing (one kernel call).

    Each tensor is written straight into its slice of the shared packing, so loading makes no
    temporary copies (they would stay in the allocator's heap and in the peak resident set).
    """
    groups: list[list[int]] = []
    for i, t in enumerate(tensors):
        kind = KIND_FOR_GGUF_TYPE[t.type_name]
        prev = groups[-1][-1] if groups else None
        if prev is not None and KIND_FOR_GGUF_TYPE[tensors[prev].type_name] == kind and parts[prev][1] % TILE == 0:
            groups[-1].append(i)
        else:
            groups.append([i])
    packed: list[PackedPart] = []
    for group in groups:
        kind = KIND_FOR_GGUF_TYPE[tensors[group[0]].type_name]
        tiles = [-(-parts[i][1] // TILE) for i in group]
        out = torch.zeros(sum(tiles), k // block_inputs(kind), TILE_BYTES[kind], dtype=torch.uint8)
        start = 0
        for i, n_tiles in zip(group, tiles):
            tensor, order = tensors[i], loader.row_order(tensors[i], parts[i][2])
            if order is not None:  # q/k rows come from all over the tensor: repack it whole
                ext.repack_gguf(
                    _torch(tensor.data), tensor.type_id, k, torch.from_numpy(order), out[start : start + n_tiles]
                )
                loader.gguf.release(tensor)
            else:  # a few MB at a time, each chunk's file pages dropped once packed
                step = max(TILE, _CHUNK_BYTES // tensor.data.shape[1] // TILE * TILE)
                for first in range(0, tensor.shape[0], step):
                    rows = slice(first, min(first + step, tensor.shape[0]))
                    t0 = start + first // TILE
                    ext.repack_gguf(
                        _torch(tensor.data[rows]),
                        tensor.type_id,
                        k,
                        None,
                        out[t0 : t0 + -(-(rows.stop - first) // TILE)],
                    )
                    loader.gguf.release(tensor, rows)
            start += n_tiles
        packed.append(PackedPart(out, kind, sum(parts[i][1] for i in group)))
    return packed


def _unpermute_rows(rows: int, heads: int) -> np.ndarray:
    """Row order that undoes llama.cpp's q/k permutation (interleaved -> rotate-half pairs)."""
    head_dim = rows // heads
    r = np.arange(rows)
    h, within = r // head_dim, r % head_dim
    half = head_dim // 2
    return h * head_dim + 2 * (within % half) + within // half


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


def _check_layer_count(gguf: GGUFModelFile, mc: ModelConfig) -> None:
    last = f"blk.{mc.num_layers - 1}.attn_norm.weight"
    if last not in gguf.tensors:
        raise GGUFError(f"{gguf.path.name} says {mc.num_layers} layers but lacks tensor {last}")


def native_weight_bytes(gguf: GGUFModelFile, mc: ModelConfig) -> int:
    """Bytes our CPU model will hold for this file's weights (load_gguf_native's packings).

    The token embeddings stay in the file (read per token) unless they also serve as the LM head.
    """
    total = 0
    for name, t in gguf.tensors.items():
        if name == "token_embd.weight" and not mc.tie_word_embeddings:
            continue
        rows, k = (int(np.prod(t.shape[:-1])) if len(t.shape) > 1 else 1), t.shape[-1]
        kind = KIND_FOR_GGUF_TYPE.get(t.type_name)
        if kind is None or len(t.shape) == 1:
            total += rows * k * 4  # float32: norms, and tensors our kernels do not take
        else:
            total += -(-rows // TILE) * (k // block_inputs(kind)) * TILE_BYTES[kind]
    return total


def load_gguf_float(
    gguf: GGUFModelFile, mc: ModelConfig, dtype: torch.dtype, device: torch.device, max_positions: int
) -> LlamaForCausalLM:
    """Every tensor de-quantised into a float model of ``dtype`` (GPU, or the CPU without our kernels)."""
    _check_layer_count(gguf, mc)
    model = model_class(mc)(mc, max_positions, device="meta")
    model = model.to_empty(device=device).to(dtype)
    loader = _Loader(gguf, mc)

    def put(dest: torch.Tensor, name: str, heads: int | None = None) -> None:
        dest.copy_(loader.float_tensor(name, tuple(dest.shape), heads))

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
                    linear.bias.copy_(bias)
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
    _check_layer_count(gguf, mc)
    device, dtype = torch.device("cpu"), torch.float32
    model = model_class(mc)(mc, max_positions, device="meta")
    loader = _Loader(gguf, mc)
    h = mc.hidden_size

    def norm(module: nn.Module, name: str, size: int) -> None:
        module.weight = nn.Parameter(loader.float_tensor(name, (size,)).clone(), requires_grad=False)

    def linear(parts: list[tuple[str, int, int | None]], bias: torch.Tensor | None) -> nn.Module:
        tensors = [gguf.tensor(name) for name, _rows, _heads in parts]
        k = tensors[0].shape[-1]
        for (name, rows, _heads), t in zip(parts, tensors):
            if t.shape != (rows, k):
                raise GGUFError(f"tensor {name} has shape {t.shape}, expected {(rows, k)}")
        if all(t.type_name in NATIVE_TYPES for t in tensors):
            return BlockQuantLinear(_repack_fused(ext, loader, parts, tensors, k), k, bias, ext)
        log.info(
            "%s: %s is not a type our kernels run; de-quantised to float32",
            parts[0][0],
            "/".join(sorted({t.type_name for t in tensors})),
        )
        dense = nn.Linear(k, sum(rows for _n, rows, _h in parts), bias=bias is not None)
        with torch.no_grad():
            dense.weight.copy_(torch.cat([loader.float_tensor(name, (rows, k), heads) for name, rows, heads in parts]))
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
    model.embed_tokens = cast(nn.Embedding, GGUFEmbedding(gguf.tensor("token_embd.weight"), dtype, device))
    if model.embed_tokens.num_embeddings != mc.vocab_size or model.embed_tokens.embedding_dim != h:
        raise GGUFError(
            f"tensor token_embd.weight has shape {gguf.tensor('token_embd.weight').shape}, "
            f"expected {(mc.vocab_size, h)}"
        )
    still_meta = [name for name, p in model.named_parameters() if p.is_meta]
    if still_meta:
        raise GGUFError(f"{gguf.path.name}: no weights loaded for {', '.join(still_meta[:4])}")
    model.build_rope(dtype, device)
    model.eval()
    return model
