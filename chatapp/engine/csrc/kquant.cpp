// Linear layers on llama.cpp's K-quant weights (Q4_K, Q5_K, Q6_K), kept exactly as the file has them.
//
// Why: Q4_K_M files (Q4_K with Q6_K for some tensors) are what people download. Their weights live in
// super-blocks of 256 inputs: one fp16 scale d (and minimum scale dmin) per super-block and small
// integer scales per sub-block, so a weight is d * sc * q - dmin * m (Q4_K, Q5_K) or d * sc * (q - 32)
// (Q6_K). A float scale per sub-block would not hold d * sc exactly in fp16, and 32-bit ones would read
// a third more bytes per token; keeping the integer scales keeps both the weights and the bytes.
//
// How: activations are quantized per row and per super-block to int8 with one float scale dx (and the
// exact integer sums of each 16 codes). For a tile of 16 output channels and one group of 32 inputs,
// 8 AVX-512 VNNI dot instructions give each channel's exact int32 dot; the sub-block scales multiply it
// and it is summed over the super-block, then the super-block's float scales apply once:
//   Q4_K / Q5_K: y += fsum * (d * dx) - imin * (dmin * dx),  fsum = sum_g sc_g * dot_g, imin = sum_g m_g * xsum_g
//   Q6_K:        y += fsum * (d * dx),  fsum = sum_s sc_s * (dot_s - 32 * xsum_s)  (sub-blocks of 16)
// fsum is a float32 chain of fused multiply-adds in group (Q6_K: sub-block) order, the same in every loop:
// each product is exact (a dot is at most 2^17, a scale 2^6, or 2^16 and 2^7 for Q6_K) and so is the sum
// while it stays under 2^24. Why float: a 32-bit integer multiply (vpmullo) per scale costs 2 vector-port
// operations and its add 1, a convert and a fused add 1 each, and those ports are what the dots wait for
// (measured, alternated: Q6_K prompts of 512 rows 11% faster, 8 rows 5%; Q4_K 5% and 2%). imin is an exact
// int32 sum, so the VNNI loops gather it in the cheapest order: word dots (vpdpwssd) on two groups' factors
// at once, once per super-block rather than a multiply per group. Each Q6_K sub-block's dot chain starts at
// -32 * xsum_s (read from memory), so its offset costs no instruction of its own.
// Every output runs the same float steps whatever the batch holds: answers are batch-invariant, and the
// portable loop below does the same arithmetic one value at a time (tests hold the two to the same bits).
//
// Packed layout, per linear: [tiles of 16 output channels][super-blocks][tile bytes]. The codes of
// group g (inputs 32g..32g+31) take 256 bytes at 256g in the Q4 layout of block_quant.cpp: in chunk j
// (64 bytes), byte 4c + i holds channel c's input 4j + i in its low nibble and 16 + 4j + i in its high
// nibble. Then, by kind:
//   Q4_K: d[16] fp16 @2048, dmin[16] fp16 @2080, then the 8 groups' 6-bit scales of the 16 channels @2112 and
//         their minimums @2208, each in six_bit_scales.h's 96 bytes of planes: the file's bytes, no more.
//   Q5_K: each group's fifth bits @2048 + 64g (byte p, bit j: the code of register j, lane p, see
//         unpack below), then d @2560, dmin @2592, scales @2624, minimums @2720 (planes as Q4_K's).
//   Q6_K: each group's bits 4-5 @2048 + 128g (two 64-byte planes, registers 0-3 and 4-7, two bits each),
//         then d[16] fp16 @3072, sc[16 sub-blocks][16] int8 @3104.
//   IQ4X (IQ4_XS: w = d * sc * v, v one of IQ4_NL's 16 values in -127..113, sc = ls - 32 per group): the
//         4-bit indices in the Q4 layout, then d[16] fp16 @2048, sc[8 groups][16] int8 @2080. A table lookup
//         (vpshufb) turns 64 indices into their values + 128, unsigned bytes for the dots; from there its
//         arithmetic is Q6_K's with an offset of 128 for 32, each group's scale serving both its sub-blocks.
// gguf_repack.cpp writes all four.
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "avx2_dot.h"
#include "block_quant.h"
#include "iq4_values.h"
#include "six_bit_scales.h"
#include "tile_walk.h"

namespace {

// Activations per row: int8 codes, one scale per super-block and the integer sum of each 16 codes.
struct SuperBlockActivations {
  std::vector<int8_t> q;       // [M, K]
  std::vector<float> scale;    // [M, K / 256]
  std::vector<int32_t> sum16;  // [M, K / 16]
  // [M, K / 64]: the sums of inputs 64p..64p+31 and 64p+32..64p+63 (groups 2p and 2p+1) as the low and high
  // int16 of one int32 (|sum| <= 32 * 128 fits), so one VNNI word dot (vpdpwssd) takes two groups' minimums.
  std::vector<int32_t> pair32;
  // [M, K / 16]: -32 x each sum of 16, where a Q6_K sub-block's dot chain starts (its codes' offset of 32 taken
  // off for free: the VNNI loops read it with a broadcast from memory)
  std::vector<int32_t> q6_start;
  // The codes again, for the batched VNNI loop, in the order it reads them: [rows / kChunkRows][K / 32 groups]
  // [kChunkRows][32]. It takes one group of inputs for 32 rows in turn; in q those sit K bytes apart, a
  // stride the prefetchers miss (measured: 6-18% slower than codes in L1), here they are one 1 KB run.
  // chunk: kChunkRows, or the batch's rows when fewer (a decode batch's copy dense, as block_quant.cpp's).
  static constexpr int64_t kChunkRows = 32;
  int64_t chunk = kChunkRows;
  std::vector<int8_t> by_group;

  void resize(int64_t rows, int64_t k) {
    if (q.size() < static_cast<size_t>(rows * k)) q.resize(rows * k);
    if (scale.size() < static_cast<size_t>(rows * (k / kSuperBlock))) scale.resize(rows * (k / kSuperBlock));
    if (sum16.size() < static_cast<size_t>(rows * (k / 16))) sum16.resize(rows * (k / 16));
    if (pair32.size() < static_cast<size_t>(rows * (k / 64))) pair32.resize(rows * (k / 64));
    if (q6_start.size() < static_cast<size_t>(rows * (k / 16))) q6_start.resize(rows * (k / 16));
  }

