// Block-quantized linear layers for the CPU: 4-bit (Q4_1-style) and 8-bit (Q8_0-style) weights.
//
// Why: a decode step streams every weight from memory, so bytes per weight set the speed. fbgemm's
// int8 reads 1 byte a weight; 4-bit codes with an fp16 scale and minimum per 32 weights read 0.625.
// And where a model comes as a Q4_1/Q8_0 GGUF (the bundled SmolLM2 does), these formats hold its
// weights exactly: nothing is lost that the file had.
//
// How: activations are quantized per row to int8, each block of 32 with its own scale, like llama.cpp's Q8
// activations, but each block's scale is the row's unit times a power of two: d_x = unit * 2^shift, shift in
// 0..11, the smallest such scale that still holds the block's largest |x| in 127 steps (so a block keeps 6-7 of
// its 7 bits; a block 2^11 times quieter than the row's loudest, fewer). For a tile of
// 16 output channels and one block, 8 AVX-512 VNNI dot instructions give the 16 exact int32 block sums; shifted
// left by the block's shift they are in the row's unit, so one fused multiply-add applies the weights' scale:
//   Q4: f += (dot(q_w, q_x) << shift) * d_w + m_w * (sum(q_x) << shift)   (w = d_w * q_w + m_w, q_w in 0..15)
//   Q4S: f += ((dot(q_w, q_x) - 8 * sum(q_x)) << shift) * d_w             (w = d_w * (q_w - 8): Q4_0)
//   Q5S / Q5M: as Q4S (offset 16: Q5_0) / Q4 (Q5_1), on codes 0..31
//   Q8: f += ((dot(u_w, q_x) - 128 * sum(q_x)) << shift) * d_w  (w = d_w * (u_w - 128))
//   IQ4NL: as Q8, on u_w = v + 128 looked up from 4-bit indices (w = d_w * v, v one of IQ4_NL's 16 values)
// and y = f * unit once the row's blocks are summed. Why the power of two: with a float scale per block, each
// block took a multiply (d_w * d_x) besides its fused add, on the two ports the dots use; the shift runs on
// another (measured, alternated, 5 rounds: a 1B Q4_0 model's 512-token prompt 510 -> 526 tok/s; Q8_0, whose
// loop waits on its loads, flat). Greedy agreement of the bundled model with float32 did not drop (quality.py:
// 96.8% -> 97.6%). A shifted sum stays exact in
// int32 (|dot| < 2^19 for the 8-bit kinds, 2^11 larger at most).
// Every output runs this same sequence whatever the batch holds: answers are batch-invariant.
//
// Packed layout, per linear: [tiles of 16 output channels][blocks of 32 inputs][tile bytes].
// Q4 tile bytes: 4 chunks of 64 bytes, then 16 fp16 scales, then 16 fp16 minimums. In chunk j,
// byte 4c + i holds channel c's input 4j + i in its low nibble and input 16 + 4j + i in its high
// nibble, so one load and two masks give the two registers the dot instruction wants. Q4S tile bytes:
// the same 4 chunks, then 16 fp16 scales (no minimums: Q4_0's 18 bytes a block, no more).
// Q5S / Q5M tile bytes: the same 4 chunks, then the codes' fifth bits (64 bytes: byte 4c + i, bit j is
// the fifth bit of register j's lane 4c + i, as kquant.cpp's Q5_K), then 16 fp16 scales (and minimums).
// Q8 tile bytes: 8 chunks of 64 (chunk j, byte 4c + i: channel c's input 4j + i, offset by 128),
// then 16 fp16 scales. IQ4NL tile bytes: Q4S's, the nibbles indices into IQ4_NL's values (one vpshufb turns a
// register of them into the values + 128). chatapp/engine/block_quant.py writes Q4 and Q8 from floats;
// gguf_repack.cpp writes every kind from a GGUF file's blocks.
#include "block_quant.h"
#include "activation_pool.h"
#include "avx2_dot.h"
#include "iq4_values.h"
#include "tile_walk.h"
#include "vec16.h"

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <initializer_list>
#include <numeric>
#include <string>
#include <utility>
#include <vector>

namespace {

// One row block's int8 codes and what the weight formats need besides them.
struct QuantizedActivations {
  std::vector<int8_t> q;      // [M, K]: x ~= unit * 2^shift * q, blockwise
  std::vector<float> unit;    // [M]: the row's unit, amax / 127 / 2^kMaxShift
  std::vector<int32_t> shift;  // [M, K / 32]: the block's scale is unit * 2^shift
  std::vector<float> msum;    // [M, K / 32]: qsum << shift, the block's sum in the row's unit (for the minimums)
  std::vector<int32_t> qsum;  // [M, K / 32]: the sum of q over the block (undoes the codes' offset)

  // What the batched VNNI loops read instead of q (quantize_rows writes one or the other), in the order they read
  // it: block by block for `chunk` rows in turn. In the arrays above one block's values of successive rows sit a row apart, a stride the
  // prefetchers miss (kquant.cpp measured it on its codes). Index: grouped(r, b) (codes: 32 from there).
  // chunk is kChunkRows, or the batch's rows when fewer: a decode batch's copy is then dense (8 rows, K 8192:
  // 64 KB) where a 64-row stride spread it over 512 KB, and its stores missed cache (~2% of an 8-way step).
  static constexpr int64_t kChunkRows = 64;
  int64_t chunk = kChunkRows;
  struct Grouped {
    int32_t shift;
    float msum;
    int32_t start;  // -offset * qsum: the kind's code offset taken off, where a row's dot chain starts
  };
  std::vector<int8_t> q_by_block;     // [rows / kChunkRows][K / 32][kChunkRows][32]
  std::vector<Grouped> by_block;      // [rows / kChunkRows][K / 32][kChunkRows]

  void resize(int64_t rows, int64_t k) {
    const size_t blocks = static_cast<size_t>(rows * (k / kQuantBlock));
    if (q.size() < static_cast<size_t>(rows * k)) q.resize(rows * k);
    if (unit.size() < static_cast<size_t>(rows)) unit.resize(rows);
    if (shift.size() < blocks) {
      shift.resize(blocks);
      msum.resize(blocks);
      qsum.resize(blocks);
    }
  }

  int64_t grouped(int64_t r, int64_t b, int64_t k) const { return (r / chunk * (k / kQuantBlock) + b) * chunk + r % chunk; }

