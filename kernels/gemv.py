"""One row times a weight matrix: the projections of a single-sequence decode step.

Why: a decode step of one chat multiplies one row by every weight matrix, so it is a pass over the
weights at memory speed or nothing. cuBLAS serves a [1, K] x [K, N] product with kernels that
leave bandwidth unused on these shapes. Here each program reads ``BLOCK_N`` whole rows of the
weight (nn.Linear's [N, K] layout: each row contiguous) in ``BLOCK_K`` slices, multiplies by the
input row and sums in float32: the weight is read once, in long contiguous runs, and nothing else
is read or written that matters.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, y_ptr, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    cols = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * K
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        if EVEN_K:
            x = tl.load(x_ptr + k + cols)
            w = tl.load(w_rows + k + cols[None, :], mask=row_ok[:, None], other=0.0, eviction_policy="evict_first")
        else:
            col_ok = k + cols < K
            x = tl.load(x_ptr + k + cols, mask=col_ok, other=0.0)
            w = tl.load(
                w_rows + k + cols[None, :],
                mask=row_ok[:, None] & col_ok[None, :],
                other=0.0,
                eviction_policy="evict_first",
            )
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    y = tl.sum(acc, axis=1)
    tl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty), mask=row_ok)


# (N, K) -> (BLOCK_N, BLOCK_K, num_warps): the fastest of 28 block shapes for each projection of a
# ~1B and an 8B Llama (qkv, o, gate_up, down, LM head), measured on an H200 by
# benchmarks/gpu_gemv.py, where each beat cuBLAS (1b: 2504 vs 2070 GB/s for qkv, 2149 vs 1385 for
# o, 3322 vs 2610 for down). Other shapes take DEFAULT, the best all-round shape there (within 10%
# of each shape's best but one).
TUNED: dict[tuple[int, int], tuple[int, int, int]] = {
    (3072, 2048): (8, 1024, 8),
    (2048, 2048): (2, 1024, 4),
    (16384, 2048): (32, 256, 4),
    (2048, 8192): (2, 1024, 4),
    (49152, 2048): (32, 256, 4),
    (6144, 4096): (8, 512, 4),
    (4096, 4096): (8, 512, 8),
    (28672, 4096): (16, 256, 4),
    (4096, 14336): (2, 1024, 8),
    (128256, 4096): (16, 256, 4),
}
DEFAULT = (2, 1024, 4)


def gemv(
    x: torch.Tensor, weight: torch.Tensor, block_n: int | None = None, block_k: int | None = None, num_warps: int = 4
) -> torch.Tensor:
    """``x @ weight.T`` for one row ``x`` [1, K] and ``weight`` [N, K] (both contiguous): [1, N].

    Block shape: the one given, else the tuned one for (N, K), else DEFAULT.
    """
    if x.dim() != 2 or x.shape[0] != 1 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(
            f"gemv takes one row: x [1, K] and weight [N, K], got {tuple(x.shape)} and {tuple(weight.shape)}"
        )
    if not (x.is_contiguous() and weight.is_contiguous()):
        raise ValueError("gemv takes contiguous x and weight")
    n, k = weight.shape
    if block_n is None:
        block_n, block_k, num_warps = TUNED.get((n, k), DEFAULT)
    block_k = min(block_k or DEFAULT[1], triton.next_power_of_2(k))
    y = torch.empty(1, n, dtype=x.dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x, weight, y, n, k, BLOCK_N=block_n, BLOCK_K=block_k, EVEN_K=k % block_k == 0, num_warps=num_warps
    )
    return y
