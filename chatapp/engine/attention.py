"""Attention over the paged KV cache: per-step metadata and the torch backend.

The KV cache of each layer is a pair of tensors shaped
``[num_blocks, block_size, num_kv_heads, head_dim]``; token slot ``s`` lives in
block ``s // block_size`` at offset ``s % block_size``. The model runner orders
each step's flattened batch with single-token queries (decodes) first, then
multi-token queries (prefill chunks), and describes it in
:class:`AttentionMetadata`; a backend stores the step's new keys and values and
attends over each request's blocks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from chatapp.engine.models.config import ModelConfig


@dataclass
class AttentionMetadata:
    """One step's batch layout, shared by every layer."""

    slot_mapping: torch.Tensor  # [T] int64: cache slot of each new token (-1: skip)
    query_start_loc: torch.Tensor  # [B + 1] int32: where each request's queries start in the flat batch
    seq_lens: torch.Tensor  # [B] int32: context length after this step (cached + new)
    block_tables: torch.Tensor  # [B, max_blocks] int32: physical block ids, padded with 0
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]
    num_decodes: int  # the first num_decodes requests have exactly one query token
    max_query_len: int
    max_seq_len: int

    @property
    def num_requests(self) -> int:
        return len(self.query_lens_cpu)


@dataclass(frozen=True)
class LayerAttention:
    """How one layer attends: its scale, its window (None: every earlier key; else a query sees its
    own key and the window - 1 before it) and soft-cap of the scores (cap * tanh(s / cap))."""

    scale: float
    window: int | None = None
    softcap: float | None = None


def layer_attention(mc: ModelConfig) -> list[LayerAttention]:
    """Each layer's attention, from a ModelConfig (Gemma's local layers have a window)."""
    return [
        LayerAttention(
            mc.attention_scale,
            mc.sliding_window if mc.layer_is_local(i) else None,
            mc.attn_logit_softcapping,
        )
        for i in range(mc.num_layers)
    ]


