// A design study for benchmarks/native_layout.py, not engine code: one-row (decode) Q4_K and Q6_K linears that read a
// GGUF file's own blocks in place, computing every output with the float steps of our tile kernel
// (chatapp/engine/csrc/kquant.cpp), so that their bits equal block_linear's on the repacked weights.
//
// Why it is worth measuring: a first start spends ~0.5 CPU-s of its ~1.4 making the packed copy of the weights
// (fresh pages and the repack); reading the file's blocks in place would skip it, if decode kept its speed.
//
// Two ways, each for 16 rows at a time (K / 256 super-blocks a row):
//  - sums out of the lanes (rows16, rows16_q6): in file order (the 16 rows are one contiguous run of memory, one
//    stream for the prefetchers), each row's super-block: its codes loaded as they lie, VNNI dots against the
//    activations arranged in the same order, and a reduction of those registers to the exact int32 dot of each
//    group of 32 (Q4_K) or sub-block of 16 (Q6_K); then per super-block the 16 rows' dots and scales are
//    transposed into registers, one row a lane;
//  - codes into the lanes (rows16_lanes, rows16_q6_lanes, `--lanes`): the strip of 16 rows is prefetched into cache
//    while the one before it is computed, then per super-block its codes are transposed so that a register holds 4
//    codes of each of the 16 rows, as a tile of ours would, and the dots land one row a lane with nothing to reduce.
// Either way the tile kernel's float steps then run for the 16 lanes at once, in its order: Q4_K fsum = fma chain
// over the 8 groups, y = fma(fsum, d * dx, y), y = fnmadd(imin, dmin * dx, y); Q6_K fsum = fma chain over the 16
// sub-blocks of (dot - 32 * sum of their activations) x scale, y = fma(fsum, d * dx, y).
#include <immintrin.h>
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "native_layout_strips.h"

namespace py = pybind11;

namespace {

using native_layout::half_to_float;
using native_layout::kDotsTranspose;
using native_layout::kHeaderTranspose;
using native_layout::Strip;

constexpr int64_t kBlockBytes = 144;  // Q4_K: fp16 d, fp16 dmin, 12 bytes of 6-bit scales and minimums, 128 of codes
constexpr int64_t kQ6BlockBytes = 210;  // Q6_K: 128 bytes of low nibbles, 64 of bits 4-5, 16 int8 scales, fp16 d
constexpr int64_t kPrefetch = 4096;   // bytes ahead in the stream (18 KB and 4 KB measured alike; none: ~10% slower)

// The 8 scales and 8 minimums of a Q4_K block's 12 scale bytes (6 bits each).
void scales_mins(const uint8_t* q, int32_t sc[8], int32_t m[8]) {
  for (int j = 0; j < 4; ++j) sc[j] = q[j] & 63, m[j] = q[j + 4] & 63;
  for (int j = 4; j < 8; ++j) {
    sc[j] = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
    m[j] = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

// The activations as the tile kernel quantizes them (per 256: int8 codes, scale amax / 127, sums of 16), plus
// the codes in the order a block's two 64-byte code loads meet them.
struct Activations {
  std::vector<int8_t> q, in_code_order;
  std::vector<float> dx;
  std::vector<int32_t> sum16;

  Activations(const float* x, int64_t k) : q(k), in_code_order(k), dx(k / 256), sum16(k / 16) {
    for (int64_t b = 0; b < k / 256; ++b) {
      const float* xb = x + b * 256;
      int8_t* qb = q.data() + b * 256;
      __m512 m = _mm512_setzero_ps();
      for (int i = 0; i < 256; i += 16) m = _mm512_max_ps(m, _mm512_abs_ps(_mm512_loadu_ps(xb + i)));
      const float amax = _mm512_reduce_max_ps(m);
      const __m512 inv = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
      for (int i = 0; i < 256; i += 16) {
        const __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(xb + i), inv));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(qb + i), _mm512_cvtsepi32_epi8(v));
        sum16[b * 16 + i / 16] = _mm512_reduce_add_epi32(v);
      }
      dx[b] = amax / 127.f;
      // Codes bytes 32j..32j+31 hold inputs 64j..64j+31 (low nibbles) and 64j+32..64j+63 (high nibbles).
      static constexpr int kFrom[8] = {0, 64, 32, 96, 128, 192, 160, 224};
      for (int part = 0; part < 8; ++part) std::memcpy(in_code_order.data() + b * 256 + 32 * part, qb + kFrom[part], 32);
    }
  }
};

