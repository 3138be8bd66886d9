#pragma once
#include <torch/extension.h>

// Causal attention over a paged KV cache (CPU, float32); see paged_attention_cpu.cpp.
// q [T, H, D] (flattened batch); k_cache_t [num_blocks, Hkv, D, block_size] (keys transposed within a
// block); v_cache [num_blocks, block_size, Hkv, D]; query_start_loc [B + 1], seq_lens [B] (context
// after this step), block_tables [B, max_blocks]: int32. Query i of request b sits at position
// seq_lens[b] - q_len[b] + i. window > 0: a query sees its own key and the window - 1 before it (Gemma's
// local layers); softcap > 0: scores become softcap * tanh(score / softcap) (Gemma 2). Returns [T, H, D].
torch::Tensor paged_attention(torch::Tensor q, torch::Tensor k_cache_t, torch::Tensor v_cache,
                              torch::Tensor query_start_loc, torch::Tensor seq_lens, torch::Tensor block_tables,
                              double scale, int64_t window = 0, double softcap = 0.0);