  // Sizes q_by_block and by_block for `rows` rows (more than 1: one row needs no regrouping) and sets chunk.
  void size_groups(int64_t rows, int64_t k) {
    chunk = std::min(rows, kChunkRows);
    const int64_t blocks = k / kQuantBlock, padded = (rows + chunk - 1) / chunk * chunk;
    if (by_block.size() < static_cast<size_t>(padded * blocks)) {
      by_block.resize(padded * blocks);
      q_by_block.resize(padded * k);
    }
  }
};

// Block shifts run 0..kMaxShift: a block 2^11 times quieter than its row's loudest still keeps its bits, and a
// shifted sum stays in int32 (the 8-bit kinds' block dots are under 2^19).
constexpr int32_t kMaxShift = 11;

// A block's sum s (an exact int32) in its row's unit: s * 2^shift, the vector loops' left shift.
inline int32_t in_row_unit(int32_t s, int32_t shift) { return s * (int32_t{1} << shift); }

// The largest |x| of each block of 32, into amax[b].
void block_amax(const float* x, int64_t k, float* amax) {
  for (int64_t b = 0; b < k / kQuantBlock; ++b) {
    const float* xb = x + b * kQuantBlock;
#if defined(__AVX512F__)
    const __m512 v0 = _mm512_loadu_ps(xb), v1 = _mm512_loadu_ps(xb + 16);
    amax[b] = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
#else
    float m = 0.f;
    for (int64_t i = 0; i < kQuantBlock; ++i) m = std::max(m, std::fabs(xb[i]));
    amax[b] = m;
#endif
  }
}

// 2^i for i in 0..kMaxShift + 1: multiplying by one is exact, as std::ldexp is, without its library call (1.3% of a
// prompt's samples).
constexpr float kPow2[kMaxShift + 2] = {1.f, 2.f, 4.f, 8.f, 16.f, 32.f, 64.f, 128.f, 256.f, 512.f, 1024.f, 2048.f, 4096.f};

// One row: its unit, and each block's codes, shift, code sum and msum (QuantizedActivations says what each is).
// q: where block 0's codes go, block b's q_stride bytes on (32 in the row-major copy, chunk x 32 in the grouped one).
void quantize_row(const float* x, int64_t k, int8_t* q, int64_t q_stride, float& unit, int32_t* shift, float* msum,
                  int32_t* qsum) {
  const int64_t blocks = k / kQuantBlock;
  block_amax(x, k, msum);  // msum holds the blocks' amax until each block's own is written
  float row_amax = 0.f;
  for (int64_t b = 0; b < blocks; ++b) row_amax = std::max(row_amax, msum[b]);
  const bool silent = !(row_amax >= 1e-30f);  // zeros (or too small to scale): every code 0
  unit = silent ? 0.f : row_amax / 127.f / kPow2[kMaxShift];
  for (int64_t b = 0; b < blocks; ++b) {
    const float* xb = x + b * kQuantBlock;
    int8_t* qb = q + b * q_stride;
    // e: the largest power of two (up to 2^kMaxShift) that keeps the block's amax within the row's
    int32_t e = 0;
    while (e < kMaxShift && msum[b] * kPow2[e + 1] <= row_amax) ++e;
    const float inv = silent ? 0.f : 127.f / row_amax * kPow2[e];
#if defined(__AVX512F__)
    const __m512 v0 = _mm512_loadu_ps(xb), v1 = _mm512_loadu_ps(xb + 16);
    const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, _mm512_set1_ps(inv)));  // round to nearest even
    const __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, _mm512_set1_ps(inv)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(qb), _mm512_cvtsepi32_epi8(q0));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(qb + 16), _mm512_cvtsepi32_epi8(q1));
    qsum[b] = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
#else
    int32_t qs = 0;
    for (int64_t i = 0; i < kQuantBlock; ++i) {
      const int32_t v = static_cast<int32_t>(std::nearbyint(xb[i] * inv));
      qb[i] = static_cast<int8_t>(std::clamp(v, -128, 127));
      qs += v;
    }
    qsum[b] = qs;
#endif
    shift[b] = kMaxShift - e;
    // The minimum term multiplies the sum of the quantized activations, not of x itself: then a
    // block's result is exactly the dequantized weights times the quantized activations, and the
    // rounding error scales with the weights (as llama.cpp's Q8_1 sums do), not with w - min, which
    // for codes 0..15 never cancels (measured: 2-4x the logit error of Q8 on the same activations).
    msum[b] = static_cast<float>(in_row_unit(qsum[b], shift[b]));  // |qsum| <= 4064: exact
  }
}

// grouped: write the batched VNNI loops' copy (q_by_block, by_block: the only arrays they read besides unit) instead
// of the row-major codes, for codes offset by offset. Why straight there: a regrouping pass after quantizing copied
// every code once more (~1.2% of a prompt's samples).
// Rows [0, rows) of k inputs, row r's floats at row_at(r, scratch): a pointer into the caller's tensor, or into
// scratch (the calling thread's own vector) for a source that computes its rows as they are quantized.
//
// A decode batch (at most kGroupsAfterRows rows) has its by_block entries written by the caller after the parts,
// not by each part for its own rows. Why: its rows are split between the threads a few rows each, and by_block
// keeps a block's rows side by side (8 rows x 12 bytes), so every one of its cache lines was written by both cores
// in turn. Inside 8-way decode steps of a 1B Q4_0 model (timers around each quantization, 4 runs alternated)
// that took 12.0-14.3 -> 8.1-11.7 us a call for 2048 inputs (qkv, o, gate_up) and 47.7-53.0 -> 44.4-44.6 us for
// the down projection's 5632 (its SwiGLU included). Bigger batches' parts are many rows long: they write their own.
constexpr int64_t kGroupsAfterRows = 8;