// One row, one value at a time, in the tile kernel's float steps: the reference the fast loop is held to.
float row_reference(const uint8_t* row, int64_t blocks, const Activations& a) {
  float f = 0.f;
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* blk = row + b * kBlockBytes;
    int32_t sc[8], m[8];
    scales_mins(blk + 4, sc, m);
    float fsum = 0.f;
    int32_t imin = 0;
    for (int g = 0; g < 8; ++g) {
      int32_t dot = 0;
      for (int i = 0; i < 32; ++i) {
        const int e = 32 * g + i;
        const uint8_t byte = blk[16 + 32 * (e / 64) + e % 32];
        dot += ((g % 2) ? byte >> 4 : byte & 15) * a.q[b * 256 + e];
      }
      fsum = std::fma(static_cast<float>(dot), static_cast<float>(sc[g]), fsum);
      imin += m[g] * a.sum16[b * 16 + 2 * g] + m[g] * a.sum16[b * 16 + 2 * g + 1];
    }
    f = std::fma(fsum, half_to_float(blk) * a.dx[b], f);
    f = std::fma(-static_cast<float>(imin), half_to_float(blk + 2) * a.dx[b], f);
  }
  return f;
}

// One Q4_K super-block's float steps for 16 rows, one a lane, in the tile kernel's order: dot[g] the groups' exact
// dots, header the blocks' first 16 bytes (d | dmin, then the 12 scale bytes), xs the activations' sums of 16.
__m512 q4k_block_steps(const __m512i dot[8], const __m512i header[4], const int32_t* xs, float dx_value, __m512 f) {
  const __m512i m63 = _mm512_set1_epi32(63), m15 = _mm512_set1_epi32(15), m3 = _mm512_set1_epi32(3);
  const __m512i s0 = header[1], s1 = header[2], s2 = header[3];  // scale bytes 0-3, 4-7, 8-11
  __m512 fsum = _mm512_setzero_ps();
  __m512i imin = _mm512_setzero_si512();
  for (int g = 0; g < 8; ++g) {
    __m512i sc, m;
    if (g < 4) {
      sc = _mm512_and_si512(_mm512_srli_epi32(s0, 8 * g), m63);
      m = _mm512_and_si512(_mm512_srli_epi32(s1, 8 * g), m63);
    } else {
      const int j = g - 4;
      sc = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(s2, 8 * j), m15),
                           _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(s0, 8 * j + 6), m3), 4));
      m = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi32(s2, 8 * j + 4), m15),
                          _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(s1, 8 * j + 6), m3), 4));
    }
    fsum = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[g]), _mm512_cvtepi32_ps(sc), fsum);
    imin = _mm512_add_epi32(imin, _mm512_mullo_epi32(m, _mm512_set1_epi32(xs[2 * g] + xs[2 * g + 1])));
  }
  const __m512 d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(header[0]));
  const __m512 dmin = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(header[0], 16)));
  const __m512 dx = _mm512_set1_ps(dx_value);
  f = _mm512_fmadd_ps(fsum, _mm512_mul_ps(d, dx), f);
  return _mm512_fnmadd_ps(_mm512_cvtepi32_ps(imin), _mm512_mul_ps(dmin, dx), f);
}

// One Q6_K super-block's float steps for 16 rows, one a lane: dot[s] the sub-blocks' exact dots, scales the 16 int8
// scale bytes (4 a register), d the rows' scales.
__m512 q6k_block_steps(const __m512i dot[16], const __m512i scales[4], const int32_t* xs, __m512 d, float dx, __m512 f) {
  __m512 fsum = _mm512_setzero_ps();
  for (int s = 0; s < 16; ++s) {
    const __m512i sc = _mm512_srai_epi32(_mm512_slli_epi32(scales[s / 4], 24 - 8 * (s % 4)), 24);  // byte s, signed
    const __m512i v = _mm512_sub_epi32(dot[s], _mm512_set1_epi32(32 * xs[s]));
    fsum = _mm512_fmadd_ps(_mm512_cvtepi32_ps(v), _mm512_cvtepi32_ps(sc), fsum);
  }
  return _mm512_fmadd_ps(fsum, _mm512_mul_ps(d, _mm512_set1_ps(dx)), f);
}

