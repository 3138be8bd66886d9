"""Causal varlen attention over the paged KV cache, for decodes and prefill chunks alike.

Work split: the host cuts each request's query tokens into tiles of
``block_q`` tokens (:func:`plan_tiles`, once per step, shared by all layers);
one program handles one tile for one KV head. Its ``block_m`` rows are the
tile's tokens times the ``group`` query heads that share that KV head (GQA), so
every key/value tile loaded from the cache serves the whole group. Row ``r`` is
token ``r // group_pad`` of the tile and head ``r % group_pad`` of the group
(the group padded to a power of two; padding rows are masked).

Keys are visited in tiles of ``tile_n`` positions independent of the cache's
block size: each position looks up its physical block in the request's block
table, so one kernel serves any block size and block tables in any order. A
query at position ``p`` (``p = seq_len - q_len + i``) sees keys ``0..p``, which
covers prefill chunks whose earlier tokens are already cached. Softmax is the
online (flash) form in fp32, in base 2 so the exponent is a native ``exp2``.

A tile never reads keys past its own last token, so decode tiles and early
prefill tiles stop early. Padding rows (tokens past the request, heads past the
group) run on zero queries and are never stored.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

# Row and key tile shapes. Decode tiles hold one token, so only the GQA group
# fills their rows: 16 rows is the least tl.dot accepts. Prefill tiles are the
# usual flash-attention 64x64. Untuned (no GPU to measure on); they only need
# to be powers of two and at least 16.
DECODE_BLOCK_M, DECODE_TILE_N = 16, 64
PREFILL_BLOCK_M, PREFILL_TILE_N = 64, 64


@dataclass(frozen=True)
class TilePlan:
    """The query tiles of one launch: tile ``i`` covers request ``tile_req[i]`` from token ``tile_q0[i]``."""

    tile_req: torch.Tensor  # [num_tiles] int32
    tile_q0: torch.Tensor  # [num_tiles] int32: first query token of the tile, within its request
    group: int  # query heads per KV head
    block_m: int  # rows per program: block_q tokens x group_pad heads
    tile_n: int  # key positions per inner-loop step

    @property
    def group_pad(self) -> int:
        return triton.next_power_of_2(self.group)

    @property
    def block_q(self) -> int:
        return self.block_m // self.group_pad

    @property
    def num_tiles(self) -> int:
        return self.tile_req.numel()


def plan_tiles(
    query_lens: Sequence[int], requests: range, group: int, device: torch.device | str, *, block_m: int, tile_n: int
) -> TilePlan | None:
    """Cut the queries of ``requests`` into tiles; None if there are no query tokens.

    ``block_m`` is raised to the padded group size when the group alone is
    larger, so every tile holds at least one whole token.
    """
    for name, value in (("block_m", block_m), ("tile_n", tile_n)):
        if value < 16 or value & (value - 1):
            raise ValueError(f"{name} must be a power of two >= 16, got {value}")
    block_m = max(block_m, triton.next_power_of_2(group))
    block_q = block_m // triton.next_power_of_2(group)
    tile_req: list[int] = []
    tile_q0: list[int] = []
    for req in requests:
        for q0 in range(0, query_lens[req], block_q):
            tile_req.append(req)
            tile_q0.append(q0)
    if not tile_req:
        return None
    as_tensor = lambda xs: torch.tensor(xs, dtype=torch.int32).to(device, non_blocking=True)  # noqa: E731
    return TilePlan(as_tensor(tile_req), as_tensor(tile_q0), group, block_m, tile_n)


def decode_plan(tile_req: torch.Tensor, tile_q0: torch.Tensor, group: int) -> TilePlan:
    """The plan of a decode-only batch from tensors the caller keeps: one tile per request.

    A decode has one query token, so request ``i`` is tile ``i`` from token 0 whatever the tile
    shape: ``tile_req`` is ``0..B-1`` and ``tile_q0`` zeros. The CUDA-graph runner passes slices of
    fixed tensors here, so a replayed graph reads a plan no step has to rebuild.
    """
    block_m = max(DECODE_BLOCK_M, triton.next_power_of_2(group))
    return TilePlan(tile_req, tile_q0, group, block_m, DECODE_TILE_N)


@triton.jit
def _paged_attention_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    block_tables_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    tile_req_ptr,
    tile_q0_ptr,
    qk_scale,  # softmax scale * log2(e)
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_bt,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    TILE_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    WIDEN_DOT: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    req = tl.load(tile_req_ptr + tile)
    q0 = tl.load(tile_q0_ptr + tile)
    q_start = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + req)
    num_cached = seq_len - q_len

    rows = tl.arange(0, BLOCK_M)
    q_idx = q0 + rows // GROUP_PAD  # token index within the request
    head = kv_head * GROUP + rows % GROUP_PAD
    row_ok = (q_idx < q_len) & (rows % GROUP_PAD < GROUP)
    q_pos = num_cached + q_idx  # the token's position: it sees keys 0..q_pos
    dims = tl.arange(0, DIM_PAD)
    dim_ok = dims < HEAD_DIM

    token = (q_start + q_idx).to(tl.int64)
    q = tl.load(
        q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
        mask=row_ok[:, None] & dim_ok[None, :],
        other=0.0,
    )
    if WIDEN_DOT:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, DIM_PAD], tl.float32)
    # Keys past the tile's last token are masked for every row: don't load them.
    kv_end = tl.minimum(num_cached + q0 + BLOCK_Q, seq_len)
    table = block_tables_ptr + req.to(tl.int64) * stride_bt
    offs_n = tl.arange(0, TILE_N)
    for start in range(0, kv_end, TILE_N):
        pos = start + offs_n
        pos_ok = pos < kv_end
        block = tl.load(table + pos // BLOCK_SIZE, mask=pos_ok, other=0).to(tl.int64)
        kv_off = block * stride_cb + (pos % BLOCK_SIZE) * stride_cs + kv_head * stride_ch
        k = tl.load(
            k_cache_ptr + kv_off[None, :] + dims[:, None], mask=pos_ok[None, :] & dim_ok[:, None], other=0.0
        )  # [DIM_PAD, TILE_N]
        if WIDEN_DOT:
            k = k.to(tl.float32)
        s = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale
        # Position 0 is in the first key tile and visible to every row, so m_i is finite from then on.
        s = tl.where((pos[None, :] <= q_pos[:, None]) & pos_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            v_cache_ptr + kv_off[:, None] + dims[None, :], mask=pos_ok[:, None] & dim_ok[None, :], other=0.0
        )  # [TILE_N, DIM_PAD]
        p = p.to(v.dtype)  # the tensor cores' input type; rounding p here is what the GPU does
        if WIDEN_DOT:
            p, v = p.to(tl.float32), v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=DOT_PRECISION)
        m_i = m_new

    out = acc / l_i[:, None]
    tl.store(
        out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & dim_ok[None, :],
    )


# Triton's interpreter keeps bfloat16 as raw uint16 bits and tl.dot multiplies
# those bits (it does not support bf16 arithmetic), so interpreted kernels
# widen bf16 dot operands to fp32 first. That is exact: a bf16 x bf16 product
# fits in fp32, which is also what the GPU's bf16 MMA accumulates in.
# Asking the kernel object reflects the decision Triton made when defining it.
_INTERPRETED = not isinstance(_paged_attention_kernel, triton.runtime.JITFunction)


def _widen_dot(q_dtype: torch.dtype, cache_dtype: torch.dtype) -> bool:
    """Whether the dot operands go to fp32 first: tl.dot takes two operands of one type, so a cache
    whose type is not the model's (kv_cache_dtype="float32" under a bf16 model, say) is met in
    fp32, which holds either type exactly; and the interpreter cannot multiply bf16 (above)."""
    return q_dtype != cache_dtype or (_INTERPRETED and torch.bfloat16 in (q_dtype, cache_dtype))


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    plan: TilePlan,
    scale: float,
) -> None:
    """Attend the query tiles of ``plan`` and write their rows of ``out`` (other rows are left alone).

    Shapes: q, out [T, H, D]; caches [num_blocks, block_size, Hkv, D];
    query_start_loc [B + 1], seq_lens [B], block_tables [B, max_blocks] (int32).
    """
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    if num_heads != num_kv_heads * plan.group:
        raise ValueError(f"{num_heads} query heads do not make groups of {plan.group} over {num_kv_heads} KV heads")
    if k_cache.stride() != v_cache.stride() or k_cache.stride(3) != 1:
        raise ValueError("k_cache and v_cache must share strides with a contiguous head_dim")
    if out.stride(-1) != 1:
        raise ValueError("out must have a contiguous last dim")
    if q.stride(-1) != 1:
        q = q.contiguous()
    _paged_attention_kernel[(plan.num_tiles, num_kv_heads)](
        q,
        k_cache,
        v_cache,
        out,
        block_tables,
        query_start_loc,
        seq_lens,
        plan.tile_req,
        plan.tile_q0,
        scale * math.log2(math.e),
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        GROUP=plan.group,
        GROUP_PAD=plan.group_pad,
        BLOCK_Q=plan.block_q,
        BLOCK_M=plan.block_m,
        TILE_N=plan.tile_n,
        BLOCK_SIZE=k_cache.shape[1],
        HEAD_DIM=head_dim,
        DIM_PAD=max(16, triton.next_power_of_2(head_dim)),
        # An fp32 model or cache means the user asked for fp32: don't let tl.dot round operands to TF32.
        DOT_PRECISION="ieee" if torch.float32 in (q.dtype, k_cache.dtype) else "tf32",
        WIDEN_DOT=_widen_dot(q.dtype, k_cache.dtype),
    )
