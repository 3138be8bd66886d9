#pragma once
#include <torch/extension.h>

#include <optional>

// Block-quantized linear layers (see block_quant.cpp): weights in blocks of 32 input channels with
// their own scale, as llama.cpp's Q4_1 and Q8_0, packed in tiles of 16 output channels.
constexpr int64_t kQuantBlock = 32;  // input channels sharing one weight scale
constexpr int64_t kQuantTile = 16;   // output channels per tile: one 512-bit register of int32 sums

// Bytes of one (tile, block): 4-bit codes + fp16 scales + fp16 minimums, or 8-bit codes + fp16 scales.
constexpr int64_t kQ4TileBytes = kQuantTile * kQuantBlock / 2 + 2 * kQuantTile * 2;  // 320
constexpr int64_t kQ8TileBytes = kQuantTile * kQuantBlock + kQuantTile * 2;          // 544

// y [M, out_features] = x [M, K] @ W^T (+ bias); packed: uint8 [tiles, K / 32, tile bytes];
// bits: 4 or 8. Every row is computed alike whatever else is in x (batch-invariant). portable: run the
// plain loop even where the VNNI kernel exists (tests hold the two to the same bits).
at::Tensor block_linear(const at::Tensor& x, const at::Tensor& packed, int64_t bits, int64_t out_features,
                        const std::optional<at::Tensor>& bias, bool portable = false);

// True where the AVX-512 VNNI kernel was compiled in; elsewhere a portable (slow) loop runs.
bool block_quant_fast();
