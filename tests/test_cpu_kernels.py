"""Our C++ decode-attention kernel against the pure-torch path of the same backend."""

from __future__ import annotations

import pytest
import torch

from chatapp.engine import cpu_kernels
from chatapp.engine.attention import AttentionMetadata, TorchAttentionBackend


def test_the_kernels_build_on_this_machine() -> None:
    assert cpu_kernels.load() is not None  # CI has a compiler: a failed build must not go unnoticed


@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim, block_size", [(9, 3, 64, 16), (4, 4, 32, 8), (8, 2, 128, 32)])
def test_decode_kernel_matches_torch_path(num_heads: int, num_kv_heads: int, head_dim: int, block_size: int) -> None:
    torch.manual_seed(0)
    num_blocks, layers = 40, 2
    seq_lens = [1, 17, 70, block_size * 3]  # one token, partial blocks, an exact multiple
    perm = torch.randperm(num_blocks).tolist()  # scattered, non-contiguous block tables
    tables, start = [], 0
    for n in seq_lens:
        need = -(-n // block_size)
        tables.append(perm[start : start + need])
        start += need
    table = torch.zeros(len(seq_lens), max(map(len, tables)), dtype=torch.int32)
    for i, t in enumerate(tables):
        table[i, : len(t)] = torch.tensor(t)
    slots = torch.tensor([t[(n - 1) // block_size] * block_size + (n - 1) % block_size
                          for t, n in zip(tables, seq_lens)])
    meta = AttentionMetadata(slot_mapping=slots, query_start_loc=torch.arange(len(seq_lens) + 1, dtype=torch.int32),
                             seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_tables=table,
                             query_lens_cpu=[1] * len(seq_lens), seq_lens_cpu=seq_lens, num_decodes=len(seq_lens),
                             max_query_len=1, max_seq_len=max(seq_lens))

    def run(use_kernels: bool) -> list[torch.Tensor]:
        torch.manual_seed(1)
        caches = [(torch.randn(num_blocks, block_size, num_kv_heads, head_dim),
                   torch.randn(num_blocks, block_size, num_kv_heads, head_dim)) for _ in range(layers)]
        backend = TorchAttentionBackend(caches, num_heads, head_dim, use_cpu_kernels=use_kernels)
        assert (backend._kernels is not None) == use_kernels
        backend.begin_step(meta)
        outs = []
        for layer in range(layers):
            q = torch.randn(len(seq_lens), num_heads, head_dim)
            k, v = torch.randn(len(seq_lens), num_kv_heads, head_dim), torch.randn(len(seq_lens), num_kv_heads, head_dim)
            outs.append(backend.forward(layer, q, k, v))
        return outs

    for fast, reference in zip(run(True), run(False)):
        assert reference.abs().mean() > 0.05
        torch.testing.assert_close(fast, reference, atol=2e-5, rtol=1e-4)