template <class RowAt>
void quantize_rows_from(int64_t rows, int64_t k, RowAt&& row_at, QuantizedActivations& a, bool grouped,
                        int32_t offset) {
  const int64_t blocks = k / kQuantBlock;
  a.resize(rows, k);
  grouped = grouped && rows > 1;
  if (grouped) a.size_groups(rows, k);
  const bool groups_after = grouped && rows <= kGroupsAfterRows;
  auto write_groups = [&](int64_t r) {
    const int64_t first = a.grouped(r, 0, k);  // block b's entry is b x chunk on
    const int32_t* shift = a.shift.data() + r * blocks;
    const float* msum = a.msum.data() + r * blocks;
    const int32_t* qsum = a.qsum.data() + r * blocks;
    for (int64_t b = 0; b < blocks; ++b)
      a.by_block[first + b * a.chunk] = QuantizedActivations::Grouped{shift[b], msum[b], -offset * qsum[b]};
  };
  chatapp::parallel_for(0, rows, chatapp::row_grain(k), [&](int64_t begin, int64_t end) {
    std::vector<float> scratch;
    for (int64_t r = begin; r < end; ++r) {
      const float* x = row_at(r, scratch);
      int32_t* shift = a.shift.data() + r * blocks;
      float* msum = a.msum.data() + r * blocks;
      int32_t* qsum = a.qsum.data() + r * blocks;
      if (!grouped) {
        quantize_row(x, k, a.q.data() + r * k, kQuantBlock, a.unit[r], shift, msum, qsum);
        continue;
      }
      const int64_t first = a.grouped(r, 0, k);
      quantize_row(x, k, a.q_by_block.data() + first * kQuantBlock, a.chunk * kQuantBlock, a.unit[r], shift, msum,
                   qsum);
      if (!groups_after) write_groups(r);
    }
  });
  if (groups_after)
    for (int64_t r = 0; r < rows; ++r) write_groups(r);
}

void quantize_rows(const at::Tensor& x, QuantizedActivations& a, bool grouped, int32_t offset) {
  const float* xp = x.data_ptr<float>();
  const int64_t stride = x.stride(0);
  quantize_rows_from(x.size(0), x.size(1), [&](int64_t r, std::vector<float>&) { return xp + r * stride; }, a,
                     grouped, offset);
}

// Where a kind's (tile, block) keeps what is not codes: 16 fp16 scales, then (Q4, Q5M) 16 fp16 minimums.
struct BlockLayout {
  int64_t tile_bytes, scale_offset, min_offset;
  bool has_min;
};

constexpr BlockLayout block_layout(int kind) {
  return kind == kKindQ4    ? BlockLayout{kQ4TileBytes, 256, 288, true}
         : kind == kKindQ4S ? BlockLayout{kQ4STileBytes, 256, 0, false}
         : kind == kKindQ5S ? BlockLayout{kQ5STileBytes, 320, 0, false}
         : kind == kKindQ5M ? BlockLayout{kQ5MTileBytes, 320, 352, true}
         : kind == kKindIQ4NL ? BlockLayout{kQ4STileBytes, 256, 0, false}
                            : BlockLayout{kQ8TileBytes, 512, 0, false};
}

// Whether a kind keeps its codes as nibbles (two inputs a byte), and the offset its codes carry (taken
// off exactly, as offset * sum(q_x), in the int32 sum).
constexpr bool five_bit(int kind) { return kind == kKindQ5S || kind == kKindQ5M; }
constexpr bool nibble_codes(int kind) {
  return kind == kKindQ4 || kind == kKindQ4S || kind == kKindIQ4NL || five_bit(kind);
}
// The kinds whose weights are 8-bit values offset by 128 (Q8's codes, IQ4NL's looked-up values): the AVX2 loop
// multiplies them as signed bytes (its sign trick), which takes the offset off by itself.
constexpr bool byte_values(int kind) { return kind == kKindQ8 || kind == kKindIQ4NL; }
constexpr int32_t code_offset(int kind) {
  return byte_values(kind) ? 128 : kind == kKindQ4S ? 8 : kind == kKindQ5S ? 16 : 0;
}
constexpr int64_t kFifthBits = 256;  // where the 5-bit kinds keep their codes' fifth bits

#if defined(CHATAPP_HAVE_VNNI)
// A block's 16 channels x 32 inputs as unsigned bytes in w[0..7] (register j: inputs 4j..4j+3 of every channel,
// j = 4..7 the high nibbles for the 4-bit kinds), the layout the dots read.
template <int kKind>
CHATAPP_INLINE inline void unpack_block(const uint8_t* blk, __m512i w[8]) {
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  if constexpr (nibble_codes(kKind)) {
    for (int j = 0; j < 4; ++j) {
      const __m512i v = _mm512_loadu_si512(blk + 64 * j);
      w[j] = _mm512_and_si512(v, low4);
      w[j + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
    }
    if constexpr (five_bit(kKind)) or_fifth_bits(w, _mm512_loadu_si512(blk + kFifthBits));
    if constexpr (kKind == kKindIQ4NL) {
      const __m512i table = _mm512_broadcast_i32x4(_mm_load_si128(reinterpret_cast<const __m128i*>(kIQ4Codes)));
      for (int j = 0; j < 8; ++j) w[j] = _mm512_shuffle_epi8(table, w[j]);
    }
  } else {
    for (int j = 0; j < 8; ++j) w[j] = _mm512_loadu_si512(blk + 64 * j);
  }
}

// Block b's int32 sums for kG rows (their grouped codes gq and Grouped gx), each started from its row's
// offset term, the rows' chains side by side.
template <int kKind, int kG>
CHATAPP_INLINE inline void block_sums(const __m512i w[8], const QuantizedActivations::Grouped* gx, const int8_t* gq,
                                      __m512i s[kG]) {
  for (int r = 0; r < kG; ++r)
    s[r] = code_offset(kKind) != 0 ? _mm512_set1_epi32(gx[r].start) : _mm512_setzero_si512();
  dots_side_by_side<kG>(w, gq, s);
}

// A block's float step for one row, on its int32 sum s: f + (s << shift) * d_w, and for the kinds with minimums
// + m_w * msum. The one sequence every vector loop runs (the portable loop's, a value at a time). The shift is
// vpsllvd, with a count per lane: on Zen 5 a shift by one count from an xmm register takes a turn on the ports the
// dots need, as a multiply does, and vpsllvd does not (12 independent dots with 4 of each beside them: 7.7 cycles
// against the dots' 5.8 alone, and 5.9).
template <bool kHasMin>
CHATAPP_INLINE inline __m512 block_step(__m512i s, int32_t shift, __m512 d, __m512 mins, float msum, __m512 f) {
  f = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sllv_epi32(s, _mm512_set1_epi32(shift))), d, f);
  if constexpr (kHasMin) f = _mm512_fmadd_ps(mins, _mm512_set1_ps(msum), f);
  return f;
}

