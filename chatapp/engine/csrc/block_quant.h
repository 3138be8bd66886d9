#pragma once
#include <torch/extension.h>

#include <optional>
#include <string>
#include <tuple>
#include <vector>

// Block-quantized linear layers (see block_quant.cpp and kquant.cpp): weights in blocks of input channels
// with their own scales, as llama.cpp's formats, packed in tiles of 16 output channels so one 512-bit
// register holds a tile's 16 int32 sums.
constexpr int64_t kQuantBlock = 32;   // input channels per block (the Q4_0/Q4_1/Q5_x/Q8_0 kinds)
constexpr int64_t kQuantTile = 16;    // output channels per tile
constexpr int64_t kSuperBlock = 256;  // input channels per super-block (the K kinds)

// Packed weight kinds. The numbers are part of the Python API (chatapp/engine/block_quant.py).
//   4: 4-bit codes, fp16 scale d and minimum m per 32 (w = d*q + m): Q4_1 exactly.
//   5: 4-bit codes offset by 8, fp16 scale per 32 (w = d*(q - 8)): Q4_0 exactly, in its own 18 bytes a block.
//   6: 5-bit codes offset by 16, fp16 scale per 32 (w = d*(q - 16)): Q5_0 exactly, in its 22 bytes a block.
//   7: 5-bit codes, fp16 scale and minimum per 32 (w = d*q + m): Q5_1 exactly, in its 24 bytes a block.
//   8: 8-bit codes offset by 128, fp16 scale per 32 (w = d*(u - 128)): Q8_0 exactly.
//   9: 4-bit indices into IQ4_NL's 16 values v, fp16 scale per 32 (w = d*v): IQ4_NL exactly, in its 18 bytes.
//   104 / 105 / 106: Q4_K / Q5_K / Q6_K super-blocks of 256, their integer sub-block scales kept.
//   108: IQ4X, 4-bit indices into IQ4_NL's 16 values, an fp16 d per 256 and an int8 scale per 32: IQ4_XS exactly.
//   1 / 2: F16 / BF16 rows, [N, K] as a GGUF file stores them (float_rows.cpp): no tiles, read in place.
constexpr int64_t kKindF16Rows = 1, kKindBF16Rows = 2;
constexpr int64_t kKindQ4 = 4, kKindQ4S = 5, kKindQ5S = 6, kKindQ5M = 7, kKindQ8 = 8, kKindIQ4NL = 9, kKindQ4K = 104, kKindQ5K = 105,
                  kKindQ6K = 106, kKindIQ4X = 108;

// The kinds whose prompts run one tile at a time on AMD family 25 (tile_walk.h: PromptTileLoop): the K-quants and
// Q8_0, measured faster so; the 4- and 5-bit blocks of 32 keep the pair loops (Q4_0 measured 2% slower).
constexpr bool single_tile_prompts_on_zen4(int64_t kind) { return kind >= kKindQ4K || kind == kKindQ8; }

// Bytes of one (tile, block) for the block-of-32 kinds.
constexpr int64_t kQ4TileBytes = kQuantTile * kQuantBlock / 2 + 2 * kQuantTile * 2;  // 320
constexpr int64_t kQ4STileBytes = kQuantTile * kQuantBlock / 2 + kQuantTile * 2;      // 288
constexpr int64_t kQ5STileBytes = kQ4STileBytes + kQuantTile * kQuantBlock / 8;        // 352: + the fifth bits
constexpr int64_t kQ5MTileBytes = kQ5STileBytes + kQuantTile * 2;                     // 384
constexpr int64_t kQ8TileBytes = kQuantTile * kQuantBlock + kQuantTile * 2;          // 544
// Bytes of one (tile, super-block) for the K kinds (layouts in kquant.cpp).
constexpr int64_t kQ4KTileBytes = 2048 + 64 + 192;        // 2304: the file's 16 x 144 (six_bit_scales.h)
constexpr int64_t kQ5KTileBytes = 2048 + 512 + 64 + 192;  // 2816: the file's 16 x 176
constexpr int64_t kQ6KTileBytes = 2048 + 1024 + 32 + 256; // 3360
constexpr int64_t kIQ4XTileBytes = 2048 + 32 + 128;        // 2208

int64_t kind_tile_bytes(int64_t kind);          // 0 for an unknown kind
int64_t kind_block_inputs(int64_t kind);        // 32 or 256

// The loops that compute a packed linear. Every one compiled in gives the same bits (tests hold them to it).
enum KernelPath : int64_t { kPathVnni = 0, kPathAvx2 = 1, kPathPortable = 2 };
// "best" (the fastest compiled in) or a name from block_quant_paths() -> its loop; an error names a
// loop this build lacks.
KernelPath kernel_path(const std::string& name);
// The loops compiled in, fastest first: "vnni" (AVX-512 VNNI), "avx2", "portable" (a plain loop, always).
std::vector<std::string> block_quant_paths();
// Which VNNI loop decode batches of 2-8 rows run (same bits either way; tile_walk.h says why there are two):
// "auto" (chosen by CPU), "rows" or "pairs". decode_batch_loop() says which runs now: "rows" or "pairs".
void set_decode_batch_loop(const std::string& name);
std::string decode_batch_loop();
// How the VNNI one-row loops (a decode step) fetch the weights ahead (same bits either way; tile_walk.h says
// why there are two): "auto" (chosen by CPU), "t1" (into L2) or "nta" (non-temporally as well or instead).
// decode_prefetch() says which holds now: "t1" or "nta".
void set_decode_prefetch(const std::string& name);
std::string decode_prefetch();
// Which VNNI loop a prompt's rows (more than 8) run (same bits either way; tile_walk.h says why there are two):
// "auto" (chosen by CPU and kind), "single" (a tile at a time) or "pairs". prompt_tile_loop(kind) says which runs
// now for a packed kind.
void set_prompt_tile_loop(const std::string& name);
std::string prompt_tile_loop(int64_t kind);

