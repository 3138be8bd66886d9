#pragma once
// What the loops over a packed linear in block_quant.cpp and kquant.cpp share: the walk over output tiles of
// 16 channels (in each tile the rows in groups, in each group the tile's blocks in memory order), where a
// tile's outputs go, and which loop a KernelPath runs. Each loop's arithmetic stays in its own file, a lambda
// the walk calls: a template parameter, inlined, so the walk compiles to the loops it replaced (the same loop
// order, prefetches and stores).
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cpuid.h>
#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>

#include "avx2_dot.h"
#include "block_quant.h"
#include "worker_pool.h"

// The walks below, and the lambdas handed to them, are inlined early (always_inline), before GCC optimises
// the function that calls them, so they compile as if written out in place. Left to the ordinary inliner,
// the hot row loops came out with their strides reloaded from the stack (Q6_K, 16 rows: 11% slower).
#define CHATAPP_INLINE __attribute__((always_inline))

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__F16C__)
#define CHATAPP_HAVE_VNNI 1
#endif

// A file's loops over a packed linear are overloads of one name, told apart by one of these tags as their
// first argument, so that on_path can run the one a KernelPath names.
struct VnniLoop {};
struct Avx2Loop {};
struct PortableLoop {};

// run(tag) with the tag of the loop `path` names. A loop this build lacks is never named (kernel_path()
// refuses it), so its overload need not exist.
template <class Run>
inline void on_path(KernelPath path, Run&& run) {
#if defined(CHATAPP_HAVE_VNNI)
  if (path == kPathVnni) return run(VnniLoop{});
#endif
#if defined(CHATAPP_HAVE_AVX2)
  if (path == kPathAvx2) return run(Avx2Loop{});
#endif
  run(PortableLoop{});
}

// Which VNNI loop a decode batch (2-8 rows) runs: the rows loops (block_quant.cpp tile_loop_rows, kquant.cpp
// tiles_rows_vnni: one tile at a time, the rows' sums in registers, each dot reading its activations straight
// from memory) or the pair loops (tile_pair_loop: two tiles at a time, the sums in L1, each activation word
// broadcast once for both tiles' dots). Both make the same integer sums and float steps in the same order:
// same bits, so the choice is speed alone, and the faster differs by CPU:
// - the rows loops were written for, and measured faster than the pair loops of the time on, the AMD EPYC
//   (Zen 5) most earlier sessions ran on: K-quant 8-way decode of 1B files +22% (Q4_0, its Q6_K head) and
//   2.1x (Q4_K_M); blocks of 32 at 3-4 rows +9-17%;
// - on an Intel Xeon (family 6 model 167, 2 cores) the pair loops stream the weights faster at every batch of
//   2-8 rows (Q4_0, 8 rows: 18.6 -> 21.2 GB/s; Q4_K and Q6_K +7%), and 8-way decode gained in every alternated
//   pair but one: 1B Q4_0 +5-13%, Q4_K_M -1 to +8%, Q6_K +5-7%, Q8_0 +1-3% (the 135M model, whose weights
//   stay in cache, -8% to +4%).
// kAuto takes the pair loops on Intel CPUs and the rows loops elsewhere; set_decode_batch_loop() overrides it
// (tests run both; benchmarks compare them on a new CPU).
enum class DecodeBatchLoop : int { kAuto = 0, kRows = 1, kPairs = 2 };

inline std::atomic<int>& decode_batch_loop_setting() {
  static std::atomic<int> setting{static_cast<int>(DecodeBatchLoop::kAuto)};
  return setting;
}

// Whether decode batches of 2-8 rows run the pair loops (the setting, kAuto resolved for this CPU).
inline bool decode_batches_in_pairs() {
  const auto setting = static_cast<DecodeBatchLoop>(decode_batch_loop_setting().load(std::memory_order_relaxed));
  if (setting != DecodeBatchLoop::kAuto) return setting == DecodeBatchLoop::kPairs;
  static const bool intel = (__builtin_cpu_init(), __builtin_cpu_is("intel"));
  return intel;
}