  // Where row r's codes of group g (inputs 32g..32g+31) start in by_group.
  int64_t grouped(int64_t r, int64_t g, int64_t k) const { return ((r / chunk * (k / 32) + g) * chunk + r % chunk) * 32; }
};

// Two int32 sums as the low and high int16 of one int32 (each must fit: sums of at most 32 codes do).
inline int32_t word_pair(int32_t low, int32_t high) {
  return static_cast<int32_t>((static_cast<uint32_t>(low) & 0xFFFFu) | (static_cast<uint32_t>(high) << 16));
}

void quantize_row_superblocks(const float* x, int64_t k, int8_t* q, float* scale, int32_t* sum16, int32_t* pair32,
                              int32_t* q6_start) {
  for (int64_t b = 0; b < k / kSuperBlock; ++b) {
    const float* xb = x + b * kSuperBlock;
    int8_t* qb = q + b * kSuperBlock;
    float amax = 0.f;
#if defined(__AVX512F__)
    __m512 m = _mm512_setzero_ps();
    for (int i = 0; i < kSuperBlock; i += 16) m = _mm512_max_ps(m, _mm512_abs_ps(_mm512_loadu_ps(xb + i)));
    amax = _mm512_reduce_max_ps(m);
    const __m512 inv = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
    for (int i = 0; i < kSuperBlock; i += 16) {
      const __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(xb + i), inv));  // nearest even
      _mm_storeu_si128(reinterpret_cast<__m128i*>(qb + i), _mm512_cvtsepi32_epi8(v));
      sum16[b * 16 + i / 16] = _mm512_reduce_add_epi32(v);
    }
#else
    for (int64_t i = 0; i < kSuperBlock; ++i) amax = std::max(amax, std::fabs(xb[i]));
    const float inv = amax > 0.f ? 127.f / amax : 0.f;
    for (int64_t s = 0; s < 16; ++s) {
      int32_t total = 0;
      for (int64_t i = 16 * s; i < 16 * s + 16; ++i) {
        const int32_t v = std::clamp(static_cast<int32_t>(std::nearbyint(xb[i] * inv)), -128, 127);
        qb[i] = static_cast<int8_t>(v);
        total += v;
      }
      sum16[b * 16 + s] = total;
    }
#endif
    scale[b] = amax / 127.f;
    const int32_t* s = sum16 + b * 16;
    for (int64_t p = 0; p < 4; ++p) pair32[b * 4 + p] = word_pair(s[4 * p] + s[4 * p + 1], s[4 * p + 2] + s[4 * p + 3]);
    for (int64_t i = 0; i < 16; ++i) q6_start[b * 16 + i] = -32 * s[i];
  }
}

// regroup: also fill by_group, the batched VNNI loop's copy (only that loop reads it).
void quantize_superblock_rows(const at::Tensor& x, SuperBlockActivations& a, bool regroup) {
  const int64_t rows = x.size(0), k = x.size(1), stride = x.stride(0);
  a.resize(rows, k);
  const float* xp = x.data_ptr<float>();
  chatapp::parallel_for(0, rows, chatapp::row_grain(k), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      quantize_row_superblocks(xp + r * stride, k, a.q.data() + r * k, a.scale.data() + r * (k / kSuperBlock),
                               a.sum16.data() + r * (k / 16), a.pair32.data() + r * (k / 64),
                               a.q6_start.data() + r * (k / 16));
  });
  if (regroup && rows > 1) {  // one-row loops read q
    a.chunk = std::min(rows, SuperBlockActivations::kChunkRows);
    const int64_t chunks = (rows + a.chunk - 1) / a.chunk;
    if (a.by_group.size() < static_cast<size_t>(chunks * a.chunk * k)) a.by_group.resize(chunks * a.chunk * k);
    chatapp::parallel_for(0, rows, chatapp::row_grain(k), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r)
        for (int64_t g = 0; g < k / 32; ++g) std::memcpy(a.by_group.data() + a.grouped(r, g, k), a.q.data() + r * k + 32 * g, 32);
    });
  }
}

struct KindLayout {
  int64_t tile_bytes, d_offset, dmin_offset, sc_offset, m_offset, high_offset, high_stride;
};

constexpr KindLayout layout_of(int64_t kind) {
  return kind == kKindQ4K   ? KindLayout{kQ4KTileBytes, 2048, 2080, 2112, 2208, 0, 0}
         : kind == kKindQ5K ? KindLayout{kQ5KTileBytes, 2560, 2592, 2624, 2720, 2048, 64}
         : kind == kKindQ6K ? KindLayout{kQ6KTileBytes, 3072, 0, 3104, 0, 2048, 128}
                            : KindLayout{kIQ4XTileBytes, 2048, 0, 2080, 0, 0, 0};
}

// The kinds with signed integer scales and no minimums (Q6_K, IQ4X): their codes' offset is taken off where each
// sub-block of 16's dot chain starts, at -offset * its sum of 16 activations.
constexpr bool sub_block_scales(int64_t kind) { return kind == kKindQ6K || kind == kKindIQ4X; }
constexpr int32_t sub_block_offset(int64_t kind) { return kind == kKindIQ4X ? 128 : 32; }
// q6_start holds -32 * each sum of 16: IQ4X's chains start at 4 times that.
constexpr int32_t start_factor(int64_t kind) { return sub_block_offset(kind) / 32; }
// Where sub-block s's scales are (a row of 16 channels' int8s): Q6_K has one per 16 inputs, IQ4X one per 32.
constexpr int64_t scale_row(int64_t kind, int64_t s) { return kind == kKindIQ4X ? s / 2 : s; }


// The code of channel c's input i (0..255) of a (tile, super-block), as the kernel sees it.
template <int64_t kKind>
inline int32_t code_at(const uint8_t* blk, int64_t c, int64_t i) {
  constexpr KindLayout L = layout_of(kKind);
  const int64_t g = i / 32, in = i % 32, half = in / 16, j = (in % 16) / 4, lane = 4 * c + in % 4;
  const uint8_t byte = blk[256 * g + 64 * j + lane];
  int32_t q = half ? byte >> 4 : byte & 0x0F;
  const int64_t reg = j + 4 * half;  // the register (0..7) holding this input
  if constexpr (kKind == kKindQ5K) q |= ((blk[L.high_offset + 64 * g + lane] >> reg) & 1) << 4;
  if constexpr (kKind == kKindQ6K)
    q |= ((blk[L.high_offset + 128 * g + 64 * (reg / 4) + lane] >> (2 * (reg % 4))) & 3) << 4;
  if constexpr (kKind == kKindIQ4X) q = kIQ4Codes[q];
  return q;
}

template <int64_t kKind>
void tile_loop(PortableLoop, const SuperBlockActivations& a, int64_t rows, int64_t k, const uint8_t* packed,
               int64_t t0, int64_t t1, float* y, int64_t n_out, const float* bias) {
  constexpr KindLayout L = layout_of(kKind);
  auto block = [&](const uint8_t* blk, const int8_t* xq, int64_t rb, int64_t c, float& f) {
    const int32_t* xs = a.sum16.data() + rb * 16;
    const float dx = a.scale[rb];
    int32_t imin = 0, group_dot = 0;
    float fsum = 0.0f;
    for (int64_t s = 0; s < 16; ++s) {  // sub-blocks of 16 inputs
      int32_t dot = 0;
      for (int64_t i = 16 * s; i < 16 * s + 16; ++i) dot += code_at<kKind>(blk, c, i) * xq[i];
      if constexpr (sub_block_scales(kKind)) {
        const float sc = static_cast<float>(static_cast<int8_t>(blk[L.sc_offset + 16 * scale_row(kKind, s) + c]));
        fsum = std::fma(static_cast<float>(dot - sub_block_offset(kKind) * xs[s]), sc, fsum);
      } else {  // one scale per group of two sub-blocks: their dots are added first
        group_dot += dot;
        if (s % 2 == 1) {
          const float sc = static_cast<float>(chatapp::six_bit_at(blk + L.sc_offset, s / 2, c));
          fsum = std::fma(static_cast<float>(group_dot), sc, fsum);
          group_dot = 0;
        }
        imin += chatapp::six_bit_at(blk + L.m_offset, s / 2, c) * xs[s];
      }
    }
    f = std::fma(fsum, half_at(blk + L.d_offset + 2 * c) * dx, f);
    if constexpr (!sub_block_scales(kKind))
      f = std::fma(-static_cast<float>(imin), half_at(blk + L.dmin_offset + 2 * c) * dx, f);
  };
  walk_outputs<kSuperBlock, L.tile_bytes>(a, packed, k, t0, t1, rows, y, n_out, bias, block);
}

#if defined(CHATAPP_HAVE_VNNI)