// Output tiles [t0, t1) for a decode batch of kR rows (2-8): each row's 16 float sums stay in a register across
// the tile's blocks, where the general loop below keeps them in L1 (a load and a store per row and block, on
// ports the dots' broadcasts also need). The float steps are the general loop's, in its order: same bits.
template <int kKind, int kR>
void tile_loop_rows(const QuantizedActivations& a, int64_t k, const uint8_t* packed, int64_t t0, int64_t t1,
                    float* y, int64_t n_out, const float* bias) {
  constexpr BlockLayout L = block_layout(kKind);
  constexpr int64_t kAhead = 24;
  const int64_t blocks = k / kQuantBlock;
  auto tile_rows = [&](const uint8_t* tile, int64_t n0, const TileOut512& out) CHATAPP_INLINE {
    __m512 acc[kR];
    for (int r = 0; r < kR; ++r) acc[r] = _mm512_setzero_ps();
    for_each_block<L.tile_bytes>(tile, blocks, kAhead, true, [&](const uint8_t* blk, int64_t b) CHATAPP_INLINE {
      __m512i w[8];
      unpack_block<kKind>(blk, w);
      const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + L.scale_offset)));
      __m512 mins = _mm512_setzero_ps();
      if constexpr (L.has_min)
        mins = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + L.min_offset)));
      const int64_t first = a.grouped(0, b, k);
      const QuantizedActivations::Grouped* gx = a.by_block.data() + first;
      const int8_t* gq = a.q_by_block.data() + first * kQuantBlock;
      __m512i s[kR];
      block_sums<kKind, kR>(w, gx, gq, s);
      for (int r = 0; r < kR; ++r) acc[r] = block_step<L.has_min>(s[r], gx[r].shift, d, mins, gx[r].msum, acc[r]);
    });
    for (int r = 0; r < kR; ++r) out.store(_mm512_mul_ps(acc[r], _mm512_set1_ps(a.unit[r])), y + r * n_out + n0);
  };
  for_each_tile<TileOut512, L.tile_bytes>(packed, blocks, t0, t1, n_out, bias, tile_rows);
}

// Output tiles [t0, t1) for one row (a decode step): the tile's 16 sums stay in a register across its blocks, and
// 4-bit codes keep their high nibbles in place (16 x the code, still an unsigned byte: the inputs 16-31 dot is
// shifted back once, exactly, as kquant.cpp's Q4_K one-row loop does). Why a loop of its own: inside the general
// loop below, one row kept its sums in L1 and spilled a register of codes per block; its few extra instructions
// a block cost ~5% of a 1B Q8_0 model's decode, which is limited by how far the core runs ahead of memory. The
// float steps are the general loop's, in its order: same bits. Blocks kAhead on are fetched with kHint
// (tile_walk.h's DecodePrefetch says which, by CPU).
template <int kKind, int kHint, int64_t kAhead>
void tile_loop_one_row(const QuantizedActivations& a, int64_t k, const uint8_t* packed, int64_t t0, int64_t t1,
                       float* y, int64_t n_out, const float* bias) {
  constexpr BlockLayout L = block_layout(kKind);
  constexpr bool kHighInPlace = kKind == kKindQ4 || kKind == kKindQ4S;
  const int64_t blocks = k / kQuantBlock;
  const int8_t* xq = a.q.data();
  const int32_t* shift = a.shift.data();
  const float* msum = a.msum.data();
  const int32_t* qsum = a.qsum.data();
  const __m512 unit = _mm512_set1_ps(a.unit[0]);
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  auto tile_row = [&](const uint8_t* tile, int64_t n0, const TileOut512& out) CHATAPP_INLINE {
    __m512 f = _mm512_setzero_ps();
    for_each_block<L.tile_bytes, kHint>(tile, blocks, kAhead, true, [&](const uint8_t* blk, int64_t b) CHATAPP_INLINE {
      __m512i w[8];
      if constexpr (kHighInPlace) {
        for (int j = 0; j < 4; ++j) {
          const __m512i v = _mm512_loadu_si512(blk + 64 * j);
          w[j] = _mm512_and_si512(v, low4);
          w[j + 4] = _mm512_andnot_si512(low4, v);
        }
      } else {
        unpack_block<kKind>(blk, w);
      }
      const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + L.scale_offset)));
      __m512 mins = _mm512_setzero_ps();
      if constexpr (L.has_min)
        mins = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + L.min_offset)));
      const int8_t* x = xq + b * kQuantBlock;
      // Two independent chains (inputs 0-15 and 16-31) halve the dot instructions' latency.
      __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
      for (int j = 0; j < 4; ++j) {
        s0 = dot_broadcast4(s0, w[j], x + 4 * j);
        s1 = dot_broadcast4(s1, w[4 + j], x + 16 + 4 * j);
      }
      if constexpr (kHighInPlace) s1 = _mm512_srai_epi32(s1, 4);
      __m512i s = _mm512_add_epi32(s0, s1);
      if constexpr (code_offset(kKind) != 0) s = _mm512_sub_epi32(s, _mm512_set1_epi32(code_offset(kKind) * qsum[b]));
      f = block_step<L.has_min>(s, shift[b], d, mins, msum[b], f);
    });
    out.store(_mm512_mul_ps(f, unit), y + n0);
  };
  for_each_tile<TileOut512, L.tile_bytes>(packed, blocks, t0, t1, n_out, bias, tile_row);
}