// How the VNNI one-row loops (a decode step) fetch the weights ahead. "t1": into L2 (prefetcht1), as every
// other loop does: blocks of 32 (block_quant.cpp tile_loop_one_row: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL) 24
// blocks on, K-quants (kquant.cpp tiles_one_row_vnni) 8 super-blocks on. "nta": non-temporally (prefetchnta:
// into L1, marked to leave first): blocks of 32 16 blocks on instead; K-quants 2 super-blocks on and nothing into
// L2, their groups unrolled (kquant.cpp kAheadNta), Q4_K and IQ4_XS nothing at all (kNoFetchFrontToBack). Same
// bits either way; the faster differs by CPU:
// - on the AMD EPYC Zen 4 of sessions 33-39 (family 25, 2 cores) "nta" streams faster. Alternated A/B, a 1B
//   file's projections, one row: Q8_0 +4-12% on two threads, +30% on one; Q4_0 +10% and +24%; Q4_K +5-8% and
//   +13%, Q6_K +5% (session 38, with prefetcht1 8 on kept; session 39's unrolled loop without it: 3-4% more on
//   two threads). Decode in the engine (128 tokens, 10-12 pairs): Q8_0 time x0.86-0.90, Q4_0 x0.88-0.98.
//   What lost there: the K-quant loop fetching into L1 alone while its groups ran in a loop (prefetcht0 or nta,
//   1-8 super-blocks on: -14-35%), blocks of 32 fetching both ways (-10-25%), and the decode batches' loops of 8
//   rows fetching into L1 (-6-42%);
// - on the Zen 5 and Intel CPUs of earlier sessions prefetcht1 was measured against no prefetch, never against
//   prefetchnta, so they keep "t1" until someone measures there (benchmarks: set_decode_prefetch).
// kAuto takes "nta" on AMD family 25 (Zen 4 is the only one there with AVX-512 VNNI, which the loops need) and
// "t1" elsewhere; set_decode_prefetch() overrides it (tests run both).
enum class DecodePrefetch : int { kAuto = 0, kT1 = 1, kNta = 2 };

inline std::atomic<int>& decode_prefetch_setting() {
  static std::atomic<int> setting{static_cast<int>(DecodePrefetch::kAuto)};
  return setting;
}

// Whether this process runs on an AMD CPU of family 25 (0x19: Zen 3 and Zen 4).
inline bool amd_family_25() {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (!__get_cpuid(1, &eax, &ebx, &ecx, &edx)) return false;
  const unsigned base = (eax >> 8) & 0xF, family = base == 0xF ? base + ((eax >> 20) & 0xFF) : base;
  return (__builtin_cpu_init(), __builtin_cpu_is("amd")) && family == 25;
}

// Whether the one-row loops fetch non-temporally now (the setting, kAuto resolved by CPU).
inline bool decode_prefetches_nta() {
  const auto setting = static_cast<DecodePrefetch>(decode_prefetch_setting().load(std::memory_order_relaxed));
  if (setting != DecodePrefetch::kAuto) return setting == DecodePrefetch::kNta;
  static const bool zen4 = amd_family_25();
  return zen4;
}

// Which VNNI loop a prompt's rows (more than 8) run: the pair loops (tile_pair_loop in block_quant.cpp and
// kquant.cpp: two tiles at a time, each activation word broadcast once into a register for both tiles' dots)
// or the one-tile loops (a tile at a time, each dot reading its activation word from memory within the
// instruction). Both make the same integer sums and float steps in the same order: same bits. The faster
// differs by CPU:
// - the pair loops were made on the Zen 5 of sessions 17-26, where a dot, a multiply and a fused add share two
//   ports and the loads had set the pace (block_quant.cpp's tile_pair_loop says by how much);
// - on the AMD EPYC Zen 4 of sessions 33-40 (family 25) the one-tile loops are faster for K-quants and Q8_0.
//   Alternated A/B, 512 rows, a 1B file's projections, two threads, time one-tile / pairs: Q4_K x0.909-0.933,
//   Q6_K x0.911-0.982, Q8_0 x0.902-0.967. A 512-token prefill in the engine (in-process, 8 rounds): Q4_K_M
//   x0.920, Q6_K x0.937, Q8_0 x0.954; but Q4_0 x1.019, so the 4- and 5-bit blocks of 32 keep the pair loops.
// kAuto takes the one-tile loops on AMD family 25 for the kinds block_quant.h's single_tile_prompts_on_zen4 names,
// the pair loops otherwise (Intel's and Zen 5's were not measured against them); set_prompt_tile_loop()
// overrides it for every kind (tests run both).
enum class PromptTileLoop : int { kAuto = 0, kSingle = 1, kPairs = 2 };