void rows16(const uint8_t* base, int64_t row_bytes, int64_t blocks, const Activations& a, float* y, int64_t nrows) {
  static thread_local std::vector<int32_t> dots, headers;  // [blocks][16 rows][8 groups], [blocks][16 rows][4]
  dots.resize(blocks * 128), headers.resize(blocks * 64);
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  const __m512i low_quarters = _mm512_setr_epi32(0, 1, 2, 3, 8, 9, 10, 11, 0, 0, 0, 0, 0, 0, 0, 0);
  for (int r = 0; r < 16; ++r) {
    const uint8_t* row = base + std::min<int64_t>(r, nrows - 1) * row_bytes;
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t* blk = row + b * kBlockBytes;
      for (int line = 0; line < 3; ++line) _mm_prefetch(reinterpret_cast<const char*>(blk + kPrefetch + 64 * line), _MM_HINT_T0);
      const __m512i* x = reinterpret_cast<const __m512i*>(a.in_code_order.data() + b * 256);
      const __m512i lo = _mm512_loadu_si512(blk + 16), hi = _mm512_loadu_si512(blk + 80);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(headers.data() + b * 64 + r * 4), _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk)));
      // Each register: two groups' partial dots, 8 lanes each (groups 0|2, 1|3, 4|6, 5|7).
      const __m512i d0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_and_si512(lo, nibble), _mm512_loadu_si512(x));
      const __m512i d1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_and_si512(_mm512_srli_epi16(lo, 4), nibble), _mm512_loadu_si512(x + 1));
      const __m512i d2 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_and_si512(hi, nibble), _mm512_loadu_si512(x + 2));
      const __m512i d3 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_and_si512(_mm512_srli_epi16(hi, 4), nibble), _mm512_loadu_si512(x + 3));
      // Per 128-bit quarter, then across quarters: g0 g1 g4 g5 in the first quarter, g2 g3 g6 g7 in the third.
      const __m512i p = _mm512_add_epi32(_mm512_unpacklo_epi32(d0, d1), _mm512_unpackhi_epi32(d0, d1));
      const __m512i q = _mm512_add_epi32(_mm512_unpacklo_epi32(d2, d3), _mm512_unpackhi_epi32(d2, d3));
      const __m512i s = _mm512_add_epi32(_mm512_unpacklo_epi64(p, q), _mm512_unpackhi_epi64(p, q));
      const __m512i w = _mm512_add_epi32(s, _mm512_shuffle_i32x4(s, s, _MM_SHUFFLE(2, 3, 0, 1)));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dots.data() + b * 128 + r * 8),
                          _mm512_castsi512_si256(_mm512_permutexvar_epi32(low_quarters, w)));
    }
  }
  static constexpr int kSlot[8] = {0, 1, 4, 5, 2, 3, 6, 7};  // where group g's dot was stored
  __m512 f = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    __m512i slots[8], dot[8], header[4];
    kDotsTranspose.run(dots.data() + b * 128, slots);
    kHeaderTranspose.run(headers.data() + b * 64, header);
    for (int g = 0; g < 8; ++g) dot[g] = slots[kSlot[g]];
    f = q4k_block_steps(dot, header, a.sum16.data() + b * 16, a.dx[b], f);
  }
  alignas(64) float out[16];
  _mm512_store_ps(out, f);
  std::copy(out, out + nrows, y);
}