// y [M, out_features] = x [M, K] @ W^T (+ bias); packed: uint8 [tiles, K / block, tile bytes] (the float rows
// kinds: uint8 [N, 2 K]). Every row is
// computed alike whatever else is in x (batch-invariant). path: which loop (kernel_path's names).
at::Tensor block_linear(const at::Tensor& x, const at::Tensor& packed, int64_t kind, int64_t out_features,
                        const std::optional<at::Tensor>& bias, const std::string& path = "best");

// True for the kinds of blocks of 32 inputs (block_quant.cpp's loops), false for the K and float rows kinds.
bool is_block_kind(int64_t kind);

// block_linear of silu(gate) * up (cpu_forward.cpp's silu_and_mul) for gate_up [M, 2 K] = [gate | up], a kind of
// blocks of 32 (is_block_kind): the same bits, each row's product computed into a scratch row as the activations
// are quantized. Why: a prompt's product never goes to memory to be read back (512 rows x 5632 of a 1B model: 11.5
// MB written and read again a layer).
at::Tensor block_linear_swiglu(const at::Tensor& gate_up, const at::Tensor& packed, int64_t kind,
                               int64_t out_features, const std::optional<at::Tensor>& bias,
                               const std::string& path = "best");

// The float rows kinds' kernel (float_rows.cpp), called by block_linear: rows uint8 [N, 2 K].
bool is_float_rows_kind(int64_t kind);
at::Tensor float_rows_linear(const at::Tensor& x, const at::Tensor& rows, int64_t kind, int64_t out_features,
                             const std::optional<at::Tensor>& bias, KernelPath path);

// The K kinds' kernel (kquant.cpp), called by block_linear and block_linear_parts: y = x @ W^T (+ bias) for each
// part, the parts' tiles shared out between the threads as one projection's.
struct KQuantPart {
  const uint8_t* packed;  // [tiles, K / 256, tile bytes] of kind `kind`
  int64_t tiles, kind, out_features;
  const float* bias;  // out_features of them, or null
  float* y;           // [M, out_features]
};
void kquant_linear_parts(const at::Tensor& x, const KQuantPart* parts, int64_t count, KernelPath path);

// One projection whose outputs are stored as several packed tensors, each of its own kind (a Q4_K_M file's q and k
// in Q4_K beside v in Q6_K): y [M, sum of outs] = the parts' outputs side by side (+ bias). Each output has
// block_linear's bits. Why one call: the parts as separate calls (and a concatenation) streamed a 1B Q4_K_M
// model's qkv weights at 27-29 GB/s against 40-43 for its gate_up (each call's threads start cold, the small v part
// split two ways). Parts all of K kinds run as one parallel call; other mixes call block_linear per part.
at::Tensor block_linear_parts(const at::Tensor& x, const std::vector<at::Tensor>& packed, const std::vector<int64_t>& kinds,
                              const std::vector<int64_t>& out_features, const std::optional<at::Tensor>& bias,
                              const std::string& path = "best");

// A GGUF tensor's rows (uint8 [N, row bytes], as the file stores them) -> (packed, kind). Every weight is
// kept exactly: no rounding happens here. ggml_type: the file's type id (Q4_0 2, Q4_1 3, Q5_0 6, Q5_1 7,
// Q8_0 8, Q3_K 11, Q4_K 12, Q5_K 13, Q6_K 14, IQ4_NL 20, IQ4_XS 23). row_order: packed row i is the file's row row_order[i] (undoes
// llama.cpp's q/k permutation without a copy). out: a zeroed [tiles, blocks, tile bytes] to fill (a
// slice of a fused projection's packing), else a new tensor is made.
std::tuple<at::Tensor, int64_t> repack_gguf(const at::Tensor& raw, int64_t ggml_type, int64_t k,
                                            const std::optional<at::Tensor>& row_order,
                                            const std::optional<at::Tensor>& out);

// A GGUF tensor's rows (uint8 [N, row bytes]) -> out, float32 [N, k]: each weight with the bits the `gguf`
// package's de-quantisation gives it (the embedding lookup of a decode step: 4-18 us a row from Python, where
// gguf's numpy took 70-180 us). For Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K and Q6_K (dequantizes_gguf_rows).
bool dequantizes_gguf_rows(int64_t ggml_type);
void dequantize_gguf_rows(const at::Tensor& raw, int64_t ggml_type, int64_t k, at::Tensor& out);

// True where a vector loop (AVX-512 VNNI or AVX2) was compiled in; elsewhere only the portable (slow) one.
bool block_quant_fast();
