// A design study for benchmarks/native_layout.py, not engine code: one-row (decode) Q4_0 and Q8_0 linears that read
// a GGUF file's own blocks in place, with the float steps of our tile kernel (chatapp/engine/csrc/block_quant.cpp,
// tile_loop_one_row), so that their bits equal block_linear's on the repacked weights.
//
// The blocks of 32 are the K types' opposite: a scale for every 32 weights (2 bytes in 18 or 34), so per byte of
// the file there is more float work and more to gather than in Q4_K's 256. The lanes way only (native_layout_kquant
// says why it beat the sums way): each strip of 16 rows is prefetched in file order while the one before it is
// computed; per block, each row's codes are transposed so that a register holds 4 codes of each of the 16 rows,
// one row a lane; the 16 rows' scales are gathered into one register; then the tile kernel's steps run for the 16
// lanes at once, in its order: s = the block's exact int32 dot (less the codes' offset x the activations' sum),
// f = fma(float(s << shift), d, f) block by block, y = f x unit.
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

constexpr int kQ4_0 = 2, kQ8_0 = 8;  // ggml's type ids
constexpr int64_t kBlock = 32;
constexpr int32_t kMaxShift = 11;
constexpr float kPow2[kMaxShift + 2] = {1.f, 2.f, 4.f, 8.f, 16.f, 32.f, 64.f, 128.f, 256.f, 512.f, 1024.f, 2048.f, 4096.f};

constexpr int64_t block_bytes(int type) { return type == kQ4_0 ? 18 : 34; }
constexpr int32_t code_offset(int type) { return type == kQ4_0 ? 8 : 128; }  // Q8_0's codes go in as unsigned bytes, + 128

// The activations as block_quant.cpp's quantize_row makes them for one row: int8 codes, the row's unit, and each
// block's shift and code sum.
struct Activations {
  std::vector<int8_t> q;
  std::vector<int32_t> shift, qsum;
  float unit = 0.f;

  Activations(const float* x, int64_t k) : q(k), shift(k / kBlock), qsum(k / kBlock) {
    const int64_t blocks = k / kBlock;
    std::vector<float> amax(blocks);
    float row_amax = 0.f;
    for (int64_t b = 0; b < blocks; ++b) {
      const __m512 v0 = _mm512_loadu_ps(x + b * kBlock), v1 = _mm512_loadu_ps(x + b * kBlock + 16);
      amax[b] = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
      row_amax = std::max(row_amax, amax[b]);
    }
    const bool silent = !(row_amax >= 1e-30f);
    unit = silent ? 0.f : row_amax / 127.f / kPow2[kMaxShift];
    for (int64_t b = 0; b < blocks; ++b) {
      int32_t e = 0;
      while (e < kMaxShift && amax[b] * kPow2[e + 1] <= row_amax) ++e;
      const float inv = silent ? 0.f : 127.f / row_amax * kPow2[e];
      const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + b * kBlock), _mm512_set1_ps(inv)));
      const __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + b * kBlock + 16), _mm512_set1_ps(inv)));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q.data() + b * kBlock), _mm512_cvtsepi32_epi8(q0));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q.data() + b * kBlock + 16), _mm512_cvtsepi32_epi8(q1));
      qsum[b] = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
      shift[b] = kMaxShift - e;
    }
  }
};

// One row, one value at a time, in the tile kernel's float steps: the reference the fast loop is held to.
float row_reference(const uint8_t* row, int64_t blocks, int type, const Activations& a) {
  float f = 0.f;
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* blk = row + b * block_bytes(type);
    int32_t s = 0;
    for (int i = 0; i < kBlock; ++i) {
      const int32_t code = type == kQ4_0 ? (i < 16 ? blk[2 + i] & 15 : blk[2 + i - 16] >> 4)
                                         : static_cast<int32_t>(static_cast<int8_t>(blk[2 + i])) + 128;
      s += code * a.q[b * kBlock + i];
    }
    s -= code_offset(type) * a.qsum[b];
    f = std::fma(static_cast<float>(s * (int32_t{1} << a.shift[b])), half_to_float(blk), f);
  }
  return f * a.unit;
}

// The 16 rows' fp16 scales at byte `at` of each row, one row a lane, as floats: one gather of 32-bit words (the rows
// are row_bytes apart), their low halves. (16 two-byte copies into an array, read back as one vector, measured alike.)
inline __m512 gather_scales(const uint8_t* base, __m512i row_offsets, int64_t at) {
  const __m512i words = _mm512_i32gather_epi32(row_offsets, base + at, 1);
  return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(words));
}

// Each of a strip's 16 rows' offset from its first, for gather_scales (the last strip's missing rows repeat its
// last row, as Strip's do).
inline __m512i row_offsets(int64_t row_bytes, int64_t nrows) {
  alignas(64) int32_t at[16];
  for (int r = 0; r < 16; ++r) at[r] = static_cast<int32_t>(std::min<int64_t>(r, nrows - 1) * row_bytes);
  return _mm512_load_si512(at);
}