inline std::atomic<int>& prompt_tile_loop_setting() {
  static std::atomic<int> setting{static_cast<int>(PromptTileLoop::kAuto)};
  return setting;
}

// Whether a prompt's rows run the pair loops now (the setting, kAuto resolved by CPU): single_on_zen4 says
// whether the weights' kind runs one tile at a time on AMD family 25.
inline bool prompt_tiles_in_pairs(bool single_on_zen4) {
  const auto setting = static_cast<PromptTileLoop>(prompt_tile_loop_setting().load(std::memory_order_relaxed));
  if (setting != PromptTileLoop::kAuto) return setting == PromptTileLoop::kPairs;
  static const bool zen4 = amd_family_25();
  return !(zen4 && single_on_zen4);
}

// fn(blk, b) for blocks [0, blocks) of one tile, kBlockBytes each. Where fetch holds (and ahead > 0: 0 leaves
// fetching to fn), each block first prefetches the one `ahead` blocks on, with kHint (into L2 unless a loop
// says why not): tiles follow one another in memory, so DRAM latency hides behind the dots (a tile's last
// blocks fetch the next tile's first ones).
template <int64_t kBlockBytes, int kHint = _MM_HINT_T1, class Fn>
CHATAPP_INLINE inline void for_each_block(const uint8_t* tile, int64_t blocks, int64_t ahead, bool fetch, Fn&& fn) {
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* blk = tile + b * kBlockBytes;
    if (fetch && ahead > 0)
      for (int64_t off = 0; off < kBlockBytes; off += 64)
        _mm_prefetch(reinterpret_cast<const char*>(blk + ahead * kBlockBytes + off), static_cast<_mm_hint>(kHint));
    fn(blk, b);
  }
}

#if defined(CHATAPP_HAVE_VNNI)
// The fifth bits of 5-bit codes (Q5_0, Q5_1, Q5_K) into their 8 registers: register j's are bit j of
// each byte of h, moved to bit 4 (the shifts are 16-bit, hence the mask).
CHATAPP_INLINE inline void or_fifth_bits(__m512i w[8], __m512i h) {
  const __m512i bit4 = _mm512_set1_epi8(0x10);
  // w | (moved & bit4) in one ternary-logic instruction (0xF8: a | (b & c))
  w[0] = _mm512_ternarylogic_epi32(w[0], _mm512_slli_epi16(h, 4), bit4, 0xF8);
  w[1] = _mm512_ternarylogic_epi32(w[1], _mm512_slli_epi16(h, 3), bit4, 0xF8);
  w[2] = _mm512_ternarylogic_epi32(w[2], _mm512_slli_epi16(h, 2), bit4, 0xF8);
  w[3] = _mm512_ternarylogic_epi32(w[3], _mm512_slli_epi16(h, 1), bit4, 0xF8);
  w[4] = _mm512_ternarylogic_epi32(w[4], h, bit4, 0xF8);
  w[5] = _mm512_ternarylogic_epi32(w[5], _mm512_srli_epi16(h, 1), bit4, 0xF8);
  w[6] = _mm512_ternarylogic_epi32(w[6], _mm512_srli_epi16(h, 2), bit4, 0xF8);
  w[7] = _mm512_ternarylogic_epi32(w[7], _mm512_srli_epi16(h, 3), bit4, 0xF8);
}
#endif

#if defined(CHATAPP_HAVE_AVX2)
// or_fifth_bits on 256-bit registers (a tile's half of 8 channels).
CHATAPP_INLINE inline void or_fifth_bits(__m256i w[8], __m256i h) {
  for (int j = 0; j < 8; ++j) {
    const __m256i moved = j < 4 ? _mm256_sll_epi16(h, _mm_cvtsi32_si128(4 - j)) : _mm256_srl_epi16(h, _mm_cvtsi32_si128(j - 4));
    w[j] = _mm256_or_si256(w[j], _mm256_and_si256(moved, _mm256_set1_epi8(0x10)));
  }
}
#endif