// Tiles t and t + 1 for every row (more than 8), 64 rows a pass, their float sums in L1. Each row's 4-byte words
// of activations are broadcast into a register once and serve both tiles' dots. Why: the one-tile loop below
// reads each word with its dot (a load per dot), and on Zen 5, where a dot, a multiply and a fused add share two
// ports, the loads then set the pace: a replica of the loop ran 8 dots and 2 float steps per row, block and tile
// in 5.8 cycles, 5.2 with the words shared (the ports' bound is 5). The float steps are the one-tile loop's, in
// its order: same bits.
template <int kKind>
void tile_pair_loop(const QuantizedActivations& a, int64_t rows, int64_t k, const uint8_t* packed, int64_t t, float* y,
                    int64_t n_out, const float* bias) {
  constexpr BlockLayout L = block_layout(kKind);
  constexpr int64_t kRows = QuantizedActivations::kChunkRows, kAhead = 24;
  const int64_t blocks = k / kQuantBlock;
  alignas(64) float acc[2][kRows * kQuantTile];
  const uint8_t* tile[2] = {packed + t * blocks * L.tile_bytes, packed + (t + 1) * blocks * L.tile_bytes};
  // The first block writes the sums (no zeroing pass: GCC made it a memset call per pass, ~2% of a prompt's samples).
  walk_tile_pair<kRows, true>(rows, t, acc, y, n_out, bias, [&](int64_t m0, int64_t count) CHATAPP_INLINE {
    for (int64_t b = 0; b < blocks; ++b) {
      __m512i w[2][8];
      __m512 d[2], mins[2];
      for (int h = 0; h < 2; ++h) {
        const uint8_t* blk = tile[h] + b * L.tile_bytes;
        // kAhead blocks on in tile h's stream, tiles t + h, t + h + 2, ...: past the tile's end, the next pair's tile
        // h (the one-tile walk's distance ran into tile t + 1, which this pass already reads)
        const int64_t on = b + kAhead;
        const uint8_t* ahead = tile[h] + (on / blocks * 2 * blocks + on % blocks) * L.tile_bytes;
        for (int64_t off = 0; off < L.tile_bytes; off += 64)
          _mm_prefetch(reinterpret_cast<const char*>(ahead + off), _MM_HINT_T1);
        unpack_block<kKind>(blk, w[h]);
        d[h] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + L.scale_offset)));
        mins[h] = L.has_min ? _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + L.min_offset)))
                            : _mm512_setzero_ps();
      }
      const int64_t first = a.grouped(m0, b, k);  // rows m0.. follow it
      const QuantizedActivations::Grouped* gx = a.by_block.data() + first;
      const int8_t* gq = a.q_by_block.data() + first * kQuantBlock;
      auto group = [&](auto size, int64_t r0) CHATAPP_INLINE {
        constexpr int kG = decltype(size)::value;
        __m512i s[2][kG];
        for (int r = 0; r < kG; ++r)
          s[0][r] = s[1][r] = code_offset(kKind) != 0 ? _mm512_set1_epi32(gx[r0 + r].start) : _mm512_setzero_si512();
        for (int j = 0; j < 8; ++j)
          for (int r = 0; r < kG; ++r) {
            const __m512i x = broadcast4(gq + kQuantBlock * (r0 + r) + 4 * (j % 4) + 16 * (j / 4));
            s[0][r] = _mm512_dpbusd_epi32(s[0][r], w[0][j], x);
            s[1][r] = _mm512_dpbusd_epi32(s[1][r], w[1][j], x);
          }
        for (int r = 0; r < kG; ++r)
          for (int h = 0; h < 2; ++h) {
            float* out = acc[h] + (r0 + r) * kQuantTile;
            const QuantizedActivations::Grouped& g = gx[r0 + r];
            const __m512 sum = b == 0 ? _mm512_setzero_ps() : _mm512_load_ps(out);
            _mm512_store_ps(out, block_step<L.has_min>(s[h][r], g.shift, d[h], mins[h], g.msum, sum));
          }
      };
      for_row_groups<4>(count, group);
    }
    for (int64_t r = 0; r < count; ++r)  // the rows' sums from their unit to y's
      for (int h = 0; h < 2; ++h) {
        float* out = acc[h] + r * kQuantTile;
        _mm512_store_ps(out, _mm512_mul_ps(_mm512_load_ps(out), _mm512_set1_ps(a.unit[m0 + r])));
      }
  });
}

// Output tiles [t0, t1) for every row, 64 rows at a time so the float sums stay in L1.
template <int kKind>
void tile_loop(VnniLoop, const QuantizedActivations& a, int64_t rows, int64_t k, const uint8_t* packed, int64_t t0,
               int64_t t1, float* y, int64_t n_out, const float* bias) {
  constexpr BlockLayout L = block_layout(kKind);
  constexpr int64_t kRows = QuantizedActivations::kChunkRows;  // rows per pass: a chunk of by_block
  constexpr int64_t kAhead = 24;  // blocks of 32 inputs prefetched ahead into L2 (~8-14 KB; kquant.cpp says why)
  // A decode batch runs the rows loop unless this CPU streams faster through the pair loop (tile_walk.h).
  switch (rows > 1 && rows <= 8 && decode_batches_in_pairs() ? int64_t{0} : rows) {
    case 1:
      if (decode_prefetches_nta())
        return tile_loop_one_row<kKind, _MM_HINT_NTA, 16>(a, k, packed, t0, t1, y, n_out, bias);
      return tile_loop_one_row<kKind, _MM_HINT_T1, 24>(a, k, packed, t0, t1, y, n_out, bias);
    case 2: return tile_loop_rows<kKind, 2>(a, k, packed, t0, t1, y, n_out, bias);
    case 3: return tile_loop_rows<kKind, 3>(a, k, packed, t0, t1, y, n_out, bias);
    case 4: return tile_loop_rows<kKind, 4>(a, k, packed, t0, t1, y, n_out, bias);
    case 5: return tile_loop_rows<kKind, 5>(a, k, packed, t0, t1, y, n_out, bias);
    case 6: return tile_loop_rows<kKind, 6>(a, k, packed, t0, t1, y, n_out, bias);
    case 7: return tile_loop_rows<kKind, 7>(a, k, packed, t0, t1, y, n_out, bias);
    case 8: return tile_loop_rows<kKind, 8>(a, k, packed, t0, t1, y, n_out, bias);
    default: break;
  }
  // Rows this far are a decode batch that runs the pair loop, or a prompt's (tile_walk.h: PromptTileLoop).
  if (rows <= 8 || prompt_tiles_in_pairs(single_tile_prompts_on_zen4(kKind)))
    for (; t0 + 1 < t1; t0 += 2) tile_pair_loop<kKind>(a, rows, k, packed, t0, y, n_out, bias);
  if (t0 == t1) return;
  // One tile at a time (a prompt's rows on CPUs where that is faster, or the last tile of an odd count), for
  // every row.
  const int64_t blocks = k / kQuantBlock;
  alignas(64) float acc[kRows * kQuantTile];
  auto block = [&](const uint8_t* blk, int64_t b, int64_t m0, int64_t count) CHATAPP_INLINE {
    __m512i w[8];
    unpack_block<kKind>(blk, w);
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + L.scale_offset)));
    __m512 mins = _mm512_setzero_ps();
    if constexpr (L.has_min)
      mins = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + L.min_offset)));
    // Many rows: 8 at a time (block_sums), each finished into its sums in L1.
    const int64_t first = a.grouped(m0, b, k);  // rows m0.. follow it
    const QuantizedActivations::Grouped* gx = a.by_block.data() + first;
    const int8_t* gq = a.q_by_block.data() + first * kQuantBlock;
    auto finish = [&](int64_t r, __m512i s) CHATAPP_INLINE {
      float* out = acc + r * kQuantTile;
      __m512 f = block_step<L.has_min>(s, gx[r].shift, d, mins, gx[r].msum, _mm512_load_ps(out));
      if (b == blocks - 1) f = _mm512_mul_ps(f, _mm512_set1_ps(a.unit[m0 + r]));
      _mm512_store_ps(out, f);
    };
    auto group = [&](auto size, int64_t r0) CHATAPP_INLINE {
      constexpr int kG = decltype(size)::value;
      __m512i sums[kG];
      block_sums<kKind, kG>(w, gx + r0, gq + r0 * kQuantBlock, sums);
      for (int i = 0; i < kG; ++i) finish(r0 + i, sums[i]);
    };
    for_row_groups(count, group);
  };
  walk_tiles<TileOut512, kRows, L.tile_bytes, false>(packed, blocks, t0, t1, rows, kAhead, acc, y, n_out, bias, block);
}
#endif