// The same outputs, the same bits, another way: each strip of 16 rows is first brought into cache whole (prefetched
// while the strip before it is computed), then per block and group pair its codes are transposed so that a register
// holds 4 codes of each of the 16 rows, one row a lane, as a tile would; the dots then land one row a lane, and no
// row's sums need gathering out of the lanes.
void rows16_lanes(const uint8_t* base, int64_t row_bytes, int64_t blocks, const Activations& a, float* y,
                  int64_t nrows) {
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  const Strip strip(base, row_bytes, blocks, nrows);
  __m512 f = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t at = b * kBlockBytes;
    strip.prefetch_next(b);
    const int32_t* xq = reinterpret_cast<const int32_t*>(a.q.data() + b * 256);
    __m512i dot[8];
    for (int p = 0; p < 4; ++p) {  // code bytes 32p..32p+31: group 2p in the low nibbles, 2p + 1 in the high
      __m512i z[8], t[8];
      strip.pairs(at + 16 + 32 * p, z);
      kDotsTranspose.run(z, t);  // t[j]: bytes 4j..4j+3 of the 16 rows
      __m512i lo = _mm512_setzero_si512(), hi = _mm512_setzero_si512();
      for (int j = 0; j < 8; ++j) {
        lo = _mm512_dpbusd_epi32(lo, _mm512_and_si512(t[j], nibble), _mm512_set1_epi32(xq[16 * p + j]));
        hi = _mm512_dpbusd_epi32(hi, _mm512_and_si512(_mm512_srli_epi16(t[j], 4), nibble), _mm512_set1_epi32(xq[16 * p + 8 + j]));
      }
      dot[2 * p] = lo, dot[2 * p + 1] = hi;
    }
    __m512i z[4], header[4];
    strip.quads(at, z);
    kHeaderTranspose.run(z, header);
    f = q4k_block_steps(dot, header, a.sum16.data() + b * 16, a.dx[b], f);
  }
  alignas(64) float out[16];
  _mm512_store_ps(out, f);
  std::copy(out, out + nrows, y);
}

// ---- Q6_K ----

// 16 x 16 int32 (row-major) -> 16 registers, register c holding column c of the 16 rows: four levels of permutes,
// each pairing registers of 2^(L-1) rows into 2^L rows of half as many columns (lane = column * rows + row).
struct Transpose16 {
  __m512i index[4][2];
  Transpose16() {
    alignas(64) int32_t t[16];
    for (int level = 1; level <= 4; ++level) {
      const int rows = 1 << level, in_rows = rows / 2, cols = 16 / rows;
      for (int k = 0; k < 2; ++k) {
        for (int c = 0; c < cols; ++c)
          for (int r = 0; r < rows; ++r) {
            const int col_in = k * cols + c, from_b = r >= in_rows, row_in = r % in_rows;
            t[c * rows + r] = (from_b ? 16 : 0) + col_in * in_rows + row_in;
          }
        index[level - 1][k] = _mm512_load_si512(t);
      }
    }
  }
  void run(const int32_t* rows, __m512i out[16]) const {
    __m512i z[16];
    for (int i = 0; i < 16; ++i) z[i] = _mm512_loadu_si512(rows + 16 * i);
    run(z, out);
  }
  void run(const __m512i in[16], __m512i out[16]) const {
    __m512i z[16], next[16];
    for (int i = 0; i < 16; ++i) z[i] = in[i];
    // level L: register (group j, column part k) from the pair (2j, 2j+1) of the level before
    for (int level = 1; level <= 4; ++level) {
      const int groups = 16 >> level, parts = 1 << (level - 1);  // inputs: 2 * groups registers per column part
      for (int j = 0; j < groups; ++j)
        for (int part = 0; part < parts; ++part)
          for (int k = 0; k < 2; ++k)
            next[j * (2 * parts) + 2 * part + k] =
                _mm512_permutex2var_epi32(z[(2 * j) * parts + part], index[level - 1][k], z[(2 * j + 1) * parts + part]);
      for (int i = 0; i < 16; ++i) z[i] = next[i];
    }
    for (int i = 0; i < 16; ++i) out[i] = z[i];
  }
};
const Transpose16 kTranspose16;

float row_reference_q6(const uint8_t* row, int64_t blocks, const Activations& a) {
  float f = 0.f;
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* blk = row + b * kQ6BlockBytes;
    float fsum = 0.f;
    for (int s = 0; s < 16; ++s) {
      int32_t dot = -32 * a.sum16[b * 16 + s];
      for (int i = 0; i < 16; ++i) {
        const int e = 16 * s + i, h = e / 128, l = e % 128;
        const uint8_t low = l < 64 ? blk[64 * h + l] & 15 : blk[64 * h + l - 64] >> 4;
        const int part = l / 32;  // bits 2*part of qh[32h + l % 32]
        const int code = low | (((blk[128 + 32 * h + l % 32] >> (2 * part)) & 3) << 4);
        dot += code * a.q[b * 256 + e];
      }
      fsum = std::fma(static_cast<float>(dot), static_cast<float>(static_cast<int8_t>(blk[192 + s])), fsum);
    }
    f = std::fma(fsum, half_to_float(blk + 208) * a.dx[b], f);
  }
  return f;
}