// A non-temporal prefetch of the line at p that stays where the loop puts it. Why asm volatile: in a fully
// unrolled loop GCC gathered _mm_prefetch calls at its top, a burst that filled the core's miss buffers (the
// K-quant one-row loop streamed 1.37x slower on one thread); the scheduler moves no other instruction across a
// volatile asm, so each group's share stays with its group.
CHATAPP_INLINE inline void prefetch_nta_in_place(const uint8_t* p) {
  asm volatile("prefetchnta %0" : : "m"(*reinterpret_cast<const char*>(p)));
}

#if defined(CHATAPP_HAVE_VNNI)
// acc + the VNNI dot (vpdpbusd) of w's unsigned bytes with the 4 signed int8 activations at x, broadcast to
// all 16 lanes by the instruction itself ({1to16}). Written in asm because GCC loads and broadcasts in an
// instruction of its own: in the one-row loops, fewer instructions per weight byte let the CPU run further
// ahead of its memory reads (1B Q4_K_M decode +4.5%, with kquant.cpp's in-place high nibbles).
CHATAPP_INLINE inline __m512i dot_broadcast4(__m512i acc, __m512i w, const int8_t* x) {
  typedef int32_t __attribute__((may_alias)) aliased_i32;
  asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*reinterpret_cast<const aliased_i32*>(x)));
  return acc;
}
#endif

#if defined(CHATAPP_HAVE_VNNI)
// s[r] + the dots of w[0..7] (a 32-input group of 16 channels, w[j] inputs 4(j%4)+16(j/4)..+3) with the 32
// activation codes at x + 32 r, for kG rows. The rows' chains go side by side, so each dot waits on the one
// kG dots back rather than the one before it: a dot takes ~5 cycles and two can issue a cycle, so one row's
// chain at a time, or two interleaved, left the dot ports idle (alternated A/B, same bits: Q4_0 +16% at 8
// rows with the weights in L3, +23% streaming them from memory; +7-11% at 512 rows).
template <int kG>
CHATAPP_INLINE inline void dots_side_by_side(const __m512i w[8], const int8_t* x, __m512i s[kG]) {
  for (int j = 0; j < 8; ++j)
    for (int r = 0; r < kG; ++r) s[r] = dot_broadcast4(s[r], w[j], x + 32 * r + 4 * (j % 4) + 16 * (j / 4));
}
#endif

// fn(std::integral_constant<int, G>{}, r0) for rows [0, count) in groups of G = kMax (2 to 8; then 4, 2, 1 for
// the rest): the group size a compile-time constant, so a group's sums live in registers.
template <int kMax = 8, class Fn>
CHATAPP_INLINE inline void for_row_groups(int64_t count, Fn&& fn) {
  static_assert(kMax >= 2 && kMax <= 8, "groups of 2 to 8 rows");
  int64_t r = 0;
  for (; r + kMax <= count; r += kMax) fn(std::integral_constant<int, kMax>{}, r);
  if constexpr (kMax > 4)
    if (count - r >= 4) fn(std::integral_constant<int, 4>{}, r), r += 4;
  if constexpr (kMax > 2)
    if (count - r >= 2) fn(std::integral_constant<int, 2>{}, r), r += 2;
  if (r < count) fn(std::integral_constant<int, 1>{}, r);
}

// Where a tile's outputs go: Out(valid, bias) for a tile with `valid` real channels (bias: its 16 or null);
// Out::zero(acc, rows) clears rows x 16 float sums, out.store(acc_row, y_row) writes one row's sums + bias.
#if defined(__AVX512F__)
// AVX-512: the tile's 16 channels in one register, the missing ones masked off.
struct TileOut512 {
  __mmask16 mask;
  __m512 bias;
  TileOut512(int64_t valid, const float* b)
      : mask(static_cast<__mmask16>((1u << valid) - 1u)),
        bias(b ? _mm512_maskz_loadu_ps(mask, b) : _mm512_setzero_ps()) {}
  static void zero(float* acc, int64_t rows) {
    for (int64_t r = 0; r < rows; ++r) _mm512_store_ps(acc + r * kQuantTile, _mm512_setzero_ps());
  }
  void store(__m512 f, float* y_row) const { _mm512_mask_storeu_ps(y_row, mask, _mm512_add_ps(f, bias)); }
  void store(const float* acc, float* y_row) const { store(_mm512_load_ps(acc), y_row); }
  // A whole tile's 16 sums + bias to a 64-byte aligned y_row, past the caches (streaming_outputs).
  void stream(const float* acc, float* y_row) const { _mm512_stream_ps(y_row, _mm512_add_ps(_mm512_load_ps(acc), bias)); }
};
#endif

