"""A GGUF file's weights as our CPU kernels take them: numpy arrays, no torch.

Both CPU loaders read through here: gguf_loader.py (the torch model) wraps these arrays as tensors
without copying, and array_runner.py (the torch-free engine) hands them to the C++ layer loop as they
are. What lives here: tensors de-quantised exactly, llama.cpp's q/k row permutation undone, fused
projections' parts found by name, and projections repacked into our kernels' tiles (F16 and BF16 rows
are not repacked: the kernel reads them in the file).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np

from chatapp.engine.block_kinds import (
    KIND_FOR_GGUF_TYPE,
    ROW_KINDS,
    TILE,
    TILE_BYTES,
    block_inputs,
    packed_bytes,
    packs,
)
from chatapp.engine.huge_pages import WeightArena, mapped_zeros
from chatapp.engine.models.config import ModelConfig
from chatapp.engine.models.gguf_file import GGUFError, GGUFModelFile, GGUFTensor
from chatapp.engine.weight_packer import PackJob

log = logging.getLogger(__name__)

# GGUF types our kernels run as they are (csrc/gguf_repack.cpp says into which packed kind).
NATIVE_TYPES = frozenset(KIND_FOR_GGUF_TYPE)
_CHUNK_BYTES = 16 * 2**20  # file bytes repacked per call (and held in memory at once)

Projection = list[tuple[str, int, int | None]]
"""A fused projection's parts: (tensor name, rows, rope heads whose rows to un-permute)."""

PackedWeight = tuple[np.ndarray, int, int]
"""One packing of a projection: (uint8 [tiles, blocks, tile bytes], kind, real output rows); for a float rows
kind, (uint8 [rows, 2 K], kind, rows): the file's own rows."""


@dataclass
class LinearWeights:
    """A projection (its fused parts side by side): packed where our kernels take every part's type,
    else de-quantised to float32 rows."""

    in_features: int
    out_features: int
    packed: list[PackedWeight] | None
    dense: np.ndarray | None  # float32 [out, in] when not packed
    bias: np.ndarray | None

    def spec(self) -> dict[str, Any]:
        """The C++ layer loop's description of it (CpuModel.add_layer / set_head)."""
        if self.packed is not None:
            return {"parts": self.packed, "bias": self.bias}
        return {"weight": self.dense, "bias": self.bias}


@dataclass
class LayerWeights:
    """One decoder layer's weights, named by role (the torch model and the C++ loop take these)."""

    input_norm: np.ndarray
    mlp_in_norm: np.ndarray  # the norm whose output the MLP reads
    q_norm: np.ndarray | None  # Qwen3 and Gemma 3
    k_norm: np.ndarray | None
    qkv: LinearWeights
    o: LinearWeights
    gate_up: LinearWeights
    down: LinearWeights
    attn_out_norm: np.ndarray | None  # Gemma: each block's output is normed before the residual
    mlp_out_norm: np.ndarray | None