#if defined(CHATAPP_HAVE_AVX2)
// The VNNI loop's arithmetic on 256-bit registers, a tile's 16 channels as two halves of 8: the same
// exact int32 block sums (dot4x8), then the same float steps in the same order, so every output has
// the VNNI loop's bits. Q8's codes u = q + 128 are taken back to signed q and multiplied as |q| by
// x with q's sign, which keeps maddubs within int16 and gives dot(u, x) - 128 * sum(x) directly.
template <int kKind>
void tile_loop(Avx2Loop, const QuantizedActivations& a, int64_t rows, int64_t k, const uint8_t* packed, int64_t t0,
               int64_t t1, float* y, int64_t n_out, const float* bias) {
  constexpr BlockLayout L = block_layout(kKind);
  constexpr int64_t kRows = 64, kAhead = 24;
  const int64_t blocks = k / kQuantBlock;
  alignas(32) float acc[kRows * kQuantTile];
  const __m256i low4 = _mm256_set1_epi8(0x0F), flip = _mm256_set1_epi8(static_cast<char>(0x80));
  auto block = [&](const uint8_t* blk, int64_t b, int64_t m0, int64_t count) CHATAPP_INLINE {
    for (int h = 0; h < 2; ++h) {  // channels 8h..8h+7: bytes 32h..32h+31 of every 64-byte chunk
      __m256i w[8], sign[8];
      if constexpr (nibble_codes(kKind)) {
        for (int j = 0; j < 4; ++j) {
          const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 * j + 32 * h));
          w[j] = _mm256_and_si256(v, low4);
          w[j + 4] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
        }
        if constexpr (five_bit(kKind))
          or_fifth_bits(w, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + kFifthBits + 32 * h)));
        if constexpr (kKind == kKindIQ4NL) {  // the values, signed, read as Q8's below
          const __m256i table = _mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(kIQ4Values)));
          for (int j = 0; j < 8; ++j) {
            sign[j] = _mm256_shuffle_epi8(table, w[j]);
            w[j] = _mm256_abs_epi8(sign[j]);
          }
        }
      } else {
        for (int j = 0; j < 8; ++j) {
          w[j] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 * j + 32 * h));
          if constexpr (kKind == kKindQ8) {
            sign[j] = _mm256_xor_si256(w[j], flip);  // q = u - 128 as a signed byte
            w[j] = _mm256_abs_epi8(sign[j]);         // |q| <= 128, read unsigned
          }
        }
      }
      const __m256 d = half8(blk + L.scale_offset + 16 * h);
      const __m256 mins = L.has_min ? half8(blk + L.min_offset + 16 * h) : _mm256_setzero_ps();
      for (int64_t r = 0; r < count; ++r) {
        const int64_t row = m0 + r, rb = row * blocks + b;
        const int8_t* xq = a.q.data() + row * k + b * kQuantBlock;
        auto x4 = [&](int j) {
          const __m256i x = broadcast4x8(xq + 4 * (j % 4) + 16 * (j / 4));
          if constexpr (byte_values(kKind)) return _mm256_sign_epi8(x, sign[j]);
          return x;
        };
        __m256i s0 = dot4x8(_mm256_setzero_si256(), w[0], x4(0));
        __m256i s1 = dot4x8(_mm256_setzero_si256(), w[4], x4(4));
        s0 = dot4x8(s0, w[1], x4(1));
        s1 = dot4x8(s1, w[5], x4(5));
        s0 = dot4x8(s0, w[2], x4(2));
        s1 = dot4x8(s1, w[6], x4(6));
        s0 = dot4x8(s0, w[3], x4(3));
        s1 = dot4x8(s1, w[7], x4(7));
        __m256i s = _mm256_add_epi32(s0, s1);
        if constexpr (!byte_values(kKind) && code_offset(kKind) != 0)  // the sign trick took Q8's offset off
          s = _mm256_sub_epi32(s, _mm256_set1_epi32(code_offset(kKind) * a.qsum[rb]));
        float* out = acc + r * kQuantTile + 8 * h;
        __m256 f = _mm256_load_ps(out);
        f = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sllv_epi32(s, _mm256_set1_epi32(a.shift[rb]))), d, f);
        if constexpr (L.has_min) f = _mm256_fmadd_ps(mins, _mm256_set1_ps(a.msum[rb]), f);
        if (b == blocks - 1) f = _mm256_mul_ps(f, _mm256_set1_ps(a.unit[row]));
        _mm256_store_ps(out, f);
      }
    }
  };
  walk_tiles<TileOut256, kRows, L.tile_bytes, false>(packed, blocks, t0, t1, rows, kAhead, acc, y, n_out, bias, block);
}
#endif

// The same arithmetic one value at a time, for CPUs without AVX2 (correct, not fast).
template <int kKind>
void tile_loop(PortableLoop, const QuantizedActivations& a, int64_t rows, int64_t k, const uint8_t* packed,
               int64_t t0, int64_t t1, float* y, int64_t n_out, const float* bias) {
  constexpr BlockLayout L = block_layout(kKind);
  auto block = [&](const uint8_t* blk, const int8_t* xq, int64_t rb, int64_t c, float& f) {
    int32_t dot = 0;
    for (int64_t i = 0; i < kQuantBlock; ++i) {
      int32_t wq;
      if constexpr (nibble_codes(kKind)) {
        const uint8_t byte = blk[64 * ((i % 16) / 4) + 4 * c + i % 4];
        wq = i < 16 ? (byte & 0x0F) : (byte >> 4);
        if constexpr (five_bit(kKind)) wq |= ((blk[kFifthBits + 4 * c + i % 4] >> ((i % 16) / 4 + 4 * (i / 16))) & 1) << 4;
        if constexpr (kKind == kKindIQ4NL) wq = kIQ4Codes[wq];
      } else {
        wq = blk[64 * (i / 4) + 4 * c + i % 4];
      }
      dot += wq * xq[i];
    }
    dot -= code_offset(kKind) * a.qsum[rb];
    f = std::fma(static_cast<float>(in_row_unit(dot, a.shift[rb])), half_at(blk + L.scale_offset + 2 * c), f);
    if constexpr (L.has_min) f = std::fma(half_at(blk + L.min_offset + 2 * c), a.msum[rb], f);
    const int64_t blocks = k / kQuantBlock;
    if (rb % blocks == blocks - 1) f *= a.unit[rb / blocks];
  };
  walk_outputs<kQuantBlock, L.tile_bytes>(a, packed, k, t0, t1, rows, y, n_out, bias, block);
}

