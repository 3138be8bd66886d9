"""Fused element-wise kernels of the decoder layer: RMSNorm, SwiGLU's gate, rotary embedding.

Why: a decode step of a 1-8B model on a GPU reads every weight once, and the matmuls that do that
run close to memory bandwidth; what else a layer does is a string of tiny element-wise ops on a
few rows. Written in torch each is its own kernel (a bfloat16 RMSNorm is four: widen, normalise,
narrow, scale), and a kernel, even replayed from a CUDA graph, costs a few microseconds however
little it does. One kernel each for these three halves the layer's launches.

Each computes in float32 and rounds once, as the torch formulas they replace do up to the
intermediate roundings those take in half precision (tests/test_kernels.py holds them to it).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, stride_x, stride_out, n, eps, BLOCK: tl.constexpr, WIDE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    y = x * (1.0 / tl.sqrt(tl.sum(x * x, 0) / n + eps))
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    if WIDE:  # float32: x * rsqrt(mean(x^2) + eps) * w in one precision
        out = y * w
    else:  # half types: the normalised row is rounded first, then scaled (Hugging Face's order)
        out = y.to(w.dtype).to(tl.float32) * w.to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim of ``x`` [rows, n] (rows may be strided; the last dim is contiguous)."""
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"rms_norm takes [rows, n] with a contiguous last dim, got {tuple(x.shape)}")
    rows, n = x.shape
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    if rows:
        _rms_norm_kernel[(rows,)](
            x,
            weight,
            out,
            x.stride(0),
            out.stride(0),
            n,
            eps,
            BLOCK=triton.next_power_of_2(n),
            WIDE=x.dtype == torch.float32,
        )
    return out


@triton.jit
def _add_rms_norm_kernel(x_ptr, a_ptr, w_ptr, sum_ptr, out_ptr, n, eps, BLOCK: tl.constexpr, WIDE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    x = tl.load(x_ptr + row * n + cols, mask=mask, other=0.0).to(tl.float32)
    a = tl.load(a_ptr + row * n + cols, mask=mask, other=0.0).to(tl.float32)
    total = (x + a).to(sum_ptr.dtype.element_ty)  # the residual stream, rounded as torch's add rounds it
    tl.store(sum_ptr + row * n + cols, total, mask=mask)
    s = total.to(tl.float32)
    y = s * (1.0 / tl.sqrt(tl.sum(s * s, 0) / n + eps))
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    if WIDE:
        out = y * w
    else:
        out = y.to(w.dtype).to(tl.float32) * w.to(tl.float32)
    tl.store(out_ptr + row * n + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def add_rms_norm(
    x: torch.Tensor, a: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + a, rms_norm(x + a)) in one pass: a layer's residual add and the norm that follows it.

    x, a: contiguous [rows, n] of one dtype.
    """
    if x.shape != a.shape or x.dim() != 2 or not (x.is_contiguous() and a.is_contiguous()):
        raise ValueError(f"add_rms_norm takes two contiguous [rows, n] tensors, got {tuple(x.shape)}, {tuple(a.shape)}")
    rows, n = x.shape
    total, out = torch.empty_like(x), torch.empty_like(x)
    if rows:
        _add_rms_norm_kernel[(rows,)](
            x, a, weight, total, out, n, eps, BLOCK=triton.next_power_of_2(n), WIDE=x.dtype == torch.float32
        )
    return total, out


@triton.jit
def _silu_mul_kernel(gate_up_ptr, out_ptr, stride_in, stride_out, n, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n
    gate = tl.load(gate_up_ptr + row * stride_in + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * stride_in + n + cols, mask=mask, other=0.0).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)  # silu, rounded as torch's
    tl.store(out_ptr + row * stride_out + cols, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for ``gate_up`` [rows, 2n] holding gate then up (SwiGLU's fused projection)."""
    rows, two_n = gate_up.shape
    n = two_n // 2
    out = torch.empty(rows, n, dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    if rows:
        _silu_mul_kernel[(rows, triton.cdiv(n, block))](gate_up, out, gate_up.stride(0), out.stride(0), n, BLOCK=block)
    return out


@triton.jit
def _rope_kernel(
    x_ptr, cos_ptr, sin_ptr, stride_xt, stride_xh, stride_ct, num_heads, HALF: tl.constexpr, HEADS: tl.constexpr
):
    token = tl.program_id(0).to(tl.int64)
    heads = tl.arange(0, HEADS)
    dims = tl.arange(0, HALF)
    mask = heads[:, None] < num_heads
    first = x_ptr + token * stride_xt + heads[:, None] * stride_xh + dims[None, :]
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + HALF, mask=mask, other=0.0).to(tl.float32)
    # The tables hold cos twice and sin as (-sin, sin): halves' rows are equal up to that sign.
    cos = tl.load(cos_ptr + token * stride_ct + dims).to(tl.float32)[None, :]
    sin = tl.load(sin_ptr + token * stride_ct + HALF + dims).to(tl.float32)[None, :]
    tl.store(first, (x1 * cos - x2 * sin).to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(first + HALF, (x2 * cos + x1 * sin).to(x_ptr.dtype.element_ty), mask=mask)


def rope_(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> None:
    """Rotate ``x`` [tokens, heads, head_dim] in place by a step's tables [tokens, head_dim] (the
    rotate-half layout: cos repeated, sin as (-sin, sin)); heads may be strided, head_dim is not."""
    tokens, num_heads, head_dim = x.shape
    if x.stride(-1) != 1 or head_dim % 2 or head_dim & (head_dim - 1):
        raise ValueError(f"rope_ takes a contiguous power-of-two head_dim, got {tuple(x.shape)}")
    if tokens:
        _rope_kernel[(tokens,)](
            x,
            cos,
            signed_sin,
            x.stride(0),
            x.stride(1),
            cos.stride(0),
            num_heads,
            HALF=head_dim // 2,
            HEADS=triton.next_power_of_2(num_heads),
        )
