"""4-bit and 8-bit block-quantized linear layers for the CPU (the kernel: csrc/block_quant.cpp).

Why: a single-stream decode step reads every weight once, so its speed is the
memory bandwidth over the bytes per weight. fbgemm's int8 reads 1 byte a weight;
4-bit codes with an fp16 scale and minimum per block of 32 read 0.625 (the same
format as llama.cpp's Q4_1). Measured on this 2-core machine, the bundled
SmolLM2 decodes ~1.4x faster than with int8 (benchmarks/engine_vs_hf.py).

Why lossless first: GGUF models already come quantized in blocks of 32. When
every weight of a model is exactly a Q4_1 or Q8_0 block (the bundled SmolLM2:
Q4_1 layers, a Q8_0 embedding), these formats hold the file's weights bit for
bit, and only the activations are rounded, per row and block of 32 to int8, as
llama.cpp does (each block's scale the row's unit times a power of two:
csrc/block_quant.cpp). ``quantization="auto"`` takes that path; elsewhere it keeps
the calibrated int8 path, and ``quantization="int4"`` rounds any model to 4 bits.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import torch
from torch import nn

from chatapp.engine.block_kinds import (  # noqa: F401  (re-exported: the packed kinds' names)
    BLOCK,
    K_KINDS,
    KIND_BF16_ROWS,
    KIND_F16_ROWS,
    KIND_FOR_GGUF_TYPE,
    KIND_IQ4NL,
    KIND_IQ4X,
    KIND_Q4,
    KIND_Q4K,
    KIND_Q4S,
    KIND_Q5K,
    KIND_Q5M,
    KIND_Q5S,
    KIND_Q6K,
    KIND_Q8,
    ROW_KINDS,
    SUPER_BLOCK,
    TILE,
    TILE_BYTES,
    block_inputs,
)
from chatapp.engine.models.config import ModelConfig
from chatapp.engine.models.llama import LlamaForCausalLM, projections

log = logging.getLogger(__name__)


def _blocks(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] -> [tiles * 16, K / 32, 32] float32, zero rows padding N to whole tiles."""
    n, k = weight.shape
    w = weight.detach().float()
    pad = -n % TILE
    if pad:
        w = torch.cat([w, w.new_zeros(pad, k)])
    return w.view(n + pad, k // BLOCK, BLOCK)


def _fp16_bytes(values: torch.Tensor, tiles: int) -> torch.Tensor:
    """[tiles * 16, B] float -> [tiles, B, 32] bytes: a tile's 16 fp16 values per block."""
    half = values.half().view(tiles, TILE, -1).permute(0, 2, 1).contiguous()
    return half.view(torch.uint8)


_PACK_CHUNK = 1 << 20  # weights packed per chunk of whole tiles: ~4 MB of float32 at a time


def _by_row_chunks(
    pack_rows: Callable[[torch.Tensor], tuple[torch.Tensor, float]], weight: torch.Tensor
) -> tuple[torch.Tensor, float]:
    """Pack a weight a few tiles at a time (tiles are independent), so that packing a large LM head
    needs a few MB of float temporaries rather than several copies of the whole weight."""
    n, k = weight.shape
    step = max(TILE, _PACK_CHUNK // max(k, 1) // TILE * TILE)
    out: torch.Tensor | None = None
    error = 0.0
    for start in range(0, n, step):
        packed, chunk_error = pack_rows(weight[start : start + step])
        if out is None:
            out = torch.empty((-(-n // TILE), *packed.shape[1:]), dtype=packed.dtype)
        out[start // TILE : start // TILE + packed.shape[0]] = packed
        error = max(error, chunk_error)
    assert out is not None, "a weight without rows"  # projections and heads all have rows
    return out, error


def pack_q4(weight: torch.Tensor) -> tuple[torch.Tensor, float]:
    """Q4_1 blocks (w = d * q + m, q in 0..15) in the kernel's layout, and the largest |error|.

    The error is 0 when the weights already were Q4_1 blocks (dequantized from a GGUF file).
    """
    return _by_row_chunks(_pack_q4_rows, weight)


def pack_q8(weight: torch.Tensor) -> tuple[torch.Tensor, float]:
    """Q8_0 blocks (w = d * q, q in -128..127) in the kernel's layout, and the largest |error|."""
    return _by_row_chunks(_pack_q8_rows, weight)


def _pack_q4_rows(weight: torch.Tensor) -> tuple[torch.Tensor, float]:
    w = _blocks(weight)
    tiles = w.shape[0] // TILE
    lo, hi = w.amin(dim=-1), w.amax(dim=-1)
    d = ((hi - lo) / 15).half().float()
    m = lo.half().float()
    q = torch.where(d[..., None] > 0, (w - m[..., None]) / d[..., None], 0.0).round_().clamp_(0, 15)
    error = float((q * d[..., None] + m[..., None] - w).abs().max()) if w.numel() else 0.0
    q = q.to(torch.uint8).view(tiles, TILE, -1, BLOCK).permute(0, 2, 1, 3)  # [tiles, B, channel, input]
    # chunk j, byte 4c + i: channel c's input 4j + i (low nibble) and 16 + 4j + i (high nibble)
    low = q[..., :16].reshape(*q.shape[:3], 4, 4)
    high = q[..., 16:].reshape(*q.shape[:3], 4, 4)
    codes = (low | (high << 4)).permute(0, 1, 3, 2, 4).reshape(tiles, q.shape[1], 256)
    packed = torch.cat([codes, _fp16_bytes(d, tiles), _fp16_bytes(m, tiles)], dim=-1).contiguous()
    return packed, error


def _pack_q8_rows(weight: torch.Tensor) -> tuple[torch.Tensor, float]:
    w = _blocks(weight)
    tiles = w.shape[0] // TILE
    d = (w.abs().amax(dim=-1) / 127).half().float()
    q = torch.where(d[..., None] > 0, w / d[..., None], 0.0).round_().clamp_(-128, 127)
    error = float((q * d[..., None] - w).abs().max()) if w.numel() else 0.0
    u = (q + 128).to(torch.uint8).view(tiles, TILE, -1, BLOCK).permute(0, 2, 1, 3)
    codes = u.reshape(*u.shape[:3], 8, 4).permute(0, 1, 3, 2, 4).reshape(tiles, u.shape[1], 512)
    packed = torch.cat([codes, _fp16_bytes(d, tiles)], dim=-1).contiguous()
    return packed, error


def _tile_channels(t: torch.Tensor, tiles: int, blocks: int) -> torch.Tensor:
    """[tiles, B, 16 channels, ...] -> [tiles * 16, B, ...]."""
    return t.transpose(1, 2).reshape(tiles * TILE, blocks, *t.shape[3:])


def _nibble_codes(codes: torch.Tensor) -> torch.Tensor:
    """Q4-layout bytes [..., 4 chunks, 16 channels, 4] -> codes [..., 16 channels, 32 inputs]."""
    low, high = codes & 0x0F, codes >> 4
    q = torch.cat([low, high], dim=-3)  # [..., 8 registers, 16, 4]: register j holds inputs 4j..4j+3
    return q.transpose(-3, -2).reshape(*q.shape[:-3], TILE, BLOCK)


def _fp16_at(packed: torch.Tensor, offset: int) -> torch.Tensor:
    """[tiles, B, bytes] -> [tiles, B, 16] float32 from 16 fp16 values at offset."""
    return packed[..., offset : offset + 32].contiguous().view(torch.float16).float()


# IQ4_NL's (and IQ4_XS's) 16 values (ggml's kvalues_iq4nl).
_IQ4_VALUES = torch.tensor(
    [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=torch.float32
)


def _six_bit_values(planes: torch.Tensor) -> torch.Tensor:
    """A (tile, super-block)'s 96 bytes of 6-bit planes (csrc/six_bit_scales.h) -> [tiles, B, 8 groups, 16]."""
    tiles, blocks = planes.shape[:2]
    nibbles = planes[..., :64].reshape(tiles, blocks, 4, TILE).to(torch.int32)
    low = torch.cat([nibbles & 0x0F, nibbles >> 4], dim=2)  # groups 0-3 in the low nibbles, 4-7 in the high
    tops = planes[..., 64:].reshape(tiles, blocks, 2, 1, TILE).to(torch.int32)
    top = (tops >> (2 * torch.arange(4)).view(1, 1, 1, 4, 1)) & 3  # [.., q, i, 16]: group 4q + i
    return low | (top.reshape(tiles, blocks, 8, TILE) << 4)


def _dequantize_k(packed: torch.Tensor, kind: int) -> torch.Tensor:
    """K kinds -> [tiles * 16, super-blocks, 256] float32, as gguf's own de-quantisation computes it."""
    tiles, blocks = packed.shape[:2]
    groups = packed[..., :2048].reshape(tiles, blocks, 8, 4, TILE, 4)
    q = _nibble_codes(groups).to(torch.int32)  # [tiles, B, 8 groups, 16 ch, 32]
    if kind == KIND_Q5K:
        plane = packed[..., 2048:2560].reshape(tiles, blocks, 8, 1, TILE, 4).to(torch.int32)
        bits = (plane >> torch.arange(8).view(1, 1, 1, 8, 1, 1)) & 1  # [.., g, register, ch, 4]
        q = q | (bits.transpose(-3, -2).reshape(tiles, blocks, 8, TILE, BLOCK) << 4)
    if kind == KIND_Q6K:
        plane = packed[..., 2048:3072].reshape(tiles, blocks, 8, 2, 1, TILE, 4).to(torch.int32)
        bits = (plane >> (2 * torch.arange(4)).view(1, 1, 1, 1, 4, 1, 1)) & 3
        bits = bits.reshape(tiles, blocks, 8, 8, TILE, 4).transpose(-3, -2).reshape(tiles, blocks, 8, TILE, BLOCK)
        q = q | (bits << 4)
    q = q.permute(0, 3, 1, 2, 4).float()  # [tiles, 16, B, 8, 32]
    if kind == KIND_IQ4X:  # the indices' values, times d * (ls - 32) per group of 32
        q = _IQ4_VALUES[q.long()]
        d = _fp16_at(packed, 2048).transpose(1, 2)  # [tiles, 16, B]
        sc = packed[..., 2080:2208].reshape(tiles, blocks, 8, TILE).view(torch.int8).float().permute(0, 3, 1, 2)
        return ((d[..., None] * sc)[..., None] * q).reshape(tiles * TILE, blocks, SUPER_BLOCK)
    if kind == KIND_Q6K:
        d = _fp16_at(packed, 3072).transpose(1, 2)  # [tiles, 16, B]
        sc = packed[..., 3104:3360].reshape(tiles, blocks, 16, TILE).view(torch.int8).float().permute(0, 3, 1, 2)
        w = (d[..., None] * sc)[..., None] * (q.reshape(tiles, TILE, blocks, 16, 16) - 32)
        return w.reshape(tiles * TILE, blocks, SUPER_BLOCK)
    base = 2048 if kind == KIND_Q4K else 2560
    d, dmin = _fp16_at(packed, base).transpose(1, 2), _fp16_at(packed, base + 32).transpose(1, 2)
    sc = _six_bit_values(packed[..., base + 64 : base + 160]).float().permute(0, 3, 1, 2)
    m = _six_bit_values(packed[..., base + 160 : base + 256]).float().permute(0, 3, 1, 2)
    w = (d[..., None] * sc)[..., None] * q - (dmin[..., None] * m)[..., None]
    return w.reshape(tiles * TILE, blocks, SUPER_BLOCK)


def dequantize(packed: torch.Tensor, kind: int, out_features: int) -> torch.Tensor:
    """The float32 [N, K] weights a packing holds (the torch fallback and tests use it).

    For weights from a GGUF file, the float operations are gguf's own, so the result is
    bit for bit what ``gguf.quants.dequantize`` gives.
    """
    if kind in ROW_KINDS:  # the file's F16 / BF16 rows: uint8 [N, 2 K]
        halves = packed.view(torch.float16 if kind == KIND_F16_ROWS else torch.bfloat16)
        return halves.float()[:out_features]
    tiles, blocks = packed.shape[:2]
    if kind in K_KINDS:
        w = _dequantize_k(packed, kind)
    elif kind == KIND_Q4:
        q = _nibble_codes(packed[..., :256].reshape(tiles, blocks, 4, TILE, 4))
        w = _tile_channels(
            q.float() * _fp16_at(packed, 256)[..., None] + _fp16_at(packed, 288)[..., None], tiles, blocks
        )
    elif kind == KIND_Q4S:  # as gguf computes Q4_0: d * (q - 8)
        q = _nibble_codes(packed[..., :256].reshape(tiles, blocks, 4, TILE, 4))
        w = _tile_channels(_fp16_at(packed, 256)[..., None] * (q.float() - 8), tiles, blocks)
    elif kind == KIND_IQ4NL:  # as gguf computes IQ4_NL: d * the indexed value
        q = _nibble_codes(packed[..., :256].reshape(tiles, blocks, 4, TILE, 4))
        w = _tile_channels(_fp16_at(packed, 256)[..., None] * _IQ4_VALUES[q.long()], tiles, blocks)
    elif kind in (KIND_Q5S, KIND_Q5M):  # as gguf computes Q5_0 (d * (q - 16)) and Q5_1 (d * q + m)
        q = _nibble_codes(packed[..., :256].reshape(tiles, blocks, 4, TILE, 4)).to(torch.int32)
        plane = packed[..., 256:320].reshape(tiles, blocks, 1, TILE, 4).to(torch.int32)
        bits = (plane >> torch.arange(8).view(1, 1, 8, 1, 1)) & 1  # [tiles, B, register, channel, 4]
        q = (q | (bits.transpose(-3, -2).reshape(tiles, blocks, TILE, BLOCK) << 4)).float()
        d = _fp16_at(packed, 320)[..., None]
        w = d * (q - 16) if kind == KIND_Q5S else d * q + _fp16_at(packed, 352)[..., None]
        w = _tile_channels(w, tiles, blocks)
    else:  # KIND_Q8
        codes = packed[..., :512].reshape(tiles, blocks, 8, TILE, 4).transpose(2, 3).reshape(tiles, blocks, TILE, BLOCK)
        w = _tile_channels((codes.float() - 128) * _fp16_at(packed, 512)[..., None], tiles, blocks)
    return w.reshape(tiles * TILE, -1)[:out_features]


@dataclass(frozen=True)
class PackedPart:
    """One packed weight: its tiles, kind and real output channels (the tiles may pad them)."""

    packed: torch.Tensor
    kind: int
    out_features: int


class BlockQuantLinear(nn.Module):
    """y = x @ W^T (+ b) with W in packed blocks; the C++ kernel where it is built.

    W may be several parts side by side (a fused q/k/v whose v has another type, as in
    Q4_K_M files); each is multiplied in its own kind, the outputs side by side.
    Without the kernel (no compiler) the weights are dequantized once and multiplied in
    float32: the same weights, activations unrounded.
    """

    def __init__(
        self, parts: list[PackedPart], in_features: int, bias: torch.Tensor | None, ext: ModuleType | None
    ) -> None:
        super().__init__()
        self.parts = list(parts)
        self.in_features = in_features
        self.out_features = sum(p.out_features for p in parts)
        self.bias = None if bias is None else bias.detach().float().contiguous()
        self._ext = ext
        self._dense: torch.Tensor | None = None
        if ext is None:
            self._dense = torch.cat([dequantize(p.packed, p.kind, p.out_features) for p in self.parts])

    @classmethod
    def single(
        cls,
        packed: torch.Tensor,
        kind: int,
        in_features: int,
        out_features: int,
        bias: torch.Tensor | None,
        ext: ModuleType | None,
    ) -> BlockQuantLinear:
        return cls([PackedPart(packed, kind, out_features)], in_features, bias, ext)

    @property
    def kinds(self) -> tuple[int, ...]:
        return tuple(p.kind for p in self.parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._ext is None:
            assert self._dense is not None  # __init__ dequantized the parts for want of the kernel
            if x.dtype != torch.float32:  # a bfloat16 model on the CPU
                bias = None if self.bias is None else self.bias.to(x.dtype)
                return nn.functional.linear(x, self._dense.to(x.dtype), bias)
            return nn.functional.linear(x, self._dense, self.bias)
        x = x.contiguous()
        if len(self.parts) == 1:
            p = self.parts[0]
            out: torch.Tensor = self._ext.block_linear(x, p.packed, p.kind, p.out_features, self.bias)
            return out
        parts = self.parts
        y: torch.Tensor = self._ext.block_linear_parts(
            x, [p.packed for p in parts], [p.kind for p in parts], [p.out_features for p in parts], self.bias
        )
        return y

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, kinds={self.kinds}"


def _pack(weight: torch.Tensor, bits: int) -> tuple[torch.Tensor, float]:
    return pack_q4(weight) if bits == 4 else pack_q8(weight)


def _exact(weight: torch.Tensor, error: float) -> bool:
    """Round-trip error at float32 rounding level of the weights, i.e. the codes were recovered."""
    return error <= 1e-6 * max(1.0, float(weight.abs().max()))


def blocks_fit(mc: ModelConfig) -> bool:
    """Every projection's input width is whole blocks of 32 (hidden, attention and MLP widths)."""
    return not (mc.hidden_size % BLOCK or (mc.num_heads * mc.head_dim) % BLOCK or mc.intermediate_size % BLOCK)


def _lossless(weight: torch.Tensor) -> tuple[torch.Tensor, int] | None:
    """The weight's exact Q4_1 (preferred) or Q8_0 blocks, or None where it is not such blocks."""
    for bits in (4, 8):
        packed, error = _pack(weight, bits)
        if _exact(weight, error):
            return packed, bits
    return None


@torch.no_grad()
def pack_layer(layer: nn.Module, ext: ModuleType | None, lossless_only: bool) -> bool:
    """Swap a decoder layer's projections for BlockQuantLinear; False (layer untouched) if it can't.

    lossless_only: each weight must already be exactly Q4_1 or Q8_0 blocks; otherwise the
    projections are rounded to 4 bits.
    """
    chosen: list[tuple[torch.Tensor, int]] = []
    for owner, attr in projections(layer):
        weight = getattr(owner, attr).weight.detach()
        found = _lossless(weight) if lossless_only else (pack_q4(weight)[0], 4)
        if found is None:
            return False
        chosen.append(found)
    for (owner, attr), (packed, bits) in zip(projections(layer), chosen):
        old = getattr(owner, attr)
        k, n = old.weight.shape[1], old.weight.shape[0]
        setattr(owner, attr, BlockQuantLinear.single(packed, bits, k, n, old.bias, ext))
    return True


@torch.no_grad()
def pack_head(model: LlamaForCausalLM, ext: ModuleType | None, lossless_only: bool) -> bool:
    """The LM head as 8-bit blocks (its error reaches every logit directly), or its exact blocks.

    An untied head's float weight is dropped; tied embeddings stay for the lookup.
    """
    weight = (model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight).detach()
    found = _lossless(weight) if lossless_only else (pack_q8(weight)[0], 8)
    if found is None:
        return False
    packed, bits = found
    model.quantized_lm_head = BlockQuantLinear.single(packed, bits, weight.shape[1], weight.shape[0], None, ext)
    model.lm_head = None
    return True