class AttentionBackend(Protocol):
    def begin_step(self, meta: AttentionMetadata) -> None:
        """Precompute whatever this backend needs for the step (called once, before the forward)."""

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Store k, v [T, Hkv, D] in the cache and return attention of q [T, H, D]."""


class TorchAttentionBackend:
    """Attention with torch ops: one SDPA call for all decodes, one for all prefill chunks.

    The requests' blocks are gathered and queries grouped per KV head (GQA) so
    keys and values are never repeated. On the CPU in float32 the engine
    normally runs our C++ layer loop with its own paged-attention kernel
    instead (chatapp/engine/csrc); this backend is the reference and fallback.
    """

    def __init__(
        self,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        num_heads: int,
        head_dim: int,
        layers: list[LayerAttention] | None = None,
    ) -> None:
        self.kv_caches = kv_caches
        self.block_size = kv_caches[0][0].shape[1]
        self.num_kv_heads = kv_caches[0][0].shape[2]
        self.num_heads = num_heads
        self.group = num_heads // self.num_kv_heads
        self.layers = layers or [LayerAttention(head_dim**-0.5)] * len(kv_caches)
        self._meta: AttentionMetadata | None = None

    def begin_step(self, meta: AttentionMetadata) -> None:
        self._meta = meta
        self._prepare_sdpa(meta)

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        k_cache, v_cache = self.kv_caches[layer]
        assert self._meta is not None, "begin_step() must be called before forward()"
        _store(k_cache, v_cache, k, v, self._meta.slot_mapping)
        return self._forward_sdpa(q, k_cache, v_cache, self.layers[layer])

    def _prepare_sdpa(self, meta: AttentionMetadata) -> None:
        """The step's block tables and key positions; masks are made per window as layers ask."""
        device = meta.block_tables.device
        bs = self.block_size
        nd = meta.num_decodes
        self._num_decode_tokens = nd
        self._decode: tuple[torch.Tensor, torch.Tensor] | None = None  # (block tables, seq lens)
        # (block tables, query positions, padded rows, max query len, (gather index, valid rows) or None)
        self._prefill: (
            tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, tuple[torch.Tensor, torch.Tensor] | None] | None
        ) = None
        self._masks: dict[int | None, tuple[torch.Tensor | None, torch.Tensor | None]] = {}
        if nd:
            num_blocks = -(-max(meta.seq_lens_cpu[:nd]) // bs)
            self._decode = (meta.block_tables[:nd, :num_blocks].long(), meta.seq_lens[:nd])
        if nd < meta.num_requests:
            q_lens = meta.query_lens_cpu[nd:]
            s_lens = meta.seq_lens_cpu[nd:]
            num_blocks = -(-max(s_lens) // bs)
            max_q = max(q_lens)
            q_len_t = torch.tensor(q_lens, device=device)
            start_t = torch.tensor(s_lens, device=device) - q_len_t  # cached tokens before the chunk
            rows = torch.arange(max_q, device=device)
            pad_rows = rows[None, :] >= q_len_t[:, None]
            gather = None
            bp = len(q_lens)
            if bp > 1:
                starts = [0]
                for n in q_lens[:-1]:
                    starts.append(starts[-1] + n)
                offsets = torch.tensor(starts, device=device)
                index = (offsets[:, None] + rows[None, :]).clamp(max=sum(q_lens) - 1)  # [Bp, max_q]
                gather = (index, ~pad_rows)
            positions = start_t[:, None] + rows[None, :]  # [Bp, max_q]: each query row's position
            self._prefill = (meta.block_tables[nd:, :num_blocks].long(), positions, pad_rows, max_q, gather)

    def _mask(self, window: int | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(decode mask [Bd, 1, 1, L], prefill mask [Bp, 1, G * max_q, L]) for a window, made once a step."""
        if window in self._masks:
            return self._masks[window]
        bs, g = self.block_size, self.group
        decode = prefill = None
        if self._decode is not None:
            tables, seq_lens = self._decode
            keys = torch.arange(tables.shape[1] * bs, device=tables.device)
            visible = keys[None, :] < seq_lens[:, None]
            if window is not None:  # the query sits at seq_len - 1
                visible &= keys[None, :] > seq_lens[:, None] - 1 - window
            decode = visible[:, None, None, :]
        if self._prefill is not None:
            tables, positions, pad_rows, max_q, _ = self._prefill
            keys = torch.arange(tables.shape[1] * bs, device=tables.device)
            visible = keys[None, None, :] <= positions[:, :, None]  # causal, bottom-right
            if window is not None:
                visible &= keys[None, None, :] > positions[:, :, None] - window
            visible[:, :, 0] |= pad_rows  # a padded query row attends somewhere, so it stays finite
            bp = visible.shape[0]
            prefill = visible[:, None, None].expand(bp, 1, g, max_q, visible.shape[-1]).reshape(bp, 1, g * max_q, -1)
        self._masks[window] = (decode, prefill)
        return decode, prefill

    def _forward_sdpa(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, spec: LayerAttention
    ) -> torch.Tensor:
        nd = self._num_decode_tokens
        decode_mask, prefill_mask = self._mask(spec.window)
        if self._prefill is None:
            # A step has at least one request, and _mask makes a mask for each part that exists.
            assert self._decode is not None and decode_mask is not None
            tables, _ = self._decode
            return self._attend(q.unsqueeze(1), k_cache, v_cache, tables, decode_mask, spec).squeeze(1)
        out = torch.empty_like(q)
        if self._decode is not None:
            assert decode_mask is not None
            tables, _ = self._decode
            out[:nd] = self._attend(q[:nd].unsqueeze(1), k_cache, v_cache, tables, decode_mask, spec).squeeze(1)
        assert prefill_mask is not None
        tables, _, _, _, gather = self._prefill
        qp = q[nd:]
        if gather is None:
            out[nd:] = self._attend(qp.unsqueeze(0), k_cache, v_cache, tables, prefill_mask, spec).squeeze(0)
        else:
            index, valid = gather
            padded = self._attend(qp[index], k_cache, v_cache, tables, prefill_mask, spec)  # [Bp, max_q, H, D]
            out[nd:] = padded[valid]
        return out

    def _attend(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        tables: torch.Tensor,
        mask: torch.Tensor,
        spec: LayerAttention,
    ) -> torch.Tensor:
        """q [B, Lq, H, D] over the blocks in ``tables`` [B, nb] -> [B, Lq, H, D]."""
        b, lq, h, d = q.shape
        hkv, g = self.num_kv_heads, self.group
        # int64 index_select: advanced indexing with int32 indices takes a slow path on the CPU.
        flat_tables = tables.reshape(-1)
        # A float16 cache under a float32 model is widened here (exactly) for SDPA.
        keys = k_cache.index_select(0, flat_tables).view(b, -1, hkv, d).transpose(1, 2).to(q.dtype)  # [B, Hkv, L, D]
        values = v_cache.index_select(0, flat_tables).view(b, -1, hkv, d).transpose(1, 2).to(q.dtype)
        qg = q.view(b, lq, hkv, g, d).permute(0, 2, 3, 1, 4).reshape(b, hkv, g * lq, d)
        if spec.softcap is None:
            o = F.scaled_dot_product_attention(qg, keys, values, attn_mask=mask, scale=spec.scale)
        else:  # Gemma 2: scores soft-capped before the mask and softmax (as Hugging Face's eager path)
            scores = torch.matmul(qg, keys.transpose(-1, -2)) * spec.scale
            scores = torch.tanh(scores / spec.softcap) * spec.softcap
            scores = scores.masked_fill(~mask, float("-inf"))
            o = torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), values)
        return o.view(b, hkv, g, lq, d).permute(0, 3, 1, 2, 4).reshape(b, lq, h, d)


def _store(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    hkv, d = k_cache.shape[2], k_cache.shape[3]
    k_cache.view(-1, hkv, d).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, hkv, d).index_copy_(0, slot_mapping, v.to(v_cache.dtype))
