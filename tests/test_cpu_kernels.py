"""Our C++ paged-attention kernel against the pure-torch (SDPA) path of the same backend."""

from __future__ import annotations

import pytest
import torch

from chatapp.engine import cpu_kernels
from chatapp.engine.attention import AttentionMetadata, TorchAttentionBackend


def test_the_kernels_build_on_this_machine() -> None:
    assert cpu_kernels.load() is not None  # CI has a compiler: a failed build must not go unnoticed


def make_step(block_size: int, seq_lens: list[int], q_lens: list[int], num_blocks: int = 64,
              seed: int = 0) -> AttentionMetadata:
    """A batch with decodes first, then prefill chunks, on scattered block tables."""
    gen = torch.Generator().manual_seed(seed)
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables, used = [], 0
    for n in seq_lens:
        need = -(-n // block_size)
        tables.append(perm[used : used + need])
        used += need
    table = torch.zeros(len(seq_lens), max(map(len, tables)), dtype=torch.int32)
    for i, t in enumerate(tables):
        table[i, : len(t)] = torch.tensor(t)
    slots = [t[p // block_size] * block_size + p % block_size
             for t, n, q in zip(tables, seq_lens, q_lens) for p in range(n - q, n)]
    starts = [0]
    for q in q_lens:
        starts.append(starts[-1] + q)
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots), query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_tables=table, query_lens_cpu=q_lens,
        seq_lens_cpu=seq_lens, num_decodes=sum(1 for q in q_lens if q == 1), max_query_len=max(q_lens),
        max_seq_len=max(seq_lens))


def run(meta: AttentionMetadata, heads: tuple[int, int, int], block_size: int, use_kernels: bool,
        num_blocks: int = 64) -> list[torch.Tensor]:
    num_heads, num_kv_heads, head_dim = heads
    torch.manual_seed(1)
    caches = [(torch.randn(num_blocks, block_size, num_kv_heads, head_dim),
               torch.randn(num_blocks, block_size, num_kv_heads, head_dim)) for _ in range(2)]
    backend = TorchAttentionBackend(caches, num_heads, head_dim, use_cpu_kernels=use_kernels)
    assert (backend._kernels is not None) == use_kernels
    backend.begin_step(meta)
    tokens = sum(meta.query_lens_cpu)
    outs = []
    for layer in range(2):
        q = torch.randn(tokens, num_heads, head_dim)
        k, v = torch.randn(tokens, num_kv_heads, head_dim), torch.randn(tokens, num_kv_heads, head_dim)
        outs.append(backend.forward(layer, q, k, v))
    return outs


@pytest.mark.parametrize("heads, block_size", [((9, 3, 64), 16), ((4, 4, 32), 8), ((8, 2, 128), 32)])
def test_kernel_matches_sdpa_for_decodes_and_prefill_chunks(heads: tuple[int, int, int], block_size: int) -> None:
    # Decodes (one partial block, one exact multiple), a fresh prompt, and chunks with cached context.
    seq_lens = [1, 17, block_size * 3, 23, 70, 2 * block_size + 5]
    q_lens = [1, 1, 1, 23, 9, block_size]
    meta = make_step(block_size, seq_lens, q_lens)
    for fast, reference in zip(run(meta, heads, block_size, True), run(meta, heads, block_size, False)):
        assert reference.abs().mean() > 0.05
        torch.testing.assert_close(fast, reference, atol=3e-5, rtol=1e-4)


def test_a_rows_result_does_not_depend_on_its_chunk_or_batch() -> None:
    """Bitwise: the same query over the same keys gives the same bits however it is batched."""
    heads, bs = (9, 3, 64), 16
    whole = make_step(bs, [40], [40])  # one 40-token prompt in one chunk
    out_whole = run(whole, heads, bs, True)[0]
    last_alone = make_step(bs, [40], [1])  # its last token as a one-token chunk
    torch.manual_seed(1)
    # Same caches and the same query row as the whole-prompt run's last token:
    caches = [(torch.randn(64, bs, 3, 64), torch.randn(64, bs, 3, 64)) for _ in range(2)]
    q = torch.randn(40, 9, 64)
    k, v = torch.randn(40, 3, 64), torch.randn(40, 3, 64)
    backend = TorchAttentionBackend(caches, 9, 64)
    backend.begin_step(whole)
    first = backend.forward(0, q, k, v)
    assert torch.equal(first, out_whole)
    backend.begin_step(last_alone)
    again = backend.forward(0, q[-1:], k[-1:], v[-1:])  # the cache already holds the 39 earlier keys
    assert torch.equal(again[0], first[-1])
    batch = make_step(bs, [40, 12], [1, 12])  # now beside another request's prefill
    batch.block_tables[0] = last_alone.block_tables[0]
    batch.slot_mapping[0] = last_alone.slot_mapping[0]
    backend.begin_step(batch)
    mixed = backend.forward(0, torch.cat([q[-1:], torch.randn(12, 9, 64)]),
                            torch.cat([k[-1:], torch.randn(12, 3, 64)]), torch.cat([v[-1:], torch.randn(12, 3, 64)]))
    assert torch.equal(mixed[0], first[-1])
