"""The block kernels' int8 activations, computed in torch: what their reference products multiply.

Blocks of 32 (block_quant.cpp): each block's scale is the row's unit, amax(row) / 127 / 2^11, times 2^shift,
the smallest such scale that still holds the block's amax in 127 steps; codes are the float32 product x * inv
rounded half to even. Super-blocks of 256 (kquant.cpp): one float scale per super-block, amax / 127.
"""

from __future__ import annotations

import torch

MAX_SHIFT = 11


def int8_activations(x: torch.Tensor, block: int) -> torch.Tensor:
    """x as the kernels quantize it, back in float64 (codes times their scales), same shape."""
    rows, k = x.shape
    xb = x.view(rows, k // block, block)
    amax = xb.abs().amax(-1, keepdim=True)
    if block != 32:
        inv = torch.where(amax > 0, torch.tensor(127.0) / amax, torch.zeros(()))
        return ((xb * inv).round().clamp(-128, 127).double() * (amax / 127).double()).reshape(rows, k)
    row_amax = amax.amax(1, keepdim=True)
    live = row_amax >= 1e-30
    e = torch.zeros_like(amax, dtype=torch.int32)
    for _ in range(MAX_SHIFT):  # the largest e <= 11 with amax * 2^e <= row_amax, one step at a time
        e = e + (torch.ldexp(amax, (e + 1).float()) <= row_amax).int()
    base = torch.where(live, torch.tensor(127.0) / row_amax, torch.zeros(()))  # float32, as the kernel
    inv = torch.ldexp(base, e.float())
    unit = torch.where(live, torch.ldexp(row_amax / 127, torch.tensor(-float(MAX_SHIFT))), torch.zeros(()))
    scale = unit.double() * torch.ldexp(torch.ones((), dtype=torch.float64), (MAX_SHIFT - e).double())
    return ((xb * inv).round().clamp(-128, 127).double() * scale).reshape(rows, k)