// The 8 registers of group g's codes (register j: inputs 4j..4j+3 of 16 channels), with the group's
// integer scales (sc0 for inputs 0-15, sc1 for 16-31; the same one for Q4_K and Q5_K).
template <int64_t kKind>
inline void load_group(const uint8_t* blk, int64_t g, __m512i w[8], __m512i& sc0, __m512i& sc1) {
  constexpr KindLayout L = layout_of(kKind);
  const __m512i low4 = _mm512_set1_epi8(0x0F), bits45 = _mm512_set1_epi8(0x30);
  const uint8_t* codes = blk + 256 * g;
  for (int j = 0; j < 4; ++j) {
    const __m512i v = _mm512_loadu_si512(codes + 64 * j);
    w[j] = _mm512_and_si512(v, low4);
    w[j + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
  }
  if constexpr (kKind == kKindIQ4X) {
    const __m512i table = _mm512_broadcast_i32x4(_mm_load_si128(reinterpret_cast<const __m128i*>(kIQ4Codes)));
    for (int j = 0; j < 8; ++j) w[j] = _mm512_shuffle_epi8(table, w[j]);
  }
  if constexpr (kKind == kKindQ5K) or_fifth_bits(w, _mm512_loadu_si512(blk + L.high_offset + 64 * g));
  if constexpr (kKind == kKindQ6K) {
    for (int p = 0; p < 2; ++p) {
      const __m512i h = _mm512_loadu_si512(blk + L.high_offset + 128 * g + 64 * p);
      // register 4p + j's bits are bits 2j..2j+1 of each byte: moved to bits 4-5, w | (moved & 0x30) in one
      // ternary-logic instruction (0xF8: a | (b & c))
      w[4 * p + 0] = _mm512_ternarylogic_epi32(w[4 * p + 0], _mm512_slli_epi16(h, 4), bits45, 0xF8);
      w[4 * p + 1] = _mm512_ternarylogic_epi32(w[4 * p + 1], _mm512_slli_epi16(h, 2), bits45, 0xF8);
      w[4 * p + 2] = _mm512_ternarylogic_epi32(w[4 * p + 2], h, bits45, 0xF8);
      w[4 * p + 3] = _mm512_ternarylogic_epi32(w[4 * p + 3], _mm512_srli_epi16(h, 2), bits45, 0xF8);
    }
  }
  if constexpr (kKind == kKindIQ4X) {
    sc0 = sc1 = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + L.sc_offset + 16 * g)));
  } else if constexpr (kKind == kKindQ6K) {
    sc0 = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + L.sc_offset + 32 * g)));
    sc1 = _mm512_cvtepi8_epi32(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + L.sc_offset + 32 * g + 16)));
  } else {
    sc0 = sc1 = _mm512_cvtepu8_epi32(chatapp::six_bit_row(blk + L.sc_offset, g));
  }
}

// start + the dots of w[0..3] with inputs xq[0..15].
inline __m512i dot_chain(const __m512i w[4], const int8_t* xq, __m512i start = _mm512_setzero_si512()) {
  __m512i s = dot_broadcast4(start, w[0], xq);
  s = dot_broadcast4(s, w[1], xq + 4);
  s = dot_broadcast4(s, w[2], xq + 8);
  return dot_broadcast4(s, w[3], xq + 12);
}

// The float32 value of group g's 16 integer scales (Q4_K, Q5_K).
template <int64_t kKind>
CHATAPP_INLINE inline __m512 group_scales(const uint8_t* blk, int64_t g) {
  constexpr KindLayout L = layout_of(kKind);
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(chatapp::six_bit_row(blk + L.sc_offset, g)));
}

// One row's Q4_K group g: its dot, with the high nibbles left in place. A byte's high nibble, masked, is
// 16 x its code and still an unsigned byte, so the inputs 16-31 dot comes out 16 x too large and is shifted
// back once (exactly: it is a multiple of 16), instead of shifting 4 registers of codes.
CHATAPP_INLINE inline __m512i q4k_group_one_row(const uint8_t* blk, int64_t g, const int8_t* x) {
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  __m512i low = _mm512_setzero_si512(), high = _mm512_setzero_si512();
  for (int j = 0; j < 4; ++j) {
    const __m512i v = _mm512_loadu_si512(blk + 256 * g + 64 * j);
    low = dot_broadcast4(low, _mm512_and_si512(v, low4), x + 4 * j);
    high = dot_broadcast4(high, _mm512_andnot_si512(low4, v), x + 16 + 4 * j);
  }
  return _mm512_add_epi32(low, _mm512_srai_epi32(high, 4));
}

// A Q6_K group's two sub-blocks added to a row's float sum: fsum + sc * (dot - 32 * sum(x)), sub-block by
// sub-block (q6: the group's two q6_start values, where its sub-blocks' chains start, times kFactor: 4 for
// IQ4X's offset of 128; fsc0, fsc1: the scales as floats).
template <int32_t kFactor>
CHATAPP_INLINE inline __m512 q6k_group(const __m512i w[8], __m512 fsc0, __m512 fsc1, const int8_t* xq,
                                       const int32_t* q6, __m512 fsum) {
  const __m512i c0 = dot_chain(w, xq, _mm512_set1_epi32(kFactor * q6[0]));
  const __m512i c1 = dot_chain(w + 4, xq + 16, _mm512_set1_epi32(kFactor * q6[1]));
  return _mm512_fmadd_ps(_mm512_cvtepi32_ps(c1), fsc1, _mm512_fmadd_ps(_mm512_cvtepi32_ps(c0), fsc0, fsum));
}

// The per-super-block factors that multiply SuperBlockActivations' pair sums in word dots (vpdpwssd), lane c
// holding channel c's two int16s: the minimums of groups 2p and 2p+1 (Q4_K, Q5_K; Q6_K has none, its
// codes' offset is taken off where each sub-block's chain starts, q6_start).
constexpr int kPairs = 4;

template <int64_t kKind>
CHATAPP_INLINE inline void load_pairs(const uint8_t* blk, __m512i pairs[kPairs]) {
  constexpr KindLayout L = layout_of(kKind);
  if constexpr (!sub_block_scales(kKind))
    for (int p = 0; p < kPairs; ++p) {
      const __m128i even = chatapp::six_bit_row(blk + L.m_offset, 2 * p);
      const __m128i odd = chatapp::six_bit_row(blk + L.m_offset, 2 * p + 1);
      pairs[p] = _mm512_or_si512(_mm512_cvtepu8_epi32(even), _mm512_slli_epi32(_mm512_cvtepu8_epi32(odd), 16));
    }
}

// A row's super-block b, from its float sum fsum into its output sum f, in the portable loop's float steps:
// Q4_K / Q5_K take off the minimums (sum_g m_g * xsum_g, 4 word dots, exact in int32).
template <int64_t kKind>
CHATAPP_INLINE inline __m512 finish_block(__m512 fsum, const __m512i pairs[kPairs], const SuperBlockActivations& a,
                                          int64_t k, int64_t row, int64_t b, __m512 d, __m512 dmin, __m512 f) {
  const __m512 dx = _mm512_set1_ps(a.scale[row * (k / kSuperBlock) + b]);
  f = _mm512_fmadd_ps(fsum, _mm512_mul_ps(d, dx), f);
  if constexpr (sub_block_scales(kKind)) return f;
  const int32_t* x = a.pair32.data() + row * (k / 64) + 4 * b;
  __m512i word_dot = _mm512_setzero_si512();
  for (int p = 0; p < kPairs; ++p) word_dot = _mm512_dpwssd_epi32(word_dot, pairs[p], _mm512_set1_epi32(x[p]));
  return _mm512_fnmadd_ps(_mm512_cvtepi32_ps(word_dot), _mm512_mul_ps(dmin, dx), f);
}