// The vector loops this build has.
#if defined(CHATAPP_HAVE_VNNI)
constexpr bool kHasVnni = true;
#else
constexpr bool kHasVnni = false;
#endif
#if defined(CHATAPP_HAVE_AVX2)
constexpr bool kHasAvx2 = true;
#else
constexpr bool kHasAvx2 = false;
#endif

}  // namespace

bool block_quant_fast() { return kHasVnni || kHasAvx2; }

std::vector<std::string> block_quant_paths() {
  std::vector<std::string> paths;
  if (kHasVnni) paths.push_back("vnni");
  if (kHasAvx2) paths.push_back("avx2");
  paths.push_back("portable");
  return paths;
}

namespace {

// The choice called `name` among `choices` into `setting` (an enum's value as an int), or an error that names the
// choices: what the loop settings below share.
template <class Choice>
void store_choice(std::atomic<int>& setting, const std::string& name, const char* what,
                  std::initializer_list<std::pair<const char*, Choice>> choices) {
  std::string names;
  size_t i = 0;
  for (const auto& [choice, value] : choices) {
    if (name == choice) return setting.store(static_cast<int>(value), std::memory_order_relaxed);
    if (i > 0) names += i + 1 == choices.size() ? " or " : ", ";
    names += choice;
    ++i;
  }
  TORCH_CHECK(false, "unknown ", what, " '", name, "' (", names, ")");
}

}  // namespace

void set_decode_batch_loop(const std::string& name) {
  store_choice<DecodeBatchLoop>(decode_batch_loop_setting(), name, "decode batch loop",
                                {{"auto", DecodeBatchLoop::kAuto}, {"rows", DecodeBatchLoop::kRows},
                                 {"pairs", DecodeBatchLoop::kPairs}});
}

std::string decode_batch_loop() { return decode_batches_in_pairs() ? "pairs" : "rows"; }

void set_decode_prefetch(const std::string& name) {
  store_choice<DecodePrefetch>(decode_prefetch_setting(), name, "decode prefetch",
                               {{"auto", DecodePrefetch::kAuto}, {"t1", DecodePrefetch::kT1},
                                {"nta", DecodePrefetch::kNta}});
}

std::string decode_prefetch() { return decode_prefetches_nta() ? "nta" : "t1"; }

void set_prompt_tile_loop(const std::string& name) {
  store_choice<PromptTileLoop>(prompt_tile_loop_setting(), name, "prompt tile loop",
                               {{"auto", PromptTileLoop::kAuto}, {"single", PromptTileLoop::kSingle},
                                {"pairs", PromptTileLoop::kPairs}});
}

std::string prompt_tile_loop(int64_t kind) {
  return prompt_tiles_in_pairs(single_tile_prompts_on_zen4(kind)) ? "pairs" : "single";
}

KernelPath kernel_path(const std::string& name) {
  if (name == "best") return kHasVnni ? kPathVnni : kHasAvx2 ? kPathAvx2 : kPathPortable;
  if (name == "portable") return kPathPortable;
  TORCH_CHECK(name == "vnni" || name == "avx2", "unknown kernel path '", name, "' (best, vnni, avx2 or portable)");
  TORCH_CHECK(name == "vnni" ? kHasVnni : kHasAvx2, "the ", name, " loop was not compiled into this build");
  return name == "vnni" ? kPathVnni : kPathAvx2;
}

int64_t kind_tile_bytes(int64_t kind) {
  switch (kind) {
    case kKindQ4: return kQ4TileBytes;
    case kKindQ4S: return kQ4STileBytes;
    case kKindQ5S: return kQ5STileBytes;
    case kKindQ5M: return kQ5MTileBytes;
    case kKindQ8: return kQ8TileBytes;
    case kKindIQ4NL: return kQ4STileBytes;
    case kKindQ4K: return kQ4KTileBytes;
    case kKindQ5K: return kQ5KTileBytes;
    case kKindQ6K: return kQ6KTileBytes;
    case kKindIQ4X: return kIQ4XTileBytes;
    default: return 0;
  }
}

int64_t kind_block_inputs(int64_t kind) { return kind >= kKindQ4K ? kSuperBlock : kQuantBlock; }

namespace {

// Checks that packed holds a linear of kind `kind` over k inputs and out_features outputs, and that x is float32
// rows with unit stride (x_shape: what the error says x must be).
void check_packing(const at::Tensor& x, int64_t k, const at::Tensor& packed, int64_t kind, int64_t out_features,
                   const char* x_shape) {
  const int64_t tile_bytes = kind_tile_bytes(kind), block = kind_block_inputs(kind);
  TORCH_CHECK(tile_bytes > 0, "unknown packed weight kind ", kind);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1, x_shape);
  TORCH_CHECK(packed.is_contiguous() && packed.scalar_type() == at::kByte && packed.dim() == 3,
              "packed must be contiguous uint8 [tiles, blocks, bytes]");
  TORCH_CHECK(k % block == 0 && packed.size(1) == k / block, "in_features must match the packing");
  TORCH_CHECK(packed.size(2) == tile_bytes, "packed tile size does not match its kind");
  TORCH_CHECK(packed.size(0) * kQuantTile >= out_features, "packing has too few output channels");
}