#if defined(CHATAPP_HAVE_VNNI)
// The 4 activation codes at x broadcast to all 16 lanes, in a register that several dots then share.
CHATAPP_INLINE inline __m512i broadcast4(const int8_t* x) {
  int32_t word;
  std::memcpy(&word, x, 4);
  return _mm512_set1_epi32(word);
}

// Asks for the cache lines a pass of the two-tile loops ends by writing: rows [0, count) of y (n_out apart), the
// 32 outputs at y_pair. Why: those rows lie a row apart in an output too big for the caches, so each of the pass's
// closing stores missed, and they came one after another (~5% of a 512-row linear's samples on its output stores).
// Fetched for writing as the pass starts, they arrive while its dots run.
inline void prefetch_outputs(float* y_pair, int64_t count, int64_t n_out) {
  for (int64_t r = 0; r < count; ++r) {
    __builtin_prefetch(y_pair + r * n_out, 1, 3);
    __builtin_prefetch(y_pair + r * n_out + kQuantTile, 1, 3);
  }
}

// Outputs at least this big are written past the caches (streaming_outputs says why).
constexpr int64_t kStreamedOutputBytes = int64_t{1} << 20;

// Whether the two-tile loops write y with non-temporal stores: a big output (a prompt's), every tile whole and
// every row 64-byte aligned. Why: a pass ends by writing one 64-byte line in each of its 64 rows, lines a whole row
// of y apart, which all fall in the same few sets of the L1 cache. Fetched ahead they evicted one another, and
// written they missed one by one (~7% of a 512-row linear's samples on those stores). Streamed, they go to memory
// whole without being read first: a 2048 x 2048 Q4_0 linear of 512 rows, 6.0-6.1 -> 5.6-5.9 cycles a row, 16
// channels and 32 inputs; 512-token prompts of 1B Q4_0, Q8_0 and Q4_K_M models +3-11% (alternated pairs, the next
// steps' reads of y from memory included). Smaller outputs, which the next step finds in L2, keep ordinary stores.
inline bool streaming_outputs(int64_t rows, int64_t n_out, const float* y) {
  return rows * n_out * static_cast<int64_t>(sizeof(float)) >= kStreamedOutputBytes && n_out % kQuantTile == 0 &&
         reinterpret_cast<uintptr_t>(y) % 64 == 0;
}

// The walk of the two-tile loops (block_quant.cpp and kquant.cpp, tile_pair_loop) over tiles t and t + 1 for every
// row, kRows rows a pass: acc[h], tile t + h's float sums of the pass's rows, is zeroed (unless kPassWritesFirst: the
// pass's first block then writes the sums instead of adding to them), the output lines are fetched (or, streamed,
// left to the stores), pass(m0, count) adds rows m0..m0+count-1's products into acc, then acc[h] + bias goes to y.
template <int64_t kRows, bool kPassWritesFirst = false, class Pass>
CHATAPP_INLINE inline void walk_tile_pair(int64_t rows, int64_t t, float (*acc)[kRows * kQuantTile], float* y,
                                         int64_t n_out, const float* bias, Pass&& pass) {
  const bool stream = streaming_outputs(rows, n_out, y);
  for (int64_t m0 = 0; m0 < rows; m0 += kRows) {
    const int64_t count = std::min(kRows, rows - m0);
    if constexpr (!kPassWritesFirst)
      for (int h = 0; h < 2; ++h) TileOut512::zero(acc[h], count);
    if (!stream) prefetch_outputs(y + m0 * n_out + t * kQuantTile, count, n_out);
    pass(m0, count);
    for (int h = 0; h < 2; ++h) {
      const int64_t n0 = (t + h) * kQuantTile;
      const TileOut512 out(std::min<int64_t>(kQuantTile, n_out - n0), bias ? bias + n0 : nullptr);
      if (stream)
        for (int64_t r = 0; r < count; ++r) out.stream(acc[h] + r * kQuantTile, y + (m0 + r) * n_out + n0);
      else
        for (int64_t r = 0; r < count; ++r) out.store(acc[h] + r * kQuantTile, y + (m0 + r) * n_out + n0);
    }
  }
  if (stream) _mm_sfence();  // the streamed lines reach memory before the threads' join publishes y
}
#endif