// Super-blocks fetched ahead into L2 (~19-27 KB): into L1 the misses in flight were too few to keep the memory
// bus busy (measured: 17 GB/s into L1 at 4 ahead, 25 into L2 at 8, 2 threads).
constexpr int64_t kAhead = 8;

// The batched loop fetches 6 super-blocks ahead instead: a super-block takes it several rows' work, so 8 ahead
// was early (alternated A/B over 390-580 MB of weights, 8 rows: Q4_K 257 -> 282 GMAC/s, Q6_K 201 -> 211;
// 32 rows: Q4_K 442 -> 484; 2, 3 and 4 ahead also beat 8, by less).
constexpr int64_t kAheadBatched = 6;

// Group g's eighth of the cache lines of the super-block kDistance blocks after blk, into L2. Each group fetches
// its share rather than each super-block all its 37-53 lines at once: such a burst filled the core's miss
// buffers and stalled it (perf put a quarter of the 8-way loop's samples on the prefetches), so reading
// and computing ran one after the other. Spread, they overlap: alternated A/B over 390 MB of weights, one
// row Q4_K +18% / Q6_K +15%, 8 rows +24% / +19%, 512 rows flat; same bits.
// Group g's share of the lines of the super-block at `next`: into L2, or (kNta) non-temporally, each prefetch
// kept where the group is (tile_walk.h's prefetch_nta_in_place).
template <int64_t kKind, bool kNta = false>
CHATAPP_INLINE inline void prefetch_share_of(const uint8_t* next, int64_t g) {
  constexpr int64_t kLines = (layout_of(kKind).tile_bytes + 63) / 64, kPerGroup = (kLines + 7) / 8;
  for (int64_t line = g * kPerGroup; line < std::min(kLines, (g + 1) * kPerGroup); ++line) {
    if constexpr (kNta)
      prefetch_nta_in_place(next + 64 * line);
    else
      _mm_prefetch(reinterpret_cast<const char*>(next + 64 * line), _MM_HINT_T1);
  }
}

template <int64_t kKind, int64_t kDistance = kAhead>
CHATAPP_INLINE inline void prefetch_share(const uint8_t* blk, int64_t g) {
  prefetch_share_of<kKind>(blk + kDistance * layout_of(kKind).tile_bytes, g);
}

// Where the one-row loop fetches non-temporally (DecodePrefetch "nta"), it fetches 2 super-blocks ahead and
// nothing into L2: alternated A/B, a 1B file's projections, one row, two threads, against the loop before it
// (prefetcht1 8 ahead and prefetchnta half a super-block ahead): Q4_K_M time x0.955-0.977 (2 super-blocks; 1 and
// 1.5 ahead x0.97-0.98, 4 ahead x0.98), Q6_K x0.969; with any prefetcht1 as well, 1.05-1.14x slower.
constexpr int64_t kAheadNta = 2;

// Except Q4_K and IQ4_XS (kNoFetchFrontToBack), whose one-row loop reads each tile front to back (codes, then
// scales): they fetch nothing and leave it to the hardware prefetcher. Why: this host's memory gives a process
// 30 GB/s most minutes and 45-60 in others, and a fetch a fixed 2 super-blocks ahead fell behind in the fast
// minutes, where the prefetcher keeps pace. Measured (the forty-fourth session, this Zen 4, one row against 8-10
// layers' projections of a 1B file as one call, the loops alternated round by round for 4-8 minutes, each
// round's plain 2-thread read beside it): time / the fetching loop, Q4_K x0.929-0.930 over all rounds (x0.92-0.96
// in rounds whose read ran under 36 GB/s, x0.90-0.91 over 42), IQ4_XS x0.947; prefetcht1 8 or 16 ahead instead
// x0.955-0.971. Q5_K and Q6_K, whose high bits sit between codes and scales, ran 1.9x slower without the fetch,
// and a Q6_K layout read front to back (each pair of groups' codes, high bits and scales in 13 lines) 1.03x.
// Whole passes of a 1B file's projections (each its own call, as a decode step makes them), 3-5 minutes of
// alternated passes: Q4_K_M time x0.974 (its Q6_K tensors unchanged), IQ4_XS x0.979, faster in every band of
// read rates (x0.97-0.98).
constexpr bool kNoFetchFrontToBack = true;

template <int64_t kKind>
CHATAPP_INLINE inline void load_block_scales(const uint8_t* blk, __m512& d, __m512& dmin) {
  constexpr KindLayout L = layout_of(kKind);
  d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + L.d_offset)));
  dmin = sub_block_scales(kKind) ? _mm512_setzero_ps()
                           : _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + L.dmin_offset)));
}