void rows16_q6(const uint8_t* base, int64_t row_bytes, int64_t blocks, const Activations& a, float* y, int64_t nrows) {
  static thread_local std::vector<int32_t> dots, scales;  // [blocks][16 rows][16 sub-blocks], [blocks][16][4]
  static thread_local std::vector<uint16_t> ds;            // [blocks][16]
  dots.resize(blocks * 256), scales.resize(blocks * 64), ds.resize(blocks * 16);
  const __m512i nibble = _mm512_set1_epi8(0x0F), two = _mm512_set1_epi8(0x03);
  // per 16-bit lane: the lower 256 bits shift qh by the first count, the upper by the second
  const __m512i shift01 = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(2), 1);
  const __m512i shift23 = _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(6), 1);
  for (int r = 0; r < 16; ++r) {
    const uint8_t* row = base + std::min<int64_t>(r, nrows - 1) * row_bytes;
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t* blk = row + b * kQ6BlockBytes;
      for (int line = 0; line < 4; ++line) _mm_prefetch(reinterpret_cast<const char*>(blk + kPrefetch + 64 * line), _MM_HINT_T0);
      const __m512i* x = reinterpret_cast<const __m512i*>(a.q.data() + b * 256);
      __m512i d[4];
      for (int h = 0; h < 2; ++h) {
        const __m512i ql = _mm512_loadu_si512(blk + 64 * h);
        const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 128 + 32 * h)));
        const __m512i hi0 = _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi16(qh, shift01), two), 4);
        const __m512i hi1 = _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi16(qh, shift23), two), 4);
        const __m512i c0 = _mm512_or_si512(_mm512_and_si512(ql, nibble), hi0);
        const __m512i c1 = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql, 4), nibble), hi1);
        d[2 * h] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), c0, _mm512_loadu_si512(x + 2 * h));
        d[2 * h + 1] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), c1, _mm512_loadu_si512(x + 2 * h + 1));
      }
      const __m512i p = _mm512_add_epi32(_mm512_unpacklo_epi32(d[0], d[1]), _mm512_unpackhi_epi32(d[0], d[1]));
      const __m512i q = _mm512_add_epi32(_mm512_unpacklo_epi32(d[2], d[3]), _mm512_unpackhi_epi32(d[2], d[3]));
      // lane 4Q + i: sub-block 4i + Q
      _mm512_storeu_si512(dots.data() + b * 256 + r * 16, _mm512_add_epi32(_mm512_unpacklo_epi64(p, q), _mm512_unpackhi_epi64(p, q)));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(scales.data() + b * 64 + r * 4), _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 192)));
      std::memcpy(ds.data() + b * 16 + r, blk + 208, 2);
    }
  }
  __m512 f = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    __m512i lanes[16], dot[16], sc4[4];
    kTranspose16.run(dots.data() + b * 256, lanes);
    kHeaderTranspose.run(scales.data() + b * 64, sc4);
    for (int s = 0; s < 16; ++s) dot[s] = lanes[4 * (s % 4) + s / 4];  // lane 4Q + i held sub-block 4i + Q
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(ds.data() + b * 16)));
    f = q6k_block_steps(dot, sc4, a.sum16.data() + b * 16, d, a.dx[b], f);
  }
  alignas(64) float out[16];
  _mm512_store_ps(out, f);
  std::copy(out, out + nrows, y);
}

