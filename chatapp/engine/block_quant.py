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
llama.cpp does. ``quantization="auto"`` takes that path; elsewhere it keeps
the calibrated int8 path, and ``quantization="int4"`` rounds any model to 4 bits.
"""

from __future__ import annotations

import logging
from types import ModuleType

import torch
from torch import nn

from chatapp.engine.models.llama import LlamaForCausalLM

log = logging.getLogger(__name__)

BLOCK = 32  # input channels per scale
TILE = 16  # output channels per packed tile


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


def pack_q4(weight: torch.Tensor) -> tuple[torch.Tensor, float]:
    """Q4_1 blocks (w = d * q + m, q in 0..15) in the kernel's layout, and the largest |error|.

    The error is 0 when the weights already were Q4_1 blocks (dequantized from a GGUF file).
    """
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


def pack_q8(weight: torch.Tensor) -> tuple[torch.Tensor, float]:
    """Q8_0 blocks (w = d * q, q in -128..127) in the kernel's layout, and the largest |error|."""
    w = _blocks(weight)
    tiles = w.shape[0] // TILE
    d = (w.abs().amax(dim=-1) / 127).half().float()
    q = torch.where(d[..., None] > 0, w / d[..., None], 0.0).round_().clamp_(-128, 127)
    error = float((q * d[..., None] - w).abs().max()) if w.numel() else 0.0
    u = (q + 128).to(torch.uint8).view(tiles, TILE, -1, BLOCK).permute(0, 2, 1, 3)
    codes = u.reshape(*u.shape[:3], 8, 4).permute(0, 1, 3, 2, 4).reshape(tiles, u.shape[1], 512)
    packed = torch.cat([codes, _fp16_bytes(d, tiles)], dim=-1).contiguous()
    return packed, error


def dequantize(packed: torch.Tensor, bits: int, out_features: int) -> torch.Tensor:
    """The float32 [N, K] weights a packing holds (the torch fallback and tests use it)."""
    tiles, blocks = packed.shape[:2]

    def fp16(offset: int) -> torch.Tensor:  # [tiles, B, 16] -> [tiles * 16, B, 1]
        v = packed[..., offset : offset + 32].contiguous().view(torch.float16).float()
        return v.permute(0, 2, 1).reshape(tiles * TILE, blocks, 1)

    if bits == 4:
        codes = packed[..., :256].reshape(tiles, blocks, 4, TILE, 4)  # [t, b, chunk, channel, byte]
        low, high = codes & 0x0F, codes >> 4
        q = torch.cat([low, high], dim=2).permute(0, 3, 1, 2, 4).reshape(tiles * TILE, blocks, BLOCK)
        w = q.float() * fp16(256) + fp16(288)
    else:
        codes = packed[..., :512].reshape(tiles, blocks, 8, TILE, 4)
        q = codes.permute(0, 3, 1, 2, 4).reshape(tiles * TILE, blocks, BLOCK).float() - 128
        w = q * fp16(512)
    return w.reshape(tiles * TILE, blocks * BLOCK)[:out_features]


class BlockQuantLinear(nn.Module):
    """y = x @ W^T (+ b) with W in 4- or 8-bit blocks of 32; the C++ kernel where it is built.

    Without it (no compiler) the weights are dequantized once and multiplied in float32:
    the same weights, activations unrounded.
    """

    def __init__(self, packed: torch.Tensor, bits: int, in_features: int, out_features: int,
                 bias: torch.Tensor | None, ext: ModuleType | None) -> None:
        super().__init__()
        self.packed, self.bits = packed, bits
        self.in_features, self.out_features = in_features, out_features
        self.bias = None if bias is None else bias.detach().float().contiguous()
        self._ext = ext
        self._dense = None if ext is not None else dequantize(packed, bits, out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._ext is None:
            if x.dtype != torch.float32:  # a bfloat16 model on the CPU
                bias = None if self.bias is None else self.bias.to(x.dtype)
                return nn.functional.linear(x, self._dense.to(x.dtype), bias)
            return nn.functional.linear(x, self._dense, self.bias)
        return self._ext.block_linear(x.contiguous(), self.packed, self.bits, self.out_features, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, q{self.bits}"


def _pack(weight: torch.Tensor, bits: int) -> tuple[torch.Tensor, float]:
    return pack_q4(weight) if bits == 4 else pack_q8(weight)


def _exact(weight: torch.Tensor, error: float) -> bool:
    """Round-trip error at float32 rounding level of the weights, i.e. the codes were recovered."""
    return error <= 1e-6 * max(1.0, float(weight.abs().max()))


def _linears(model: LlamaForCausalLM) -> dict[str, tuple[nn.Module, torch.Tensor]]:
    """Every projection to quantize, by name, with its float weight; the LM head last."""
    found: dict[str, tuple[nn.Module, torch.Tensor]] = {}
    for i, layer in enumerate(model.layers):
        for name in ("qkv_proj", "o_proj"):
            found[f"layers.{i}.self_attn.{name}"] = (layer.self_attn, getattr(layer.self_attn, name).weight.detach())
        for name in ("gate_up_proj", "down_proj"):
            found[f"layers.{i}.mlp.{name}"] = (layer.mlp, getattr(layer.mlp, name).weight.detach())
    head = model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
    found["head"] = (model, head.detach())
    return found


@torch.no_grad()
def quantize_blocks(model: LlamaForCausalLM, ext: ModuleType | None, lossless_only: bool) -> bool:
    """Swap every projection and the LM head for BlockQuantLinear; False (model untouched) if it can't.

    lossless_only: each weight must already be exactly Q4_1 (preferred) or Q8_0 blocks.
    Otherwise projections are rounded to 4 bits and the LM head to 8 (the head's error
    reaches every logit directly).
    """
    if model.config.hidden_size % BLOCK or model.config.intermediate_size % BLOCK:
        return False
    chosen: dict[str, tuple[torch.Tensor, int]] = {}
    for name, (_owner, weight) in _linears(model).items():
        if weight.shape[1] % BLOCK:
            return False
        if lossless_only:
            for bits in (4, 8):
                packed, error = _pack(weight, bits)
                if _exact(weight, error):
                    break
            else:
                log.info("%s is not exactly 4- or 8-bit blocks: keeping int8", name)
                return False
        else:
            bits = 8 if name == "head" else 4
            packed, _error = _pack(weight, bits)
        chosen[name] = (packed, bits)
    for name, (owner, weight) in _linears(model).items():
        packed, bits = chosen[name]
        attr = name.rsplit(".", 1)[-1]
        old = getattr(owner, attr) if attr != "head" else None
        bias = None if old is None else old.bias
        linear = BlockQuantLinear(packed, bits, weight.shape[1], weight.shape[0], bias, ext)
        if attr == "head":
            model.quantized_lm_head = linear
        else:
            setattr(owner, attr, linear)
    return True