// One row (a decode step) against tiles [t0, t1): the super-block sums stay in registers, and the bytes ahead
// are prefetched, a share per group (the tiles sit one after another in memory): with kNta (tile_walk.h's
// DecodePrefetch says where), kAheadNta super-blocks ahead non-temporally, the groups unrolled (1.34-1.40x the
// rate with Q4_K weights in L3, one thread; Q6_K 1.03-1.10x); otherwise kAhead super-blocks ahead into L2, the
// groups in a loop (unrolled, that fetch streamed 8% slower on the Zen 4 where it was measured).
// The same integer sums and the same float steps in the same order as the batched loop below: rows agree
// to the bit.
template <int64_t kKind, bool kNta>
void tiles_one_row_vnni(const SuperBlockActivations& a, int64_t row, int64_t k, const uint8_t* packed, int64_t t0,
                        int64_t t1, float* y, int64_t n_out, const float* bias) {
  constexpr KindLayout L = layout_of(kKind);
  const int64_t blocks = k / kSuperBlock;
  auto tile_row = [&](const uint8_t* tile, int64_t n0, const TileOut512& out) CHATAPP_INLINE {
    __m512 f = _mm512_setzero_ps();
    for_each_block<L.tile_bytes>(tile, blocks, 0, false, [&](const uint8_t* blk, int64_t b) CHATAPP_INLINE {
      const int8_t* xq = a.q.data() + row * k + b * kSuperBlock;
      const int32_t* q6 = a.q6_start.data() + row * (k / 16) + b * 16;
      __m512 fsum = _mm512_setzero_ps();
      auto add_group = [&](int64_t g) CHATAPP_INLINE {
        if constexpr (kKind == kKindQ4K) {
          const __m512i dot = q4k_group_one_row(blk, g, xq + 32 * g);
          fsum = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), group_scales<kKind>(blk, g), fsum);
        } else {
          __m512i w[8], sc0, sc1;
          load_group<kKind>(blk, g, w, sc0, sc1);
          if constexpr (sub_block_scales(kKind)) {
            fsum = q6k_group<start_factor(kKind)>(w, _mm512_cvtepi32_ps(sc0), _mm512_cvtepi32_ps(sc1), xq + 32 * g, q6 + 2 * g, fsum);
          } else {
            const __m512i dot = _mm512_add_epi32(dot_chain(w, xq + 32 * g), dot_chain(w + 4, xq + 32 * g + 16));
            fsum = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_cvtepi32_ps(sc0), fsum);
          }
        }
      };
      if constexpr (kNta && kKind == kKindQ4K) {
        // Every group's codes first, then their scales, so that the super-block's lines are asked for front to
        // back. Read with each group's codes, the scales (the super-block's last 256 bytes) sent the reads to its
        // end and back eight times, and the hardware prefetcher fell behind: alternated A/B over a 1B Q4_K_M
        // file's projections, one row, time x0.897 on one thread, x0.954 on two; engine decode 1.12x (8 pairs).
        // The same float steps in the same order: same bits.
        // Read front to back, the tile needs no software fetch (kNoFetchFrontToBack says why).
        __m512i dots[8];
#pragma GCC unroll 8
        for (int64_t g = 0; g < 8; ++g) {
          if constexpr (!kNoFetchFrontToBack) prefetch_share_of<kKind, true>(blk + kAheadNta * L.tile_bytes, g);
          dots[g] = q4k_group_one_row(blk, g, xq + 32 * g);
        }
#pragma GCC unroll 8
        for (int64_t g = 0; g < 8; ++g)
          fsum = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dots[g]), group_scales<kKind>(blk, g), fsum);
      } else if constexpr (kNta && kKind == kKindIQ4X) {
        // IQ4_XS has Q4_K's shape (one stream of codes, the scales after them), so the same order: alternated A/B
        // over a 1B IQ4_XS file's projections, one row, time x0.944 on one thread and x0.976 on two. Not for
        // Q5_K or Q6_K, whose high bits sit between codes and scales: that order made Q5_K x1.05 slower, and
        // Q6_K's engine decode x0.93 (session 41). The same float steps in the same order as q6k_group: same bits.
        __m512i c0[8], c1[8];
#pragma GCC unroll 8
        for (int64_t g = 0; g < 8; ++g) {
          if constexpr (!kNoFetchFrontToBack) prefetch_share_of<kKind, true>(blk + kAheadNta * L.tile_bytes, g);
          __m512i w[8], sc0, sc1;  // the scales unused here: read below, after every group's codes
          load_group<kKind>(blk, g, w, sc0, sc1);
          c0[g] = dot_chain(w, xq + 32 * g, _mm512_set1_epi32(start_factor(kKind) * q6[2 * g]));
          c1[g] = dot_chain(w + 4, xq + 32 * g + 16, _mm512_set1_epi32(start_factor(kKind) * q6[2 * g + 1]));
        }
#pragma GCC unroll 8
        for (int64_t g = 0; g < 8; ++g) {
          const __m512 fsc = _mm512_cvtepi32_ps(
              _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + L.sc_offset + 16 * g))));
          fsum = _mm512_fmadd_ps(_mm512_cvtepi32_ps(c1[g]), fsc, _mm512_fmadd_ps(_mm512_cvtepi32_ps(c0[g]), fsc, fsum));
        }
      } else if constexpr (kNta) {
#pragma GCC unroll 8
        for (int64_t g = 0; g < 8; ++g) {
          // in place: the loop is unrolled, and GCC gathered plain prefetches into a burst at its top
          prefetch_share_of<kKind, true>(blk + kAheadNta * L.tile_bytes, g);
          add_group(g);
        }
      } else {
        for (int64_t g = 0; g < 8; ++g) {
          prefetch_share<kKind>(blk, g);
          add_group(g);
        }
      }
      __m512 d, dmin;
      load_block_scales<kKind>(blk, d, dmin);
      __m512i pairs[kPairs];
      load_pairs<kKind>(blk, pairs);
      f = finish_block<kKind>(fsum, pairs, a, k, row, b, d, dmin, f);
    });
    out.store(f, y + row * n_out + n0);
  };
  for_each_tile<TileOut512, L.tile_bytes>(packed, blocks, t0, t1, n_out, bias, tile_row);
}

// A decode batch of kR rows (2-8) against tiles [t0, t1), a tile at a time: each group is unpacked once for the
// rows, their super-block sums stay in registers, and the bytes ahead are prefetched a share per group, as the
// one-row loop does. Why: the batched loop below, which keeps the sums in L1 and was made for prompts, read a
// 1B model's Q6_K output head at 12-15 GB/s for 2-8 rows where one row read it at 52 (and made 8-way decode of the
// 1B Q4_0 file spend 17% of its time there). The same integer sums and float steps in the same order: same bits.
template <int64_t kKind, int kR>
void tiles_rows_vnni(const SuperBlockActivations& a, int64_t k, const uint8_t* packed, int64_t t0, int64_t t1, float* y,
                     int64_t n_out, const float* bias) {
  constexpr KindLayout L = layout_of(kKind);
  const int64_t blocks = k / kSuperBlock;
  auto tile_rows = [&](const uint8_t* tile, int64_t n0, const TileOut512& out) CHATAPP_INLINE {
    __m512 acc[kR];
    for (int r = 0; r < kR; ++r) acc[r] = _mm512_setzero_ps();
    for_each_block<L.tile_bytes>(tile, blocks, 0, false, [&](const uint8_t* blk, int64_t b) CHATAPP_INLINE {
      __m512 fsum[kR];
      for (int r = 0; r < kR; ++r) fsum[r] = _mm512_setzero_ps();
      for (int64_t g = 0; g < 8; ++g) {
        prefetch_share<kKind>(blk, g);
        __m512i w[8], sc0, sc1;
        load_group<kKind>(blk, g, w, sc0, sc1);
        const int8_t* xq = a.by_group.data() + a.grouped(0, b * 8 + g, k);  // the rows' 32 codes each, in turn
        if constexpr (sub_block_scales(kKind)) {
          const __m512 fsc0 = _mm512_cvtepi32_ps(sc0), fsc1 = _mm512_cvtepi32_ps(sc1);
          const int32_t* q6 = a.q6_start.data() + b * 16 + 2 * g;
          for (int r = 0; r < kR; ++r) {
            __m512i c0 = _mm512_set1_epi32(start_factor(kKind) * q6[r * (k / 16)]);
            __m512i c1 = _mm512_set1_epi32(start_factor(kKind) * q6[r * (k / 16) + 1]);
            for (int j = 0; j < 4; ++j) {
              c0 = dot_broadcast4(c0, w[j], xq + 32 * r + 4 * j);
              c1 = dot_broadcast4(c1, w[4 + j], xq + 32 * r + 16 + 4 * j);
            }
            fsum[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(c1), fsc1, _mm512_fmadd_ps(_mm512_cvtepi32_ps(c0), fsc0, fsum[r]));
          }
        } else {
          const __m512 fsc = _mm512_cvtepi32_ps(sc0);
          __m512i dots[kR];
          for (int r = 0; r < kR; ++r) dots[r] = _mm512_setzero_si512();
          dots_side_by_side<kR>(w, xq, dots);
          for (int r = 0; r < kR; ++r) fsum[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dots[r]), fsc, fsum[r]);
        }
      }
      __m512 d, dmin;
      load_block_scales<kKind>(blk, d, dmin);
      __m512i pairs[kPairs];
      load_pairs<kKind>(blk, pairs);
      for (int r = 0; r < kR; ++r) acc[r] = finish_block<kKind>(fsum[r], pairs, a, k, r, b, d, dmin, acc[r]);
    });
    for (int r = 0; r < kR; ++r) out.store(acc[r], y + r * n_out + n0);
  };
  for_each_tile<TileOut512, L.tile_bytes>(packed, blocks, t0, t1, n_out, bias, tile_rows);
}