#if defined(CHATAPP_HAVE_AVX2)
// AVX2: the sums zeroed 8 at a time, the valid channels stored one by one.
struct TileOut256 {
  int64_t valid;
  const float* bias;
  TileOut256(int64_t v, const float* b) : valid(v), bias(b) {}
  static void zero(float* acc, int64_t rows) {
    for (int64_t i = 0; i < rows * kQuantTile; i += 8) _mm256_store_ps(acc + i, _mm256_setzero_ps());
  }
  void store(const float* acc, float* y_row) const {
    for (int64_t c = 0; c < valid; ++c) y_row[c] = acc[c] + (bias ? bias[c] : 0.f);
  }
};
#endif

// fn(tile, n0, out) for output tiles [t0, t1): the tile's bytes (blocks of kBlockBytes), its first channel
// and its Out.
template <class Out, int64_t kBlockBytes, class Fn>
CHATAPP_INLINE inline void for_each_tile(const uint8_t* packed, int64_t blocks, int64_t t0, int64_t t1,
                                        int64_t n_out, const float* bias, Fn&& fn) {
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t n0 = t * kQuantTile;
    const Out out(std::min<int64_t>(kQuantTile, n_out - n0), bias ? bias + n0 : nullptr);
    fn(packed + t * blocks * kBlockBytes, n0, out);
  }
}

// Output tiles [t0, t1) for every row, kRows rows at a time so their float sums acc [kRows][16] stay in L1.
// For each tile and group of rows: acc is zeroed, block(blk, b, m0, count) adds block b's products for rows
// m0..m0+count-1 into acc, then acc + bias goes to y. Blocks prefetch `ahead` blocks on in every group's
// pass, or with kFetchOnce only in the first.
template <class Out, int64_t kRows, int64_t kBlockBytes, bool kFetchOnce, class Block>
CHATAPP_INLINE inline void walk_tiles(const uint8_t* packed, int64_t blocks, int64_t t0, int64_t t1, int64_t rows,
                                     int64_t ahead, float* acc, float* y, int64_t n_out, const float* bias,
                                     Block&& block) {
  auto tile_rows = [&](const uint8_t* tile, int64_t n0, const Out& out) CHATAPP_INLINE {
    for (int64_t m0 = 0; m0 < rows; m0 += kRows) {
      const int64_t count = std::min(kRows, rows - m0);
      Out::zero(acc, count);
      for_each_block<kBlockBytes>(tile, blocks, ahead, !kFetchOnce || m0 == 0,
                                  [&](const uint8_t* blk, int64_t b) CHATAPP_INLINE { block(blk, b, m0, count); });
      for (int64_t r = 0; r < count; ++r) out.store(acc + r * kQuantTile, y + (m0 + r) * n_out + n0);
    }
  };
  for_each_tile<Out, kBlockBytes>(packed, blocks, t0, t1, n_out, bias, tile_rows);
}

// The portable loops' walk, one output at a time: for tile t's valid channel c and each row, f starts at 0,
// block(blk, xq, rb, c, f) adds each of the tile's blocks into f in order, then f + bias goes to y. xq: the
// block's kBlockInputs activation codes in a.q; rb = row * blocks + b, the block's index in a's per-block
// arrays.
template <int64_t kBlockInputs, int64_t kBlockBytes, class Acts, class Block>
inline void walk_outputs(const Acts& a, const uint8_t* packed, int64_t k, int64_t t0, int64_t t1, int64_t rows,
                         float* y, int64_t n_out, const float* bias, Block&& block) {
  const int64_t blocks = k / kBlockInputs;
  for (int64_t t = t0; t < t1; ++t)
    for (int64_t c = 0; c < kQuantTile && t * kQuantTile + c < n_out; ++c)
      for (int64_t row = 0; row < rows; ++row) {
        float f = 0.f;
        for (int64_t b = 0; b < blocks; ++b) {
          const int64_t rb = row * blocks + b;
          block(packed + (t * blocks + b) * kBlockBytes, a.q.data() + rb * kBlockInputs, rb, c, f);
        }
        y[row * n_out + t * kQuantTile + c] = f + (bias ? bias[t * kQuantTile + c] : 0.f);
      }
}

