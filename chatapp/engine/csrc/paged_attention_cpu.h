#pragma once
#include <torch/extension.h>

// Causal attention over a paged KV cache (CPU, float32); see paged_attention_cpu.cpp.
torch::Tensor paged_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                              torch::Tensor query_start_loc, torch::Tensor seq_lens, torch::Tensor block_tables,
                              double scale);