// Tiles t and t + 1 for every row (more than 8), 32 rows a pass: the batched loop below on two tiles at once, each
// row's activation words broadcast into a register once for both tiles' dots (block_quant.cpp's tile_pair_loop says
// why). The same integer sums and float steps in the same order: same bits.
template <int64_t kKind>
void tile_pair_loop(const SuperBlockActivations& a, int64_t rows, int64_t k, const uint8_t* packed, int64_t t, float* y,
                    int64_t n_out, const float* bias) {
  constexpr KindLayout L = layout_of(kKind);
  constexpr int64_t kRows = SuperBlockActivations::kChunkRows;
  const int64_t blocks = k / kSuperBlock;
  alignas(64) float acc[2][kRows * kQuantTile];
  alignas(64) float fsum[2][kRows * kQuantTile];
  const uint8_t* tile[2] = {packed + t * blocks * L.tile_bytes, packed + (t + 1) * blocks * L.tile_bytes};
  walk_tile_pair<kRows>(rows, t, acc, y, n_out, bias, [&](int64_t m0, int64_t count) CHATAPP_INLINE {
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t* blk[2] = {tile[0] + b * L.tile_bytes, tile[1] + b * L.tile_bytes};
      // kAheadBatched super-blocks on in tile h's stream, tiles t + h, t + h + 2, ...: past the tile's end, the next
      // pair's tile h (the one-tile walk's distance ran into tile t + 1, which this pass already reads)
      const uint8_t* ahead[2];
      for (int h = 0; h < 2; ++h) {
        const int64_t on = b + kAheadBatched;
        ahead[h] = tile[h] + (on / blocks * 2 * blocks + on % blocks) * L.tile_bytes;
      }
      for (int64_t g = 0; g < 8; ++g) {
        __m512i w[2][8], sc0[2], sc1[2];
        for (int h = 0; h < 2; ++h) {
          if (m0 == 0) prefetch_share_of<kKind>(ahead[h], g);  // later passes find the tiles in L2
          load_group<kKind>(blk[h], g, w[h], sc0[h], sc1[h]);
        }
        const int8_t* xq = a.by_group.data() + a.grouped(m0, b * 8 + g, k);  // rows m0.. follow it, 32 bytes apart
        if constexpr (sub_block_scales(kKind)) {
          const __m512 fsc0[2] = {_mm512_cvtepi32_ps(sc0[0]), _mm512_cvtepi32_ps(sc0[1])};
          const __m512 fsc1[2] = {_mm512_cvtepi32_ps(sc1[0]), _mm512_cvtepi32_ps(sc1[1])};
          const int32_t* q6 = a.q6_start.data() + m0 * (k / 16) + b * 16 + 2 * g;
          auto group_rows = [&](auto size, int64_t r0) CHATAPP_INLINE {
            constexpr int kG = decltype(size)::value;
            __m512i c0[2][kG], c1[2][kG];
            for (int r = 0; r < kG; ++r) {
              c0[0][r] = c0[1][r] = _mm512_set1_epi32(start_factor(kKind) * q6[(r0 + r) * (k / 16)]);
              c1[0][r] = c1[1][r] = _mm512_set1_epi32(start_factor(kKind) * q6[(r0 + r) * (k / 16) + 1]);
            }
            for (int j = 0; j < 4; ++j)
              for (int r = 0; r < kG; ++r) {
                const __m512i x0 = broadcast4(xq + 32 * (r0 + r) + 4 * j), x1 = broadcast4(xq + 32 * (r0 + r) + 16 + 4 * j);
                for (int h = 0; h < 2; ++h) {
                  c0[h][r] = _mm512_dpbusd_epi32(c0[h][r], w[h][j], x0);
                  c1[h][r] = _mm512_dpbusd_epi32(c1[h][r], w[h][4 + j], x1);
                }
              }
            for (int r = 0; r < kG; ++r)
              for (int h = 0; h < 2; ++h) {
                float* fs = fsum[h] + (r0 + r) * kQuantTile;  // the first group starts the sum
                const __m512 sum = g == 0 ? _mm512_setzero_ps() : _mm512_load_ps(fs);
                _mm512_store_ps(fs, _mm512_fmadd_ps(_mm512_cvtepi32_ps(c1[h][r]), fsc1[h],
                                                    _mm512_fmadd_ps(_mm512_cvtepi32_ps(c0[h][r]), fsc0[h], sum)));
              }
          };
          for_row_groups<2>(count, group_rows);  // 4 rows (16 chains) spilled: 8% slower
        } else {
          const __m512 fsc[2] = {_mm512_cvtepi32_ps(sc0[0]), _mm512_cvtepi32_ps(sc0[1])};
          auto group_rows = [&](auto size, int64_t r0) CHATAPP_INLINE {
            constexpr int kG = decltype(size)::value;
            __m512i dots[2][kG];
            for (int r = 0; r < kG; ++r) dots[0][r] = dots[1][r] = _mm512_setzero_si512();
            for (int j = 0; j < 8; ++j)
              for (int r = 0; r < kG; ++r) {
                const __m512i x = broadcast4(xq + 32 * (r0 + r) + 4 * (j % 4) + 16 * (j / 4));
                for (int h = 0; h < 2; ++h) dots[h][r] = _mm512_dpbusd_epi32(dots[h][r], w[h][j], x);
              }
            for (int r = 0; r < kG; ++r)
              for (int h = 0; h < 2; ++h) {
                float* fs = fsum[h] + (r0 + r) * kQuantTile;
                const __m512 sum = g == 0 ? _mm512_setzero_ps() : _mm512_load_ps(fs);
                _mm512_store_ps(fs, _mm512_fmadd_ps(_mm512_cvtepi32_ps(dots[h][r]), fsc[h], sum));
              }
          };
          for_row_groups<4>(count, group_rows);
        }
      }
      for (int h = 0; h < 2; ++h) {
        __m512 d, dmin;
        load_block_scales<kKind>(blk[h], d, dmin);
        __m512i pairs[kPairs];
        load_pairs<kKind>(blk[h], pairs);
        for (int64_t r = 0; r < count; ++r) {
          float* out = acc[h] + r * kQuantTile;
          _mm512_store_ps(out, finish_block<kKind>(_mm512_load_ps(fsum[h] + r * kQuantTile), pairs, a, k, m0 + r, b, d,
                                                   dmin, _mm512_load_ps(out)));
        }
      }
    }
  });
}