// Q6_K the same way as rows16_lanes: the strip in cache, its codes transposed into lanes (one row a lane), each
// sub-block of 16's dot accumulated in its own register.
void rows16_q6_lanes(const uint8_t* base, int64_t row_bytes, int64_t blocks, const Activations& a, float* y,
                     int64_t nrows) {
  const __m512i nibble = _mm512_set1_epi8(0x0F), two = _mm512_set1_epi8(0x03);
  const Strip strip(base, row_bytes, blocks, nrows);
  __m512 f = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t at = b * kQ6BlockBytes;
    strip.prefetch_next(b);
    const int32_t* xq = reinterpret_cast<const int32_t*>(a.q.data() + b * 256);
    __m512i dot[16];
    for (int h = 0; h < 2; ++h) {
      __m512i z[16], low[16], z8[8], high[8];
      for (int r = 0; r < 16; ++r) z[r] = _mm512_loadu_si512(strip.row[r] + at + 64 * h);
      kTranspose16.run(z, low);  // low[j]: ql bytes 64h + 4j..4j+3 of the 16 rows
      strip.pairs(at + 128 + 32 * h, z8);
      kDotsTranspose.run(z8, high);  // high[j]: qh bytes 32h + 4j..4j+3
      for (int q = 0; q < 8; ++q) dot[8 * h + q] = _mm512_setzero_si512();
      for (int j = 0; j < 16; ++j) {
        // low nibbles: inputs 128h + 4j.. (part j / 8 of qh's bit pairs); high nibbles: 128h + 64 + 4j.. (part 2 + j / 8)
        const int part = j / 8;
        const __m512i hb = high[j % 8];
        const __m512i c0 = _mm512_or_si512(_mm512_and_si512(low[j], nibble),
                                           _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(hb, 2 * part), two), 4));
        const __m512i c1 = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(low[j], 4), nibble),
                                           _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(hb, 4 + 2 * part), two), 4));
        dot[8 * h + j / 4] = _mm512_dpbusd_epi32(dot[8 * h + j / 4], c0, _mm512_set1_epi32(xq[32 * h + j]));
        dot[8 * h + 4 + j / 4] = _mm512_dpbusd_epi32(dot[8 * h + 4 + j / 4], c1, _mm512_set1_epi32(xq[32 * h + 16 + j]));
      }
    }
    __m512i z4[4], sc4[4];
    strip.quads(at + 192, z4);
    kHeaderTranspose.run(z4, sc4);
    alignas(64) uint16_t d16[16];
    for (int r = 0; r < 16; ++r) std::memcpy(d16 + r, strip.row[r] + at + 208, 2);
    const __m512 d = _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(d16)));
    f = q6k_block_steps(dot, sc4, a.sum16.data() + b * 16, d, a.dx[b], f);
  }
  alignas(64) float out[16];
  _mm512_store_ps(out, f);
  std::copy(out, out + nrows, y);
}

// y = W x for W's rows as the file stores them (uint8 [N, K / 256 * 144]); the fastest of `reps` runs' seconds.
py::tuple linear(const py::array_t<float, py::array::c_style>& x, const py::array_t<uint8_t, py::array::c_style>& raw,
                 int threads, int reps, bool reference, int ggml_type, bool lanes) {
  const bool q6 = ggml_type == 14;
  if (ggml_type != 12 && !q6) throw py::value_error("Q4_K (12) or Q6_K (14) only");
  const int64_t block_bytes = q6 ? kQ6BlockBytes : kBlockBytes;
  const int64_t k = x.shape(0), n = raw.shape(0), row_bytes = raw.shape(1), blocks = k / 256;
  if (k % 256 != 0 || row_bytes != blocks * block_bytes) throw py::value_error("raw must be rows of K = len(x)");
  const Activations a(x.data(), k);
  py::array_t<float> y(n);
  float* yp = y.mutable_data();
  const uint8_t* base = raw.data();
  const double best = native_layout::fastest_run(
      n, threads, reps, reference,
      [&](int64_t r) {
        yp[r] = q6 ? row_reference_q6(base + r * row_bytes, blocks, a) : row_reference(base + r * row_bytes, blocks, a);
      },
      [&](int64_t t, int64_t rows) {
        const uint8_t* strip = base + t * 16 * row_bytes;
        if (q6 && lanes)
          rows16_q6_lanes(strip, row_bytes, blocks, a, yp + t * 16, rows);
        else if (q6)
          rows16_q6(strip, row_bytes, blocks, a, yp + t * 16, rows);
        else if (lanes)
          rows16_lanes(strip, row_bytes, blocks, a, yp + t * 16, rows);
        else
          rows16(strip, row_bytes, blocks, a, yp + t * 16, rows);
      });
  return py::make_tuple(y, best);
}

}  // namespace

PYBIND11_MODULE(native_layout_kquant, m) { m.def("linear", &linear); }