// The fp16 value at p as a float.
inline float half_at(const uint8_t* p) {
  c10::Half h;
  std::memcpy(&h, p, 2);
  return static_cast<float>(h);
}

// run(t0, t1) over output tiles [0, tiles), on as many threads as torch's intra-op count (worker_pool.h), so that no
// thread waits long for another at the end. Each thread walks its own contiguous share from the front,
// kTilesPerClaim tiles at a time (one stream the prefetchers follow, an atomic step per 40-300 KB of weights); one
// that runs out takes single tiles from the back of the share with the most left. Why: with a fixed split, the
// thread woken second or reading slower memory at that moment left the other idle for ~8% of a decode step's linear
// time (measured on a 1B Q4_K_M model). A tile is always computed whole by one thread with the same arithmetic, so
// where it runs never changes its bits.
// The claims shrink as a share runs out (a quarter of what is left, at least one tile): a thread that has emptied
// its own share can only take tiles nobody has claimed, so the other's last claim of 4 tiles was left to run alone
// (a down projection's 4 tiles of a 1B model: ~13 us). Throwaway timers in a one-row decode, alternated (1B Q4_K_M,
// 400 tokens, 6 runs): the time each thread spent waiting at the end of a call, both threads summed, 4.1 us against
// 6.7 before (of ~220 us a call, 89 calls a step); the stream each thread reads stays one run from the front.
constexpr int64_t kTilesPerClaim = 4;

template <class Run>
inline void for_tiles_balanced(int64_t tiles, Run&& run) {
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), tiles);
  if (threads <= 1) return run(int64_t{0}, tiles);
  // A share's unclaimed tiles [front, back): front in the low 32 bits, back in the high, changed by CAS.
  struct alignas(64) Share {
    std::atomic<uint64_t> range;
  };
  const std::unique_ptr<Share[]> shares(new Share[threads]);
  auto pack = [](uint64_t front, uint64_t back) { return front | (back << 32); };
  for (int64_t t = 0; t < threads; ++t) shares[t].range.store(pack(t * tiles / threads, (t + 1) * tiles / threads));
  // Takes up to n tiles from the front (at most a quarter of those left, at least one) or the back of share s:
  // [t0, t1), empty when none is left.
  auto take = [&](int64_t s, int64_t n, bool from_back, int64_t& t0, int64_t& t1) {
    uint64_t cur = shares[s].range.load(std::memory_order_relaxed);
    for (;;) {
      const int64_t front = static_cast<int64_t>(cur & 0xFFFFFFFFu), back = static_cast<int64_t>(cur >> 32);
      const int64_t want = from_back ? n : std::min(n, std::max<int64_t>(1, (back - front) / 4));
      const int64_t got = std::min(want, back - front);
      if (got <= 0) return false;
      t0 = from_back ? back - got : front;
      t1 = t0 + got;
      const uint64_t next = from_back ? pack(front, back - got) : pack(front + got, back);
      if (shares[s].range.compare_exchange_weak(cur, next, std::memory_order_relaxed)) return true;
    }
  };
  // Share `me` is walked by whichever thread claims part `me` (the caller does a part no worker joins for).
  chatapp::parallel_parts(threads, [&](int64_t me) {
    int64_t t0 = 0, t1 = 0;
    while (take(me, kTilesPerClaim, false, t0, t1)) run(t0, t1);
    for (;;) {  // the others' tiles, from the back of the fullest share
      int64_t fullest = -1, most = 0;
      for (int64_t s = 0; s < threads; ++s) {
        const uint64_t cur = shares[s].range.load(std::memory_order_relaxed);
        const int64_t left = static_cast<int64_t>(cur >> 32) - static_cast<int64_t>(cur & 0xFFFFFFFFu);
        if (left > most) fullest = s, most = left;
      }
      if (fullest < 0) return;
      if (take(fullest, 1, true, t0, t1)) run(t0, t1);
    }
  });
}