template <int64_t kKind>
void tile_loop(VnniLoop, const SuperBlockActivations& a, int64_t rows, int64_t k, const uint8_t* packed, int64_t t0,
               int64_t t1, float* y, int64_t n_out, const float* bias) {
  constexpr KindLayout L = layout_of(kKind);
  constexpr int64_t kRows = SuperBlockActivations::kChunkRows;  // rows per pass: a chunk of by_group
  const int64_t blocks = k / kSuperBlock;
  alignas(64) float acc[kRows * kQuantTile];
  alignas(64) float fsum[kRows * kQuantTile];
  if (rows == 1) {
    if (decode_prefetches_nta()) return tiles_one_row_vnni<kKind, true>(a, 0, k, packed, t0, t1, y, n_out, bias);
    return tiles_one_row_vnni<kKind, false>(a, 0, k, packed, t0, t1, y, n_out, bias);
  }
  // A decode batch runs the rows loop unless this CPU streams faster through the pair loop (tile_walk.h).
  switch (rows <= 8 && decode_batches_in_pairs() ? int64_t{0} : rows) {
    case 2: return tiles_rows_vnni<kKind, 2>(a, k, packed, t0, t1, y, n_out, bias);
    case 3: return tiles_rows_vnni<kKind, 3>(a, k, packed, t0, t1, y, n_out, bias);
    case 4: return tiles_rows_vnni<kKind, 4>(a, k, packed, t0, t1, y, n_out, bias);
    case 5: return tiles_rows_vnni<kKind, 5>(a, k, packed, t0, t1, y, n_out, bias);
    case 6: return tiles_rows_vnni<kKind, 6>(a, k, packed, t0, t1, y, n_out, bias);
    case 7: return tiles_rows_vnni<kKind, 7>(a, k, packed, t0, t1, y, n_out, bias);
    case 8: return tiles_rows_vnni<kKind, 8>(a, k, packed, t0, t1, y, n_out, bias);
    default: break;
  }
  // Rows this far are a decode batch that runs the pair loop, or a prompt's (tile_walk.h: PromptTileLoop).
  if (rows <= 8 || prompt_tiles_in_pairs(single_tile_prompts_on_zen4(kKind)))
    for (; t0 + 1 < t1; t0 += 2) tile_pair_loop<kKind>(a, rows, k, packed, t0, y, n_out, bias);
  if (t0 == t1) return;
  // One tile at a time (a prompt's rows on CPUs where that is faster, or the last tile of an odd count). Each
  // group's codes are unpacked once for all the rows (its registers reused row after row), the rows' super-block
  // sums kept in L1.
  auto block = [&](const uint8_t* blk, int64_t b, int64_t m0, int64_t count) CHATAPP_INLINE {
    // The first group's sums start the rows' sums (no zeroing pass: GCC made it a memset call per super-block,
    // 2% of a prefill).
    auto add_group = [&](int64_t g, bool first) CHATAPP_INLINE {
      if (m0 == 0) prefetch_share<kKind, kAheadBatched>(blk, g);  // the first rows' pass brings the tile in
      __m512i w[8], sc0, sc1;
      load_group<kKind>(blk, g, w, sc0, sc1);
      const int8_t* xq = a.by_group.data() + a.grouped(m0, b * 8 + g, k);  // rows m0.. follow it, 32 bytes apart
      if constexpr (sub_block_scales(kKind)) {
        const __m512 fsc0 = _mm512_cvtepi32_ps(sc0), fsc1 = _mm512_cvtepi32_ps(sc1);
        const int32_t* q6 = a.q6_start.data() + m0 * (k / 16) + b * 16 + 2 * g;
        // q6k_group for kG rows at once: each row's two sub-block chains, the rows side by side.
        auto rows = [&](auto size, int64_t r0) CHATAPP_INLINE {
          constexpr int kG = decltype(size)::value;
          __m512i c0[kG], c1[kG];
          for (int r = 0; r < kG; ++r) {
            c0[r] = _mm512_set1_epi32(start_factor(kKind) * q6[(r0 + r) * (k / 16)]);
            c1[r] = _mm512_set1_epi32(start_factor(kKind) * q6[(r0 + r) * (k / 16) + 1]);
          }
          for (int j = 0; j < 4; ++j)
            for (int r = 0; r < kG; ++r) {
              c0[r] = dot_broadcast4(c0[r], w[j], xq + 32 * (r0 + r) + 4 * j);
              c1[r] = dot_broadcast4(c1[r], w[4 + j], xq + 32 * (r0 + r) + 16 + 4 * j);
            }
          for (int r = 0; r < kG; ++r) {
            float* fs = fsum + (r0 + r) * kQuantTile;
            const __m512 sum = first ? _mm512_setzero_ps() : _mm512_load_ps(fs);
            _mm512_store_ps(fs, _mm512_fmadd_ps(_mm512_cvtepi32_ps(c1[r]), fsc1,
                                                _mm512_fmadd_ps(_mm512_cvtepi32_ps(c0[r]), fsc0, sum)));
          }
        };
        for_row_groups<4>(count, rows);  // two chains a row: 8 rows side by side were no faster
      } else {
        const __m512 fsc = _mm512_cvtepi32_ps(sc0);
        auto add = [&](int64_t r, __m512i dot) CHATAPP_INLINE {
          float* fs = fsum + r * kQuantTile;
          const __m512 sum = first ? _mm512_setzero_ps() : _mm512_load_ps(fs);
          _mm512_store_ps(fs, _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), fsc, sum));
        };
        auto rows = [&](auto size, int64_t r0) CHATAPP_INLINE {
          constexpr int kG = decltype(size)::value;
          __m512i dots[kG];
          for (int r = 0; r < kG; ++r) dots[r] = _mm512_setzero_si512();
          dots_side_by_side<kG>(w, xq + 32 * r0, dots);
          for (int r = 0; r < kG; ++r) add(r0 + r, dots[r]);
        };
        for_row_groups(count, rows);
      }
    };
    add_group(0, true);
    for (int64_t g = 1; g < 8; ++g) add_group(g, false);
    __m512 d, dmin;
    load_block_scales<kKind>(blk, d, dmin);
    __m512i pairs[kPairs];
    load_pairs<kKind>(blk, pairs);
    for (int64_t r = 0; r < count; ++r) {
      float* out = acc + r * kQuantTile;
      _mm512_store_ps(out, finish_block<kKind>(_mm512_load_ps(fsum + r * kQuantTile), pairs, a, k, m0 + r, b, d, dmin,
                                               _mm512_load_ps(out)));
    }
  };
  // Only the first rows' pass prefetches (block does, a share per group): later passes find the tile in L2.
  walk_tiles<TileOut512, kRows, L.tile_bytes, true>(packed, blocks, t0, t1, rows, 0, acc, y, n_out, bias, block);
}
#endif

#if defined(CHATAPP_HAVE_AVX2)
// The VNNI loops' arithmetic on 256-bit registers: a tile's 16 channels as two halves of 8 (bytes
// 32h..32h+31 of every 64-byte chunk, and entries 8h..8h+7 of its scale arrays). The same exact integer
// dots, the same float chain per super-block and the same float steps in the same order: every output has
// the VNNI bits.
template <int64_t kKind>
inline void load_group_avx2(const uint8_t* blk, int64_t g, int h, __m256i w[8], __m256i& sc0, __m256i& sc1,
                            __m256i& mv) {
  constexpr KindLayout L = layout_of(kKind);
  const __m256i low4 = _mm256_set1_epi8(0x0F), bits45 = _mm256_set1_epi8(0x30);
  const uint8_t* codes = blk + 256 * g + 32 * h;
  for (int j = 0; j < 4; ++j) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + 64 * j));
    w[j] = _mm256_and_si256(v, low4);
    w[j + 4] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
  }
  if constexpr (kKind == kKindIQ4X) {  // the values as signed bytes: dot_chain_avx2's sign trick reads them
    const __m256i table = _mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(kIQ4Values)));
    for (int j = 0; j < 8; ++j) w[j] = _mm256_shuffle_epi8(table, w[j]);
  }
  if constexpr (kKind == kKindQ5K)
    or_fifth_bits(w, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + L.high_offset + 64 * g + 32 * h)));
  if constexpr (kKind == kKindQ6K) {
    for (int p = 0; p < 2; ++p) {  // register 4p + j's bits 4-5 are bits 2j..2j+1 of plane p's bytes
      const __m256i hb =
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + L.high_offset + 128 * g + 64 * p + 32 * h));
      w[4 * p + 0] = _mm256_or_si256(w[4 * p + 0], _mm256_and_si256(_mm256_slli_epi16(hb, 4), bits45));
      w[4 * p + 1] = _mm256_or_si256(w[4 * p + 1], _mm256_and_si256(_mm256_slli_epi16(hb, 2), bits45));
      w[4 * p + 2] = _mm256_or_si256(w[4 * p + 2], _mm256_and_si256(hb, bits45));
      w[4 * p + 3] = _mm256_or_si256(w[4 * p + 3], _mm256_and_si256(_mm256_srli_epi16(hb, 2), bits45));
    }
  }
  mv = _mm256_setzero_si256();
  if constexpr (kKind == kKindIQ4X) {
    sc0 = sc1 = i8x8(blk + L.sc_offset + 16 * g + 8 * h);
  } else if constexpr (kKind == kKindQ6K) {
    sc0 = i8x8(blk + L.sc_offset + 32 * g + 8 * h);
    sc1 = i8x8(blk + L.sc_offset + 32 * g + 16 + 8 * h);
  } else {  // channels 8h..8h+7 of the group's rows
    const __m128i sc = chatapp::six_bit_row(blk + L.sc_offset, g), m = chatapp::six_bit_row(blk + L.m_offset, g);
    sc0 = sc1 = _mm256_cvtepu8_epi32(h ? _mm_srli_si128(sc, 8) : sc);
    mv = _mm256_cvtepu8_epi32(h ? _mm_srli_si128(m, 8) : m);
  }
}

