"""Attention backend built on the Triton kernels in :mod:`chatapp.kernels`.

Same interface as :class:`chatapp.engine.attention.TorchAttentionBackend`.
Per step, :meth:`TritonAttentionBackend.begin_step` plans the query tiles on
the host once; each layer's :meth:`~TritonAttentionBackend.forward` is then
one store launch plus one attention launch for the decodes and one for the
prefill chunks, which get different tile shapes (a decode has one token, so
a big row tile would be mostly padding).

Without a GPU the kernels run in Triton's interpreter (see
:mod:`chatapp.kernels`): correct but far too slow to serve, so the CPU
default stays the torch backend.
"""

from __future__ import annotations

import torch

from chatapp.engine.attention import AttentionMetadata
from chatapp.kernels import TilePlan, decode_plan, paged_attention, plan_tiles, store_kv
from chatapp.kernels.attention import DECODE_BLOCK_M, DECODE_TILE_N, PREFILL_BLOCK_M, PREFILL_TILE_N


class TritonAttentionBackend:
    """Paged attention with Triton kernels: store the step's KV, then attend decodes and prefill chunks."""

    def __init__(
        self,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        num_heads: int,
        head_dim: int,
        scale: float | None = None,
    ) -> None:
        self.kv_caches = kv_caches
        self.num_heads = num_heads
        self.num_kv_heads = kv_caches[0][0].shape[2]
        if num_heads % self.num_kv_heads:
            raise ValueError(f"{num_heads} query heads cannot share {self.num_kv_heads} KV heads evenly")
        self.group = num_heads // self.num_kv_heads
        self.scale = head_dim**-0.5 if scale is None else scale
        self._meta: AttentionMetadata | None = None
        self._plans: list[TilePlan] = []

    def begin_step(self, meta: AttentionMetadata) -> None:
        self._meta = meta
        device = meta.block_tables.device
        nd, nr = meta.num_decodes, meta.num_requests
        decode = plan_tiles(
            meta.query_lens_cpu, range(0, nd), self.group, device, block_m=DECODE_BLOCK_M, tile_n=DECODE_TILE_N
        )
        prefill = plan_tiles(
            meta.query_lens_cpu, range(nd, nr), self.group, device, block_m=PREFILL_BLOCK_M, tile_n=PREFILL_TILE_N
        )
        self._plans = [plan for plan in (decode, prefill) if plan is not None]
        self._num_tokens = sum(meta.query_lens_cpu)

    def begin_decode_step(self, meta: AttentionMetadata, tile_req: torch.Tensor, tile_q0: torch.Tensor) -> None:
        """A decode-only step whose one-tile-per-request plan lives in the caller's tensors.

        For CUDA graphs: nothing here allocates or copies, so a captured forward keeps reading
        the same plan, metadata and caches on every replay; every row is a request's token.
        """
        self._meta = meta
        self._plans = [decode_plan(tile_req, tile_q0, self.group)]
        self._num_tokens = meta.num_requests

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        meta = self._meta
        if meta is None:
            raise RuntimeError("begin_step() must be called before forward()")
        k_cache, v_cache = self.kv_caches[layer]
        store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out = torch.empty_like(q)
        for plan in self._plans:
            paged_attention(
                q, k_cache, v_cache, out, meta.query_start_loc, meta.seq_lens, meta.block_tables, plan, self.scale
            )
        if out.shape[0] > self._num_tokens:
            out[self._num_tokens :].zero_()  # padded tokens belong to no request; keep them finite
        return out