// y = the quantized rows a times a block kind's packed weights (+ bias): the tiles shared out between the threads.
void block_tiles(const QuantizedActivations& a, int64_t rows, int64_t k, const at::Tensor& packed, int64_t kind,
                 int64_t out_features, const std::optional<at::Tensor>& bias, KernelPath path, at::Tensor& y) {
  at::Tensor bias_c = bias && bias->defined() ? bias->contiguous() : at::Tensor();
  const uint8_t* pp = packed.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  const float* bp = bias_c.defined() ? bias_c.data_ptr<float>() : nullptr;
  for_tiles_balanced(packed.size(0), [&](int64_t t0, int64_t t1) {
    on_path(path, [&](auto loop) {
      if (kind == kKindQ4) tile_loop<kKindQ4>(loop, a, rows, k, pp, t0, t1, yp, out_features, bp);
      else if (kind == kKindQ4S) tile_loop<kKindQ4S>(loop, a, rows, k, pp, t0, t1, yp, out_features, bp);
      else if (kind == kKindQ5S) tile_loop<kKindQ5S>(loop, a, rows, k, pp, t0, t1, yp, out_features, bp);
      else if (kind == kKindQ5M) tile_loop<kKindQ5M>(loop, a, rows, k, pp, t0, t1, yp, out_features, bp);
      else if (kind == kKindIQ4NL) tile_loop<kKindIQ4NL>(loop, a, rows, k, pp, t0, t1, yp, out_features, bp);
      else tile_loop<kKindQ8>(loop, a, rows, k, pp, t0, t1, yp, out_features, bp);
    });
  });
}

thread_local QuantizedActivations acts;  // the calling thread's, reused from call to call

}  // namespace

bool is_block_kind(int64_t kind) { return kind_tile_bytes(kind) > 0 && kind < kKindQ4K && !is_float_rows_kind(kind); }

at::Tensor block_linear(const at::Tensor& x, const at::Tensor& packed, int64_t kind, int64_t out_features,
                        const std::optional<at::Tensor>& bias, const std::string& path_name) {
  const KernelPath path = kernel_path(path_name);
  if (is_float_rows_kind(kind)) return float_rows_linear(x, packed, kind, out_features, bias, path);
  check_packing(x, x.dim() == 2 ? x.size(1) : 0, packed, kind, out_features, "x must be [M, K] float32 rows");
  const int64_t rows = x.size(0), k = x.size(1);
  at::Tensor y = pooled_empty({rows, out_features}, x.options());
  if (rows == 0) return y;
  if (kind >= kKindQ4K) {
    at::Tensor bias_c = bias && bias->defined() ? bias->contiguous() : at::Tensor();
    const KQuantPart part{packed.data_ptr<uint8_t>(), packed.size(0), kind, out_features,
                          bias_c.defined() ? bias_c.data_ptr<float>() : nullptr, y.data_ptr<float>()};
    kquant_linear_parts(x, &part, 1, path);
    return y;
  }
  quantize_rows(x, acts, path == kPathVnni, code_offset(static_cast<int>(kind)));
  block_tiles(acts, rows, k, packed, kind, out_features, bias, path, y);
  return y;
}

at::Tensor block_linear_parts(const at::Tensor& x, const std::vector<at::Tensor>& packed, const std::vector<int64_t>& kinds,
                              const std::vector<int64_t>& out_features, const std::optional<at::Tensor>& bias,
                              const std::string& path_name) {
  const size_t count = packed.size();
  TORCH_CHECK(count > 0 && kinds.size() == count && out_features.size() == count,
              "block_linear_parts takes one kind and one output count per packed part");
  const int64_t total = std::accumulate(out_features.begin(), out_features.end(), int64_t{0});
  at::Tensor bias_c = bias && bias->defined() ? bias->contiguous() : at::Tensor();
  TORCH_CHECK(!bias_c.defined() || bias_c.numel() == total, "bias must have one value per output");
  const bool all_k = std::all_of(kinds.begin(), kinds.end(), [](int64_t kind) { return kind >= kKindQ4K; });
  if (!all_k) {
    std::vector<at::Tensor> ys;
    for (size_t i = 0; i < count; ++i) ys.push_back(block_linear(x, packed[i], kinds[i], out_features[i], {}, path_name));
    at::Tensor y = at::cat(ys, 1);
    return bias_c.defined() ? y.add_(bias_c) : y;
  }
  const KernelPath path = kernel_path(path_name);
  const int64_t rows = x.dim() == 2 ? x.size(0) : 0;
  for (size_t i = 0; i < count; ++i)
    check_packing(x, x.dim() == 2 ? x.size(1) : 0, packed[i], kinds[i], out_features[i], "x must be [M, K] float32 rows");
  at::Tensor y = pooled_empty({rows, total}, x.options());
  if (rows == 0) return y;
  // One row is written in place (a part's outputs are its columns); more rows go to a buffer a part, then into y.
  std::vector<at::Tensor> ys;
  std::vector<KQuantPart> parts;
  int64_t column = 0;
  for (size_t i = 0; i < count; ++i) {
    float* out = y.data_ptr<float>() + column;
    if (rows > 1) {
      ys.push_back(pooled_empty({rows, out_features[i]}, x.options()));
      out = ys.back().data_ptr<float>();
    }
    const float* b = bias_c.defined() ? bias_c.data_ptr<float>() + column : nullptr;
    parts.push_back(KQuantPart{packed[i].data_ptr<uint8_t>(), packed[i].size(0), kinds[i], out_features[i], b, out});
    column += out_features[i];
  }
  kquant_linear_parts(x, parts.data(), static_cast<int64_t>(count), path);
  for (size_t i = 0, c = 0; rows > 1 && i < count; c += out_features[i++]) y.narrow(1, c, out_features[i]).copy_(ys[i]);
  return y;
}

at::Tensor block_linear_swiglu(const at::Tensor& gate_up, const at::Tensor& packed, int64_t kind,
                               int64_t out_features, const std::optional<at::Tensor>& bias,
                               const std::string& path_name) {
  const KernelPath path = kernel_path(path_name);
  TORCH_CHECK(is_block_kind(kind), "the fused SwiGLU projection takes a kind of blocks of 32, not kind ", kind);
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0, "gate_up must be [M, 2 K]");
  const int64_t rows = gate_up.size(0), k = gate_up.size(1) / 2, stride = gate_up.stride(0);
  check_packing(gate_up, k, packed, kind, out_features, "gate_up must be [M, 2 K] float32 rows");
  at::Tensor y = pooled_empty({rows, out_features}, gate_up.options());
  if (rows == 0) return y;
  const float* gp = gate_up.data_ptr<float>();
  auto swiglu_row = [&](int64_t r, std::vector<float>& scratch) {
    scratch.resize(k);
    silu_mul_row(gp + r * stride, gp + r * stride + k, scratch.data(), k);
    return static_cast<const float*>(scratch.data());
  };
  quantize_rows_from(rows, k, swiglu_row, acts, path == kPathVnni, code_offset(static_cast<int>(kind)));
  block_tiles(acts, rows, k, packed, kind, out_features, bias, path, y);
  return y;
}