// kSigned: w holds signed codes (IQ4X's values), read as |w| with x given w's signs, so each pair of
// products fits maddubs' int16 (|w| <= 128, |x| <= 127), and the dot is of the signed codes.
template <bool kSigned = false>
inline __m256i dot_chain_avx2(const __m256i w[4], const int8_t* xq) {
  __m256i s = _mm256_setzero_si256();
  for (int j = 0; j < 4; ++j) {
    if constexpr (kSigned) s = dot4x8(s, _mm256_abs_epi8(w[j]), _mm256_sign_epi8(broadcast4x8(xq + 4 * j), w[j]));
    else s = dot4x8(s, w[j], broadcast4x8(xq + 4 * j));
  }
  return s;
}

template <int64_t kKind>
void tile_loop(Avx2Loop, const SuperBlockActivations& a, int64_t rows, int64_t k, const uint8_t* packed, int64_t t0,
               int64_t t1, float* y, int64_t n_out, const float* bias) {
  constexpr KindLayout L = layout_of(kKind);
  constexpr int64_t kRows = 32;
  const int64_t blocks = k / kSuperBlock;
  const int64_t ahead = rows == 1 ? 8 : 2;  // super-blocks prefetched into L2 (the VNNI loops' kAhead says why)
  alignas(32) float acc[kRows * kQuantTile];
  alignas(32) int32_t imin[kRows * kQuantTile];
  alignas(32) float fsum[kRows * kQuantTile];
  auto block = [&](const uint8_t* blk, int64_t b, int64_t m0, int64_t count) CHATAPP_INLINE {
    for (int64_t i = 0; i < count * kQuantTile; i += 8) {
      _mm256_store_si256(reinterpret_cast<__m256i*>(imin + i), _mm256_setzero_si256());
      _mm256_store_ps(fsum + i, _mm256_setzero_ps());
    }
    for (int64_t g = 0; g < 8; ++g)
      for (int h = 0; h < 2; ++h) {
        __m256i w[8], sc0, sc1, mv;
        load_group_avx2<kKind>(blk, g, h, w, sc0, sc1, mv);
        for (int64_t r = 0; r < count; ++r) {
          const int64_t row = m0 + r;
          const int8_t* xq = a.q.data() + row * k + b * kSuperBlock + 32 * g;
          const int32_t* xs = a.sum16.data() + row * (k / 16) + b * 16 + 2 * g;
          constexpr bool kSigned = kKind == kKindIQ4X;
          __m256i s0 = dot_chain_avx2<kSigned>(w, xq), s1 = dot_chain_avx2<kSigned>(w + 4, xq + 16);
          float* fs = fsum + r * kQuantTile + 8 * h;
          if constexpr (sub_block_scales(kKind)) {
            if constexpr (!kSigned) {  // IQ4X's signed values have no offset to take off
              s0 = _mm256_sub_epi32(s0, _mm256_set1_epi32(32 * xs[0]));
              s1 = _mm256_sub_epi32(s1, _mm256_set1_epi32(32 * xs[1]));
            }
            const __m256 sum = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s0), _mm256_cvtepi32_ps(sc0), _mm256_load_ps(fs));
            _mm256_store_ps(fs, _mm256_fmadd_ps(_mm256_cvtepi32_ps(s1), _mm256_cvtepi32_ps(sc1), sum));
          } else {
            const __m256 dot = _mm256_cvtepi32_ps(_mm256_add_epi32(s0, s1));
            _mm256_store_ps(fs, _mm256_fmadd_ps(dot, _mm256_cvtepi32_ps(sc0), _mm256_load_ps(fs)));
            __m256i* im = reinterpret_cast<__m256i*>(imin + r * kQuantTile + 8 * h);
            *im = _mm256_add_epi32(*im, _mm256_mullo_epi32(mv, _mm256_set1_epi32(xs[0] + xs[1])));
          }
        }
      }
    for (int h = 0; h < 2; ++h) {
      const __m256 d = half8(blk + L.d_offset + 16 * h);
      const __m256 dmin = !sub_block_scales(kKind) ? half8(blk + L.dmin_offset + 16 * h) : _mm256_setzero_ps();
      for (int64_t r = 0; r < count; ++r) {
        const __m256 dx = _mm256_set1_ps(a.scale[(m0 + r) * blocks + b]);
        float* out = acc + r * kQuantTile + 8 * h;
        const int64_t at = r * kQuantTile + 8 * h;
        __m256 f = _mm256_fmadd_ps(_mm256_load_ps(fsum + at), _mm256_mul_ps(d, dx), _mm256_load_ps(out));
        if constexpr (!sub_block_scales(kKind))
          f = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(imin + at))),
                               _mm256_mul_ps(dmin, dx), f);
        _mm256_store_ps(out, f);
      }
    }
  };
  walk_tiles<TileOut256, kRows, L.tile_bytes, true>(packed, blocks, t0, t1, rows, ahead, acc, y, n_out, bias, block);
}
#endif

}  // namespace

void kquant_linear_parts(const at::Tensor& x, const KQuantPart* parts, int64_t count, KernelPath path) {
  static thread_local SuperBlockActivations acts;
  quantize_superblock_rows(x, acts, path == kPathVnni);
  const SuperBlockActivations& a = acts;
  const int64_t rows = x.size(0), k = x.size(1);
  int64_t tiles = 0;
  for (int64_t i = 0; i < count; ++i) tiles += parts[i].tiles;
  // The parts' tiles in a row, shared out as one projection's: [t0, t1) is cut where one part ends.
  for_tiles_balanced(tiles, [&](int64_t t0, int64_t t1) {
    int64_t first = 0;  // the part's first tile in the row
    for (int64_t i = 0; i < count && t0 < t1; first += parts[i++].tiles) {
      const KQuantPart& p = parts[i];
      if (t0 >= first + p.tiles) continue;
      const int64_t u0 = t0 - first, u1 = std::min(t1 - first, p.tiles);
      on_path(path, [&](auto loop) {
        if (p.kind == kKindQ4K) tile_loop<kKindQ4K>(loop, a, rows, k, p.packed, u0, u1, p.y, p.out_features, p.bias);
        else if (p.kind == kKindQ5K) tile_loop<kKindQ5K>(loop, a, rows, k, p.packed, u0, u1, p.y, p.out_features, p.bias);
        else if (p.kind == kKindQ6K) tile_loop<kKindQ6K>(loop, a, rows, k, p.packed, u0, u1, p.y, p.out_features, p.bias);
        else tile_loop<kKindIQ4X>(loop, a, rows, k, p.packed, u0, u1, p.y, p.out_features, p.bias);
      });
      t0 = first + u1;
    }
  });
}