// The two chains of a block's dots for 16 rows, one row a lane: inputs 0-15 into s0, 16-31 into s1, the codes as
// unsigned bytes (Q4_0's 0..15; Q8_0's flipped to + 128, as our tiles store them). Q4_0: the rows' 16 code bytes
// transposed (register j: bytes 4j..4j+3, whose low nibbles are inputs 4j.. and high nibbles 16 + 4j..); Q8_0: their
// 32 (register j: codes 4j..4j+3).
template <int kType>
inline void block_dots(const Strip& strip, int64_t codes_at, const int32_t* xq, __m512i& s0, __m512i& s1) {
  s0 = s1 = _mm512_setzero_si512();
  if constexpr (kType == kQ4_0) {
    const __m512i nibble = _mm512_set1_epi8(0x0F);
    __m512i z[4], t[4];
    strip.quads(codes_at, z);
    kHeaderTranspose.run(z, t);
    for (int j = 0; j < 4; ++j) {
      s0 = _mm512_dpbusd_epi32(s0, _mm512_and_si512(t[j], nibble), _mm512_set1_epi32(xq[j]));
      s1 = _mm512_dpbusd_epi32(s1, _mm512_and_si512(_mm512_srli_epi16(t[j], 4), nibble), _mm512_set1_epi32(xq[4 + j]));
    }
  } else {
    const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
    __m512i z[8], t[8];
    strip.pairs(codes_at, z);
    kDotsTranspose.run(z, t);
    for (int j = 0; j < 4; ++j) {
      s0 = _mm512_dpbusd_epi32(s0, _mm512_xor_si512(t[j], flip), _mm512_set1_epi32(xq[j]));
      s1 = _mm512_dpbusd_epi32(s1, _mm512_xor_si512(t[4 + j], flip), _mm512_set1_epi32(xq[4 + j]));
    }
  }
}

// 16 rows of Q4_0 or Q8_0, the tile kernel's float steps per block: f = fma(float((s - offset x qsum) << shift), d, f).
template <int kType>
void rows16(const uint8_t* base, int64_t row_bytes, int64_t blocks, const Activations& a, float* y, int64_t nrows) {
  const __m512i offsets = row_offsets(row_bytes, nrows);
  const Strip strip(base, row_bytes, blocks, nrows);
  __m512 f = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t at = b * block_bytes(kType);
    strip.prefetch_next(b);
    __m512i s0, s1;
    block_dots<kType>(strip, at + 2, reinterpret_cast<const int32_t*>(a.q.data() + b * kBlock), s0, s1);
    __m512i s = _mm512_sub_epi32(_mm512_add_epi32(s0, s1), _mm512_set1_epi32(code_offset(kType) * a.qsum[b]));
    s = _mm512_sllv_epi32(s, _mm512_set1_epi32(a.shift[b]));
    f = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), gather_scales(base, offsets, at), f);
  }
  alignas(64) float out[16];
  _mm512_store_ps(out, _mm512_mul_ps(f, _mm512_set1_ps(a.unit)));
  std::copy(out, out + nrows, y);
}

// y = W x for W's rows as the file stores them (uint8 [N, K / 32 * block bytes]); the fastest of `reps` runs' seconds.
py::tuple linear(const py::array_t<float, py::array::c_style>& x, const py::array_t<uint8_t, py::array::c_style>& raw,
                 int threads, int reps, bool reference, int ggml_type) {
  if (ggml_type != kQ4_0 && ggml_type != kQ8_0) throw py::value_error("Q4_0 (2) or Q8_0 (8) only");
  const int64_t k = x.shape(0), n = raw.shape(0), row_bytes = raw.shape(1), blocks = k / kBlock;
  if (k % kBlock != 0 || row_bytes != blocks * block_bytes(ggml_type))
    throw py::value_error("raw must be rows of K = len(x)");
  const Activations a(x.data(), k);
  py::array_t<float> y(n);
  float* yp = y.mutable_data();
  const uint8_t* base = raw.data();
  const double best = native_layout::fastest_run(
      n, threads, reps, reference,
      [&](int64_t r) { yp[r] = row_reference(base + r * row_bytes, blocks, ggml_type, a); },
      [&](int64_t t, int64_t rows) {
        const uint8_t* strip = base + t * 16 * row_bytes;
        if (ggml_type == kQ4_0)
          rows16<kQ4_0>(strip, row_bytes, blocks, a, yp + t * 16, rows);
        else
          rows16<kQ8_0>(strip, row_bytes, blocks, a, yp + t * 16, rows);
      });
  return py::make_tuple(y, best);
}

}  // namespace

PYBIND11_MODULE(native_layout_blocks32, m) { m.def("linear", &linear); }