def dequantize_rows(tensor: GGUFTensor, rows: np.ndarray | slice = slice(None)) -> np.ndarray:
    """float32 [rows, columns] of a tensor, exactly as the `gguf` package de-quantises them.

    Float tensors (every norm) are converted here: the `gguf` package costs ~0.1 s to import."""
    data = np.asarray(tensor.data[rows])
    if tensor.type_name == "F32":
        return data.view(np.float32).copy()
    if tensor.type_name == "F16":
        return data.view(np.float16).astype(np.float32)
    if tensor.type_name == "BF16":
        return (data.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    from gguf import GGMLQuantizationType, quants

    return np.asarray(quants.dequantize(data, GGMLQuantizationType(tensor.type_id)), dtype=np.float32)


class EmbeddingTable:
    """A GGUF token embedding's rows, de-quantised as a step asks for them, with the `gguf` package's bits.

    Why not dequantize_rows alone: `gguf`'s numpy de-quantisation runs ~20 whole-array passes whatever the row
    count, 70-180 us for a decode step's one row (0.29 ms a step inside a 1B Q4_K_M model's decode, ~1% of it).
    The extension decodes the types it packs in 4-18 us a row; any other type still goes through `gguf`."""

    def __init__(self, tensor: GGUFTensor, ext: ModuleType) -> None:
        self.tensor = tensor
        self._ext = ext if ext.dequantizes_gguf_rows(tensor.type_id) else None

    def rows(self, token_ids: np.ndarray) -> np.ndarray:
        """float32 [T, hidden], a new array: token_ids' rows, in order."""
        if self._ext is None:
            unique, inverse = np.unique(token_ids, return_inverse=True)
            return dequantize_rows(self.tensor, unique)[inverse.reshape(-1)]
        raw = np.asarray(self.tensor.data[np.asarray(token_ids).reshape(-1)])
        out = np.empty((raw.shape[0], self.tensor.shape[1]), dtype=np.float32)
        self._ext.dequantize_gguf_rows(raw, self.tensor.type_id, self.tensor.shape[1], out)
        return out


class GGUFWeights:
    """Named weights of one model file, each read when asked for and its file pages dropped after."""

    def __init__(
        self, gguf: GGUFModelFile, mc: ModelConfig, arena: WeightArena | None = None, defer_packing: bool = False
    ) -> None:
        self.gguf, self.mc = gguf, mc
        self.arena = arena  # where packings go (huge_pages.py); None: a mapping each
        # defer_packing: each projection's tiles are left unfilled and the job that fills them is kept here, for a
        # WeightPacker to run after the engine is ready (weight_packer.py says why); else they are filled at once.
        self.pack_jobs: list[PackJob] | None = [] if defer_packing else None

    def _zeros(self, shape: tuple[int, ...]) -> np.ndarray:
        return self.arena.zeros(shape) if self.arena is not None else mapped_zeros(shape)

    def raw(self, name: str, heads: int | None = None) -> GGUFTensor:
        """A tensor, its rows put back in Hugging Face order when the converter permuted them (a copy)."""
        tensor = self.gguf.tensor(name)
        order = self.row_order(tensor, heads)
        if order is None:
            return tensor
        return dataclasses.replace(tensor, data=tensor.data[order])

    def row_order(self, tensor: GGUFTensor, heads: int | None) -> np.ndarray | None:
        if heads is None or not self.gguf.permuted_qk:
            return None
        return unpermute_rows(tensor.shape[0], heads)

    def floats(self, name: str, shape: tuple[int, ...], heads: int | None = None) -> np.ndarray:
        """A tensor de-quantised to float32 in ``shape`` (a new array: the file's pages are dropped)."""
        tensor = self.raw(name, heads)
        if tensor.shape != shape:
            raise GGUFError(f"tensor {name} has shape {tensor.shape}, expected {shape}")
        values = dequantize_rows(tensor).reshape(shape)
        self.gguf.release(self.gguf.tensor(name))
        return values

    def projections(self, layer: int, kind: str) -> Projection:
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

    def bias(self, layer: int, kind: str) -> np.ndarray | None:
        """A fused projection's bias (float32), or None where the file has none."""
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
            parts.append(dequantize_rows(tensor).reshape(rows))
        return np.concatenate(parts)

    def layer(self, ext: ModuleType, i: int) -> LayerWeights:
        """Layer ``i``'s weights. llama.cpp's Gemma files store the norm weights with the 1 already
        added, which is what our norms multiply by."""
        mc, p, h = self.mc, f"blk.{i}.", self.mc.hidden_size

        def norm(name: str, size: int = h) -> np.ndarray:
            return self.floats(p + name, (size,))

        def linear(kind: str, has_bias: bool) -> LinearWeights:
            return self.linear(ext, self.projections(i, kind), self.bias(i, kind) if has_bias else None)

        return LayerWeights(
            input_norm=norm("attn_norm.weight"),
            mlp_in_norm=norm("ffn_norm.weight"),
            q_norm=norm("attn_q_norm.weight", mc.head_dim) if mc.qk_norm else None,
            k_norm=norm("attn_k_norm.weight", mc.head_dim) if mc.qk_norm else None,
            qkv=linear("qkv", mc.attention_bias),
            o=linear("o", False),
            gate_up=linear("gate_up", mc.mlp_bias),
            down=linear("down", mc.mlp_bias),
            attn_out_norm=norm("post_attention_norm.weight") if mc.is_gemma else None,
            mlp_out_norm=norm("post_ffw_norm.weight") if mc.is_gemma else None,
        )

    def lm_head(self, ext: ModuleType) -> LinearWeights:
        """The LM head: the embeddings themselves where the model ties them."""
        name = "token_embd.weight" if self.mc.tie_word_embeddings else "output.weight"
        return self.linear(ext, [(name, self.mc.vocab_size, None)], None)

    def linear(self, ext: ModuleType, parts: Projection, bias: np.ndarray | None) -> LinearWeights:
        """A projection packed in the file's own types, or de-quantised where our kernels lack one."""
        tensors = self.checked_tensors(parts)
        k, n = tensors[0].shape[-1], sum(rows for _name, rows, _heads in parts)
        if all(t.type_name in NATIVE_TYPES and packs(KIND_FOR_GGUF_TYPE[t.type_name], k) for t in tensors):
            return LinearWeights(k, n, self.repack(ext, parts, tensors), None, bias)
        log.info(
            "%s: %s is not a type our kernels run; de-quantised to float32",
            parts[0][0],
            "/".join(sorted({t.type_name for t in tensors})),
        )
        dense = np.concatenate([self.floats(name, (rows, k), heads) for name, rows, heads in parts])
        return LinearWeights(k, n, None, dense, bias)

    def checked_tensors(self, parts: Projection) -> list[GGUFTensor]:
        """The parts' tensors, each checked to be [rows, K] with one K."""
        tensors = [self.gguf.tensor(name) for name, _rows, _heads in parts]
        k = tensors[0].shape[-1]
        for (name, rows, _heads), t in zip(parts, tensors):
            if t.shape != (rows, k):
                raise GGUFError(f"tensor {name} has shape {t.shape}, expected {(rows, k)}")
        return tensors

    def repack(self, ext: ModuleType, parts: Projection, tensors: list[GGUFTensor]) -> list[PackedWeight]:
        """Repack a projection's tensors; neighbours of one kind share one packing (one kernel call).

        Each tensor is written straight into its slice of the shared packing, so loading makes no
        temporary copies (they would stay in the allocator's heap and in the peak resident set). With
        deferred packing the slices are made here and filled later, in the same order (pack_jobs).
        """
        k = tensors[0].shape[-1]
        groups: list[list[int]] = []
        for i, t in enumerate(tensors):
            kind = KIND_FOR_GGUF_TYPE[t.type_name]
            prev = groups[-1][-1] if groups else None
            if (
                prev is not None
                and KIND_FOR_GGUF_TYPE[tensors[prev].type_name] == kind
                and kind not in ROW_KINDS
                and parts[prev][1] % TILE == 0
            ):
                groups[-1].append(i)
            else:
                groups.append([i])
        packed: list[PackedWeight] = []
        for group in groups:
            kind = KIND_FOR_GGUF_TYPE[tensors[group[0]].type_name]
            if kind in ROW_KINDS:
                (i,) = group
                packed.append((self.float_rows(tensors[i], parts[i][2]), kind, parts[i][1]))
                continue
            tiles = [-(-parts[i][1] // TILE) for i in group]
            out = self._zeros((sum(tiles), k // block_inputs(kind), TILE_BYTES[kind]))
            start = 0
            for i, n_tiles in zip(group, tiles):
                order = self.row_order(tensors[i], parts[i][2])
                fill = self._fill_job(ext, tensors[i], order, out[start : start + n_tiles])
                if self.pack_jobs is None:
                    fill()
                else:
                    self.pack_jobs.append(fill)
                start += n_tiles
            packed.append((out, kind, sum(parts[i][1] for i in group)))
        return packed

    def _fill_job(self, ext: ModuleType, tensor: GGUFTensor, order: np.ndarray | None, out: np.ndarray) -> PackJob:
        """The job that packs ``tensor`` (its rows in ``order``) into ``out``, its tiles of a packing."""
        k = tensor.shape[-1]

        def fill() -> None:
            if order is not None:  # q/k rows come from all over the tensor: repack it whole
                ext.repack_gguf_array(tensor.data, tensor.type_id, k, order, out)
                self.gguf.release(tensor)
                return
            # a few MB at a time, each chunk's file pages dropped once packed
            step = max(TILE, _CHUNK_BYTES // tensor.data.shape[1] // TILE * TILE)
            for first in range(0, tensor.shape[0], step):
                rows = slice(first, min(first + step, tensor.shape[0]))
                t0 = first // TILE
                t1 = t0 + -(-(rows.stop - first) // TILE)
                ext.repack_gguf_array(tensor.data[rows], tensor.type_id, k, None, out[t0:t1])
                self.gguf.release(tensor, rows)

        return fill

    def float_rows(self, tensor: GGUFTensor, heads: int | None) -> np.ndarray:
        """An F16/BF16 tensor's rows for the float rows kernel: the file's own (mapped, nothing copied), or
        where llama.cpp permuted them, a copy in Hugging Face's order."""
        order = self.row_order(tensor, heads)
        if order is None:
            return tensor.data
        rows = self._zeros(tensor.data.shape)
        np.take(tensor.data, order, axis=0, out=rows)
        self.gguf.release(tensor)
        return rows


def unpermute_rows(rows: int, heads: int) -> np.ndarray:
    """Row order that undoes llama.cpp's q/k permutation (interleaved -> rotate-half pairs)."""
    head_dim = rows // heads
    r = np.arange(rows)
    h, within = r // head_dim, r % head_dim
    half = head_dim // 2
    return h * head_dim + 2 * (within % half) + within // half


def check_layer_count(gguf: GGUFModelFile, mc: ModelConfig) -> None:
    last = f"blk.{mc.num_layers - 1}.attn_norm.weight"
    if last not in gguf.tensors:
        raise GGUFError(f"{gguf.path.name} says {mc.num_layers} layers but lacks tensor {last}")


def check_embedding(gguf: GGUFModelFile, mc: ModelConfig) -> GGUFTensor:
    """The token embedding tensor, checked to be [vocab, hidden]."""
    tensor = gguf.tensor("token_embd.weight")
    if tuple(tensor.shape) != (mc.vocab_size, mc.hidden_size):
        raise GGUFError(
            f"tensor token_embd.weight has shape {tensor.shape}, expected {(mc.vocab_size, mc.hidden_size)}"
        )
    return tensor


def native_weight_bytes(gguf: GGUFModelFile, mc: ModelConfig) -> int:
    """Bytes our CPU model will hold for this file's weights (the native loaders' packings).

    The token embeddings stay in the file (read per token) unless they also serve as the LM head.
    """
    total = 0
    for name, t in gguf.tensors.items():
        if name == "token_embd.weight" and not mc.tie_word_embeddings:
            continue
        rows, k = (int(np.prod(t.shape[:-1])) if len(t.shape) > 1 else 1), t.shape[-1]
        kind = KIND_FOR_GGUF_TYPE.get(t.type_name)
        if kind is None or len(t.shape) == 1 or not packs(kind, k):
            total += rows * k * 4  # float32: norms, and tensors our kernels do not take
        else:
            total += packed_bytes(kind, rows, k)
    return total
